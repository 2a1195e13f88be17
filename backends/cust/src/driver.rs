//! cust's binding-specific driver calls: hints and prefetch in their CUDA 11 form (cust's
//! bindings are CUDA 11.4), with a device number instead of a `CUmemLocation`. The calls both
//! driver backends share are in `backends/cuda-common/cuda_driver.rs` (the `cuda` module).

use cust::sys::{self, CUdevice, CUmem_advise, CUstream};
use tensor_wasm_mem_core::CudaCallError;

use crate::cuda::check;

/// `CU_DEVICE_CPU`: the host, in the CUDA 11 forms of advise and prefetch.
pub(crate) const DEVICE_CPU: CUdevice = -1;

/// `cuMemAdvise` in its CUDA 11 form: the location is a device ordinal, [`DEVICE_CPU`] for the
/// host.
pub(crate) fn advise(
    ptr: u64,
    len: usize,
    advice: CUmem_advise,
    device: CUdevice,
) -> Result<(), CudaCallError> {
    // SAFETY: hints change no memory contents; the caller checked the range.
    check("cuMemAdvise", unsafe {
        sys::cuMemAdvise(ptr, len, advice, device)
    })
}

/// `cuMemPrefetchAsync` in its CUDA 11 form (a device ordinal, [`DEVICE_CPU`] for the host).
pub(crate) fn prefetch(
    ptr: u64,
    len: usize,
    device: CUdevice,
    stream: usize,
) -> Result<(), CudaCallError> {
    // SAFETY: migration changes no memory contents; the caller checked the range and stream.
    check("cuMemPrefetchAsync", unsafe {
        sys::cuMemPrefetchAsync(ptr, len, device, stream as CUstream)
    })
}
