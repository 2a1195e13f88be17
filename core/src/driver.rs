//! [`DriverBackend`]: the three backend traits implemented once, on top of a thin [`DriverApi`]
//! (a CUDA-like driver's raw calls). The real driver backends (cudarc, cust) implement only
//! `DriverApi`; every check, every table and every counter lives here, so they cannot drift apart.

use alloc::vec::Vec;
use core::fmt;
use core::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashMap;

use crate::advisor::Advisor;
use crate::allocator::{Allocation, ManagedAllocator, Refused};
use crate::device::{Advice, Capabilities, DeviceId, Location};
use crate::error::{BackendError, ErrorKind, ErrorType, RangeError};
use crate::host::{HostAccess, HostMemory};
use crate::ledger::{Reservation, TenantKey};

use crate::stream::Stream;

mod device_pools;
mod recovery;
mod streams;

pub use recovery::{DeviceHealth, Recovery};

/// What [`DriverBackend`] refuses before calling the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// An allocation of zero bytes.
    #[error("allocation size is zero")]
    ZeroSize,
    /// No such device.
    #[error("{device} does not exist ({count} devices)")]
    InvalidDevice {
        /// The device asked for.
        device: DeviceId,
        /// Devices the driver has.
        count: u32,
    },
    /// A range outside its allocation.
    #[error(transparent)]
    Range(#[from] RangeError),
    /// An allocation this backend does not know.
    #[error("unknown allocation at {address:#x}")]
    UnknownAllocation {
        /// Its base address.
        address: u64,
    },
    /// A stream this backend did not hand out (or took back).
    #[error("unknown stream {stream:#x}")]
    UnknownStream {
        /// The stream.
        stream: DriverStream,
    },
    /// A context-isolated tenant's stream asked for on another device than the one its context
    /// is on (a tenant has one context, on one device, while it has streams).
    #[error(
        "a context-isolated tenant's stream on {device}: its context is on {context_device} while it has streams there"
    )]
    ContextOnAnotherDevice {
        /// The device asked for.
        device: DeviceId,
        /// The device of the tenant's context.
        context_device: DeviceId,
    },
    /// The driver (or its binding) has no stream-ordered memory pools.
    #[error("this backend has no device memory pools")]
    NoDevicePools,
    /// A pool this backend did not make (or destroyed), or an allocation not from it.
    #[error("unknown pool {pool:#x} (or an allocation not from it)")]
    UnknownPool {
        /// The pool.
        pool: DriverPool,
    },
    /// A stream that is not the pool's tenant's, or is on another device than the pool.
    #[error("stream {stream:#x} is not a stream of pool {pool:#x}'s tenant on its device")]
    ForeignStream {
        /// The stream.
        stream: DriverStream,
        /// The pool.
        pool: DriverPool,
    },
    /// The driver (or its binding) cannot register host memory for devices.
    #[error("this backend cannot register host memory")]
    NoHostRegistration,
    /// Host memory attached already at this base (detach it first).
    #[error("host memory at {address:#x} is attached already")]
    AlreadyAttached {
        /// Its base address.
        address: u64,
    },
    /// Attached host memory handed to `free`: it goes back with `HostMemory::detach_host`.
    #[error("{address:#x} is attached host memory: detach it, do not free it")]
    AttachedHost {
        /// Its base address.
        address: u64,
    },
    /// The device is fenced: a kernel faulted in its primary context, and it takes no new work
    /// until it is recovered.
    #[error(
        "{device} is fenced after a kernel fault in its primary context: it takes no new work until it is recovered"
    )]
    DeviceFenced {
        /// The device.
        device: DeviceId,
    },
    /// A recovery of a fenced device waits for what of ours still lives in its primary context.
    #[error(
        "{device} cannot be recovered yet: {allocations} allocations, {streams} streams and {pools} pools in its primary context are still in use ({calls} calls in flight)"
    )]
    StillInUse {
        /// The device.
        device: DeviceId,
        /// Allocations (and registered host ranges) not given up.
        allocations: u64,
        /// Streams handed out, or in a call.
        streams: u64,
        /// Pools in service, or in a call.
        pools: u64,
        /// Other driver calls on the device in flight.
        calls: u64,
    },
    /// Another call is recovering the device now.
    #[error("{device} is being recovered by another call")]
    Recovering {
        /// The device.
        device: DeviceId,
    },
    /// An allocation a recovery's reset destroyed: only its free is left to do.
    #[error("the allocation at {address:#x} was destroyed by a recovery of its device")]
    LostInRecovery {
        /// Its base address.
        address: u64,
    },
    /// The driver cannot reset a device's primary context.
    #[error("this driver cannot reset a device's primary context")]
    NoContextReset,
    /// The device cannot do this.
    #[error("{device} does not support {what}")]
    Unsupported {
        /// The device.
        device: DeviceId,
        /// What it lacks.
        what: &'static str,
    },
}

impl Refusal {
    /// The kind of this refusal.
    #[must_use]
    pub const fn kind(&self) -> ErrorKind {
        match self {
            Self::Range(e) => e.kind(),
            Self::Unsupported { .. }
            | Self::NoDevicePools
            | Self::NoHostRegistration
            | Self::NoContextReset => ErrorKind::Unsupported,
            Self::DeviceFenced { .. }
            | Self::StillInUse { .. }
            | Self::Recovering { .. }
            | Self::LostInRecovery { .. } => ErrorKind::ContextLost,
            Self::UnknownPool { .. }
            | Self::ZeroSize
            | Self::InvalidDevice { .. }
            | Self::UnknownAllocation { .. }
            | Self::UnknownStream { .. }
            | Self::AttachedHost { .. }
            | Self::AlreadyAttached { .. }
            | Self::ForeignStream { .. }
            | Self::ContextOnAnotherDevice { .. } => ErrorKind::InvalidArgument,
        }
    }
}

macro_rules! driver_handle {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(transparent)]
        pub struct $name(u64);

        impl $name {
            /// The handle from the driver's value (`CUcontext`, `CUstream`, `CUmemoryPool` as
            /// an integer).
            #[must_use]
            pub const fn from_raw(raw: u64) -> Self {
                Self(raw)
            }

            /// The driver's value.
            #[must_use]
            pub const fn raw(self) -> u64 {
                self.0
            }
        }

        impl core::fmt::LowerHex for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                core::fmt::LowerHex::fmt(&self.0, f)
            }
        }
    };
}

driver_handle!(
    /// A driver context (`CUcontext`); never 0.
    DriverContext
);
driver_handle!(
    /// A driver stream (`CUstream`); [`DriverStream::DEFAULT`] is the legacy default stream of
    /// the current context.
    DriverStream
);
driver_handle!(
    /// A stream-ordered memory pool (`CUmemoryPool`).
    DriverPool
);

impl DriverStream {
    /// The legacy default stream (0).
    pub const DEFAULT: Self = Self(crate::stream::DEFAULT_STREAM);
}

/// Per-device facts a [`DriverApi`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceFacts {
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
    pub concurrent_managed_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`: the device reaches any host memory.
    pub pageable_memory_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES` (ATS, as on Grace
    /// Hopper; reported only).
    pub pageable_uses_host_page_tables: bool,
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` and
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` both: host memory registered
    /// device-mapped is device-accessible at its own address.
    pub host_registration: bool,
}

/// A CUDA-like driver's raw calls, as a backend crate wraps them. Contexts and streams are raw
/// handle values; `0` is never a valid context and is the default stream.
///
/// # Safety
///
/// Implementors guarantee that:
/// - [`alloc_managed`](Self::alloc_managed) returns the non-zero base address of a fresh managed
///   allocation of exactly `bytes` bytes on `device`, accessible from the host and the device at
///   that address, aligned to at least [`MIN_ALIGN`](crate::MIN_ALIGN), overlapping nothing else
///   alive;
/// - [`zero`](Self::zero) writes zeros to exactly `ptr..ptr + len` and returns once they are
///   visible to the host;
/// - [`device_facts`](Self::device_facts) is honest;
/// - where [`allocations_come_zeroed`](Self::allocations_come_zeroed) answers `true`, every
///   allocation from `alloc_managed` reads as zeros.
pub unsafe trait DriverApi: Send + Sync + 'static {
    /// The backend's error type; [`DriverBackend`]'s refusals convert into it.
    type Error: BackendError + From<Refusal>;

    /// Devices the driver has (at least one: a backend does not start without).
    fn device_count(&self) -> u32;

    /// Facts about `device` (`device < device_count()`).
    fn device_facts(&self, device: DeviceId) -> DeviceFacts;

    /// Whether fresh managed allocations read as zeros (`cuMemAllocManaged` does not promise it:
    /// real drivers keep the default, `false`, and the core zeroes what a guest may read).
    fn allocations_come_zeroed(&self) -> bool {
        false
    }

    /// Whether `device` can access memory resident on `peer` directly
    /// (`cuDeviceCanAccessPeer`; `device != peer`, both below `device_count()`). Default: no.
    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> bool {
        let _ = (device, peer);
        false
    }

    /// `(free, total)` bytes of the current context's device (`cuMemGetInfo`); `None` where the
    /// driver cannot say (the default).
    fn memory_info(&self) -> Result<Option<(u64, u64)>, Self::Error> {
        Ok(None)
    }

    /// The primary context of `device`, retained for the life of the driver value.
    fn primary_context(&self, device: DeviceId) -> DriverContext;

    /// Pushes `context` on the calling thread's context stack (`cuCtxPushCurrent`): it is
    /// current until the matching [`pop_current`](Self::pop_current). [`DriverBackend`] pairs
    /// every push with a pop, so the caller's current context is what it was before each call.
    fn push_current(&self, context: DriverContext) -> Result<(), Self::Error>;

    /// Pops the calling thread's context stack (`cuCtxPopCurrent`).
    fn pop_current(&self) -> Result<(), Self::Error>;

    /// Allocates managed memory, attached globally, with `device`'s primary context current.
    fn alloc_managed(&self, device: DeviceId, bytes: usize) -> Result<u64, Self::Error>;

    /// Frees a managed allocation.
    ///
    /// # Safety
    ///
    /// `ptr` must be the base of a live allocation from `alloc_managed`, not used afterwards.
    unsafe fn free(&self, ptr: u64) -> Result<(), Self::Error>;

    /// Zeroes `ptr..ptr + len` (non-empty) and waits for it, with `device`'s primary context
    /// current.
    ///
    /// # Safety
    ///
    /// The range must lie inside one live allocation, and nothing may access it meanwhile.
    unsafe fn zero(&self, device: DeviceId, ptr: u64, len: usize) -> Result<(), Self::Error>;

    /// Applies `advice` to `ptr..ptr + len` (non-empty, inside one allocation, the location
    /// checked), with the allocation's device's primary context current.
    fn advise(&self, ptr: u64, len: usize, advice: Advice) -> Result<(), Self::Error>;

    /// Prefetches `ptr..ptr + len` (non-empty, inside one allocation, the location checked) to
    /// `to` on `stream`, with the stream's context current.
    fn prefetch(
        &self,
        ptr: u64,
        len: usize,
        to: Location,
        stream: DriverStream,
    ) -> Result<(), Self::Error>;

    /// The stream [`zero`](Self::zero) runs on for `device`: a non-blocking stream of its
    /// primary context that no tenant's work is queued on, so a scrub never waits for tenants'
    /// work (as the legacy default stream would make it wait for every shared tenant's).
    fn scrub_stream(&self, device: DeviceId) -> DriverStream;

    /// Creates a non-blocking stream in the current context.
    fn stream_create(&self) -> Result<DriverStream, Self::Error>;

    /// Destroys a stream made by `stream_create`, with its context current.
    fn stream_destroy(&self, stream: DriverStream) -> Result<(), Self::Error>;

    /// Waits for `stream` (0: the default stream), with its context current.
    fn synchronize(&self, stream: DriverStream) -> Result<(), Self::Error>;

    /// Creates a context on `device` and leaves the calling thread's context stack as it was
    /// (`cuCtxCreate` pushes the new context: the implementation pops it).
    fn context_create(&self, device: DeviceId) -> Result<DriverContext, Self::Error>;

    /// Destroys a context made by `context_create` (current on no thread of ours).
    fn context_destroy(&self, context: DriverContext) -> Result<(), Self::Error>;

    /// Registers host memory `ptr..ptr + len` (non-empty, page-aligned) for device access,
    /// device-mapped (`cuMemHostRegister_v2` with `CU_MEMHOSTREGISTER_DEVICEMAP`), with a
    /// device's primary context current. Drivers that cannot keep this default.
    fn host_register(&self, ptr: u64, len: usize) -> Result<(), Self::Error> {
        let _ = (ptr, len);
        Err(Refusal::NoHostRegistration.into())
    }

    /// Unregisters host memory registered at `ptr` (`cuMemHostUnregister`), with the primary
    /// context current that registered it.
    ///
    /// # Safety
    ///
    /// `ptr` must be the base of a range registered with [`host_register`](Self::host_register)
    /// that no device work uses any more.
    unsafe fn host_unregister(&self, ptr: u64) -> Result<(), Self::Error> {
        let _ = ptr;
        Err(Refusal::NoHostRegistration.into())
    }

    /// Creates a stream-ordered memory pool on `device` (`max_bytes` 0: no driver maximum), with
    /// `device`'s primary context current. Drivers without pools keep this default.
    fn pool_create(
        &self,
        device: DeviceId,
        max_bytes: u64,
        release_threshold: u64,
    ) -> Result<DriverPool, Self::Error> {
        let _ = (device, max_bytes, release_threshold);
        Err(Refusal::NoDevicePools.into())
    }

    /// Destroys a pool with nothing allocated from it.
    fn pool_destroy(&self, pool: DriverPool) -> Result<(), Self::Error> {
        let _ = pool;
        Err(Refusal::NoDevicePools.into())
    }

    /// Allocates `bytes` from `pool` on `stream` (with the stream's context current) and
    /// zero-fills them in stream order.
    fn pool_alloc(
        &self,
        pool: DriverPool,
        bytes: usize,
        stream: DriverStream,
    ) -> Result<u64, Self::Error> {
        let _ = (pool, bytes, stream);
        Err(Refusal::NoDevicePools.into())
    }

    /// Frees a pool allocation on `stream` (with the stream's context current).
    fn pool_free(&self, ptr: u64, stream: DriverStream) -> Result<(), Self::Error> {
        let _ = (ptr, stream);
        Err(Refusal::NoDevicePools.into())
    }

    /// Gives the pool's freed memory back until it holds at most `keep_bytes`.
    fn pool_trim(&self, pool: DriverPool, keep_bytes: u64) -> Result<(), Self::Error> {
        let _ = (pool, keep_bytes);
        Err(Refusal::NoDevicePools.into())
    }

    /// Bytes the driver holds for the pool.
    fn pool_reserved(&self, pool: DriverPool) -> Result<u64, Self::Error> {
        let _ = pool;
        Err(Refusal::NoDevicePools.into())
    }

    /// Resets `device`'s primary context (`cuDevicePrimaryCtxReset_v2`), which destroys every
    /// allocation, stream, pool, event, module and registration made in it and clears a sticky
    /// fault, then makes again what the driver value keeps there for itself (its
    /// [`scrub_stream`](Self::scrub_stream)). The context's handle stays valid (a reset does
    /// not release it). Drivers that cannot keep this default.
    ///
    /// # Safety
    ///
    /// Nothing made in the context may be used afterwards, and no thread may have it current.
    unsafe fn reset_primary_context(&self, device: DeviceId) -> Result<(), Self::Error> {
        let _ = device;
        Err(Refusal::NoContextReset.into())
    }
}

/// Counters of a [`DriverBackend`].
///
/// A resource the driver refused to release (a failed `cuStreamDestroy`, `cuCtxDestroy`,
/// `cuMemPoolDestroy`, `cuMemFreeAsync`, `cuMemFree`) is still held by the driver: it stays in
/// the backend's tables, counted as live, is counted in
/// [`release_failures`](Self::release_failures), and is tried again when the backend drops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Allocations alive.
    pub live_allocations: u64,
    /// Bytes in them.
    pub live_bytes: u64,
    /// Host ranges attached for device access ([`HostMemory`]) alive.
    pub attached_host_ranges: u64,
    /// Bytes in them.
    pub attached_host_bytes: u64,
    /// Of those, bytes registered with the driver ([`HostAccess::Registered`]).
    pub registered_host_bytes: u64,
    /// Streams the driver holds for this backend (the shared default stream not counted),
    /// including retired ones whose destroy failed.
    pub live_streams: u64,
    /// Per-tenant contexts the driver holds, including retired ones whose destroy failed.
    pub live_contexts: u64,
    /// Device memory pools the driver holds, including retired ones whose destroy failed.
    pub live_pools: u64,
    /// Pool allocations alive.
    pub live_pool_allocations: u64,
    /// Releases the driver refused so far (stream, context and pool destroys, pool frees, and
    /// context-stack pops).
    pub release_failures: u64,
    /// Streams, contexts and pools now retired (handed to no one) but still held by the driver
    /// after a failed release: they are tried again at drop.
    pub pending_releases: u64,
    /// Contexts seen lost to a kernel fault (sticky), primary and per-tenant alike.
    pub faults: u64,
    /// Devices fenced now (a fault in the primary context, not recovered yet).
    pub fenced_devices: u64,
    /// Primary contexts reset by [`DriverBackend::recover`].
    pub recoveries: u64,
    /// Allocations a recovery destroyed whose owners have not freed them yet (no driver
    /// resource: their frees succeed without a driver call).
    pub lost_allocations: u64,
    /// Bytes in them.
    pub lost_bytes: u64,
}

impl DriverStats {
    /// Counts an attached host range in or out of the figures.
    fn count_host(&mut self, access: HostAccess, len: usize, attached: bool) {
        let registered = if access == HostAccess::Registered {
            len as u64
        } else {
            0
        };
        if attached {
            self.attached_host_ranges += 1;
            self.attached_host_bytes += len as u64;
            self.registered_host_bytes += registered;
        } else {
            self.attached_host_ranges -= 1;
            self.attached_host_bytes -= len as u64;
            self.registered_host_bytes -= registered;
        }
    }
}

/// What one [`DriverBackend`] did at its drop, readable before and after it goes (take it with
/// [`DriverBackend::drop_report`]): a `Drop` cannot return an error, so this is where what it
/// could not give back is reported. Clones read the same counts.
#[derive(Clone, Debug, Default)]
pub struct DropReport(alloc::sync::Arc<DropCounts>);

#[derive(Debug, Default)]
struct DropCounts {
    dropped: core::sync::atomic::AtomicBool,
    reclaimed: AtomicU64,
    unreleased: AtomicU64,
}

impl DropReport {
    /// Whether the backend has dropped (the counts are final).
    #[must_use]
    pub fn dropped(&self) -> bool {
        self.0.dropped.load(Ordering::Acquire)
    }

    /// Driver resources (allocations, streams, contexts, pools, pool blocks) still live when the
    /// backend dropped that it gave back then: what an embedder forgot to release, or what a
    /// failed release left for the drop to retry.
    #[must_use]
    pub fn reclaimed(&self) -> u64 {
        self.0.reclaimed.load(Ordering::Acquire)
    }

    /// Driver resources the backend could not give back even at drop (the driver refused the
    /// retry as well). Non-zero means the driver still holds them: a real leak.
    #[must_use]
    pub fn unreleased(&self) -> u64 {
        self.0.unreleased.load(Ordering::Acquire)
    }
}

/// Where a stream or pool record is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    /// In service.
    Live,
    /// Released while a driver call was using it: refused to new callers, torn down by the last
    /// user.
    Releasing,
    /// The driver refused to tear it down: refused to callers, counted, retried at drop.
    Failed,
}

/// A live allocation of ours: managed memory, or host memory attached through [`HostMemory`].
#[derive(Debug)]
struct AllocationRecord {
    len: usize,
    device: DeviceId,
    /// `None`: managed memory from `alloc_managed`; `Some`: attached host memory.
    host: Option<HostAccess>,
    /// The recovery generation it was made in.
    generation: u64,
    /// Its owner gave it up (its free or detach was refused): a recovery need not wait for it.
    abandoned: bool,
    /// Its owner will never free it ([`ManagedAllocator::forget`]): a reset destroys it with
    /// no lost record (only this backend's drop frees it, if no reset came first).
    orphaned: bool,
}

#[derive(Debug, Default)]
struct State {
    allocations: HashMap<u64, AllocationRecord>,
    streams: HashMap<DriverStream, streams::StreamRecord>,
    contexts: HashMap<TenantKey, streams::TenantContextEntry>,
    /// Contexts whose destroy the driver refused: counted live, retried at drop.
    retired_contexts: Vec<DriverContext>,
    pools: HashMap<DriverPool, device_pools::PoolRecord>,
    stats: DriverStats,
    /// Per device: its fault record.
    devices: Vec<DeviceHealth>,
    /// Allocations a recovery destroyed, by address and generation, until their owners free them.
    lost: HashMap<(u64, u64), recovery::LostRecord>,
    /// Recoveries so far: the generation new allocations are made in.
    generation: u64,
}

impl State {
    /// Counts a release the driver refused; `retired`: of a stream, context or pool now held
    /// for the retry at drop.
    fn release_failed(&mut self, retired: bool) {
        self.stats.release_failures += 1;
        if retired {
            self.stats.pending_releases += 1;
        }
    }
}

/// Runs `f` with `context` pushed on the calling thread's context stack, and pops it after.
/// Returns `f`'s answer and whether the pop succeeded.
fn with_context<D: DriverApi, T>(
    driver: &D,
    context: DriverContext,
    f: impl FnOnce(&D) -> Result<T, D::Error>,
) -> (Result<T, D::Error>, bool) {
    if let Err(e) = driver.push_current(context) {
        return (Err(e), true);
    }
    /// Pops if `f` unwinds, so a panic leaves the stack balanced too.
    struct PopOnUnwind<'d, D: DriverApi>(&'d D);
    impl<D: DriverApi> Drop for PopOnUnwind<'_, D> {
        fn drop(&mut self) {
            let _ = self.0.pop_current();
        }
    }
    let guard = PopOnUnwind(driver);
    let result = f(driver);
    core::mem::forget(guard);
    let popped = driver.pop_current().is_ok();
    (result, popped)
}

/// The three backend traits and [`DevicePools`](crate::DevicePools) on a [`DriverApi`].
///
/// What `DriverBackend` adds to the raw calls:
/// - ranges checked against its own table of live allocations before the driver is asked, so an
///   out-of-range or overflowing request never reaches the driver, and an allocation of another
///   backend is refused;
/// - devices and locations checked against the driver's device count; prefetch to a device
///   without concurrent managed access refused as unsupported;
/// - streams per isolation level (the default stream when shared, one stream per instance in the
///   primary context when stream-isolated, a context per tenant when context-isolated, destroyed
///   with its last stream), and stream handles it did not hand out refused;
/// - empty ranges accepted without a driver call;
/// - device memory pools ([`DevicePools`](crate::DevicePools)) on the driver's optional pool calls (drivers without
///   them answer `Unsupported`), with their allocations tracked;
/// - counters, and everything still alive at drop given back to the driver;
/// - safety under threads and failures: tenants keyed by [`TenantKey`], each driver call on a
///   stream or pool holding a counted use of its record (a release never tears one down under a
///   call), records out of the table before the driver frees, contexts pushed and popped in
///   pairs, and every release the driver refuses kept, counted and retried at drop (see
///   `docs/BACKENDS.md` and the submodules `streams` and `device_pools`).
///
/// Streams are made on the device `acquire_stream_on` names.
pub struct DriverBackend<D: DriverApi> {
    driver: D,
    caps: Capabilities,
    state: spin::Mutex<State>,
    drop_report: DropReport,
    /// Devices fenced now, and lost records held: read without the lock, so that a backend
    /// that never saw a fault pays nothing for the checks on its hot paths.
    faulted: recovery::Faulted,
}

impl<D: DriverApi + fmt::Debug> fmt::Debug for DriverBackend<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DriverBackend")
            .field("driver", &self.driver)
            .field("capabilities", &self.caps)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<D: DriverApi> DriverBackend<D> {
    /// Wraps a started driver. Capabilities: managed, host- and device-accessible, zeroed only
    /// where the driver says fresh allocations are, no guard pages; concurrent managed access and pageable memory access only if every device
    /// has them.
    pub fn new(driver: D) -> Self {
        let driver_devices = driver.device_count();
        let facts = (0..driver.device_count()).map(|d| driver.device_facts(DeviceId(d)));
        let (mut concurrent, mut pageable) = (true, true);
        for f in facts {
            concurrent &= f.concurrent_managed_access;
            pageable &= f.pageable_memory_access;
        }
        Self {
            caps: Capabilities {
                host_accessible: true,
                device_accessible: true,
                managed: true,
                comes_zeroed: driver.allocations_come_zeroed(),
                guard_pages: false,
                concurrent_managed_access: concurrent,
                pageable_memory_access: pageable,
            },
            state: spin::Mutex::new(State {
                devices: alloc::vec![DeviceHealth::default(); driver.device_count() as usize],
                ..State::default()
            }),
            driver,
            drop_report: DropReport::default(),
            faulted: recovery::Faulted::new(driver_devices),
        }
    }

    /// The report of this backend's drop: what it gave back then and what the driver refused
    /// even then, readable once it has gone.
    #[must_use]
    pub fn drop_report(&self) -> DropReport {
        self.drop_report.clone()
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> DriverStats {
        self.state.lock().stats
    }

    /// Runs `f` with `context` current on the calling thread, and restores the thread's previous
    /// current context after (a push and a pop: the caller's context stack is left as it was).
    fn in_context<T>(
        &self,
        context: DriverContext,
        f: impl FnOnce(&D) -> Result<T, D::Error>,
    ) -> Result<T, D::Error> {
        let (result, popped) = with_context(&self.driver, context, f);
        if !popped {
            self.state.lock().release_failed(false);
        }
        if let Err(e) = &result {
            self.note_fault(context, e);
        }
        result
    }

    /// [`in_context`](Self::in_context) with `device`'s primary context.
    fn in_primary<T>(
        &self,
        device: DeviceId,
        f: impl FnOnce(&D) -> Result<T, D::Error>,
    ) -> Result<T, D::Error> {
        self.in_context(self.driver.primary_context(device), f)
    }

    fn check_device(&self, device: DeviceId) -> Result<(), Refusal> {
        let count = self.driver.device_count();
        if device.0 < count {
            Ok(())
        } else {
            Err(Refusal::InvalidDevice { device, count })
        }
    }

    fn check_location(&self, location: Location) -> Result<(), Refusal> {
        match location {
            Location::Host => Ok(()),
            Location::Device(d) => self.check_device(d),
        }
    }

    /// The device of a live allocation of ours, and the checked range as the driver names it:
    /// its device address and length (`None` for an empty range, which the driver is not asked
    /// about).
    fn checked(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<Checked<'_>, Refusal> {
        let address = allocation.device_ptr();
        // Entered before the record is read: no reset can destroy the range under the call.
        let call = self.enter(allocation.device(), false)?;
        let (device, host) = {
            let state = self.state.lock();
            match state.allocations.get(&address) {
                Some(r) if r.len == allocation.len() && r.generation == allocation.generation() => {
                    (r.device, r.host)
                }
                _ if state.lost.contains_key(&(address, allocation.generation())) => {
                    return Err(Refusal::LostInRecovery { address });
                }
                _ => return Err(Refusal::UnknownAllocation { address }),
            }
        };
        let range = allocation.range(offset, len)?;
        let span = (!range.is_empty()).then(|| (address + range.start as u64, range.len()));
        Ok(Checked {
            device,
            host,
            span,
            _call: call,
        })
    }
}

/// A range [`DriverBackend::checked`] found inside a live allocation of ours.
struct Checked<'b> {
    /// The call's place in its device's gate, held while the driver is asked.
    _call: recovery::DeviceCall<'b>,
    /// The allocation's device.
    device: DeviceId,
    /// How the device reaches it, when it is attached host memory.
    host: Option<HostAccess>,
    /// The driver's address and length of the range (`None`: empty).
    span: Option<(u64, usize)>,
}

impl<D: DriverApi + Default> Default for DriverBackend<D> {
    /// A backend over the driver's default value.
    fn default() -> Self {
        Self::new(D::default())
    }
}

impl<D: DriverApi> ErrorType for DriverBackend<D> {
    type Error = D::Error;
}

// SAFETY: `allocate` wraps what `DriverApi::alloc_managed` returned for exactly `bytes` bytes,
// whose guarantees are those `Allocation::from_raw_parts` asks for (the `DriverApi` contract);
// `zero` checks the range against the table of live allocations before the driver writes; the
// capabilities follow the `DriverApi` contract and its device facts.
unsafe impl<D: DriverApi> ManagedAllocator for DriverBackend<D> {
    fn capabilities(&self) -> Capabilities {
        self.caps
    }

    fn device_count(&self) -> u32 {
        self.driver.device_count()
    }

    fn device_health(&self, device: DeviceId) -> DeviceHealth {
        self.health(device)
    }

    fn recoveries(&self) -> u64 {
        self.recoveries_so_far()
    }

    fn claim_fault(&self, device: DeviceId, fault: u64) -> bool {
        Self::claim_fault(self, device, fault)
    }

    fn device_fenced(&self, device: DeviceId) -> bool {
        // One atomic load while no device is fenced (what a slot pool asks on every slot).
        self.is_fenced(device)
    }

    fn begin_device_work(&self, device: DeviceId) -> Result<(), D::Error> {
        self.begin_work(device).map_err(Into::into)
    }

    fn end_device_work(&self, device: DeviceId) {
        self.end_work(device);
    }

    unsafe fn recover_device(&self, device: DeviceId) -> Result<Option<Recovery>, D::Error> {
        // SAFETY: the caller upholds the contract, which is `recover`'s.
        unsafe { self.recover(device) }
    }

    fn watch_idle(&self, holder: alloc::sync::Weak<dyn crate::allocator::IdleHolder>) {
        Self::watch_idle(self, holder);
    }

    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> bool {
        device != peer
            && self.check_device(device).is_ok()
            && self.check_device(peer).is_ok()
            && self.driver.can_access_peer(device, peer)
    }

    /// The device's own facts, and its memory as `cuMemGetInfo` in its primary context
    /// answers (figures `None` if the driver cannot say or the call fails).
    fn device_report(&self, device: DeviceId) -> Option<crate::DeviceReport> {
        self.check_device(device).ok()?;
        let facts = self.driver.device_facts(device);
        let memory = self.in_primary(device, |d| d.memory_info()).ok().flatten();
        Some(crate::DeviceReport {
            device,
            concurrent_managed_access: facts.concurrent_managed_access,
            pageable_memory_access: facts.pageable_memory_access,
            host_registration: facts.host_registration,
            total_bytes: memory.map(|(_, total)| total),
            free_bytes: memory.map(|(free, _)| free),
        })
    }

    fn allocate(&self, device: DeviceId, bytes: usize) -> Result<Allocation, D::Error> {
        if bytes == 0 {
            return Err(Refusal::ZeroSize.into());
        }
        let _call = self.enter(device, false)?;
        let address = self.in_primary(device, |d| d.alloc_managed(device, bytes))?;
        let Some(ptr) = core::ptr::NonNull::new(address as usize as *mut u8) else {
            return Err(Refusal::UnknownAllocation { address }.into());
        };
        let mut state = self.state.lock();
        let generation = state.generation;
        state.allocations.insert(
            address,
            AllocationRecord {
                len: bytes,
                device,
                host: None,
                generation,
                abandoned: false,
                orphaned: false,
            },
        );
        state.stats.live_allocations += 1;
        state.stats.live_bytes += bytes as u64;
        // SAFETY: the `DriverApi` contract: a fresh managed allocation of `bytes` bytes.
        Ok(unsafe { Allocation::from_raw_parts_in(ptr, bytes, device, generation) })
    }

    unsafe fn free(&self, allocation: Allocation) -> Result<(), Refused<Allocation, D::Error>> {
        if self.take_lost(&allocation, false) {
            // A recovery's reset destroyed it: nothing is left for the driver to do.
            return Ok(());
        }
        // A reset under way is waited out, not a refusal: the caller would keep the memory
        // (a growth's detach would even leave its pages unknown) for a moment's overlap.
        let _call = match self.enter_teardown(allocation.device()) {
            Ok(call) => call,
            Err(refusal) => return Err(refused(allocation, refusal.into())),
        };
        let address = allocation.device_ptr();
        // The record leaves the table before the driver frees: once freed, the driver may hand
        // the same address to another thread's `allocate` at once, whose record this call must
        // not touch. It goes back if the driver refuses.
        let record = match self.take_record(&allocation, false) {
            Ok(record) => record,
            Err(refusal) => return Err(refused(allocation, refusal.into())),
        };
        let device = record.device;
        if self.is_fenced(device) {
            // Not sent to a lost context: given up, kept for the recovery's reset.
            self.give_back_record(address, record, false);
            return Err(refused(allocation, Refusal::DeviceFenced { device }.into()));
        }
        // SAFETY: `address` is the base of a live allocation of ours (its record was in the
        // table), and the caller guarantees it is not used afterwards.
        match self.in_primary(device, |d| unsafe { d.free(address) }) {
            Ok(()) => {
                let mut state = self.state.lock();
                state.stats.live_allocations -= 1;
                state.stats.live_bytes -= record.len as u64;
                Ok(())
            }
            Err(e) => {
                self.give_back_record(address, record, true);
                Err(refused(allocation, e))
            }
        }
    }

    fn forget(&self, allocation: Allocation) {
        self.forget_record(&allocation);
    }

    unsafe fn zero(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), D::Error> {
        let Checked {
            device,
            host,
            span,
            _call,
        } = self.checked(allocation, offset, len)?;
        let Some((start, len)) = span else {
            return Ok(());
        };
        if host.is_some() {
            // Attached host memory is the host's to write: zeros written here are what the
            // device reads (through the host's page tables, or the pinned pages).
            // SAFETY: the range lies inside attached host memory, mapped readable and writable
            // by `attach_host`'s contract (checked against our table); the caller guarantees
            // nothing else accesses it meanwhile.
            unsafe { (start as usize as *mut u8).write_bytes(0, len) };
            return Ok(());
        }
        // SAFETY: the range lies inside a live allocation of ours (checked); the caller
        // guarantees nothing else accesses it meanwhile.
        self.in_primary(device, |d| unsafe { d.zero(device, start, len) })
    }

    /// Managed memory is written from the host where every device has concurrent managed
    /// access (the host may touch managed memory while kernels run); otherwise, and for a
    /// driver without it, this is [`zero`](Self::zero).
    unsafe fn zero_on_host(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), D::Error> {
        if !self.caps.concurrent_managed_access {
            // SAFETY: the caller upholds `zero`'s contract.
            return unsafe { self.zero(allocation, offset, len) };
        }
        let Checked { span, _call, .. } = self.checked(allocation, offset, len)?;
        if let Some((start, len)) = span {
            // SAFETY: the range lies inside a live allocation of ours or attached host memory
            // (checked against our table), host-accessible and mapped readable and writable;
            // the caller guarantees nothing else, device work included, uses it meanwhile, and
            // every device has concurrent managed access, so the host may write it while other
            // work runs.
            unsafe { (start as usize as *mut u8).write_bytes(0, len) };
        }
        Ok(())
    }
}

impl<D: DriverApi> Advisor for DriverBackend<D> {
    fn advise(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
        advice: Advice,
    ) -> Result<(), D::Error> {
        let Checked {
            device,
            host,
            span,
            _call,
        } = self.checked(allocation, offset, len)?;
        if let Some(Location::Device(d)) = advice.location()
            && self.is_fenced(d)
        {
            return Err(Refusal::DeviceFenced { device: d }.into());
        }
        if let Some(location) = advice.location() {
            self.check_location(location)?;
        }
        if host == Some(HostAccess::Registered) {
            return Err(Refusal::Unsupported {
                device,
                what: "advice on registered host memory (pinned, never migrated)",
            }
            .into());
        }
        let Some((start, len)) = span else {
            return Ok(());
        };
        self.in_primary(device, |d| d.advise(start, len, advice))
    }

    fn prefetch(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
        to: Location,
        stream: &Stream,
    ) -> Result<(), D::Error> {
        let Checked {
            host, span, _call, ..
        } = self.checked(allocation, offset, len)?;
        self.check_location(to)?;
        if let Location::Device(d) = to
            && self.is_fenced(d)
        {
            return Err(Refusal::DeviceFenced { device: d }.into());
        }
        if host == Some(HostAccess::Registered) {
            // Pinned pages the device reads where they are: nothing to migrate, whatever the
            // device's managed-memory abilities (the stream is checked all the same).
            self.stream_use(stream.key())?;
            return Ok(());
        }
        if let Location::Device(device) = to
            && !self.driver.device_facts(device).concurrent_managed_access
        {
            return Err(Refusal::Unsupported {
                device,
                what: "prefetch to the device (no concurrent managed access)",
            }
            .into());
        }
        let using = self.stream_use(stream.key())?;
        let Some((start, len)) = span else {
            return Ok(());
        };
        self.in_context(using.context, |d| d.prefetch(start, len, to, using.raw()))
    }

    /// Unsets every advice over the range (accessed-by for the host and each device). No page
    /// moves: residency stays where it is.
    fn reset_hints(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), D::Error> {
        let Checked {
            device,
            host,
            span,
            _call,
        } = self.checked(allocation, offset, len)?;
        let Some((start, len)) = span.filter(|_| host != Some(HostAccess::Registered)) else {
            // Empty, or registered host memory, which takes no advice and never migrates.
            return Ok(());
        };
        let devices = self.driver.device_count();
        // Accessed-by advice on pageable host memory names only devices that reach it (a
        // device without pageable memory access refuses it there).
        let advisable = |other: u32| {
            host.is_none()
                || self
                    .driver
                    .device_facts(DeviceId(other))
                    .pageable_memory_access
        };
        // Residency is left where the pages are: prefetching dead bytes back to the host would
        // move them over the link for nothing (the next touch places them).
        self.in_primary(device, |d| {
            d.advise(start, len, Advice::UnsetReadMostly)?;
            d.advise(start, len, Advice::UnsetPreferredLocation)?;
            d.advise(start, len, Advice::UnsetAccessedBy(Location::Host))?;
            for other in (0..devices).filter(|&o| advisable(o)) {
                let peer = Location::Device(DeviceId(other));
                d.advise(start, len, Advice::UnsetAccessedBy(peer))?;
            }
            Ok(())
        })
    }
}

/// A release handed back to its owner with the driver's (or our own) error.
fn refused<E>(allocation: Allocation, error: E) -> Refused<Allocation, E> {
    Refused {
        resource: allocation,
        error,
    }
}

impl<D: DriverApi> DriverBackend<D> {
    /// Takes the record of the allocation at `address` out of the table, if it is ours, `len`
    /// bytes long, and attached host memory exactly when `host` says so; else the table is left
    /// as it was and the refusal says why.
    fn take_record(
        &self,
        allocation: &Allocation,
        host: bool,
    ) -> Result<AllocationRecord, Refusal> {
        let (address, len) = (allocation.device_ptr(), allocation.len());
        let mut state = self.state.lock();
        match state.allocations.remove(&address) {
            Some(r)
                if r.len == len
                    && r.host.is_some() == host
                    && r.generation == allocation.generation() =>
            {
                Ok(r)
            }
            Some(r) => {
                let attached = r.host.is_some() && !host;
                state.allocations.insert(address, r);
                if attached {
                    Err(Refusal::AttachedHost { address })
                } else {
                    Err(Refusal::UnknownAllocation { address })
                }
            }
            None => Err(Refusal::UnknownAllocation { address }),
        }
    }

    /// Its owner gives `allocation` up for good: a lost record of it goes (nothing waits for
    /// its free any more), a live record is marked orphaned (a reset destroys it without a lost
    /// record; this backend's drop frees it otherwise).
    fn forget_record(&self, allocation: &Allocation) {
        // Both tables under one lock (no lock-free shortcut): a recovery between a look at the
        // live table and one at the lost table would otherwise leave its lost record behind.
        let mut state = self.state.lock();
        if self.remove_lost(&mut state, allocation, None) {
            return;
        }
        if let Some(r) = state.allocations.get_mut(&allocation.device_ptr())
            && r.len == allocation.len()
            && r.generation == allocation.generation()
        {
            r.abandoned = true;
            r.orphaned = true;
        }
    }

    /// A record whose release was refused (by the driver, or by the fence) goes back to the
    /// table, given up by its owner: no reason for a recovery to wait; a driver's refusal is
    /// counted (`by_driver`).
    fn give_back_record(&self, address: u64, record: AllocationRecord, by_driver: bool) {
        let mut state = self.state.lock();
        state.allocations.insert(
            address,
            AllocationRecord {
                abandoned: true,
                ..record
            },
        );
        if by_driver {
            state.release_failed(false);
        }
    }
}

// SAFETY: `can_attach_host` reads the driver's device facts (honest by the `DriverApi`
// contract: pageable access, or registration with the host pointer usable on the device);
// `attach_host` registers exactly the range given (or, with pageable access, asks the driver
// nothing) and records it; `detach_host` unregisters it and forgets it only once the driver
// has let go.
unsafe impl<D: DriverApi> HostMemory for DriverBackend<D> {
    fn can_attach_host(&self, device: DeviceId, access: HostAccess) -> bool {
        if self.check_device(device).is_err() {
            return false;
        }
        let facts = self.driver.device_facts(device);
        match access {
            HostAccess::Pageable => facts.pageable_memory_access,
            HostAccess::Registered => facts.host_registration,
        }
    }

    unsafe fn attach_host(
        &self,
        device: DeviceId,
        access: HostAccess,
        ptr: core::ptr::NonNull<u8>,
        len: usize,
    ) -> Result<Allocation, D::Error> {
        if len == 0 {
            return Err(Refusal::ZeroSize.into());
        }
        let _call = self.enter(device, false)?;
        if !self.can_attach_host(device, access) {
            return Err(Refusal::Unsupported {
                device,
                what: match access {
                    HostAccess::Pageable => "pageable memory access",
                    HostAccess::Registered => "host memory registration",
                },
            }
            .into());
        }
        let address = ptr.as_ptr() as usize as u64;
        // The record goes in first (a second attach of the same base is refused), and leaves
        // again if the driver refuses the registration.
        let generation = {
            let mut state = self.state.lock();
            if state.allocations.contains_key(&address) {
                return Err(Refusal::AlreadyAttached { address }.into());
            }
            let generation = state.generation;
            state.allocations.insert(
                address,
                AllocationRecord {
                    len,
                    device,
                    host: Some(access),
                    generation,
                    abandoned: false,
                    orphaned: false,
                },
            );
            generation
        };
        if access == HostAccess::Registered
            && let Err(e) = self.in_primary(device, |d| d.host_register(address, len))
        {
            self.state.lock().allocations.remove(&address);
            return Err(e);
        }
        self.state.lock().stats.count_host(access, len, true);
        // SAFETY: the caller guarantees host memory mapped readable and writable for `len`
        // bytes, page-aligned (so at least `MIN_ALIGN`), owned by the caller until detached.
        Ok(unsafe { Allocation::from_raw_parts_in(ptr, len, device, generation) })
    }

    unsafe fn detach_host(
        &self,
        allocation: Allocation,
    ) -> Result<(), Refused<Allocation, D::Error>> {
        if self.take_lost(&allocation, true) {
            // A recovery's reset dropped its registration: the host pages are the caller's.
            return Ok(());
        }
        // A reset under way is waited out, not a refusal: the caller would keep the memory
        // (a growth's detach would even leave its pages unknown) for a moment's overlap.
        let _call = match self.enter_teardown(allocation.device()) {
            Ok(call) => call,
            Err(refusal) => return Err(refused(allocation, refusal.into())),
        };
        let address = allocation.device_ptr();
        let record = match self.take_record(&allocation, true) {
            Ok(record) => record,
            Err(refusal) => return Err(refused(allocation, refusal.into())),
        };
        let access = record.host.unwrap_or(HostAccess::Pageable);
        if access == HostAccess::Registered && self.is_fenced(record.device) {
            let device = record.device;
            self.give_back_record(address, record, false);
            return Err(refused(allocation, Refusal::DeviceFenced { device }.into()));
        }
        if access == HostAccess::Registered {
            // SAFETY: a range this backend registered (its record was in the table); the
            // caller guarantees no device work uses it any more.
            let unregistered =
                self.in_primary(record.device, |d| unsafe { d.host_unregister(address) });
            if let Err(e) = unregistered {
                self.give_back_record(address, record, true);
                return Err(refused(allocation, e));
            }
        }
        self.state
            .lock()
            .stats
            .count_host(access, record.len, false);
        Ok(())
    }
}

impl<D: DriverApi> Drop for DriverBackend<D> {
    /// Gives back everything still live, retired resources included (a retry of each release
    /// the driver refused before), and reports the outcome in its [`DropReport`]
    /// ([`drop_report`](Self::drop_report)). Streams are waited for before they are destroyed; pool blocks are
    /// freed on their own stream while it lives (streams go after pools).
    fn drop(&mut self) {
        let driver = &self.driver;
        let state = self.state.get_mut();
        let (mut reclaimed, mut unreleased) = (0u64, 0u64);
        let mut tally = |ok: bool| {
            if ok {
                reclaimed += 1;
            } else {
                unreleased += 1;
            }
        };
        for (raw, record) in state.pools.drain() {
            let primary = driver.primary_context(record.device);
            for (&ptr, block) in &record.live {
                let (context, stream) = match state.streams.get(&block.stream) {
                    Some(s)
                        if s.life != Life::Failed
                            && Some(s.tenant) == block.tenant
                            && s.context == block.context =>
                    {
                        (s.context, block.stream)
                    }
                    _ => (primary, DriverStream::DEFAULT),
                };
                let (freed, _) = with_context(driver, context, |d| d.pool_free(ptr, stream));
                tally(freed.is_ok());
            }
            let (destroyed, _) = with_context(driver, primary, |d| d.pool_destroy(raw));
            tally(destroyed.is_ok());
            if destroyed.is_err() {
                // The driver may still hold its blocks: their charges stay with the tenant.
                record.charges.into_iter().for_each(Reservation::strand);
            }
        }
        for (raw, record) in state.streams.drain() {
            let (destroyed, _) = with_context(driver, record.context, |d| {
                // A failed wait does not keep the stream: it is destroyed all the same.
                let _ = d.synchronize(raw);
                d.stream_destroy(raw)
            });
            tally(destroyed.is_ok());
        }
        let contexts = state.contexts.drain().filter_map(|(_, e)| e.context);
        for context in contexts.chain(state.retired_contexts.drain(..)) {
            tally(driver.context_destroy(context).is_ok());
        }
        for (address, record) in state.allocations.drain() {
            let primary = driver.primary_context(record.device);
            let (freed, _) = match record.host {
                // SAFETY: a live allocation of ours; the backend is going away, and by the
                // `Allocation` contract nothing may use its memory past the backend's life.
                None => with_context(driver, primary, |d| unsafe { d.free(address) }),
                Some(HostAccess::Registered) => with_context(driver, primary, |d| {
                    // SAFETY: a range this backend registered (its owner could not detach it);
                    // no device work of this backend outlives it.
                    unsafe { d.host_unregister(address) }
                }),
                Some(HostAccess::Pageable) => continue,
            };
            tally(freed.is_ok());
        }
        let report = &self.drop_report.0;
        report.reclaimed.fetch_add(reclaimed, Ordering::AcqRel);
        report.unreleased.fetch_add(unreleased, Ordering::AcqRel);
        report.dropped.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_typed() {
        assert_eq!(Refusal::ZeroSize.kind(), ErrorKind::InvalidArgument);
        assert_eq!(Refusal::NoDevicePools.kind(), ErrorKind::Unsupported);
        assert_eq!(
            Refusal::Range(RangeError::Overflow { offset: 1, len: 2 }).kind(),
            ErrorKind::Overflow
        );
        assert!(
            !Refusal::UnknownStream {
                stream: DriverStream::from_raw(7)
            }
            .kind()
            .is_denial()
        );
    }
}
