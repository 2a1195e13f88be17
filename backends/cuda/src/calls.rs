//! The driver calls, made through an [`Api`] table: each checks the raw `CUresult` and turns
//! anything but success into a [`CudaError`] with the integer.

use std::ffi::{CStr, c_char, c_int};

use tensor_wasm_mem_core::{Advice, DriverContext, DriverPool, DriverStream};

use crate::api::{Api, Handle, HintEntries, MemLocation, MemPoolProps, PoolEntries};
use crate::{CudaError, code};

/// `CU_MEM_ATTACH_GLOBAL`.
const ATTACH_GLOBAL: u32 = 1;
/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: u32 = 1;
/// `CU_MEMHOSTREGISTER_DEVICEMAP`.
const HOST_REGISTER_DEVICEMAP: u32 = 2;
/// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
const ATTR_RELEASE_THRESHOLD: u32 = 4;
/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`.
const ATTR_RESERVED_MEM_CURRENT: u32 = 5;
use crate::api::location::DEVICE_CPU;

/// A driver handle's pointer from its integer value.
fn handle(raw: u64) -> Handle {
    raw as usize as Handle
}

/// Turns a raw `CUresult` into a `Result`.
pub(crate) fn check(call: &'static str, result: u32) -> Result<(), CudaError> {
    if result == code::SUCCESS {
        Ok(())
    } else {
        Err(CudaError { call, code: result })
    }
}

/// The driver's `CU_MEM_ADVISE_*` value for a core [`Advice`] (the location travels apart).
fn advice_value(advice: Advice) -> u32 {
    match advice {
        Advice::SetReadMostly => 1,
        Advice::UnsetReadMostly => 2,
        Advice::SetPreferredLocation(_) => 3,
        Advice::UnsetPreferredLocation => 4,
        Advice::SetAccessedBy(_) => 5,
        Advice::UnsetAccessedBy(_) => 6,
    }
}

impl Api {
    pub(crate) fn init(&self) -> Result<(), CudaError> {
        // SAFETY: cuInit takes no pointers.
        check("cuInit", unsafe { (self.entries.cuInit)(0) })
    }

    pub(crate) fn driver_version(&self) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer.
        check("cuDriverGetVersion", unsafe {
            (self.entries.cuDriverGetVersion)(&mut v)
        })?;
        Ok(v)
    }

    pub(crate) fn device_count(&self) -> Result<i32, CudaError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            (self.entries.cuDeviceGetCount)(&mut n)
        })?;
        Ok(n)
    }

    pub(crate) fn device(&self, ordinal: i32) -> Result<c_int, CudaError> {
        let mut d: c_int = 0;
        // SAFETY: `d` is a valid out-pointer.
        check("cuDeviceGet", unsafe {
            (self.entries.cuDeviceGet)(&mut d, ordinal)
        })?;
        Ok(d)
    }

    pub(crate) fn attribute(&self, device: c_int, attribute: u32) -> Result<bool, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer; `device` came from cuDeviceGet.
        check("cuDeviceGetAttribute", unsafe {
            (self.entries.cuDeviceGetAttribute)(&mut v, attribute, device)
        })?;
        Ok(v != 0)
    }

    pub(crate) fn can_access_peer(&self, device: c_int, peer: c_int) -> bool {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer; both devices came from cuDeviceGet.
        let result = unsafe { (self.entries.cuDeviceCanAccessPeer)(&mut v, device, peer) };
        result == code::SUCCESS && v != 0
    }

    pub(crate) fn device_name(&self, device: c_int) -> Result<String, CudaError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: `buf` is valid for its length, which is passed.
        check("cuDeviceGetName", unsafe {
            (self.entries.cuDeviceGetName)(buf.as_mut_ptr(), buf.len() as c_int, device)
        })?;
        buf[buf.len() - 1] = 0;
        // SAFETY: `buf` is NUL-terminated (its last byte was just set).
        let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(name.to_string_lossy().into_owned())
    }

    pub(crate) fn primary_context_retain(&self, device: c_int) -> Result<DriverContext, CudaError> {
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        check("cuDevicePrimaryCtxRetain", unsafe {
            (self.entries.cuDevicePrimaryCtxRetain)(&mut ctx, device)
        })?;
        Ok(DriverContext::from_raw(ctx as u64))
    }

    pub(crate) fn primary_context_release(&self, device: c_int) -> Result<(), CudaError> {
        // SAFETY: releases one reference this backend retained.
        check("cuDevicePrimaryCtxRelease_v2", unsafe {
            (self.entries.cuDevicePrimaryCtxRelease_v2)(device)
        })
    }

    /// `cuDevicePrimaryCtxReset_v2`.
    ///
    /// # Safety
    ///
    /// Nothing made in the device's primary context is used afterwards.
    pub(crate) unsafe fn primary_context_reset(&self, device: c_int) -> Result<(), CudaError> {
        // SAFETY: by the caller's contract; the call takes a device ordinal only.
        check("cuDevicePrimaryCtxReset_v2", unsafe {
            (self.entries.cuDevicePrimaryCtxReset_v2)(device)
        })
    }

    /// `cuMemGetInfo_v2`: `(free, total)` bytes of the current context's device.
    pub(crate) fn mem_get_info(&self) -> Result<(u64, u64), CudaError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers; without a current context the driver answers an
        // error, not undefined behaviour.
        check("cuMemGetInfo_v2", unsafe {
            (self.entries.cuMemGetInfo_v2)(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    pub(crate) fn push_current(&self, ctx: DriverContext) -> Result<(), CudaError> {
        // SAFETY: `ctx` is a live context of this backend (the driver checks it).
        check("cuCtxPushCurrent_v2", unsafe {
            (self.entries.cuCtxPushCurrent_v2)(handle(ctx.raw()))
        })
    }

    pub(crate) fn pop_current(&self) -> Result<(), CudaError> {
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        check("cuCtxPopCurrent_v2", unsafe {
            (self.entries.cuCtxPopCurrent_v2)(&mut ctx)
        })
    }

    /// Runs `f` with `ctx` pushed on the calling thread's context stack, then pops it.
    pub(crate) fn in_context<T>(
        &self,
        ctx: DriverContext,
        f: impl FnOnce() -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        self.push_current(ctx)?;
        let result = f();
        let popped = self.pop_current();
        let value = result?;
        popped?;
        Ok(value)
    }

    /// Creates a context on `device`; `cuCtxCreate` pushes it, and it is popped again, so the
    /// calling thread's context stack is left as it was.
    pub(crate) fn context_create(&self, device: c_int) -> Result<DriverContext, CudaError> {
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        check("cuCtxCreate_v2", unsafe {
            (self.entries.cuCtxCreate_v2)(&mut ctx, 0, device)
        })?;
        if let Err(e) = self.pop_current() {
            // SAFETY: the context was just made here and no one else has it.
            let _ = unsafe { (self.entries.cuCtxDestroy_v2)(ctx) };
            return Err(e);
        }
        Ok(DriverContext::from_raw(ctx as u64))
    }

    pub(crate) fn context_destroy(&self, ctx: DriverContext) -> Result<(), CudaError> {
        // SAFETY: `ctx` was created by `context_create` and has no users left.
        check("cuCtxDestroy_v2", unsafe {
            (self.entries.cuCtxDestroy_v2)(handle(ctx.raw()))
        })
    }

    pub(crate) fn alloc_managed(&self, bytes: usize) -> Result<u64, CudaError> {
        let mut ptr = 0u64;
        // SAFETY: `ptr` is a valid out-pointer.
        check("cuMemAllocManaged", unsafe {
            (self.entries.cuMemAllocManaged)(&mut ptr, bytes, ATTACH_GLOBAL)
        })?;
        Ok(ptr)
    }

    /// # Safety
    ///
    /// `ptr` must be the base of a live managed allocation no one uses any more.
    pub(crate) unsafe fn free(&self, ptr: u64) -> Result<(), CudaError> {
        // SAFETY: guaranteed by the caller.
        check("cuMemFree_v2", unsafe { (self.entries.cuMemFree_v2)(ptr) })
    }

    /// Zeroes `ptr..ptr + len` on `stream` and waits for it.
    ///
    /// # Safety
    ///
    /// The range must lie inside a live allocation that nothing else accesses meanwhile.
    pub(crate) unsafe fn zero(
        &self,
        ptr: u64,
        len: usize,
        stream: DriverStream,
    ) -> Result<(), CudaError> {
        // SAFETY: guaranteed by the caller; `stream` is a live stream of the current context.
        check("cuMemsetD8Async", unsafe {
            (self.entries.cuMemsetD8Async)(ptr, 0, len, handle(stream.raw()))
        })?;
        self.synchronize(stream)
    }

    /// Registers `ptr..ptr + len` of host memory, device-mapped (`cuMemHostRegister_v2`).
    pub(crate) fn host_register(&self, ptr: u64, len: usize) -> Result<(), CudaError> {
        // SAFETY: the driver reads the range's page tables and pins its pages; a range that is
        // not mapped is an error it answers, not undefined behaviour.
        check("cuMemHostRegister_v2", unsafe {
            (self.entries.cuMemHostRegister_v2)(
                ptr as usize as *mut _,
                len,
                HOST_REGISTER_DEVICEMAP,
            )
        })
    }

    /// # Safety
    ///
    /// `ptr` is the base of a registered range that no device work uses any more.
    pub(crate) unsafe fn host_unregister(&self, ptr: u64) -> Result<(), CudaError> {
        // SAFETY: guaranteed by the caller.
        check("cuMemHostUnregister", unsafe {
            (self.entries.cuMemHostUnregister)(ptr as usize as *mut _)
        })
    }

    pub(crate) fn stream_create(&self) -> Result<DriverStream, CudaError> {
        let mut s: Handle = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer.
        check("cuStreamCreate", unsafe {
            (self.entries.cuStreamCreate)(&mut s, STREAM_NON_BLOCKING)
        })?;
        Ok(DriverStream::from_raw(s as u64))
    }

    pub(crate) fn stream_destroy(&self, stream: DriverStream) -> Result<(), CudaError> {
        // SAFETY: `stream` was created by `stream_create` and is released once.
        check("cuStreamDestroy_v2", unsafe {
            (self.entries.cuStreamDestroy_v2)(handle(stream.raw()))
        })
    }

    pub(crate) fn synchronize(&self, stream: DriverStream) -> Result<(), CudaError> {
        // SAFETY: `stream` is 0 (the legacy default stream) or a live stream of this backend.
        check("cuStreamSynchronize", unsafe {
            (self.entries.cuStreamSynchronize)(handle(stream.raw()))
        })
    }

    /// Advice over `ptr..ptr + len`, at `device` (`None`: the host) where the advice names a
    /// location.
    pub(crate) fn advise(
        &self,
        ptr: u64,
        len: usize,
        advice: Advice,
        device: Option<i32>,
    ) -> Result<(), CudaError> {
        let value = advice_value(advice);
        match self.hints {
            // SAFETY: hints change no memory contents; the caller checked the range.
            HintEntries::V2 { advise, .. } => check("cuMemAdvise_v2", unsafe {
                advise(ptr, len, value, MemLocation::of(device))
            }),
            // SAFETY: as above.
            HintEntries::V1 { advise, .. } => check("cuMemAdvise", unsafe {
                advise(ptr, len, value, device.unwrap_or(DEVICE_CPU))
            }),
        }
    }

    /// Migrates `ptr..ptr + len` to `device` (`None`: the host), ordered on `stream`.
    pub(crate) fn prefetch(
        &self,
        ptr: u64,
        len: usize,
        device: Option<i32>,
        stream: DriverStream,
    ) -> Result<(), CudaError> {
        let stream = handle(stream.raw());
        match self.hints {
            // SAFETY: migration changes no memory contents; the caller checked range and stream.
            HintEntries::V2 { prefetch, .. } => check("cuMemPrefetchAsync_v2", unsafe {
                prefetch(ptr, len, MemLocation::of(device), 0, stream)
            }),
            // SAFETY: as above.
            HintEntries::V1 { prefetch, .. } => check("cuMemPrefetchAsync", unsafe {
                prefetch(ptr, len, device.unwrap_or(DEVICE_CPU), stream)
            }),
        }
    }
}

impl PoolEntries {
    /// Creates a pinned device-memory pool on `device`; `max_size` is set only where the driver
    /// knows the field (CUDA 12.2 and later, `with_max_size`).
    pub(crate) fn create(
        &self,
        device: i32,
        max_size: u64,
        with_max_size: bool,
        release_threshold: u64,
    ) -> Result<DriverPool, CudaError> {
        let props = MemPoolProps {
            alloc_type: 1,
            handle_types: 0,
            location: MemLocation::of(Some(device)),
            win32_security_attributes: std::ptr::null_mut(),
            max_size: if with_max_size { max_size as usize } else { 0 },
            usage: 0,
            reserved: [0; 54],
        };
        let mut pool: Handle = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer and `props` a valid CUmemPoolProps.
        check("cuMemPoolCreate", unsafe {
            (self.cuMemPoolCreate)(&mut pool, &props)
        })?;
        let mut threshold = release_threshold;
        // SAFETY: the release threshold attribute takes a `cuuint64_t`.
        let set = check("cuMemPoolSetAttribute", unsafe {
            (self.cuMemPoolSetAttribute)(pool, ATTR_RELEASE_THRESHOLD, (&raw mut threshold).cast())
        });
        if let Err(e) = set {
            // SAFETY: the pool was just made and has no allocations.
            let _ = unsafe { (self.cuMemPoolDestroy)(pool) };
            return Err(e);
        }
        Ok(DriverPool::from_raw(pool as u64))
    }

    pub(crate) fn destroy(&self, pool: DriverPool) -> Result<(), CudaError> {
        // SAFETY: `pool` came from `create` and is destroyed once.
        check("cuMemPoolDestroy", unsafe {
            (self.cuMemPoolDestroy)(handle(pool.raw()))
        })
    }

    /// Allocates from `pool` on `stream` and zero-fills it in stream order.
    pub(crate) fn alloc(
        &self,
        api: &Api,
        pool: DriverPool,
        bytes: usize,
        stream: DriverStream,
    ) -> Result<u64, CudaError> {
        let stream = handle(stream.raw());
        let mut ptr = 0u64;
        // SAFETY: `ptr` is a valid out-pointer; `pool` and `stream` are live handles of ours.
        check("cuMemAllocFromPoolAsync", unsafe {
            (self.cuMemAllocFromPoolAsync)(&mut ptr, bytes, handle(pool.raw()), stream)
        })?;
        // SAFETY: `ptr..ptr + bytes` was just allocated on `stream`; the memset is ordered
        // after it.
        let zeroed = check("cuMemsetD8Async", unsafe {
            (api.entries.cuMemsetD8Async)(ptr, 0, bytes, stream)
        });
        if let Err(e) = zeroed {
            // SAFETY: the allocation was never handed out.
            let _ = unsafe { (self.cuMemFreeAsync)(ptr, stream) };
            return Err(e);
        }
        Ok(ptr)
    }

    pub(crate) fn free(&self, ptr: u64, stream: DriverStream) -> Result<(), CudaError> {
        // SAFETY: `ptr` is a live pool allocation of ours, freed once, ordered on `stream`.
        check("cuMemFreeAsync", unsafe {
            (self.cuMemFreeAsync)(ptr, handle(stream.raw()))
        })
    }

    pub(crate) fn trim(&self, pool: DriverPool, keep: u64) -> Result<(), CudaError> {
        // SAFETY: `pool` is a live pool of ours.
        check("cuMemPoolTrimTo", unsafe {
            (self.cuMemPoolTrimTo)(handle(pool.raw()), keep as usize)
        })
    }

    pub(crate) fn reserved(&self, pool: DriverPool) -> Result<u64, CudaError> {
        let mut v: u64 = 0;
        // SAFETY: the reserved-memory attribute writes a `cuuint64_t` into `v`.
        check("cuMemPoolGetAttribute", unsafe {
            (self.cuMemPoolGetAttribute)(
                handle(pool.raw()),
                ATTR_RESERVED_MEM_CURRENT,
                (&raw mut v).cast(),
            )
        })?;
        Ok(v)
    }
}
