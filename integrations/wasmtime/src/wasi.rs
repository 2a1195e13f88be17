//! WASI preview 1 for guests, next to the `twm` host functions (**available with the feature
//! `wasi`**).
//!
//! What a real toolchain produces (clang with wasi-libc, Rust's `wasm32-wasip1`) imports
//! `wasi_snapshot_preview1`. [`add_wasi_to_linker`] adds it to a [`Linker`] whose Store data
//! carries a [`WasiP1Ctx`] (see [`HasWasi`]); with [`TenantStore`] that is the embedder's data
//! `U = WasiP1Ctx` (or any type that holds one). WASI state is per Store, so per tenant: each
//! Store gets its own arguments, environment, preopened directories and stdio.
//!
//! ```
//! use std::sync::Arc;
//! use tensor_wasm_mem_wasmtime::core::IsolationLevel;
//! use tensor_wasm_mem_wasmtime::mock::MockBackend;
//! use tensor_wasm_mem_wasmtime::wasi::{WasiCtxBuilder, add_wasi_to_linker};
//! use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
//! use tensor_wasm_mem_wasmtime::{
//!     ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, add_to_linker, instantiate,
//!     new_store,
//! };
//!
//! let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).build()?;
//! let engine = creator.engine()?;
//! let mut linker = Linker::new(&engine);
//! add_to_linker(&mut linker)?; // twm.advise, twm.prefetch
//! add_wasi_to_linker(&mut linker)?; // wasi_snapshot_preview1
//!
//! // A guest that asks WASI for its argument count.
//! let module = Module::new(&engine, r#"(module
//!   (import "wasi_snapshot_preview1" "args_sizes_get"
//!     (func $sizes (param i32 i32) (result i32)))
//!   (memory (export "memory") 1)
//!   (func (export "argc") (result i32)
//!     (drop (call $sizes (i32.const 0) (i32.const 4)))
//!     (i32.load (i32.const 0))))"#)?;
//! let tenant = Tenant::new(1, "alice", 64 << 20, IsolationLevel::StreamIsolated);
//! let wasi = WasiCtxBuilder::new().args(&["guest", "--fast"]).build_p1();
//! let mut store = new_store(&engine, TenantStore::new(&creator, &tenant, ChargeMode::Touched, wasi));
//! let instance = instantiate(&mut store, &linker, &module)?;
//! let argc = instance.get_typed_func::<(), i32>(&mut store, "argc")?;
//! assert_eq!(argc.call(&mut store, ())?, 2);
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```
//!
//! A guest's `proc_exit(code)` ends the call with an [`I32Exit`] error carrying the code
//! ([`exit_code`] finds it); WASI preview 1 passes codes 0 to 125 and answers larger ones with an
//! error of its own.
//!
//! # Limits
//!
//! WASI state lives on the host, outside the tenant's memory budgets, so each Store's WASI
//! context has [`WasiLimits`] of its own ([`HasWasi::wasi_limits`]; [`LimitedWasi`] carries
//! them beside the context): the descriptors it may hold open (past them `path_open` answers
//! `EMFILE`, errno 33, and the host's own descriptors are untouched), the subscriptions one
//! `poll_oneoff` may pass (past them, `EINVAL`), and the entries of its resource table
//! (descriptors, streams, pollables: a call that would add one past it traps). Wasmtime-wasi 48
//! has none of its own but the table's million entries.
//!
//! # Preopens
//!
//! A preopened directory is what the guest can reach, and all of it: paths are resolved under
//! it and cannot leave it (`..` past its root and absolute paths are refused; symlinks are
//! followed only where they stay inside). Preopen with [`FsPerms::ReadOnly`] for a directory the
//! guest may read but not change. With [`FsPerms::ReadWrite`] the guest may create, write,
//! rename and delete files there, and create symlinks whose *text* names anything (a symlink
//! pointing out of the directory can be made, not followed by the guest: the host must not
//! follow it either, see docs/SAFETY.md).

use wasmtime::{Caller, Extern, Linker};
use wasmtime_wasi::WasiView;
use wasmtime_wasi::p1::types::{Errno, Fd};
use wasmtime_wasi::p1::wasi_snapshot_preview1 as p1;
use wasmtime_wasi::p1::wasi_snapshot_preview1::WasiSnapshotPreview1;
use wiggle::GuestMemory;

use crate::Backend;
use crate::guest::TenantStore;

/// The WASI implementation itself, re-exported so embedders use the same version (for pipes,
/// clocks, and the rest of `WasiCtxBuilder`'s inputs).
pub use wasmtime_wasi;
pub use wasmtime_wasi::p1::WasiP1Ctx;
pub use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

/// What one Store's WASI guest may hold on the host (see the [module docs](self#limits)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WasiLimits {
    /// Entries of the context's resource table when a `path_open` begins (its open
    /// descriptors, preopens included): at this many, `path_open` answers `EMFILE`. A value
    /// above [`resources`](Self::resources) counts as `resources` (the table's ceiling would
    /// otherwise trap the guest first): see [`open_files`](Self::open_files).
    pub descriptors: u32,
    /// Subscriptions one `poll_oneoff` may pass: more is `EINVAL`, before anything is read.
    pub poll_subscriptions: u32,
    /// Entries the context's resource table may hold at all: a call that would add one more
    /// traps (Wasmtime's `ResourceTableError::Full`).
    pub resources: u32,
}

impl WasiLimits {
    /// 256 descriptors, 256 subscriptions a poll, 1,024 table entries: what a command-line
    /// program needs, with room to spare.
    pub const DEFAULT: Self = Self {
        descriptors: 256,
        poll_subscriptions: 256,
        resources: 1024,
    };

    /// The entries at which `path_open` answers `EMFILE`: [`descriptors`](Self::descriptors),
    /// never more than [`resources`](Self::resources), so that a guest past its descriptors
    /// always gets the errno a program can handle rather than a trap.
    #[must_use]
    pub const fn open_files(&self) -> u32 {
        if self.descriptors < self.resources {
            self.descriptors
        } else {
            self.resources
        }
    }
}

impl Default for WasiLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Store data that carries a WASI preview-1 context.
pub trait HasWasi: Send + 'static {
    /// The WASI context.
    fn wasi(&mut self) -> &mut WasiP1Ctx;

    /// Its limits (default [`WasiLimits::DEFAULT`]).
    fn wasi_limits(&self) -> WasiLimits {
        WasiLimits::DEFAULT
    }
}

impl HasWasi for WasiP1Ctx {
    fn wasi(&mut self) -> &mut WasiP1Ctx {
        self
    }
}

/// A WASI context with limits of its own (a tenant's, say).
pub struct LimitedWasi {
    /// The context.
    pub ctx: WasiP1Ctx,
    /// Its limits.
    pub limits: WasiLimits,
}

impl std::fmt::Debug for LimitedWasi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimitedWasi")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl HasWasi for LimitedWasi {
    fn wasi(&mut self) -> &mut WasiP1Ctx {
        &mut self.ctx
    }

    fn wasi_limits(&self) -> WasiLimits {
        self.limits
    }
}

/// Made lazily, as `Option<WasiP1Ctx>` is: an empty context with the default limits.
impl HasWasi for Option<LimitedWasi> {
    fn wasi(&mut self) -> &mut WasiP1Ctx {
        &mut self
            .get_or_insert_with(|| LimitedWasi {
                ctx: WasiCtxBuilder::new().build_p1(),
                limits: WasiLimits::DEFAULT,
            })
            .ctx
    }

    fn wasi_limits(&self) -> WasiLimits {
        self.as_ref().map_or(WasiLimits::DEFAULT, |w| w.limits)
    }
}

/// A WASI context made only when the guest first calls WASI: a Store whose guest imports
/// nothing from WASI pays nothing for it. Made lazily, it is an empty context (no arguments,
/// environment, preopened directories or stdio); give `Some(context)` to a guest that needs one.
impl HasWasi for Option<WasiP1Ctx> {
    fn wasi(&mut self) -> &mut WasiP1Ctx {
        self.get_or_insert_with(|| WasiCtxBuilder::new().build_p1())
    }
}

impl<B: Backend, U: HasWasi> HasWasi for TenantStore<B, U> {
    fn wasi(&mut self) -> &mut WasiP1Ctx {
        self.data.wasi()
    }

    fn wasi_limits(&self) -> WasiLimits {
        self.data.wasi_limits()
    }
}

/// The context of `data`, its resource table capped at its limit (set on every WASI call: a
/// store of one number).
fn limited<T: HasWasi>(data: &mut T) -> &mut WasiP1Ctx {
    let limits = data.wasi_limits();
    let ctx = data.wasi();
    ctx.ctx()
        .table
        .set_max_capacity(usize::try_from(limits.resources).unwrap_or(usize::MAX));
    ctx
}

/// Adds WASI preview 1 (`wasi_snapshot_preview1`, synchronous) to `linker`, with each Store's
/// [`WasiLimits`] enforced. Modules that import nothing from WASI are unaffected: a linker
/// resolves only what a module imports. (The limited calls are defined over Wasmtime-wasi's
/// own, with the linker's shadowing allowed for them and then turned off, its default.)
///
/// # Errors
/// A definition Wasmtime refuses, or Wasmtime-wasi's runtime (a Tokio runtime for the process,
/// started here rather than at a guest's first call) cannot start: a process out of
/// descriptors or threads.
pub fn add_wasi_to_linker<T: HasWasi>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    start_runtime()?;
    wasmtime_wasi::p1::add_to_linker_sync(linker, limited::<T>)?;
    linker.allow_shadowing(true);
    let defined = define_limited_calls(linker);
    linker.allow_shadowing(false);
    defined
}

const MODULE: &str = "wasi_snapshot_preview1";

/// Starts Wasmtime-wasi's ambient Tokio runtime now, while the linker is set up, rather than at
/// a guest's first file or poll call: its start needs descriptors and threads, and a start
/// that fails panics inside Wasmtime-wasi (a guest call would abort the process), so a failure
/// is this call's error instead. Once started it stays for the process.
fn start_runtime() -> wasmtime::Result<()> {
    std::panic::catch_unwind(|| wasmtime_wasi::runtime::with_ambient_tokio_runtime(|| ())).map_err(
        |_| {
            wasmtime::Error::msg(
                "cannot start WASI's runtime (Wasmtime-wasi's Tokio runtime: no descriptors or \
                 threads left?)",
            )
        },
    )
}

/// `path_open` refused with `EMFILE` at the descriptor limit, and `poll_oneoff` with `EINVAL`
/// past the subscription limit; otherwise Wasmtime-wasi's own.
fn define_limited_calls<T: HasWasi>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    linker.func_wrap(
        MODULE,
        "path_open",
        #[allow(clippy::too_many_arguments)] // the call's own ABI
        |mut caller: Caller<'_, T>,
         fd: i32,
         dirflags: i32,
         path: i32,
         path_len: i32,
         oflags: i32,
         rights_base: i64,
         rights_inheriting: i64,
         fdflags: i32,
         fd_out: i32|
         -> wasmtime::Result<i32> {
            let limit = caller.data().wasi_limits().open_files();
            with_p1(&mut caller, |ctx, memory| {
                // The descriptor table (stdio, the preopens) is set up by a context's first
                // preview-1 call: set it up now if this is the first, so that it counts.
                let _ = WasiSnapshotPreview1::fd_prestat_get(ctx, memory, Fd::from(0));
                let open = ctx.ctx().table.iter_mut().count();
                if u32::try_from(open).unwrap_or(u32::MAX) >= limit {
                    return Ok(Errno::Mfile as i32);
                }
                wasmtime_wasi::runtime::in_tokio(p1::path_open(
                    ctx,
                    memory,
                    fd,
                    dirflags,
                    path,
                    path_len,
                    oflags,
                    rights_base,
                    rights_inheriting,
                    fdflags,
                    fd_out,
                ))
            })
        },
    )?;
    linker.func_wrap(
        MODULE,
        "poll_oneoff",
        |mut caller: Caller<'_, T>,
         subscriptions: i32,
         events: i32,
         count: i32,
         events_out: i32|
         -> wasmtime::Result<i32> {
            let limit = caller.data().wasi_limits().poll_subscriptions;
            if u32::try_from(count).map_or(true, |n| n > limit) {
                return Ok(Errno::Inval as i32);
            }
            with_p1(&mut caller, |ctx, memory| {
                wasmtime_wasi::runtime::in_tokio(p1::poll_oneoff(
                    ctx,
                    memory,
                    subscriptions,
                    events,
                    count,
                    events_out,
                ))
            })
        },
    )?;
    Ok(())
}

/// Calls one of Wasmtime-wasi's preview-1 functions as its own binding does: on the caller's
/// exported memory, with the Store's host-call fuel.
fn with_p1<T: HasWasi>(
    caller: &mut Caller<'_, T>,
    call: impl FnOnce(&mut WasiP1Ctx, &mut GuestMemory<'_>) -> wasmtime::Result<i32>,
) -> wasmtime::Result<i32> {
    let fuel = wasmtime::AsContextMut::as_context_mut(&mut *caller).hostcall_fuel();
    match caller.get_export("memory") {
        Some(Extern::Memory(memory)) => {
            let (bytes, data) = memory.data_and_store_mut(&mut *caller);
            let ctx = limited(data);
            ctx.set_hostcall_fuel(fuel);
            call(ctx, &mut GuestMemory::Unshared(bytes))
        }
        Some(Extern::SharedMemory(memory)) => {
            let ctx = limited(caller.data_mut());
            ctx.set_hostcall_fuel(fuel);
            call(ctx, &mut GuestMemory::Shared(memory.data()))
        }
        _ => Err(wasmtime::Error::msg("missing required memory export")),
    }
}

/// Whether `module` imports anything from WASI preview 1 (`wasi_snapshot_preview1`).
#[must_use]
pub fn imports_wasi(module: &wasmtime::Module) -> bool {
    module
        .imports()
        .any(|import| import.module() == "wasi_snapshot_preview1")
}

/// The exit code of a guest that called `proc_exit`, if that is what ended `error`.
#[must_use]
pub fn exit_code(error: &wasmtime::Error) -> Option<i32> {
    error.downcast_ref::<I32Exit>().map(|e| e.0)
}
