#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod error;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::driver::sys;
use tensor_wasm_mem_core::DriverBackend;
use tensor_wasm_mem_cuda::{Api, CudaDriver, LoadError};

/// The cudarc crate this backend loads the driver with (for embedders whose kernels are
/// written with it: the same version, so its types are the embedder's).
pub use cudarc;
pub use error::CudarcError;
/// A driver call that failed.
pub use tensor_wasm_mem_cuda::CudaError as DriverError;
pub use tensor_wasm_mem_cuda::DeviceInfo;

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
    if library_present() {
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
    if library_present() {
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

/// `true` when a library named like libcuda loads (cudarc's search).
fn library_present() -> bool {
    // SAFETY: loading the driver library runs its initialisers, which is what using it means;
    // the probe only opens and closes it.
    unsafe { sys::is_culib_present() }
}

/// The CUDA driver as the cudarc backend drives it: found by cudarc's search at run time, called
/// through `tensor-wasm-mem-cuda`'s table of entry points with raw-integer results (cudarc's
/// bindings model `CUresult` as an enum: a code it does not know, a newer CUDA's, would be
/// undefined behaviour through them), with the `_v2` forms of advice and prefetch (CUDA 12.2+).
pub type CudarcDriver = CudaDriver<CudarcError>;

/// The cudarc backend: [`DriverBackend`] on [`CudarcDriver`].
pub type CudarcBackend = DriverBackend<CudarcDriver>;

/// Starts the cudarc backend on the driver `source` names.
///
/// Never panics: a missing driver, a driver lacking an entry point, no device, or a device
/// without managed memory is a typed [`CudarcError`].
pub fn start(source: &DriverSource) -> Result<CudarcBackend, CudarcError> {
    start_driver(source).map(DriverBackend::new)
}

/// Finds, probes and initialises the driver, and retains every device's primary context.
pub fn start_driver(source: &DriverSource) -> Result<CudarcDriver, CudarcError> {
    locate(source)?;
    let mut last = None;
    for name in ["libcuda.so.1", "libcuda.so"] {
        // SAFETY: cudarc's search found a CUDA driver by these names (`locate`); loading it
        // again returns the same library.
        match unsafe { Api::load(name) } {
            Ok(api) => return Ok(CudaDriver::start(api)?),
            Err(LoadError::MissingSymbol(symbol)) => {
                return Err(CudarcError::MissingSymbol { symbol });
            }
            Err(LoadError::NotFound(e)) => last = Some(e),
        }
    }
    Err(CudarcError::DriverNotFound(last.unwrap_or_default()))
}
