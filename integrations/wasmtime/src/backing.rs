//! Where a [`TensorWasmMemoryCreator`](crate::TensorWasmMemoryCreator) puts linear memory:
//! [`Backing`].
//!
//! - [`Backing::Managed`]: managed memory (`cuMemAllocManaged`), which migrates between host and
//!   device on demand. It cannot carry guard pages, so compiled code checks bounds explicitly
//!   (about 1.0x on a fixed-size memory, 1.5-1.9x on a growable one's scalar loop).
//! - [`Backing::Guarded`]: host virtual memory with `PROT_NONE` guard pages, made device-visible
//!   as a [`HostAccess`] says, and compiled code runs with no bounds checks at all (Wasmtime's
//!   guard-page Config: signals-based traps, a 4 GiB reservation and a 32 MiB guard that the
//!   backing really maps).
//!   - `Guarded(HostAccess::Pageable)` where the device has pageable memory access (HMM, ATS):
//!     the device reaches the pages through the host's page tables (a guard faults there too),
//!     advice and prefetch go to the driver, pages migrate as with managed memory.
//!   - `Guarded(HostAccess::Registered)` where the device can map registered host memory: each
//!     page the guest can reach is pinned (`cuMemHostRegister`, a registration per growth) and
//!     read by the device over the link, zero-copy, never migrated. It suits streaming reads (a
//!     kernel that reads each byte once or twice); a kernel that reuses data is better served by
//!     managed memory, whose pages move to the device once. Advice is refused (a typed
//!     `Unsupported` error) and a prefetch has nothing to do.
//!
//! By default a creator picks at start-up from what its devices report ([`Backing::detect`]):
//! guarded pageable memory where every served device has pageable memory access, managed memory
//! otherwise. Registration is never picked by default, because it trades a kernel's bandwidth
//! for the guest's speed: an embedder chooses it with
//! [`CreatorBuilder::backing`](crate::CreatorBuilder::backing).

use std::fmt;
use std::str::FromStr;

use tensor_wasm_mem_core::{Capabilities, DeviceId, HostAccess, HostMemory};

use crate::error::TwmError;

/// The memory behind a creator's linear memories (`docs/SAFETY.md` section 1b has the contract).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Backing {
    /// Managed memory, explicit bounds checks. (The `Default`, as the one backing every device
    /// serves; a creator's default is [`detect`](Self::detect)'s pick.)
    #[default]
    Managed,
    /// Host virtual memory with guard pages, device-visible as the [`HostAccess`] says; no
    /// bounds checks in compiled code.
    Guarded(HostAccess),
}

impl Backing {
    /// Every backing: the guarded ones first (what `detect` considers, though it never picks
    /// registration), then managed memory.
    pub const ALL: [Self; 3] = [
        Self::Guarded(HostAccess::Pageable),
        Self::Guarded(HostAccess::Registered),
        Self::Managed,
    ];

    /// A stable name for spans, metrics, the CLI and `--json`: `managed`, `guarded_pageable`
    /// or `guarded_registered`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Managed => "managed",
            Self::Guarded(HostAccess::Pageable) => "guarded_pageable",
            Self::Guarded(HostAccess::Registered) => "guarded_registered",
        }
    }

    /// The backing a creator serving `devices` on `backend` uses unless told otherwise: guarded
    /// pageable memory where every device has pageable memory access, managed memory otherwise
    /// (registration is opt-in: it trades a kernel's bandwidth for the guest's speed).
    pub fn detect<B: HostMemory + ?Sized>(backend: &B, devices: &[DeviceId]) -> Self {
        let pageable = !devices.is_empty()
            && devices
                .iter()
                .all(|&d| backend.can_attach_host(d, HostAccess::Pageable));
        if pageable {
            Self::Guarded(HostAccess::Pageable)
        } else {
            Self::Managed
        }
    }

    /// Whether `backend` can serve this backing on every one of `devices`; the first device
    /// that cannot is the error.
    pub fn check<B: HostMemory + ?Sized>(
        self,
        backend: &B,
        devices: &[DeviceId],
    ) -> Result<(), TwmError> {
        let Self::Guarded(access) = self else {
            return Ok(());
        };
        match devices
            .iter()
            .find(|&&d| !backend.can_attach_host(d, access))
        {
            Some(&device) => Err(TwmError::BackingUnavailable {
                backing: self,
                device,
                access,
            }),
            None => Ok(()),
        }
    }

    /// What memories of this backing offer, on a backend offering `backend`: a guarded backing
    /// is host- and device-accessible, zeroed, with guard pages; it migrates (is managed) only
    /// with pageable access on a backend whose memory migrates.
    #[must_use]
    pub const fn capabilities(self, backend: Capabilities) -> Capabilities {
        match self {
            Self::Managed => backend,
            Self::Guarded(access) => Capabilities {
                host_accessible: true,
                device_accessible: true,
                managed: backend.managed && matches!(access, HostAccess::Pageable),
                comes_zeroed: true,
                guard_pages: true,
                ..backend
            },
        }
    }
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A backing name that is none of [`Backing::ALL`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown backing {0:?}: expected managed, guarded_pageable (pageable) or guarded_registered (registered)"
)]
pub struct ParseBackingError(String);

/// Parses `managed`, `guarded_pageable` (or `pageable`), `guarded_registered` (or
/// `registered`).
impl FromStr for Backing {
    type Err = ParseBackingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "managed" => Ok(Self::Managed),
            "guarded_pageable" | "pageable" => Ok(Self::Guarded(HostAccess::Pageable)),
            "guarded_registered" | "registered" => Ok(Self::Guarded(HostAccess::Registered)),
            other => Err(ParseBackingError(other.to_string())),
        }
    }
}
