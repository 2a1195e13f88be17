#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod error;

use tensor_wasm_mem_core::DriverBackend;
use tensor_wasm_mem_cuda::CudaDriver;
// cust links libcuda (`-lcuda`, through its build script's search path): the entry points below
// are that library's.
use cust as _;

pub use error::CustError;
/// A driver call that failed.
pub use tensor_wasm_mem_cuda::CudaError as DriverError;
pub use tensor_wasm_mem_cuda::DeviceInfo;

/// The CUDA driver as the cust backend drives it: libcuda linked at link time (as cust links
/// it), called through `tensor-wasm-mem-cuda`'s table of entry points with raw-integer results
/// (cust's bindings model `CUresult` as an enum: a code they do not know, a newer CUDA's, would
/// be undefined behaviour through them), with the CUDA 11 forms of advice and prefetch (a device
/// ordinal, `-1` for the host: every `Location` the core has maps exactly), and stream-ordered
/// pools (CUDA 11.2+).
pub type CustDriver = CudaDriver<CustError>;

/// The cust backend: [`DriverBackend`] on [`CustDriver`].
pub type CustBackend = DriverBackend<CustDriver>;

/// Starts the cust backend. (libcuda is linked at link time: a binary using this backend does
/// not load at all without a `libcuda.so.1`.)
pub fn start() -> Result<CustBackend, CustError> {
    start_driver().map(DriverBackend::new)
}

/// Initialises the driver and retains every device's primary context.
pub fn start_driver() -> Result<CustDriver, CustError> {
    Ok(CudaDriver::start(tensor_wasm_mem_cuda::linked_api!())?)
}
