#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod driver;
mod error;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::driver::sys::{CUdevice, CUdevice_attribute, CUmem_advise};
use tensor_wasm_mem_core::{
    Advice, DeviceFacts, DeviceId, DriverApi, DriverBackend, Location, Refusal,
};

pub use error::{CudarcError, DriverError};

/// Where the driver library comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DriverSource {
    /// The system's `libcuda` (found by name, as cudarc searches for it).
    #[default]
    System,
    /// The system's `libcuda` if one loads; otherwise the library at this path, which must have
    /// the SONAME `libcuda.so.1` (it is loaded first, so cudarc's search by name finds it). Used
    /// to run on a simulated driver where there is no GPU; on a GPU machine the real driver wins.
    SystemOr(PathBuf),
}

/// Entry-point and device facts read at start-up.
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
}

/// The driver library: found (and, for [`DriverSource::SystemOr`], preloaded) once per process.
static PRELOADED: OnceLock<Result<(), String>> = OnceLock::new();

fn locate(source: &DriverSource) -> Result<(), CudarcError> {
    if driver::library_present() {
        return Ok(());
    }
    let DriverSource::SystemOr(path) = source else {
        return Err(CudarcError::DriverNotFound(
            "libcuda did not load by any of cudarc's names (is the NVIDIA driver installed, \
             and on the loader path?)"
                .into(),
        ));
    };
    let preloaded = PRELOADED.get_or_init(|| preload(path));
    preloaded.clone().map_err(CudarcError::DriverNotFound)?;
    if driver::library_present() {
        Ok(())
    } else {
        Err(CudarcError::DriverNotFound(format!(
            "{} loaded, but libcuda is still not found by name: its SONAME must be libcuda.so.1",
            path.display()
        )))
    }
}

fn preload(path: &Path) -> Result<(), String> {
    // SAFETY: loading a library runs its initialisers; the caller chose this driver library.
    match unsafe { libloading::Library::new(path) } {
        Ok(lib) => {
            // Keep it loaded for the life of the process: cudarc's own handle refers to it by
            // SONAME.
            std::mem::forget(lib);
            Ok(())
        }
        Err(e) => Err(format!(
            "no system libcuda, and {} did not load: {e}",
            path.display()
        )),
    }
}

#[derive(Debug)]
struct Device {
    info: DeviceInfo,
    cu: CUdevice,
    primary: usize,
    /// The stream zeroing runs on.
    scrub_stream: usize,
}

/// The CUDA driver through cudarc: the raw calls [`DriverBackend`] builds the backend on.
pub struct CudarcDriver {
    devices: Vec<Device>,
    version: i32,
    /// The driver has stream-ordered memory pools.
    pools: bool,
}

/// The cudarc backend: [`DriverBackend`] on [`CudarcDriver`].
pub type CudarcBackend = DriverBackend<CudarcDriver>;

impl fmt::Debug for CudarcDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudarcDriver")
            .field("driver_version", &self.version)
            .field(
                "devices",
                &self.devices.iter().map(|d| &d.info).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// Starts the cudarc backend on the driver `source` names.
///
/// Never panics: a missing driver, a driver lacking an entry point, no device, or a device
/// without managed memory is a typed [`CudarcError`].
pub fn start(source: &DriverSource) -> Result<CudarcBackend, CudarcError> {
    CudarcDriver::start(source).map(DriverBackend::new)
}

impl CudarcDriver {
    /// Finds, probes and initialises the driver, and retains every device's primary context.
    pub fn start(source: &DriverSource) -> Result<Self, CudarcError> {
        locate(source)?;
        if let Some(symbol) = driver::missing_symbol(driver::SYMBOLS) {
            return Err(CudarcError::MissingSymbol { symbol });
        }
        let pools = driver::missing_symbol(driver::POOL_SYMBOLS).is_none();
        match driver::init() {
            Err(e) if e.result == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => {
                return Err(CudarcError::NoDevice);
            }
            other => other?,
        }
        let version = driver::driver_version()?;
        let count = driver::device_count()?;
        if count <= 0 {
            return Err(CudarcError::NoDevice);
        }
        // Devices pushed so far are released by `Drop` if a later one fails.
        let mut this = Self {
            devices: Vec::new(),
            version,
            pools,
        };
        for ordinal in 0..count {
            let id = DeviceId(ordinal as u32);
            let cu = driver::device(ordinal)?;
            let attr = |a| driver::attribute(cu, a).map(|v| v != 0);
            if !attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? {
                return Err(CudarcError::NoManagedMemory { device: id });
            }
            let info = DeviceInfo {
                id,
                name: driver::device_name(cu)?,
                concurrent_managed_access: attr(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
                )?,
                pageable_memory_access: attr(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
                )?,
            };
            let primary = driver::primary_context_retain(cu)?;
            let scrub_stream = driver::set_current(primary).and_then(|()| driver::stream_create());
            let scrub_stream = match scrub_stream {
                Ok(s) => s,
                Err(e) => {
                    let _ = driver::primary_context_release(cu);
                    return Err(e.into());
                }
            };
            this.devices.push(Device {
                info,
                cu,
                primary,
                scrub_stream,
            });
        }
        Ok(this)
    }

    /// The driver version (`cuDriverGetVersion`, e.g. 12080).
    #[must_use]
    pub fn driver_version(&self) -> i32 {
        self.version
    }

    /// The devices driven.
    pub fn devices(&self) -> impl Iterator<Item = &DeviceInfo> {
        self.devices.iter().map(|d| &d.info)
    }

    /// `true` when the driver has stream-ordered memory pools (device pools work).
    #[must_use]
    pub fn has_pools(&self) -> bool {
        self.pools
    }

    fn pools(&self) -> Result<(), CudarcError> {
        if self.pools {
            Ok(())
        } else {
            Err(Refusal::NoDevicePools.into())
        }
    }

    fn device(&self, id: DeviceId) -> &Device {
        // `DriverBackend` checks every device id against `device_count` before asking.
        &self.devices[id.0 as usize]
    }
}

fn cu_advice(advice: Advice) -> CUmem_advise {
    match advice {
        Advice::SetReadMostly => CUmem_advise::CU_MEM_ADVISE_SET_READ_MOSTLY,
        Advice::UnsetReadMostly => CUmem_advise::CU_MEM_ADVISE_UNSET_READ_MOSTLY,
        Advice::SetPreferredLocation(_) => CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
        Advice::UnsetPreferredLocation => CUmem_advise::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION,
        Advice::SetAccessedBy(_) => CUmem_advise::CU_MEM_ADVISE_SET_ACCESSED_BY,
        Advice::UnsetAccessedBy(_) => CUmem_advise::CU_MEM_ADVISE_UNSET_ACCESSED_BY,
    }
}

/// The `CUmemLocation` device of a location (`None`: the host).
fn ordinal(location: Location) -> Option<i32> {
    match location {
        Location::Host => None,
        Location::Device(d) => Some(d.0 as i32),
    }
}

// SAFETY: `alloc_managed` returns what cuMemAllocManaged returned (attached globally) for exactly
// `bytes` bytes: managed memory, host- and device-accessible at that address, aligned far beyond
// MIN_ALIGN, disjoint from other live allocations; `zero` is cuMemsetD8Async of exactly the range
// followed by a synchronise; device facts are read from the device attributes.
unsafe impl DriverApi for CudarcDriver {
    type Error = CudarcError;

    fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    fn device_facts(&self, device: DeviceId) -> DeviceFacts {
        let info = &self.device(device).info;
        DeviceFacts {
            concurrent_managed_access: info.concurrent_managed_access,
            pageable_memory_access: info.pageable_memory_access,
        }
    }

    fn primary_context(&self, device: DeviceId) -> u64 {
        self.device(device).primary as u64
    }

    fn set_current(&self, context: u64) -> Result<(), CudarcError> {
        Ok(driver::set_current(context as usize)?)
    }

    fn alloc_managed(&self, _device: DeviceId, bytes: usize) -> Result<u64, CudarcError> {
        Ok(driver::alloc_managed(bytes)?)
    }

    unsafe fn free(&self, ptr: u64) -> Result<(), CudarcError> {
        // SAFETY: guaranteed by the caller.
        Ok(unsafe { driver::free(ptr) }?)
    }

    unsafe fn zero(&self, device: DeviceId, ptr: u64, len: usize) -> Result<(), CudarcError> {
        // SAFETY: guaranteed by the caller; the zeroing stream belongs to the device's primary
        // context, which is current.
        Ok(unsafe { driver::zero(ptr, len, self.device(device).scrub_stream) }?)
    }

    fn advise(&self, ptr: u64, len: usize, advice: Advice) -> Result<(), CudarcError> {
        let target = advice.location().and_then(ordinal);
        Ok(driver::advise(ptr, len, cu_advice(advice), target)?)
    }

    fn prefetch(&self, ptr: u64, len: usize, to: Location, stream: u64) -> Result<(), CudarcError> {
        Ok(driver::prefetch(ptr, len, ordinal(to), stream as usize)?)
    }

    fn stream_create(&self) -> Result<u64, CudarcError> {
        Ok(driver::stream_create()? as u64)
    }

    fn stream_destroy(&self, stream: u64) -> Result<(), CudarcError> {
        Ok(driver::stream_destroy(stream as usize)?)
    }

    fn synchronize(&self, stream: u64) -> Result<(), CudarcError> {
        Ok(driver::synchronize(stream as usize)?)
    }

    fn context_create(&self, device: DeviceId) -> Result<u64, CudarcError> {
        Ok(driver::context_create(self.device(device).cu)? as u64)
    }

    fn context_destroy(&self, context: u64) -> Result<(), CudarcError> {
        Ok(driver::context_destroy(context as usize)?)
    }

    fn pool_create(
        &self,
        device: DeviceId,
        max_bytes: u64,
        release_threshold: u64,
    ) -> Result<u64, CudarcError> {
        self.pools()?;
        // CUmemPoolProps.maxSize exists from CUDA 12.2: a second line behind the tenant ledger.
        let with_max_size = self.version >= 12020;
        Ok(
            driver::pool_create(device.0 as i32, max_bytes, with_max_size, release_threshold)?
                as u64,
        )
    }

    fn pool_destroy(&self, pool: u64) -> Result<(), CudarcError> {
        self.pools()?;
        Ok(driver::pool_destroy(pool as usize)?)
    }

    fn pool_alloc(&self, pool: u64, bytes: usize, stream: u64) -> Result<u64, CudarcError> {
        self.pools()?;
        Ok(driver::pool_alloc(pool as usize, bytes, stream as usize)?)
    }

    fn pool_free(&self, ptr: u64, stream: u64) -> Result<(), CudarcError> {
        self.pools()?;
        Ok(driver::pool_free(ptr, stream as usize)?)
    }

    fn pool_trim(&self, pool: u64, keep_bytes: u64) -> Result<(), CudarcError> {
        self.pools()?;
        Ok(driver::pool_trim(pool as usize, keep_bytes)?)
    }

    fn pool_reserved(&self, pool: u64) -> Result<u64, CudarcError> {
        self.pools()?;
        Ok(driver::pool_reserved(pool as usize)?)
    }
}

impl Drop for CudarcDriver {
    fn drop(&mut self) {
        for d in &self.devices {
            let _ = driver::set_current(d.primary);
            let _ = driver::stream_destroy(d.scrub_stream);
            let _ = driver::primary_context_release(d.cu);
        }
    }
}
