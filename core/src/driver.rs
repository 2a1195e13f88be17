//! [`DriverBackend`]: the three backend traits implemented once, on top of a thin [`DriverApi`]
//! (a CUDA-like driver's raw calls). The real driver backends (cudarc, cust) implement only
//! `DriverApi`; every check, every table and every counter lives here, so they cannot drift apart.
//!
//! What `DriverBackend` adds to the raw calls:
//! - ranges checked against its own table of live allocations before the driver is asked, so an
//!   out-of-range or overflowing request never reaches the driver, and an allocation of another
//!   backend is refused;
//! - devices and locations checked against the driver's device count; prefetch to a device
//!   without concurrent managed access refused as unsupported;
//! - streams per isolation level (the default stream when shared, one stream per instance in the
//!   primary context when stream-isolated, a context per tenant when context-isolated, destroyed
//!   with its last stream), and stream handles it did not hand out refused;
//! - empty ranges accepted without a driver call;
//! - device memory pools ([`DevicePools`]) on the driver's optional pool calls (drivers without
//!   them answer `Unsupported`), with their allocations tracked;
//! - counters, and everything still alive at drop given back to the driver.

use core::fmt;

use hashbrown::HashMap;

use crate::advisor::Advisor;
use crate::allocator::{Allocation, ManagedAllocator};
use crate::device::{Advice, Capabilities, DeviceId, Location};
use crate::error::{BackendError, ErrorKind, ErrorType, RangeError};
use crate::isolation::IsolationLevel;
use crate::ledger::TenantId;
use crate::pools::{DevicePoolConfig, DevicePoolStats, DevicePools, PoolAllocation, PoolHandle};
use crate::stream::{DEFAULT_STREAM, Stream, StreamProvider};

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
    #[error("unknown stream {raw:#x}")]
    UnknownStream {
        /// The raw handle.
        raw: u64,
    },
    /// The driver (or its binding) has no stream-ordered memory pools.
    #[error("this backend has no device memory pools")]
    NoDevicePools,
    /// A pool this backend did not make (or destroyed), or an allocation not from it.
    #[error("unknown pool {raw:#x} (or an allocation not from it)")]
    UnknownPool {
        /// The raw handle.
        raw: u64,
    },
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
            Self::Unsupported { .. } | Self::NoDevicePools => ErrorKind::Unsupported,
            Self::UnknownPool { .. }
            | Self::ZeroSize
            | Self::InvalidDevice { .. }
            | Self::UnknownAllocation { .. }
            | Self::UnknownStream { .. } => ErrorKind::InvalidArgument,
        }
    }
}

/// The [`ErrorKind`] of a `CUresult` code, for backends that wrap the CUDA driver API.
#[must_use]
pub const fn cuda_result_kind(code: u32) -> ErrorKind {
    match code {
        // CUDA_ERROR_OUT_OF_MEMORY
        2 => ErrorKind::OutOfMemory,
        // INVALID_VALUE, INVALID_DEVICE, INVALID_CONTEXT, INVALID_HANDLE
        1 | 101 | 201 | 400 => ErrorKind::InvalidArgument,
        // CUDA_ERROR_NO_DEVICE
        100 => ErrorKind::NoDevice,
        // CUDA_ERROR_NOT_SUPPORTED
        801 => ErrorKind::Unsupported,
        _ => ErrorKind::Driver,
    }
}

/// The `CUDA_ERROR_*` name of a `CUresult` code (the common ones), for messages.
#[must_use]
pub const fn cuda_result_name(code: u32) -> &'static str {
    match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        218 => "CUDA_ERROR_INVALID_PTX",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        500 => "CUDA_ERROR_NOT_FOUND",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "CUDA_ERROR_(other)",
    }
}

/// A CUDA driver call that failed: the entry point and the `CUresult` it returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {} ({code})", cuda_result_name(*.code))]
pub struct CudaCallError {
    /// The entry point.
    pub call: &'static str,
    /// The `CUresult` it returned.
    pub code: u32,
}

impl CudaCallError {
    /// The kind of this error.
    #[must_use]
    pub const fn kind(&self) -> ErrorKind {
        cuda_result_kind(self.code)
    }
}

/// Per-device facts a [`DriverApi`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceFacts {
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
    pub concurrent_managed_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`.
    pub pageable_memory_access: bool,
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
/// - [`device_facts`](Self::device_facts) is honest.
pub unsafe trait DriverApi: Send + Sync + 'static {
    /// The backend's error type; [`DriverBackend`]'s refusals convert into it.
    type Error: BackendError + From<Refusal>;

    /// Devices the driver has (at least one: a backend does not start without).
    fn device_count(&self) -> u32;

    /// Facts about `device` (`device < device_count()`).
    fn device_facts(&self, device: DeviceId) -> DeviceFacts;

    /// The primary context of `device`, retained for the life of the driver value.
    fn primary_context(&self, device: DeviceId) -> u64;

    /// Makes `context` current on the calling thread.
    fn set_current(&self, context: u64) -> Result<(), Self::Error>;

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
    fn prefetch(&self, ptr: u64, len: usize, to: Location, stream: u64) -> Result<(), Self::Error>;

    /// Creates a non-blocking stream in the current context.
    fn stream_create(&self) -> Result<u64, Self::Error>;

    /// Destroys a stream made by `stream_create`, with its context current.
    fn stream_destroy(&self, stream: u64) -> Result<(), Self::Error>;

    /// Waits for `stream` (0: the default stream), with its context current.
    fn synchronize(&self, stream: u64) -> Result<(), Self::Error>;

    /// Creates a context on `device` (it may become current).
    fn context_create(&self, device: DeviceId) -> Result<u64, Self::Error>;

    /// Destroys a context made by `context_create`.
    fn context_destroy(&self, context: u64) -> Result<(), Self::Error>;

    /// Creates a stream-ordered memory pool on `device` (`max_bytes` 0: no driver maximum), with
    /// `device`'s primary context current. Drivers without pools keep this default.
    fn pool_create(
        &self,
        device: DeviceId,
        max_bytes: u64,
        release_threshold: u64,
    ) -> Result<u64, Self::Error> {
        let _ = (device, max_bytes, release_threshold);
        Err(Refusal::NoDevicePools.into())
    }

    /// Destroys a pool with nothing allocated from it.
    fn pool_destroy(&self, pool: u64) -> Result<(), Self::Error> {
        let _ = pool;
        Err(Refusal::NoDevicePools.into())
    }

    /// Allocates `bytes` from `pool` on `stream` (with the stream's context current) and
    /// zero-fills them in stream order.
    fn pool_alloc(&self, pool: u64, bytes: usize, stream: u64) -> Result<u64, Self::Error> {
        let _ = (pool, bytes, stream);
        Err(Refusal::NoDevicePools.into())
    }

    /// Frees a pool allocation on `stream` (with the stream's context current).
    fn pool_free(&self, ptr: u64, stream: u64) -> Result<(), Self::Error> {
        let _ = (ptr, stream);
        Err(Refusal::NoDevicePools.into())
    }

    /// Gives the pool's freed memory back until it holds at most `keep_bytes`.
    fn pool_trim(&self, pool: u64, keep_bytes: u64) -> Result<(), Self::Error> {
        let _ = (pool, keep_bytes);
        Err(Refusal::NoDevicePools.into())
    }

    /// Bytes the driver holds for the pool.
    fn pool_reserved(&self, pool: u64) -> Result<u64, Self::Error> {
        let _ = pool;
        Err(Refusal::NoDevicePools.into())
    }
}

/// Counters of a [`DriverBackend`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Allocations alive.
    pub live_allocations: u64,
    /// Bytes in them.
    pub live_bytes: u64,
    /// Streams alive (the shared default stream not counted).
    pub live_streams: u64,
    /// Per-tenant contexts alive.
    pub live_contexts: u64,
    /// Device memory pools alive.
    pub live_pools: u64,
    /// Pool allocations alive.
    pub live_pool_allocations: u64,
    /// Allocations, streams, contexts and pools still alive when the backend dropped (then
    /// given back).
    pub leaked_at_drop: u64,
}

#[derive(Debug, Default)]
struct PoolRecord {
    device: DeviceId,
    tenant: TenantId,
    /// device pointer -> length
    live: HashMap<u64, usize>,
    live_bytes: u64,
    peak_bytes: u64,
}

#[derive(Debug)]
struct StreamRecord {
    tenant: TenantId,
    context: u64,
    level: IsolationLevel,
}

#[derive(Debug, Default)]
struct State {
    /// base -> (len, device)
    allocations: HashMap<u64, (usize, DeviceId)>,
    streams: HashMap<u64, StreamRecord>,
    /// tenant -> (context, live streams in it)
    contexts: HashMap<TenantId, (u64, u64)>,
    pools: HashMap<u64, PoolRecord>,
    stats: DriverStats,
}

/// The three backend traits on a [`DriverApi`]. See the [module docs](self).
///
/// Streams are made on device 0 (the trait's `acquire_stream` names no device).
pub struct DriverBackend<D: DriverApi> {
    driver: D,
    caps: Capabilities,
    state: spin::Mutex<State>,
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
    /// Wraps a started driver. Capabilities: managed, host- and device-accessible, not zeroed,
    /// no guard pages; concurrent managed access and pageable memory access only if every device
    /// has them.
    pub fn new(driver: D) -> Self {
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
                comes_zeroed: false,
                guard_pages: false,
                concurrent_managed_access: concurrent,
                pageable_memory_access: pageable,
            },
            driver,
            state: spin::Mutex::new(State::default()),
        }
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> DriverStats {
        self.state.lock().stats
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

    /// The device of a live allocation of ours, and the checked range.
    fn checked(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(DeviceId, core::ops::Range<usize>), Refusal> {
        let address = allocation.device_ptr();
        let device = match self.state.lock().allocations.get(&address) {
            Some(&(l, d)) if l == allocation.len() => d,
            _ => return Err(Refusal::UnknownAllocation { address }),
        };
        Ok((device, allocation.range(offset, len)?))
    }

    /// The context a stream handle belongs to, if this backend handed it out.
    fn stream_context(&self, stream: &Stream) -> Result<u64, Refusal> {
        if stream.raw() == DEFAULT_STREAM {
            if stream.is_shared() {
                return Ok(self.driver.primary_context(DeviceId(0)));
            }
        } else if let Some(r) = self.state.lock().streams.get(&stream.raw())
            && r.tenant == stream.tenant()
            && r.context == stream.context()
        {
            return Ok(r.context);
        }
        Err(Refusal::UnknownStream { raw: stream.raw() })
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

    fn allocate(&self, device: DeviceId, bytes: usize) -> Result<Allocation, D::Error> {
        if bytes == 0 {
            return Err(Refusal::ZeroSize.into());
        }
        self.check_device(device)?;
        self.driver
            .set_current(self.driver.primary_context(device))?;
        let address = self.driver.alloc_managed(device, bytes)?;
        let Some(ptr) = core::ptr::NonNull::new(address as usize as *mut u8) else {
            return Err(Refusal::UnknownAllocation { address }.into());
        };
        let mut state = self.state.lock();
        state.allocations.insert(address, (bytes, device));
        state.stats.live_allocations += 1;
        state.stats.live_bytes += bytes as u64;
        // SAFETY: the `DriverApi` contract: a fresh managed allocation of `bytes` bytes.
        Ok(unsafe { Allocation::from_raw_parts(ptr, bytes, device) })
    }

    unsafe fn free(&self, allocation: Allocation) -> Result<(), D::Error> {
        let (device, _) = self.checked(&allocation, 0, 0)?;
        let address = allocation.device_ptr();
        self.driver
            .set_current(self.driver.primary_context(device))?;
        // SAFETY: `address` is the base of a live allocation of ours (checked), and the caller
        // guarantees it is not used afterwards.
        unsafe { self.driver.free(address) }?;
        let mut state = self.state.lock();
        if let Some((len, _)) = state.allocations.remove(&address) {
            state.stats.live_allocations -= 1;
            state.stats.live_bytes -= len as u64;
        }
        Ok(())
    }

    unsafe fn zero(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), D::Error> {
        let (device, range) = self.checked(allocation, offset, len)?;
        if range.is_empty() {
            return Ok(());
        }
        self.driver
            .set_current(self.driver.primary_context(device))?;
        // SAFETY: the range lies inside a live allocation of ours (checked); the caller
        // guarantees nothing else accesses it meanwhile.
        unsafe {
            self.driver.zero(
                device,
                allocation.device_ptr() + range.start as u64,
                range.len(),
            )
        }
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
        let (device, range) = self.checked(allocation, offset, len)?;
        if let Some(location) = advice.location() {
            self.check_location(location)?;
        }
        if range.is_empty() {
            return Ok(());
        }
        self.driver
            .set_current(self.driver.primary_context(device))?;
        self.driver.advise(
            allocation.device_ptr() + range.start as u64,
            range.len(),
            advice,
        )
    }

    fn prefetch(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
        to: Location,
        stream: &Stream,
    ) -> Result<(), D::Error> {
        let (_, range) = self.checked(allocation, offset, len)?;
        self.check_location(to)?;
        if let Location::Device(device) = to
            && !self.driver.device_facts(device).concurrent_managed_access
        {
            return Err(Refusal::Unsupported {
                device,
                what: "prefetch to the device (no concurrent managed access)",
            }
            .into());
        }
        let context = self.stream_context(stream)?;
        if range.is_empty() {
            return Ok(());
        }
        self.driver.set_current(context)?;
        self.driver.prefetch(
            allocation.device_ptr() + range.start as u64,
            range.len(),
            to,
            stream.raw(),
        )
    }
}

impl<D: DriverApi> StreamProvider for DriverBackend<D> {
    fn acquire_stream(&self, tenant: TenantId, level: IsolationLevel) -> Result<Stream, D::Error> {
        let primary = self.driver.primary_context(DeviceId(0));
        let context = match level {
            IsolationLevel::Shared => {
                return Ok(Stream::new(DEFAULT_STREAM, primary, level, tenant));
            }
            IsolationLevel::StreamIsolated => primary,
            IsolationLevel::ContextIsolated => {
                let existing = self.state.lock().contexts.get(&tenant).map(|c| c.0);
                match existing {
                    Some(ctx) => ctx,
                    None => {
                        let ctx = self.driver.context_create(DeviceId(0))?;
                        let mut state = self.state.lock();
                        state.contexts.insert(tenant, (ctx, 0));
                        state.stats.live_contexts += 1;
                        ctx
                    }
                }
            }
        };
        let created = self
            .driver
            .set_current(context)
            .and_then(|()| self.driver.stream_create());
        let raw = match created {
            Ok(raw) => raw,
            Err(e) => {
                // A context made for this stream alone goes again.
                let mut state = self.state.lock();
                if level == IsolationLevel::ContextIsolated
                    && let Some(&(ctx, 0)) = state.contexts.get(&tenant)
                {
                    state.contexts.remove(&tenant);
                    state.stats.live_contexts -= 1;
                    drop(state);
                    let _ = self.driver.set_current(primary);
                    let _ = self.driver.context_destroy(ctx);
                }
                return Err(e);
            }
        };
        let mut state = self.state.lock();
        if level == IsolationLevel::ContextIsolated
            && let Some(entry) = state.contexts.get_mut(&tenant)
        {
            entry.1 += 1;
        }
        state.streams.insert(
            raw,
            StreamRecord {
                tenant,
                context,
                level,
            },
        );
        state.stats.live_streams += 1;
        Ok(Stream::new(raw, context, level, tenant))
    }

    fn release_stream(&self, stream: Stream) -> Result<(), D::Error> {
        let context = self.stream_context(&stream)?;
        if stream.raw() == DEFAULT_STREAM {
            return Ok(());
        }
        self.driver.set_current(context)?;
        self.driver.stream_destroy(stream.raw())?;
        let mut state = self.state.lock();
        let Some(record) = state.streams.remove(&stream.raw()) else {
            return Ok(());
        };
        state.stats.live_streams -= 1;
        if record.level != IsolationLevel::ContextIsolated {
            return Ok(());
        }
        let last = state.contexts.get_mut(&record.tenant).is_some_and(|entry| {
            entry.1 -= 1;
            entry.1 == 0
        });
        if last {
            state.contexts.remove(&record.tenant);
            state.stats.live_contexts -= 1;
            drop(state);
            self.driver
                .set_current(self.driver.primary_context(DeviceId(0)))?;
            self.driver.context_destroy(record.context)?;
        }
        Ok(())
    }

    fn synchronize(&self, stream: &Stream) -> Result<(), D::Error> {
        let context = self.stream_context(stream)?;
        self.driver.set_current(context)?;
        self.driver.synchronize(stream.raw())
    }
}

impl<D: DriverApi> DriverBackend<D> {
    /// The record of a pool handle of ours (device and tenant must match too).
    fn check_pool(&self, pool: &PoolHandle) -> Result<(), Refusal> {
        match self.state.lock().pools.get(&pool.raw()) {
            Some(r) if r.device == pool.device() && r.tenant == pool.tenant() => Ok(()),
            _ => Err(Refusal::UnknownPool { raw: pool.raw() }),
        }
    }
}

impl<D: DriverApi> DevicePools for DriverBackend<D> {
    fn create_pool(
        &self,
        tenant: TenantId,
        device: DeviceId,
        config: &DevicePoolConfig,
    ) -> Result<PoolHandle, D::Error> {
        self.check_device(device)?;
        self.driver
            .set_current(self.driver.primary_context(device))?;
        let raw = self
            .driver
            .pool_create(device, config.max_bytes, config.release_threshold)?;
        let mut state = self.state.lock();
        state.pools.insert(
            raw,
            PoolRecord {
                device,
                tenant,
                ..PoolRecord::default()
            },
        );
        state.stats.live_pools += 1;
        Ok(PoolHandle::new(raw, device, tenant))
    }

    fn pool_allocate(
        &self,
        pool: &PoolHandle,
        bytes: usize,
        stream: &Stream,
    ) -> Result<PoolAllocation, D::Error> {
        if bytes == 0 {
            return Err(Refusal::ZeroSize.into());
        }
        self.check_pool(pool)?;
        let context = self.stream_context(stream)?;
        self.driver.set_current(context)?;
        let ptr = self.driver.pool_alloc(pool.raw(), bytes, stream.raw())?;
        let mut state = self.state.lock();
        if let Some(r) = state.pools.get_mut(&pool.raw()) {
            r.live.insert(ptr, bytes);
            r.live_bytes += bytes as u64;
            r.peak_bytes = r.peak_bytes.max(r.live_bytes);
        }
        state.stats.live_pool_allocations += 1;
        Ok(PoolAllocation::new(ptr, bytes))
    }

    fn pool_free(
        &self,
        pool: &PoolHandle,
        allocation: PoolAllocation,
        stream: &Stream,
    ) -> Result<(), D::Error> {
        self.check_pool(pool)?;
        let known = self
            .state
            .lock()
            .pools
            .get(&pool.raw())
            .is_some_and(|r| r.live.get(&allocation.device_ptr()) == Some(&allocation.len()));
        if !known {
            return Err(Refusal::UnknownPool { raw: pool.raw() }.into());
        }
        let context = self.stream_context(stream)?;
        self.driver.set_current(context)?;
        self.driver
            .pool_free(allocation.device_ptr(), stream.raw())?;
        let mut state = self.state.lock();
        if let Some(r) = state.pools.get_mut(&pool.raw())
            && let Some(len) = r.live.remove(&allocation.device_ptr())
        {
            r.live_bytes -= len as u64;
            state.stats.live_pool_allocations -= 1;
        }
        Ok(())
    }

    fn trim_pool(&self, pool: &PoolHandle, keep_bytes: u64) -> Result<(), D::Error> {
        self.check_pool(pool)?;
        self.driver
            .set_current(self.driver.primary_context(pool.device()))?;
        self.driver.pool_trim(pool.raw(), keep_bytes)
    }

    fn pool_stats(&self, pool: &PoolHandle) -> Result<DevicePoolStats, D::Error> {
        self.check_pool(pool)?;
        self.driver
            .set_current(self.driver.primary_context(pool.device()))?;
        let reserved = self.driver.pool_reserved(pool.raw())?;
        let state = self.state.lock();
        let r = state
            .pools
            .get(&pool.raw())
            .ok_or(Refusal::UnknownPool { raw: pool.raw() })?;
        Ok(DevicePoolStats {
            live_bytes: r.live_bytes,
            peak_bytes: r.peak_bytes,
            reserved_bytes: reserved,
            live_allocations: r.live.len() as u64,
        })
    }

    fn destroy_pool(&self, pool: PoolHandle) -> Result<(), D::Error> {
        self.check_pool(&pool)?;
        let Some(record) = self.state.lock().pools.remove(&pool.raw()) else {
            return Err(Refusal::UnknownPool { raw: pool.raw() }.into());
        };
        self.driver
            .set_current(self.driver.primary_context(record.device))?;
        for &ptr in record.live.keys() {
            let _ = self.driver.pool_free(ptr, DEFAULT_STREAM);
        }
        let mut state = self.state.lock();
        state.stats.live_pools -= 1;
        state.stats.live_pool_allocations -= record.live.len() as u64;
        drop(state);
        self.driver.pool_destroy(pool.raw())
    }
}

impl<D: DriverApi> Drop for DriverBackend<D> {
    fn drop(&mut self) {
        let driver = &self.driver;
        let state = self.state.get_mut();
        let mut leaked = 0;
        for (raw, record) in state.pools.drain() {
            let _ = driver.set_current(driver.primary_context(record.device));
            for &ptr in record.live.keys() {
                let _ = driver.pool_free(ptr, DEFAULT_STREAM);
            }
            let _ = driver.pool_destroy(raw);
            leaked += 1;
        }
        for (raw, record) in state.streams.drain() {
            let _ = driver.set_current(record.context);
            let _ = driver.stream_destroy(raw);
            leaked += 1;
        }
        let _ = driver.set_current(driver.primary_context(DeviceId(0)));
        for (_, (ctx, _)) in state.contexts.drain() {
            let _ = driver.context_destroy(ctx);
            leaked += 1;
        }
        for (address, (_, device)) in state.allocations.drain() {
            let _ = driver.set_current(driver.primary_context(device));
            // SAFETY: a live allocation of ours; the backend is going away, and by the
            // `Allocation` contract nothing may use its memory past the backend's life.
            let _ = unsafe { driver.free(address) };
            leaked += 1;
        }
        state.stats.leaked_at_drop += leaked;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_results_map_to_kinds() {
        assert_eq!(cuda_result_kind(2), ErrorKind::OutOfMemory);
        assert_eq!(cuda_result_kind(1), ErrorKind::InvalidArgument);
        assert_eq!(cuda_result_kind(400), ErrorKind::InvalidArgument);
        assert_eq!(cuda_result_kind(100), ErrorKind::NoDevice);
        assert_eq!(cuda_result_kind(801), ErrorKind::Unsupported);
        assert_eq!(cuda_result_kind(999), ErrorKind::Driver);
    }

    #[test]
    fn refusals_are_typed() {
        assert_eq!(Refusal::ZeroSize.kind(), ErrorKind::InvalidArgument);
        assert_eq!(Refusal::NoDevicePools.kind(), ErrorKind::Unsupported);
        assert_eq!(
            Refusal::Range(RangeError::Overflow { offset: 1, len: 2 }).kind(),
            ErrorKind::Overflow
        );
        assert!(!Refusal::UnknownStream { raw: 7 }.kind().is_denial());
    }
}
