#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

#[path = "../../cuda-common/cuda_driver.rs"]
mod cuda;
mod driver;
mod error;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::driver::sys;
use tensor_wasm_mem_core::{Advice, DeviceId, DriverApi, DriverBackend, Location, Refusal};

pub use cuda::DeviceInfo;
pub use error::CudarcError;
/// A driver call that failed.
pub use tensor_wasm_mem_core::CudaCallError as DriverError;

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

/// The CUDA driver through cudarc: the raw calls [`DriverBackend`] builds the backend on.
pub struct CudarcDriver {
    devices: cuda::Devices,
    /// The driver has stream-ordered memory pools.
    pools: bool,
}

/// The cudarc backend: [`DriverBackend`] on [`CudarcDriver`].
pub type CudarcBackend = DriverBackend<CudarcDriver>;

impl fmt::Debug for CudarcDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudarcDriver")
            .field("driver_version", &self.devices.version())
            .field("devices", &self.devices.infos().collect::<Vec<_>>())
            .field("pools", &self.pools)
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
        Ok(Self {
            devices: cuda::Devices::start()?,
            pools,
        })
    }

    /// The driver version (`cuDriverGetVersion`, e.g. 12080).
    #[must_use]
    pub fn driver_version(&self) -> i32 {
        self.devices.version()
    }

    /// The devices driven.
    pub fn devices(&self) -> impl Iterator<Item = &DeviceInfo> {
        self.devices.infos()
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

    cuda::common_driver_api!(CudarcError);

    fn advise(&self, ptr: u64, len: usize, advice: Advice) -> Result<(), CudarcError> {
        let target = advice.location().and_then(ordinal);
        Ok(driver::advise(ptr, len, cuda::advice(advice), target)?)
    }

    fn prefetch(&self, ptr: u64, len: usize, to: Location, stream: u64) -> Result<(), CudarcError> {
        Ok(driver::prefetch(ptr, len, ordinal(to), stream as usize)?)
    }

    fn pool_create(
        &self,
        device: DeviceId,
        max_bytes: u64,
        release_threshold: u64,
    ) -> Result<u64, CudarcError> {
        self.pools()?;
        // CUmemPoolProps.maxSize exists from CUDA 12.2: a second line behind the tenant ledger.
        let with_max_size = self.devices.version() >= 12020;
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
