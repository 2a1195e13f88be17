#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod api;
mod backend_error;
mod calls;
pub mod code;
mod error;

use std::ffi::c_int;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

use tensor_wasm_mem_core::{
    Advice, BackendError, DeviceFacts, DeviceId, DriverApi, DriverContext, DriverPool,
    DriverStream, Location, Refusal,
};

pub use api::{
    Api, Entries, Handle, HintEntries, LoadError, MemLocation, MemPoolProps, PoolEntries, attr,
    location,
};
pub use backend_error::CudaBackendError;
pub use error::CudaError;

/// Facts about one device, read at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device.
    pub id: DeviceId,
    /// Its name.
    pub name: String,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
    pub concurrent_managed_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`.
    pub pageable_memory_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES` (ATS).
    pub pageable_uses_host_page_tables: bool,
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` and
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`.
    pub host_registration: bool,
}

#[derive(Debug)]
struct Device {
    info: DeviceInfo,
    /// Per device ordinal: whether this device can access memory on that one directly.
    peers: Vec<bool>,
    cu: c_int,
    primary: DriverContext,
    /// The stream zeroing runs on (its raw handle: made again after a reset of the context).
    scrub_stream: AtomicU64,
}

impl Device {
    fn scrub_stream(&self) -> DriverStream {
        DriverStream::from_raw(self.scrub_stream.load(Ordering::Acquire))
    }
}

/// Why start-up stopped before a device table existed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartError {
    /// The driver reports no device.
    NoDevice,
    /// A device cannot allocate managed memory.
    NoManagedMemory(DeviceId),
    /// A driver call failed.
    Call(CudaError),
}

impl From<CudaError> for StartError {
    fn from(e: CudaError) -> Self {
        Self::Call(e)
    }
}

/// The core's `DriverApi` over a table of CUDA driver entry points, with the backend's error
/// type `E`: every device's primary context retained and a zeroing stream in it (given back on
/// drop), managed memory, streams, contexts, host registration, advice and prefetch, and
/// stream-ordered pools where the driver has them.
pub struct CudaDriver<E> {
    api: &'static Api,
    devices: Vec<Device>,
    version: i32,
    error: PhantomData<fn() -> E>,
}

impl<E> fmt::Debug for CudaDriver<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDriver")
            .field("driver_version", &self.version)
            .field("devices", &self.devices().collect::<Vec<_>>())
            .field("pools", &self.has_pools())
            .finish()
    }
}

impl<E> CudaDriver<E> {
    /// `cuInit`, then every device: managed memory required, its primary context retained, a
    /// zeroing stream made in it.
    pub fn start(api: &'static Api) -> Result<Self, StartError> {
        match api.init() {
            Err(e) if e.code == code::NO_DEVICE => return Err(StartError::NoDevice),
            other => other?,
        }
        let version = api.driver_version()?;
        let count = api.device_count()?;
        if count <= 0 {
            return Err(StartError::NoDevice);
        }
        // Devices pushed so far are released by `Drop` if a later one fails.
        let mut this = Self {
            api,
            devices: Vec::new(),
            version,
            error: PhantomData,
        };
        for ordinal in 0..count {
            let id = DeviceId(ordinal as u32);
            let cu = api.device(ordinal)?;
            if !api.attribute(cu, attr::MANAGED_MEMORY)? {
                return Err(StartError::NoManagedMemory(id));
            }
            // Attributes an older driver may not know: an error reads as "no".
            let optional = |a| api.attribute(cu, a).unwrap_or(false);
            let info = DeviceInfo {
                id,
                name: api.device_name(cu)?,
                concurrent_managed_access: api.attribute(cu, attr::CONCURRENT_MANAGED_ACCESS)?,
                pageable_memory_access: api.attribute(cu, attr::PAGEABLE_MEMORY_ACCESS)?,
                pageable_uses_host_page_tables: optional(
                    attr::PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
                ),
                host_registration: optional(attr::HOST_REGISTER_SUPPORTED)
                    && optional(attr::CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM),
            };
            let primary = api.primary_context_retain(cu)?;
            let scrub_stream = match api.in_context(primary, || api.stream_create()) {
                Ok(s) => s,
                Err(e) => {
                    let _ = api.primary_context_release(cu);
                    return Err(e.into());
                }
            };
            this.devices.push(Device {
                info,
                peers: Vec::new(),
                cu,
                primary,
                scrub_stream: AtomicU64::new(scrub_stream.raw()),
            });
        }
        // Peer access, asked once: a pair the driver cannot answer for is taken as no access.
        let cus: Vec<c_int> = this.devices.iter().map(|d| d.cu).collect();
        for device in &mut this.devices {
            device.peers = cus
                .iter()
                .map(|&peer| peer != device.cu && api.can_access_peer(device.cu, peer))
                .collect();
        }
        Ok(this)
    }

    /// The driver's version (`cuDriverGetVersion`, e.g. 12080).
    #[must_use]
    pub fn driver_version(&self) -> i32 {
        self.version
    }

    /// The devices, as read at start-up.
    pub fn devices(&self) -> impl Iterator<Item = &DeviceInfo> {
        self.devices.iter().map(|d| &d.info)
    }

    /// `true` when the driver has stream-ordered memory pools.
    #[must_use]
    pub fn has_pools(&self) -> bool {
        self.api.pools.is_some()
    }

    /// The entry-point table.
    #[must_use]
    pub fn api(&self) -> &'static Api {
        self.api
    }

    /// The device `id`; `DriverBackend` checks every device id against `device_count` before
    /// asking, and a caller of the bare driver who does not gets a refusal, never a panic.
    fn get(&self, id: DeviceId) -> Result<&Device, Refusal> {
        self.devices
            .get(id.0 as usize)
            .ok_or(Refusal::InvalidDevice {
                device: id,
                count: self.devices.len() as u32,
            })
    }

    fn pools(&self) -> Result<&PoolEntries, Refusal> {
        self.api.pools.as_ref().ok_or(Refusal::NoDevicePools)
    }
}

impl<E> Drop for CudaDriver<E> {
    fn drop(&mut self) {
        for d in &self.devices {
            let _ = self
                .api
                .in_context(d.primary, || self.api.stream_destroy(d.scrub_stream()));
            let _ = self.api.primary_context_release(d.cu);
        }
    }
}

fn ordinal(location: Location) -> Option<i32> {
    match location {
        Location::Host => None,
        Location::Device(d) => Some(d.0 as i32),
    }
}

// SAFETY: `alloc_managed` returns what cuMemAllocManaged returned (attached globally) for exactly
// `bytes` bytes: managed memory, host- and device-accessible at that address, aligned far beyond
// MIN_ALIGN, disjoint from other live allocations; `zero` is cuMemsetD8Async of exactly the range
// on the device's zeroing stream followed by a synchronise; device facts are read from the device
// attributes.
unsafe impl<E> DriverApi for CudaDriver<E>
where
    E: BackendError + From<Refusal> + From<CudaError>,
{
    type Error = E;

    fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    fn device_facts(&self, device: DeviceId) -> DeviceFacts {
        match self.get(device) {
            Ok(d) => DeviceFacts {
                concurrent_managed_access: d.info.concurrent_managed_access,
                pageable_memory_access: d.info.pageable_memory_access,
                pageable_uses_host_page_tables: d.info.pageable_uses_host_page_tables,
                host_registration: d.info.host_registration,
            },
            // No such device: it can do nothing.
            Err(_) => DeviceFacts {
                concurrent_managed_access: false,
                pageable_memory_access: false,
                pageable_uses_host_page_tables: false,
                host_registration: false,
            },
        }
    }

    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> bool {
        self.devices
            .get(device.0 as usize)
            .and_then(|d| d.peers.get(peer.0 as usize))
            .copied()
            .unwrap_or(false)
    }

    fn memory_info(&self) -> Result<Option<(u64, u64)>, E> {
        Ok(Some(self.api.mem_get_info()?))
    }

    fn primary_context(&self, device: DeviceId) -> DriverContext {
        // No such device: no context (0 is never one; the driver refuses it).
        self.get(device)
            .map_or(DriverContext::from_raw(0), |d| d.primary)
    }

    fn push_current(&self, context: DriverContext) -> Result<(), E> {
        Ok(self.api.push_current(context)?)
    }

    fn pop_current(&self) -> Result<(), E> {
        Ok(self.api.pop_current()?)
    }

    fn alloc_managed(&self, _device: DeviceId, bytes: usize) -> Result<u64, E> {
        Ok(self.api.alloc_managed(bytes)?)
    }

    unsafe fn free(&self, ptr: u64) -> Result<(), E> {
        // SAFETY: guaranteed by the caller (the `DriverApi::free` contract).
        Ok(unsafe { self.api.free(ptr) }?)
    }

    unsafe fn zero(&self, device: DeviceId, ptr: u64, len: usize) -> Result<(), E> {
        let stream = self.get(device)?.scrub_stream();
        // SAFETY: guaranteed by the caller (the `DriverApi::zero` contract: the range is inside
        // a live allocation, the device's primary context is current, whose stream this is).
        Ok(unsafe { self.api.zero(ptr, len, stream) }?)
    }

    fn advise(&self, ptr: u64, len: usize, advice: Advice) -> Result<(), E> {
        let target = advice.location().and_then(ordinal);
        Ok(self.api.advise(ptr, len, advice, target)?)
    }

    fn prefetch(&self, ptr: u64, len: usize, to: Location, stream: DriverStream) -> Result<(), E> {
        Ok(self.api.prefetch(ptr, len, ordinal(to), stream)?)
    }

    fn scrub_stream(&self, device: DeviceId) -> DriverStream {
        self.get(device)
            .map_or(DriverStream::DEFAULT, Device::scrub_stream)
    }

    unsafe fn reset_primary_context(&self, device: DeviceId) -> Result<(), E> {
        let d = self.get(device)?;
        // SAFETY: by the caller's contract, nothing made in the context is used afterwards; the
        // zeroing stream the reset destroys is made again below before any zeroing.
        unsafe { self.api.primary_context_reset(d.cu) }?;
        let stream = self
            .api
            .in_context(d.primary, || self.api.stream_create())?;
        d.scrub_stream.store(stream.raw(), Ordering::Release);
        Ok(())
    }

    fn stream_create(&self) -> Result<DriverStream, E> {
        Ok(self.api.stream_create()?)
    }

    fn stream_destroy(&self, stream: DriverStream) -> Result<(), E> {
        Ok(self.api.stream_destroy(stream)?)
    }

    fn synchronize(&self, stream: DriverStream) -> Result<(), E> {
        Ok(self.api.synchronize(stream)?)
    }

    fn context_create(&self, device: DeviceId) -> Result<DriverContext, E> {
        Ok(self.api.context_create(self.get(device)?.cu)?)
    }

    fn context_destroy(&self, context: DriverContext) -> Result<(), E> {
        Ok(self.api.context_destroy(context)?)
    }

    fn host_register(&self, ptr: u64, len: usize) -> Result<(), E> {
        Ok(self.api.host_register(ptr, len)?)
    }

    unsafe fn host_unregister(&self, ptr: u64) -> Result<(), E> {
        // SAFETY: guaranteed by the caller (the `DriverApi::host_unregister` contract).
        Ok(unsafe { self.api.host_unregister(ptr) }?)
    }

    fn pool_create(
        &self,
        device: DeviceId,
        max_bytes: u64,
        release_threshold: u64,
    ) -> Result<DriverPool, E> {
        // CUmemPoolProps.maxSize exists from CUDA 12.2: a second line behind the tenant ledger.
        let with_max_size = self.version >= 12020;
        let pools = self.pools()?;
        Ok(pools.create(device.0 as i32, max_bytes, with_max_size, release_threshold)?)
    }

    fn pool_destroy(&self, pool: DriverPool) -> Result<(), E> {
        Ok(self.pools()?.destroy(pool)?)
    }

    fn pool_alloc(&self, pool: DriverPool, bytes: usize, stream: DriverStream) -> Result<u64, E> {
        Ok(self.pools()?.alloc(self.api, pool, bytes, stream)?)
    }

    fn pool_free(&self, ptr: u64, stream: DriverStream) -> Result<(), E> {
        Ok(self.pools()?.free(ptr, stream)?)
    }

    fn pool_trim(&self, pool: DriverPool, keep_bytes: u64) -> Result<(), E> {
        Ok(self.pools()?.trim(pool, keep_bytes)?)
    }

    fn pool_reserved(&self, pool: DriverPool) -> Result<u64, E> {
        Ok(self.pools()?.reserved(pool)?)
    }
}
