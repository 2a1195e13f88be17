//! cudarc's binding-specific driver calls: probing the library and its entry points, hints and
//! prefetch with `CUmemLocation` (the `_v2` forms), and stream-ordered memory pools. The calls both
//! driver backends share are in `backends/cuda-common/cuda_driver.rs` (the `cuda` module).

use cudarc::driver::sys::{self, CUmem_advise, CUmemLocation, CUmemLocationType, CUstream};
use tensor_wasm_mem_core::CudaCallError;

use crate::cuda::check;

/// Every driver entry point this backend calls: probed before the first call, because cudarc
/// resolves symbols lazily and panics on a missing one.
pub(crate) const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxCreate_v2",
    "cuCtxDestroy_v2",
    "cuMemAllocManaged",
    "cuMemFree_v2",
    "cuMemsetD8Async",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuMemAdvise_v2",
    "cuMemPrefetchAsync_v2",
    "cuGetErrorString",
];

/// The entry points of stream-ordered memory pools: optional (a driver without them has no
/// device pools; everything else still works).
pub(crate) const POOL_SYMBOLS: &[&str] = &[
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemPoolTrimTo",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
];

/// `true` when a library named like libcuda loads.
pub(crate) fn library_present() -> bool {
    // SAFETY: loading the driver library runs its initialisers, which is what using it means;
    // the probe only opens and closes it.
    unsafe { sys::is_culib_present() }
}

/// The first symbol of [`SYMBOLS`] the loaded driver lacks, if any.
///
/// Call only after [`library_present`] said `true` (cudarc panics otherwise).
pub(crate) fn missing_symbol(symbols: &[&'static str]) -> Option<&'static str> {
    // SAFETY: `library_present()` was true, so `culib()` finds a library and does not panic;
    // looking a symbol up calls nothing.
    let lib = unsafe { sys::culib() };
    symbols
        .iter()
        // SAFETY: the symbol is only looked up, never called through this pointer.
        .find(|name| unsafe { lib.get::<unsafe extern "C" fn()>(**name) }.is_err())
        .copied()
}

/// A `CUmemLocation`: `None` is the host, `Some(n)` device `n`.
fn location(device: Option<i32>) -> CUmemLocation {
    match device {
        Some(id) => CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id,
        },
        None => CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
    }
}

pub(crate) fn advise(
    ptr: u64,
    len: usize,
    advice: CUmem_advise,
    device: Option<i32>,
) -> Result<(), CudaCallError> {
    // SAFETY: hints change no memory contents; the caller checked the range.
    check("cuMemAdvise_v2", unsafe {
        sys::cuMemAdvise_v2(ptr, len, advice, location(device))
    })
}

pub(crate) fn prefetch(
    ptr: u64,
    len: usize,
    device: Option<i32>,
    stream: usize,
) -> Result<(), CudaCallError> {
    // SAFETY: migration changes no memory contents; the caller checked the range and stream.
    check("cuMemPrefetchAsync_v2", unsafe {
        sys::cuMemPrefetchAsync_v2(ptr, len, location(device), 0, stream as CUstream)
    })
}

/// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
const ATTR_RELEASE_THRESHOLD: u32 = 4;
/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`.
const ATTR_RESERVED_MEM_CURRENT: u32 = 5;

/// Creates a pinned device-memory pool on `device`; `max_size` is set only where the driver
/// knows the field (CUDA 12.2 and later, `with_max_size`).
pub(crate) fn pool_create(
    device: i32,
    max_size: u64,
    with_max_size: bool,
    release_threshold: u64,
) -> Result<usize, CudaCallError> {
    // SAFETY: an all-zero CUmemPoolProps is valid (every field is an integer, a pointer or an
    // array of bytes); the fields that matter are set below.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location = location(Some(device));
    if with_max_size {
        props.maxSize = max_size as usize;
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer and `props` a valid CUmemPoolProps.
    check("cuMemPoolCreate", unsafe {
        sys::cuMemPoolCreate(&mut pool, &props)
    })?;
    let mut threshold = release_threshold;
    // SAFETY: the release threshold attribute takes a `cuuint64_t`.
    let set = check("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            pool_attribute(ATTR_RELEASE_THRESHOLD),
            (&raw mut threshold).cast(),
        )
    });
    if let Err(e) = set {
        // SAFETY: the pool was just made and has no allocations.
        let _ = unsafe { sys::cuMemPoolDestroy(pool) };
        return Err(e);
    }
    Ok(pool as usize)
}

fn pool_attribute(value: u32) -> sys::CUmemPool_attribute {
    match value {
        ATTR_RELEASE_THRESHOLD => sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        _ => sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
    }
}

pub(crate) fn pool_destroy(pool: usize) -> Result<(), CudaCallError> {
    // SAFETY: `pool` came from `pool_create` and is destroyed once.
    check("cuMemPoolDestroy", unsafe {
        sys::cuMemPoolDestroy(pool as sys::CUmemoryPool)
    })
}

/// Allocates from `pool` on `stream` and zero-fills it in stream order.
pub(crate) fn pool_alloc(pool: usize, bytes: usize, stream: usize) -> Result<u64, CudaCallError> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid out-pointer; `pool` and `stream` are live handles of ours.
    check("cuMemAllocFromPoolAsync", unsafe {
        sys::cuMemAllocFromPoolAsync(
            &mut ptr,
            bytes,
            pool as sys::CUmemoryPool,
            stream as CUstream,
        )
    })?;
    // SAFETY: `ptr..ptr + bytes` was just allocated on `stream`; the memset is ordered after it.
    let zeroed = check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(ptr, 0, bytes, stream as CUstream)
    });
    if let Err(e) = zeroed {
        // SAFETY: the allocation was never handed out.
        let _ = unsafe { sys::cuMemFreeAsync(ptr, stream as CUstream) };
        return Err(e);
    }
    Ok(ptr)
}

pub(crate) fn pool_free(ptr: u64, stream: usize) -> Result<(), CudaCallError> {
    // SAFETY: `ptr` is a live pool allocation of ours, freed once, ordered on `stream`.
    check("cuMemFreeAsync", unsafe {
        sys::cuMemFreeAsync(ptr, stream as CUstream)
    })
}

pub(crate) fn pool_trim(pool: usize, keep: u64) -> Result<(), CudaCallError> {
    // SAFETY: `pool` is a live pool of ours.
    check("cuMemPoolTrimTo", unsafe {
        sys::cuMemPoolTrimTo(pool as sys::CUmemoryPool, keep as usize)
    })
}

pub(crate) fn pool_reserved(pool: usize) -> Result<u64, CudaCallError> {
    let mut v: u64 = 0;
    // SAFETY: the reserved-memory attribute writes a `cuuint64_t` into `v`.
    check("cuMemPoolGetAttribute", unsafe {
        sys::cuMemPoolGetAttribute(
            pool as sys::CUmemoryPool,
            pool_attribute(ATTR_RESERVED_MEM_CURRENT),
            (&raw mut v).cast(),
        )
    })?;
    Ok(v)
}
