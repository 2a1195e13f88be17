//! The cudarc backend's error: the one error of the backends over the CUDA driver.

/// Everything the cudarc backend can fail or refuse with: [`CudaBackendError`], shared with the
/// cust backend (cudarc and cust are two ways to reach one CUDA driver).
///
/// [`CudaBackendError`]: tensor_wasm_mem_cuda::CudaBackendError
pub type CudarcError = tensor_wasm_mem_cuda::CudaBackendError;
