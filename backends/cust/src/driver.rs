//! The only place this crate calls the CUDA driver (through cust's bindings, `cust::sys`): one
//! function per entry point, each turning the `CUresult` into a `Result`. Handles cross this
//! boundary as integers.

use std::ffi::{CStr, c_char, c_int};

use cust::sys::{self, CUcontext, CUdevice, CUdevice_attribute, CUmem_advise, CUresult, CUstream};

use crate::error::DriverError;

/// `CU_MEM_ATTACH_GLOBAL`.
const ATTACH_GLOBAL: u32 = 1;
/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: u32 = 1;
/// `CU_DEVICE_CPU`: the host, in the CUDA 11 forms of advise and prefetch.
pub(crate) const DEVICE_CPU: CUdevice = -1;

fn check(call: &'static str, result: CUresult) -> Result<(), DriverError> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError {
            call,
            code: result as u32,
        })
    }
}

pub(crate) fn init() -> Result<(), DriverError> {
    // SAFETY: cuInit takes no pointers.
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
) -> Result<bool, DriverError> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; `device` came from cuDeviceGet.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attribute, device)
    })?;
    Ok(v != 0)
}

pub(crate) fn device_name(device: CUdevice) -> Result<String, DriverError> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: `buf` is valid for its length, which is passed.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, device)
    })?;
    buf[buf.len() - 1] = 0;
    // SAFETY: `buf` is NUL-terminated (its last byte was just set).
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

/// `cuMemAdvise` in its CUDA 11 form: the location is a device ordinal, [`DEVICE_CPU`] for the
/// host.
pub(crate) fn advise(
    ptr: u64,
    len: usize,
    advice: CUmem_advise,
    device: CUdevice,
) -> Result<(), DriverError> {
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
) -> Result<(), DriverError> {
    // SAFETY: migration changes no memory contents; the caller checked the range and stream.
    check("cuMemPrefetchAsync", unsafe {
        sys::cuMemPrefetchAsync(ptr, len, device, stream as CUstream)
    })
}
