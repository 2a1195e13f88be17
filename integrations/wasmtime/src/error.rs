//! The integration's error.

use tensor_wasm_mem_core::{Denied, DeviceId, ErrorKind, PlanError, PoolError, RangeError};

/// Everything the Wasmtime integration can refuse or fail with.
///
/// Errors reach Wasmtime as `wasmtime::Error` (downcast with
/// `err.downcast_ref::<TwmError>()`), except from `MemoryCreator::new_memory`, whose signature
/// only carries a message: there the message is this error's `Display`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TwmError {
    /// One of a tenant's budgets (touched bytes, held bytes, live memories) refused a memory,
    /// a growth or a table.
    #[error(
        "{tenant_name:?} ({}) denied {} {unit} by its {} budget: its limit is {} {unit} and {} \
         are already reserved",
        .denied.tenant, .denied.requested, .denied.budget, .denied.cap, .denied.live,
        unit = .denied.budget.unit()
    )]
    Denied {
        /// The tenant's name.
        tenant_name: String,
        /// The ledger's answer (tenant id, budget, limit, live, request).
        denied: Denied,
    },
    /// A count the Store or the tenant limits (instances, tables, memories per Store, elements
    /// per table) would be passed.
    #[error("{what}: {requested} would pass the limit of {limit}")]
    Limit {
        /// What is counted, e.g. "tables in one Store".
        what: &'static str,
        /// The count it would reach.
        requested: u64,
        /// The limit.
        limit: u64,
    },
    /// The memory type cannot be planned under the configured limits.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The engine asked for guard pages the backing cannot provide.
    #[error(
        "the engine asks for {guard} bytes of guard pages, which managed memory cannot provide: \
         set Config::memory_guard_size(0) and Config::signals_based_traps(false) \
         (tensor_wasm_mem_wasmtime::configure does)"
    )]
    GuardNotHonoured {
        /// Guard bytes asked for.
        guard: usize,
    },
    /// The engine asked for an address-space reservation the backing cannot provide (managed
    /// memory has none; a guarded pool slot has its fixed size).
    #[error(
        "the engine asks for a reservation of {reserved} bytes, which this backing cannot \
         provide: for managed memory set Config::memory_reservation(0) \
         (tensor_wasm_mem_wasmtime::configure does); for a guarded pool, install the creator \
         with its own install() or engine(), which reserve what its slots hold"
    )]
    ReservationNotHonoured {
        /// Reservation asked for.
        reserved: usize,
    },
    /// Shared memories (threads) are not served by this creator.
    #[error("shared linear memories are not supported; keep the threads proposal off")]
    SharedMemory,
    /// A memory with a page size other than 64 KiB (the custom-page-sizes proposal).
    #[error(
        "memories with a page size of {page_size} bytes are not supported (only 64 KiB pages): keep Config::wasm_custom_page_sizes off (tensor_wasm_mem_wasmtime::configure does)"
    )]
    CustomPageSize {
        /// The page size the module declared.
        page_size: u64,
    },
    /// A growth past the memory's fixed capacity.
    #[error("growth to {requested} bytes exceeds the memory's capacity of {capacity} bytes")]
    CapacityExceeded {
        /// Bytes asked for.
        requested: usize,
        /// The fixed capacity.
        capacity: usize,
    },
    /// Every slot of the pool that could hold the memory is in use: a denial (the pool's size is
    /// the embedder's decision), not a failure; retry once a memory is dropped, or give the
    /// pool more slots. [`kind`](Self::kind) is [`ErrorKind::PoolExhausted`].
    #[error(
        "slot pool exhausted: no free slot of at least {requested} bytes on {device} (the pool's \
         size is a limit: free a memory or configure more slots)"
    )]
    PoolExhausted {
        /// Bytes the memory needs.
        requested: u64,
        /// The pool's device.
        device: DeviceId,
    },
    /// Two ranges of a device-access scope overlap, so they cannot be lent as mutable views at
    /// once ([`DeviceAccess::host_slices_mut`](crate::DeviceAccess::host_slices_mut)).
    #[error("ranges {first} and {second} of the scope overlap: no two mutable views of one byte")]
    OverlappingRanges {
        /// The earlier range's index.
        first: usize,
        /// The later range's index.
        second: usize,
    },
    /// A scope's range cannot be viewed as the element type asked for: its address is not
    /// aligned to it, or its length is not a multiple of its size.
    #[error("range {range} of the scope cannot be viewed as {element}: {reason}")]
    HostView {
        /// The range's index.
        range: usize,
        /// The element type.
        element: &'static str,
        /// Why (bytemuck's reason).
        reason: String,
    },
    /// An embedder's kernel launcher failed ([`KernelLauncher`](crate::kernels::KernelLauncher)):
    /// its own words.
    #[error("kernel launch failed: {0}")]
    Launch(String),
    /// A kernel could not be registered: a signature that could not be checked, or a name
    /// registered twice ([`KernelRegistry::register`](crate::kernels::KernelRegistry::register)).
    #[error("kernel registry: {0}")]
    KernelSignature(&'static str),
    /// The tenant already holds its share of a shared pool's slots
    /// ([`CreatorBuilder::slots_per_tenant`](crate::CreatorBuilder::slots_per_tenant); by
    /// default half the slots): a denial, so that one tenant cannot take every slot.
    #[error(
        "{tenant_name:?} holds {held} slot(s) of the pool, its share of {share}: one tenant may \
         not take every slot (CreatorBuilder::slots_per_tenant)"
    )]
    PoolShare {
        /// The tenant's name.
        tenant_name: String,
        /// Slots it holds.
        held: usize,
        /// The most it may.
        share: usize,
    },
    /// The slot pool could not serve the memory otherwise (a memory larger than its largest
    /// slot, a bad configuration).
    #[error(transparent)]
    Pool(PoolError),
    /// The backend (driver) failed. [`driver_code`](TwmError::driver_code) and
    /// [`hint`](TwmError::hint) read the driver's code and what to do without a downcast.
    #[error("backend failed ({kind}): {source}")]
    Backend {
        /// Its kind.
        kind: ErrorKind,
        /// The driver's code (a CUDA `CUresult`), where a driver call answered.
        code: Option<u32>,
        /// What to do about it, where the backend knows.
        hint: Option<&'static str>,
        /// The backend's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A guarded backing was asked for where a served device cannot reach host memory that
    /// way (no pageable memory access, or no host registration).
    #[error("the {backing} backing is not available on {device}: it lacks {access} host access")]
    BackingUnavailable {
        /// The backing asked for.
        backing: crate::Backing,
        /// The device that lacks it.
        device: DeviceId,
        /// The host access it lacks.
        access: tensor_wasm_mem_core::HostAccess,
    },
    /// A guarded memory lost its attachment to the device, or the protection of its pages,
    /// after a failure (a backend that refused to detach, an `mprotect` that failed): it takes
    /// no growth and no device calls any more, and its slot or mapping is withdrawn when it
    /// goes.
    #[error(
        "this guarded memory lost its device attachment or page protection after a failure: it \
         takes no growth and no device calls (drop it)"
    )]
    GuardedMemoryBroken,
    /// The host could not map memory for the guarded backing.
    #[error("host memory mapping failed: {0}")]
    HostMapping(#[source] std::io::Error),
    /// A thread the creator runs (a pool's scrub-ahead thread,
    /// [`CreatorBuilder::scrub_ahead`](crate::CreatorBuilder::scrub_ahead)) could not be
    /// started.
    #[error("could not start a pool's scrub-ahead thread: {0}")]
    Thread(#[source] std::io::Error),
    /// A memory that did not come from this creator (made with `Memory::new`, by the pooling
    /// allocator, or by another engine) was given where a device-visible memory is required.
    #[error(
        "this memory did not come from the tensor-wasm-mem creator (Memory::new, SharedMemory \
         and the pooling allocator bypass it): it is not device-visible"
    )]
    NotOurMemory,
    /// The memory's backing is not device-accessible.
    #[error("this memory's backing is not device-accessible")]
    NotDeviceAccessible,
    /// A guest range outside the memory's current size, or one that overflows.
    #[error("guest range refused: {0}")]
    GuestRange(#[source] RangeError),
    /// The export named is missing or not a memory.
    #[error("the instance exports no memory named {0:?}")]
    NoMemoryExport(String),
    /// A memory of another Store than the one given (or, for a device-access scope, made by a
    /// creator on another backend than the Store's guest context uses).
    #[error("this memory belongs to another Store than the one given")]
    ForeignMemory,
    /// A memory no tenant would pay for: its Store has no tenant limiter announcing it (made
    /// with `Store::new` instead of [`new_store`](crate::new_store), refilled with
    /// `Store::into_data`, or instantiated outside [`instantiate`](crate::instantiate)), and the
    /// creator is bound to no tenant.
    #[error(
        "no tenant pays for this memory: make the Store with tensor_wasm_mem_wasmtime::new_store \
         and instantiate with tensor_wasm_mem_wasmtime::instantiate (a plain Linker::instantiate \
         or a Store without the tenant limiter announces no tenant), or bind the creator to a \
         tenant (CreatorBuilder::tenant), or allow untenanted memories \
         (CreatorBuilder::allow_untenanted)"
    )]
    NoTenant,
    /// [`instantiate`](crate::instantiate) on a tenant's Store whose limiter is not installed.
    #[error(
        "{tenant_name:?}'s Store has no tenant limiter installed: make it with \
         tensor_wasm_mem_wasmtime::new_store (a Store from Store::new, or one refilled with \
         Store::into_data, would charge nobody)"
    )]
    NoLimiter {
        /// The tenant's name.
        tenant_name: String,
    },
    /// A device the backend does not have.
    #[error("{device} is unknown here: there are {count} device(s)")]
    UnknownDevice {
        /// The device named.
        device: DeviceId,
        /// Devices the backend has.
        count: u32,
    },
    /// A device set that is empty or names a device twice.
    #[error("invalid device set: {0}")]
    Devices(&'static str),
    /// A device-access scope over a memory on one device, for a guest whose stream is on
    /// another (the memory was made where its Store named no tenant).
    #[error("the memory is on {memory} but the guest's stream is on {stream}")]
    DeviceMismatch {
        /// The memory's device.
        memory: DeviceId,
        /// The guest stream's device (its tenant's home).
        stream: DeviceId,
    },
    /// A tenant's home device is not one this creator serves.
    #[error("{tenant_name:?} is on {device}, which this creator does not serve")]
    DeviceNotServed {
        /// The tenant's name.
        tenant_name: String,
        /// Its home device.
        device: DeviceId,
    },
    /// A library's own types could not be made over an open scope (see
    /// [`interop`](crate::interop)): why.
    #[error("interop: {0}")]
    Interop(String),
    /// The wait for a guest's kernel failed (a plain driver error, three tries) and the kernel
    /// may still run: the guest traps rather than go on over memory the kernel may still write,
    /// and the Store's memories are kept when it goes (never scrubbed for another tenant under
    /// the kernel). The embedder drops the Store.
    #[error(
        "twm.{op}: waiting for the guest's kernel failed and it may still run (the guest traps; \
         drop its Store, whose memories are kept)"
    )]
    WorkMayRun {
        /// The host call (`launch`).
        op: &'static str,
    },
    /// A guest's host call found its tenant's device state lost to a kernel fault (its device
    /// is fenced, or its own context is gone): the guest traps with this error. The embedder
    /// drops the Store; the device comes back with
    /// [`TensorWasmMemoryCreator::recover`](crate::TensorWasmMemoryCreator::recover).
    #[error(
        "twm.{op}: the tenant's device state was lost to a kernel fault (the guest traps; drop \
         its Store, and the creator's recover brings the device back)"
    )]
    DeviceLost {
        /// The host call (`launch`, `advise`, ...).
        op: &'static str,
    },
    /// A time or work limit could not be set up (see [`deadline`](crate::deadline)).
    #[error("interruption: {0}")]
    Interruption(&'static str),
    /// No device can take a new tenant: every device is full (its committed caps plus this one
    /// would pass its capacity) or unavailable.
    #[error(
        "no device can take tenant {tenant_name:?} with a cap of {cap} bytes: {available} of \
         {devices} device(s) take tenants, the most room left on one is {largest_room} bytes"
    )]
    Unplaceable {
        /// The tenant's name.
        tenant_name: String,
        /// The cap (touched budget) it asked for.
        cap: u64,
        /// Devices the placement knows.
        devices: u32,
        /// Of them, those taking tenants (not marked unavailable, not fenced).
        available: u32,
        /// The most capacity left on one available device.
        largest_room: u64,
    },
}

/// Refuses the memory types no creator of ours serves: shared memories and page sizes other
/// than 64 KiB. (With 1-byte pages Wasmtime reports some failed growths to the limiter without
/// announcing them first; refusing them keeps the limiter's accounting exact.)
pub(crate) fn check_memory_type(ty: &wasmtime::MemoryType) -> Result<(), TwmError> {
    if ty.is_shared() {
        return Err(TwmError::SharedMemory);
    }
    if ty.page_size_log2() != 16 {
        return Err(TwmError::CustomPageSize {
            page_size: ty.page_size(),
        });
    }
    Ok(())
}

impl TwmError {
    /// The kind of this error.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Denied { .. } => ErrorKind::CapExceeded,
            Self::Plan(e) => e.kind(),
            Self::PoolExhausted { .. } => ErrorKind::PoolExhausted,
            Self::PoolShare { .. } => ErrorKind::LimitExceeded,
            Self::OverlappingRanges { .. } | Self::HostView { .. } => ErrorKind::InvalidArgument,
            Self::Pool(e) => e.kind(),
            Self::CapacityExceeded { .. } | Self::Limit { .. } => ErrorKind::LimitExceeded,
            Self::GuestRange(e) => e.kind(),
            Self::Backend { kind, .. } => *kind,
            Self::HostMapping(_) | Self::Thread(_) => ErrorKind::OutOfMemory,
            Self::GuardedMemoryBroken => ErrorKind::Driver,
            Self::GuardNotHonoured { .. }
            | Self::ReservationNotHonoured { .. }
            | Self::SharedMemory
            | Self::NoMemoryExport(_)
            | Self::ForeignMemory => ErrorKind::InvalidArgument,
            Self::CustomPageSize { .. } | Self::BackingUnavailable { .. } => ErrorKind::Unsupported,
            Self::NotOurMemory | Self::NotDeviceAccessible => ErrorKind::Unsupported,
            Self::NoTenant | Self::NoLimiter { .. } => ErrorKind::InvalidArgument,
            Self::UnknownDevice { .. }
            | Self::Devices(_)
            | Self::DeviceNotServed { .. }
            | Self::DeviceMismatch { .. } => ErrorKind::InvalidArgument,
            Self::Unplaceable { .. } => ErrorKind::LimitExceeded,
            Self::Interruption(_) => ErrorKind::Unsupported,
            Self::KernelSignature(_) => ErrorKind::InvalidArgument,
            Self::Launch(_) => ErrorKind::Driver,
            Self::Interop(_) => ErrorKind::Unsupported,
            Self::DeviceLost { .. } => ErrorKind::ContextLost,
            Self::WorkMayRun { .. } => ErrorKind::Driver,
        }
    }

    /// A backend's own error (a driver call the embedder made itself, say), typed by its kind:
    /// [`TwmError::Backend`].
    pub fn from_backend<E: tensor_wasm_mem_core::BackendError>(e: E) -> Self {
        Self::backend(e)
    }

    /// A backend's own error, typed by its kind.
    pub(crate) fn backend<E: tensor_wasm_mem_core::BackendError>(e: E) -> Self {
        Self::Backend {
            kind: e.kind(),
            code: e.driver_code(),
            hint: e.hint(),
            source: Box::new(e),
        }
    }

    /// Converts a core error carrying a backend error.
    pub(crate) fn from_core<E: tensor_wasm_mem_core::BackendError>(
        e: tensor_wasm_mem_core::Error<E>,
    ) -> Self {
        use tensor_wasm_mem_core::Error as CoreError;
        let kind = e.kind();
        match e {
            CoreError::Plan(p) => Self::Plan(p),
            CoreError::Pool(p) => p.into(),
            CoreError::Range(r) => Self::GuestRange(r),
            CoreError::Denied(d) => Self::Denied {
                tenant_name: d.tenant.to_string(),
                denied: d,
            },
            other => Self::Backend {
                kind,
                code: other.driver_code(),
                hint: other.hint(),
                source: Box::new(other),
            },
        }
    }
}

impl From<PoolError> for TwmError {
    /// An exhausted pool is [`TwmError::PoolExhausted`] (its device unknown here: device 0
    /// unless the caller says otherwise with [`TwmError::on_device`]); anything else
    /// [`TwmError::Pool`].
    fn from(e: PoolError) -> Self {
        match e {
            PoolError::Exhausted { requested } => Self::PoolExhausted {
                requested,
                device: DeviceId(0),
            },
            other => Self::Pool(other),
        }
    }
}

impl TwmError {
    /// Whether this is a denial (a budget, a limit or an exhausted pool said no: the embedder's
    /// configuration, working as set) rather than a failure (bad input, the driver or the host
    /// broke). See [`ErrorKind::is_denial`].
    #[must_use]
    pub fn is_denial(&self) -> bool {
        self.kind().is_denial()
    }

    /// The driver's own code (a CUDA `CUresult`, named in the Display) where a driver call
    /// answered this error: a failed driver call the layer made ([`TwmError::Backend`]);
    /// `None` otherwise.
    #[must_use]
    pub fn driver_code(&self) -> Option<u32> {
        match self {
            Self::Backend { code, .. } => *code,
            _ => None,
        }
    }

    /// What to do about this error, where the layer knows: the usual cause of a driver code in
    /// this workspace and its fix (also the Display's last clause), or a held budget smaller
    /// than one memory; `None` otherwise.
    #[must_use]
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            Self::Backend { hint, .. } => *hint,
            // More than the whole budget: no release by the tenant can make room.
            Self::Denied { denied, .. }
                if denied.budget == tensor_wasm_mem_core::Budget::Held
                    && denied.requested > denied.cap =>
            {
                Some(
                    "one memory holds more than the tenant's whole held budget (a pool's slot \
                     larger than its default): size its budgets to the creator's memories with \
                     TensorWasmMemoryCreator::budgets_for_cap",
                )
            }
            _ => None,
        }
    }

    /// The same error, naming `device` where it names a pool's device.
    #[must_use]
    pub fn on_device(self, device: DeviceId) -> Self {
        match self {
            Self::PoolExhausted { requested, .. } => Self::PoolExhausted { requested, device },
            other => other,
        }
    }
}
