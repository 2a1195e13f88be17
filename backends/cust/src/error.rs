//! The cust backend's error: the one error of the backends over the CUDA driver.

/// Everything the cust backend can fail or refuse with: [`CudaBackendError`], shared with the
/// cudarc backend (cudarc and cust are two ways to reach one CUDA driver). A linked driver never
/// reports `DriverNotFound` or `MissingSymbol`.
///
/// [`CudaBackendError`]: tensor_wasm_mem_cuda::CudaBackendError
pub type CustError = tensor_wasm_mem_cuda::CudaBackendError;
