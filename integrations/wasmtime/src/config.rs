//! The engine configuration that makes a custom linear memory memory-safe.
//!
//! Wasmtime's compiled code trusts the engine configuration, not the memory: under the default
//! Config (a 4 GiB reservation, a 32 MiB guard, signal-based traps) it emits *no* bounds checks
//! and relies on guard pages to fault. A creator that hands back a plain buffer under that Config
//! lets a guest read and write host memory past the buffer. Managed memory cannot carry guard
//! pages, so for it every access must be bounds-checked explicitly:
//!
//! | setting | value | why |
//! |---|---|---|
//! | `signals_based_traps` | `false` | no fault handler to rely on: Cranelift emits an explicit check on every access |
//! | `memory_guard_size` | `0` | there are no guard pages after managed memory |
//! | `guard_before_linear_memory` | `false` | nor before it |
//! | `memory_reservation` | `0` | no address-space reservation to elide checks against; capacity is ours |
//! | `memory_reservation_for_growth` | `0` | growth never moves the base: no extra room to reserve |
//! | `memory_may_move` | `true` | our memories never move (growth is a size bump, so device pointers stay valid), and compiled code checks every access against the current length whatever this says; `false` would let Wasmtime 48.0.10 cap a memory that fits in the (zero) reservation at that reservation, so a memory declared with 0 pages could never grow |
//! | `memory_init_cow` | `false` | copy-on-write init with a custom creator panics on data segments (wasmtime #10740) |
//! | `wasm_custom_page_sizes` | `false` | only 64 KiB pages are served (the creators refuse others): with 1-byte pages Wasmtime reports some failed growths to the limiter unannounced |
//!
//! A backing that *does* reserve real `PROT_NONE` guard pages ([`GuardedHostCreator`]) can take the
//! guard-page settings instead (`signals_based_traps(true)`, a 4 GiB reservation and a 32 MiB
//! guard, `memory_may_move(false)`: the reservation covers every capacity), and then the guest runs
//! without explicit bounds checks. [`configure`] picks the recipe
//! from the backing's [`Capabilities::guard_pages`]; the creators refuse any guard or reservation
//! they cannot honour (the second line of defence).
//!
//! [`GuardedHostCreator`]: crate::GuardedHostCreator

use tensor_wasm_mem_core::Capabilities;
use wasmtime::Config;

/// The address-space reservation used with a guarded backing: 4 GiB, so every 32-bit index lands
/// in the reservation.
pub const GUARDED_RESERVATION: u64 = 4 << 30;

/// The guard after a guarded backing's reservation: 32 MiB (Wasmtime's default), covering static
/// offsets.
pub const GUARDED_GUARD: u64 = 32 << 20;

/// How compiled code is kept inside linear memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoundsStrategy {
    /// Every access is checked against the current length (no guard pages needed).
    ExplicitChecks,
    /// Accesses inside the reservation plus guard are left to fault on guard pages.
    GuardPages {
        /// Reservation in bytes.
        reservation: u64,
        /// Guard after the reservation in bytes.
        guard: u64,
    },
}

impl BoundsStrategy {
    /// The strategy a backing with `caps` needs.
    #[must_use]
    pub const fn for_capabilities(caps: &Capabilities) -> Self {
        if caps.guard_pages {
            Self::GuardPages {
                reservation: GUARDED_RESERVATION,
                guard: GUARDED_GUARD,
            }
        } else {
            Self::ExplicitChecks
        }
    }
}

/// Adjusts `config` so that linear memories from a backing with `caps` are memory-safe (see
/// `docs/SAFETY.md` section 1 for each setting), and turns on memory64.
pub fn configure<'c>(config: &'c mut Config, caps: &Capabilities) -> &'c mut Config {
    config
        .memory_init_cow(false)
        .memory_reservation_for_growth(0)
        .guard_before_linear_memory(false)
        .wasm_custom_page_sizes(false)
        .wasm_memory64(true);
    match BoundsStrategy::for_capabilities(caps) {
        BoundsStrategy::ExplicitChecks => config
            .memory_may_move(true)
            .signals_based_traps(false)
            .memory_reservation(0)
            .memory_guard_size(0),
        BoundsStrategy::GuardPages { reservation, guard } => config
            .memory_may_move(false)
            .signals_based_traps(true)
            .memory_reservation(reservation)
            .memory_guard_size(guard),
    }
}

/// A fresh [`Config`] made safe for a backing with `caps` by [`configure`].
#[must_use]
pub fn engine_config(caps: &Capabilities) -> Config {
    let mut config = Config::new();
    configure(&mut config, caps);
    config
}
