//! The only place this crate calls the CUDA driver: one safe-signature function per entry point,
//! each turning the `CUresult` into a `Result`. Handles cross this boundary as integers.
//!
//! Every function here is `unsafe`-free to call except where a raw address is involved; the
//! callers in `lib.rs` uphold the ranges (they check them against their allocation table first).

use std::ffi::{CStr, c_char, c_int};

use cudarc::driver::sys::{
    self, CUcontext, CUdevice, CUdevice_attribute, CUmem_advise, CUmemLocation, CUmemLocationType,
    CUresult, CUstream,
};

use crate::error::DriverError;

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
    "cuCtxSetCurrent",
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

/// `CU_MEM_ATTACH_GLOBAL`.
const ATTACH_GLOBAL: u32 = 1;
/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: u32 = 1;

fn check(call: &'static str, result: CUresult) -> Result<(), DriverError> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError { call, result })
    }
}

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

pub(crate) fn init() -> Result<(), DriverError> {
    // SAFETY: every symbol was probed; cuInit takes no pointers.
    check("cuInit", unsafe { sys::cuInit(0) })
}

pub(crate) fn driver_version() -> Result<i32, DriverError> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut v)
    })?;
    Ok(v)
}

pub(crate) fn device_count() -> Result<i32, DriverError> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n)
}

pub(crate) fn device(ordinal: i32) -> Result<CUdevice, DriverError> {
    let mut d: CUdevice = 0;
    // SAFETY: `d` is a valid out-pointer.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut d, ordinal) })?;
    Ok(d)
}

pub(crate) fn attribute(
    device: CUdevice,
    attribute: CUdevice_attribute,
) -> Result<i32, DriverError> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; `device` came from cuDeviceGet.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attribute, device)
    })?;
    Ok(v)
}

pub(crate) fn device_name(device: CUdevice) -> Result<String, DriverError> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: `buf` is valid for its length, which is passed.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, device)
    })?;
    // SAFETY: the driver wrote a NUL-terminated string into `buf` (and the last byte is NUL
    // either way: the driver writes at most `len` bytes including the terminator).
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}

pub(crate) fn primary_context_retain(device: CUdevice) -> Result<usize, DriverError> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
    })?;
    Ok(ctx as usize)
}

pub(crate) fn primary_context_release(device: CUdevice) -> Result<(), DriverError> {
    // SAFETY: releases one reference this backend retained.
    check("cuDevicePrimaryCtxRelease_v2", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(device)
    })
}

pub(crate) fn set_current(ctx: usize) -> Result<(), DriverError> {
    // SAFETY: `ctx` is a live context of this backend (primary or created by it).
    check("cuCtxSetCurrent", unsafe {
        sys::cuCtxSetCurrent(ctx as CUcontext)
    })
}

pub(crate) fn context_create(device: CUdevice) -> Result<usize, DriverError> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer.
    check("cuCtxCreate_v2", unsafe {
        sys::cuCtxCreate_v2(&mut ctx, 0, device)
    })?;
    Ok(ctx as usize)
}

pub(crate) fn context_destroy(ctx: usize) -> Result<(), DriverError> {
    // SAFETY: `ctx` was created by `context_create` and has no users left.
    check("cuCtxDestroy_v2", unsafe {
        sys::cuCtxDestroy_v2(ctx as CUcontext)
    })
}

pub(crate) fn alloc_managed(bytes: usize) -> Result<u64, DriverError> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid out-pointer.
    check("cuMemAllocManaged", unsafe {
        sys::cuMemAllocManaged(&mut ptr, bytes, ATTACH_GLOBAL)
    })?;
    Ok(ptr)
}

/// # Safety
///
/// `ptr` must be the base of a live managed allocation no one uses any more.
pub(crate) unsafe fn free(ptr: u64) -> Result<(), DriverError> {
    // SAFETY: guaranteed by the caller.
    check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) })
}

/// Zeroes `ptr..ptr + len` on `stream` and waits for it.
///
/// # Safety
///
/// The range must lie inside a live managed allocation that nothing else accesses meanwhile.
pub(crate) unsafe fn zero(ptr: u64, len: usize, stream: usize) -> Result<(), DriverError> {
    // SAFETY: guaranteed by the caller; `stream` is a live stream of the current context.
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(ptr, 0, len, stream as CUstream)
    })?;
    synchronize(stream)
}

pub(crate) fn stream_create() -> Result<usize, DriverError> {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: `s` is a valid out-pointer.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, STREAM_NON_BLOCKING)
    })?;
    Ok(s as usize)
}

pub(crate) fn stream_destroy(stream: usize) -> Result<(), DriverError> {
    // SAFETY: `stream` was created by `stream_create` and is released once.
    check("cuStreamDestroy_v2", unsafe {
        sys::cuStreamDestroy_v2(stream as CUstream)
    })
}

pub(crate) fn synchronize(stream: usize) -> Result<(), DriverError> {
    // SAFETY: `stream` is 0 (the legacy default stream) or a live stream of this backend.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream as CUstream)
    })
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
) -> Result<(), DriverError> {
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
) -> Result<(), DriverError> {
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
) -> Result<usize, DriverError> {
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

pub(crate) fn pool_destroy(pool: usize) -> Result<(), DriverError> {
    // SAFETY: `pool` came from `pool_create` and is destroyed once.
    check("cuMemPoolDestroy", unsafe {
        sys::cuMemPoolDestroy(pool as sys::CUmemoryPool)
    })
}

/// Allocates from `pool` on `stream` and zero-fills it in stream order.
pub(crate) fn pool_alloc(pool: usize, bytes: usize, stream: usize) -> Result<u64, DriverError> {
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

pub(crate) fn pool_free(ptr: u64, stream: usize) -> Result<(), DriverError> {
    // SAFETY: `ptr` is a live pool allocation of ours, freed once, ordered on `stream`.
    check("cuMemFreeAsync", unsafe {
        sys::cuMemFreeAsync(ptr, stream as CUstream)
    })
}

pub(crate) fn pool_trim(pool: usize, keep: u64) -> Result<(), DriverError> {
    // SAFETY: `pool` is a live pool of ours.
    check("cuMemPoolTrimTo", unsafe {
        sys::cuMemPoolTrimTo(pool as sys::CUmemoryPool, keep as usize)
    })
}

pub(crate) fn pool_reserved(pool: usize) -> Result<u64, DriverError> {
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
