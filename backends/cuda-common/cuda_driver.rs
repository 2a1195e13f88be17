// Shared by the cudarc and cust backends (each includes it with `#[path]` as its `cuda` module):
// the driver calls both bindings make the same way, the device table and start-up, and the
// `DriverApi` methods that do not depend on the binding. The including crate provides, at its
// root, `sys` (its binding: `cudarc::driver::sys` or `cust::sys`) and `Error` (its error type,
// `From<CudaCallError>`). Only the binding-specific calls (hints, prefetch, pools, finding the
// library) stay in each crate.

use std::ffi::{CStr, c_char, c_int};

use tensor_wasm_mem_core::{Advice, CudaCallError, DeviceFacts, DeviceId};

use crate::sys::{self, CUcontext, CUdevice, CUdevice_attribute, CUmem_advise, CUresult, CUstream};

/// `CU_MEM_ATTACH_GLOBAL`.
const ATTACH_GLOBAL: u32 = 1;
/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: u32 = 1;
/// `CUDA_ERROR_NO_DEVICE`.
const NO_DEVICE: u32 = 100;

/// The driver's advice value for a core [`Advice`] (the location, if any, travels apart).
pub(crate) fn advice(advice: Advice) -> CUmem_advise {
    match advice {
        Advice::SetReadMostly => CUmem_advise::CU_MEM_ADVISE_SET_READ_MOSTLY,
        Advice::UnsetReadMostly => CUmem_advise::CU_MEM_ADVISE_UNSET_READ_MOSTLY,
        Advice::SetPreferredLocation(_) => CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
        Advice::UnsetPreferredLocation => CUmem_advise::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION,
        Advice::SetAccessedBy(_) => CUmem_advise::CU_MEM_ADVISE_SET_ACCESSED_BY,
        Advice::UnsetAccessedBy(_) => CUmem_advise::CU_MEM_ADVISE_UNSET_ACCESSED_BY,
    }
}

/// Turns a `CUresult` into a `Result`.
pub(crate) fn check(call: &'static str, result: CUresult) -> Result<(), CudaCallError> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaCallError {
            call,
            code: result as u32,
        })
    }
}

pub(crate) fn init() -> Result<(), CudaCallError> {
    // SAFETY: cuInit takes no pointers.
    check("cuInit", unsafe { sys::cuInit(0) })
}

fn driver_version() -> Result<i32, CudaCallError> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut v)
    })?;
    Ok(v)
}

fn device_count() -> Result<i32, CudaCallError> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n)
}

fn device(ordinal: i32) -> Result<CUdevice, CudaCallError> {
    let mut d: CUdevice = 0;
    // SAFETY: `d` is a valid out-pointer.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut d, ordinal) })?;
    Ok(d)
}

fn attribute(device: CUdevice, attribute: CUdevice_attribute) -> Result<bool, CudaCallError> {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; `device` came from cuDeviceGet.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, attribute, device)
    })?;
    Ok(v != 0)
}

fn can_access_peer(device: CUdevice, peer: CUdevice) -> bool {
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer; both devices came from cuDeviceGet.
    let result = unsafe { sys::cuDeviceCanAccessPeer(&mut v, device, peer) };
    check("cuDeviceCanAccessPeer", result).is_ok() && v != 0
}

fn device_name(device: CUdevice) -> Result<String, CudaCallError> {
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

fn primary_context_retain(device: CUdevice) -> Result<usize, CudaCallError> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
    })?;
    Ok(ctx as usize)
}

fn primary_context_release(device: CUdevice) -> Result<(), CudaCallError> {
    // SAFETY: releases one reference this backend retained.
    check("cuDevicePrimaryCtxRelease_v2", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(device)
    })
}

/// `cuMemGetInfo_v2`: `(free, total)` bytes of the current context's device.
pub(crate) fn mem_get_info() -> Result<(u64, u64), CudaCallError> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both are valid out-pointers; a current context is the caller's to provide (the
    // driver answers an error, not undefined behaviour, without one).
    check("cuMemGetInfo_v2", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

pub(crate) fn push_current(ctx: usize) -> Result<(), CudaCallError> {
    // SAFETY: `ctx` is a live context of this backend (primary or created by it).
    check("cuCtxPushCurrent_v2", unsafe {
        sys::cuCtxPushCurrent_v2(ctx as CUcontext)
    })
}

pub(crate) fn pop_current() -> Result<(), CudaCallError> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer.
    check("cuCtxPopCurrent_v2", unsafe {
        sys::cuCtxPopCurrent_v2(&mut ctx)
    })
}

/// Runs `f` with `ctx` pushed on the calling thread's context stack, then pops it.
fn in_context<T>(
    ctx: usize,
    f: impl FnOnce() -> Result<T, CudaCallError>,
) -> Result<T, CudaCallError> {
    push_current(ctx)?;
    let result = f();
    let popped = pop_current();
    let value = result?;
    popped?;
    Ok(value)
}

/// Creates a context on `device`; `cuCtxCreate` pushes it, and it is popped again, so the
/// calling thread's context stack is left as it was.
fn context_create(device: CUdevice) -> Result<usize, CudaCallError> {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer.
    check("cuCtxCreate_v2", unsafe {
        sys::cuCtxCreate_v2(&mut ctx, 0, device)
    })?;
    if let Err(e) = pop_current() {
        // SAFETY: the context was just made here and no one else has it.
        let _ = unsafe { sys::cuCtxDestroy_v2(ctx) };
        return Err(e);
    }
    Ok(ctx as usize)
}

fn context_destroy(ctx: usize) -> Result<(), CudaCallError> {
    // SAFETY: `ctx` was created by `context_create` and has no users left.
    check("cuCtxDestroy_v2", unsafe {
        sys::cuCtxDestroy_v2(ctx as CUcontext)
    })
}

fn alloc_managed(bytes: usize) -> Result<u64, CudaCallError> {
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
unsafe fn free(ptr: u64) -> Result<(), CudaCallError> {
    // SAFETY: guaranteed by the caller.
    check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) })
}

/// Zeroes `ptr..ptr + len` on `stream` and waits for it.
///
/// # Safety
///
/// The range must lie inside a live allocation that nothing else accesses meanwhile.
unsafe fn zero(ptr: u64, len: usize, stream: usize) -> Result<(), CudaCallError> {
    // SAFETY: guaranteed by the caller; `stream` is a live stream of the current context.
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(ptr, 0, len, stream as CUstream)
    })?;
    synchronize(stream)
}

/// `CU_MEMHOSTREGISTER_DEVICEMAP`.
const HOST_REGISTER_DEVICEMAP: u32 = 2;

/// Registers `ptr..ptr + len` of host memory, device-mapped (`cuMemHostRegister_v2`).
pub(crate) fn host_register(ptr: u64, len: usize) -> Result<(), CudaCallError> {
    // SAFETY: the driver reads the range's page tables and pins its pages; a range that is not
    // mapped is an error it answers, not undefined behaviour. Only called on devices that report
    // registration (so the symbol is probed by the attribute first).
    check("cuMemHostRegister_v2", unsafe {
        sys::cuMemHostRegister_v2(ptr as usize as *mut _, len, HOST_REGISTER_DEVICEMAP)
    })
}

/// Unregisters the host range registered at `ptr` (`cuMemHostUnregister`).
///
/// # Safety
///
/// `ptr` is the base of a registered range that no device work uses any more.
pub(crate) unsafe fn host_unregister(ptr: u64) -> Result<(), CudaCallError> {
    // SAFETY: guaranteed by the caller.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(ptr as usize as *mut _)
    })
}

pub(crate) fn stream_create() -> Result<usize, CudaCallError> {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: `s` is a valid out-pointer.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, STREAM_NON_BLOCKING)
    })?;
    Ok(s as usize)
}

pub(crate) fn stream_destroy(stream: usize) -> Result<(), CudaCallError> {
    // SAFETY: `stream` was created by `stream_create` and is released once.
    check("cuStreamDestroy_v2", unsafe {
        sys::cuStreamDestroy_v2(stream as CUstream)
    })
}

pub(crate) fn synchronize(stream: usize) -> Result<(), CudaCallError> {
    // SAFETY: `stream` is 0 (the legacy default stream) or a live stream of this backend.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream as CUstream)
    })
}

/// Facts about one device, read at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device.
    pub id: DeviceId,
    /// Its name.
    pub name: String,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
    pub concurrent_managed_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`.
    pub pageable_memory_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES` (ATS).
    pub pageable_uses_host_page_tables: bool,
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` and
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`.
    pub host_registration: bool,
}

#[derive(Debug)]
struct Device {
    info: DeviceInfo,
    /// Per device ordinal: whether this device can access memory on that one directly.
    peers: Vec<bool>,
    cu: CUdevice,
    primary: usize,
    /// The stream zeroing runs on.
    scrub_stream: usize,
}

/// Why start-up stopped before a device table existed.
pub(crate) enum StartError {
    /// The driver reports no device.
    NoDevice,
    /// A device cannot allocate managed memory.
    NoManagedMemory(DeviceId),
    /// A driver call failed.
    Call(CudaCallError),
}

impl From<CudaCallError> for StartError {
    fn from(e: CudaCallError) -> Self {
        Self::Call(e)
    }
}

/// The devices of a started driver: each with its primary context retained and a zeroing stream
/// in it, given back on drop.
#[derive(Debug)]
pub(crate) struct Devices {
    devices: Vec<Device>,
    version: i32,
}

impl Devices {
    /// `cuInit`, then every device: managed memory required, its primary context retained.
    pub(crate) fn start() -> Result<Self, StartError> {
        match init() {
            Err(e) if e.code == NO_DEVICE => return Err(StartError::NoDevice),
            other => other?,
        }
        let version = driver_version()?;
        let count = device_count()?;
        if count <= 0 {
            return Err(StartError::NoDevice);
        }
        // Devices pushed so far are released by `Drop` if a later one fails.
        let mut this = Self {
            devices: Vec::new(),
            version,
        };
        for ordinal in 0..count {
            let id = DeviceId(ordinal as u32);
            let cu = device(ordinal)?;
            if !attribute(cu, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? {
                return Err(StartError::NoManagedMemory(id));
            }
            let info = DeviceInfo {
                id,
                name: device_name(cu)?,
                concurrent_managed_access: attribute(
                    cu,
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
                )?,
                pageable_memory_access: attribute(
                    cu,
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS,
                )?,
                // Attributes an older driver may not know: an error reads as "no".
                pageable_uses_host_page_tables: attribute(
                    cu,
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
                )
                .unwrap_or(false),
                host_registration: attribute(
                    cu,
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED,
                )
                .unwrap_or(false)
                    && attribute(
                        cu,
                        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                    )
                    .unwrap_or(false),
            };
            let primary = primary_context_retain(cu)?;
            let scrub_stream = match in_context(primary, stream_create) {
                Ok(s) => s,
                Err(e) => {
                    let _ = primary_context_release(cu);
                    return Err(e.into());
                }
            };
            this.devices.push(Device {
                info,
                peers: Vec::new(),
                cu,
                primary,
                scrub_stream,
            });
        }
        // Peer access, asked once: a pair the driver cannot answer for is taken as no access.
        let cus: Vec<CUdevice> = this.devices.iter().map(|d| d.cu).collect();
        for device in &mut this.devices {
            device.peers = cus
                .iter()
                .map(|&peer| peer != device.cu && can_access_peer(device.cu, peer))
                .collect();
        }
        Ok(this)
    }

    pub(crate) fn version(&self) -> i32 {
        self.version
    }

    pub(crate) fn infos(&self) -> impl Iterator<Item = &DeviceInfo> {
        self.devices.iter().map(|d| &d.info)
    }

    fn get(&self, id: DeviceId) -> &Device {
        // `DriverBackend` checks every device id against `device_count` before asking.
        &self.devices[id.0 as usize]
    }

    pub(crate) fn count(&self) -> u32 {
        self.devices.len() as u32
    }

    pub(crate) fn can_access_peer(&self, id: DeviceId, peer: DeviceId) -> bool {
        self.devices
            .get(id.0 as usize)
            .and_then(|d| d.peers.get(peer.0 as usize))
            .copied()
            .unwrap_or(false)
    }

    pub(crate) fn facts(&self, id: DeviceId) -> DeviceFacts {
        let info = &self.get(id).info;
        DeviceFacts {
            concurrent_managed_access: info.concurrent_managed_access,
            pageable_memory_access: info.pageable_memory_access,
            pageable_uses_host_page_tables: info.pageable_uses_host_page_tables,
            host_registration: info.host_registration,
        }
    }

    pub(crate) fn primary(&self, id: DeviceId) -> u64 {
        self.get(id).primary as u64
    }

    pub(crate) fn alloc_managed(&self, bytes: usize) -> Result<u64, CudaCallError> {
        alloc_managed(bytes)
    }

    /// # Safety
    ///
    /// As `free`.
    pub(crate) unsafe fn free(&self, ptr: u64) -> Result<(), CudaCallError> {
        // SAFETY: guaranteed by the caller.
        unsafe { free(ptr) }
    }

    /// # Safety
    ///
    /// As `zero`; the device's primary context must be current.
    pub(crate) unsafe fn zero(
        &self,
        id: DeviceId,
        ptr: u64,
        len: usize,
    ) -> Result<(), CudaCallError> {
        // SAFETY: guaranteed by the caller; the zeroing stream belongs to the device's primary
        // context.
        unsafe { zero(ptr, len, self.get(id).scrub_stream) }
    }

    /// The device's zeroing stream (non-blocking, in its primary context).
    pub(crate) fn scrub_stream(&self, id: DeviceId) -> u64 {
        self.get(id).scrub_stream as u64
    }

    pub(crate) fn context_create(&self, id: DeviceId) -> Result<u64, CudaCallError> {
        Ok(context_create(self.get(id).cu)? as u64)
    }

    pub(crate) fn context_destroy(&self, ctx: u64) -> Result<(), CudaCallError> {
        context_destroy(ctx as usize)
    }
}

impl Drop for Devices {
    fn drop(&mut self) {
        for d in &self.devices {
            let _ = in_context(d.primary, || stream_destroy(d.scrub_stream));
            let _ = primary_context_release(d.cu);
        }
    }
}

/// The `DriverApi` methods that do not depend on the binding, for a driver type with a
/// `devices: cuda::Devices` field and an error type that is `From<CudaCallError>`.
macro_rules! common_driver_api {
    ($error:ty) => {
        fn device_count(&self) -> u32 {
            self.devices.count()
        }

        fn device_facts(&self, device: DeviceId) -> tensor_wasm_mem_core::DeviceFacts {
            self.devices.facts(device)
        }

        fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> bool {
            self.devices.can_access_peer(device, peer)
        }

        fn memory_info(&self) -> Result<Option<(u64, u64)>, $error> {
            Ok(Some(cuda::mem_get_info()?))
        }

        fn primary_context(&self, device: DeviceId) -> u64 {
            self.devices.primary(device)
        }

        fn push_current(&self, context: u64) -> Result<(), $error> {
            Ok(cuda::push_current(context as usize)?)
        }

        fn pop_current(&self) -> Result<(), $error> {
            Ok(cuda::pop_current()?)
        }

        fn alloc_managed(&self, _device: DeviceId, bytes: usize) -> Result<u64, $error> {
            Ok(self.devices.alloc_managed(bytes)?)
        }

        unsafe fn free(&self, ptr: u64) -> Result<(), $error> {
            // SAFETY: guaranteed by the caller (the `DriverApi::free` contract).
            Ok(unsafe { self.devices.free(ptr) }?)
        }

        unsafe fn zero(&self, device: DeviceId, ptr: u64, len: usize) -> Result<(), $error> {
            // SAFETY: guaranteed by the caller (the `DriverApi::zero` contract: the range is
            // inside a live allocation, the device's primary context is current).
            Ok(unsafe { self.devices.zero(device, ptr, len) }?)
        }

        fn scrub_stream(&self, device: DeviceId) -> u64 {
            self.devices.scrub_stream(device)
        }

        fn stream_create(&self) -> Result<u64, $error> {
            Ok(cuda::stream_create()? as u64)
        }

        fn stream_destroy(&self, stream: u64) -> Result<(), $error> {
            Ok(cuda::stream_destroy(stream as usize)?)
        }

        fn synchronize(&self, stream: u64) -> Result<(), $error> {
            Ok(cuda::synchronize(stream as usize)?)
        }

        fn context_create(&self, device: DeviceId) -> Result<u64, $error> {
            Ok(self.devices.context_create(device)?)
        }

        fn context_destroy(&self, context: u64) -> Result<(), $error> {
            Ok(self.devices.context_destroy(context)?)
        }

        fn host_register(&self, ptr: u64, len: usize) -> Result<(), $error> {
            Ok(cuda::host_register(ptr, len)?)
        }

        unsafe fn host_unregister(&self, ptr: u64) -> Result<(), $error> {
            // SAFETY: guaranteed by the caller (the `DriverApi::host_unregister` contract).
            Ok(unsafe { cuda::host_unregister(ptr) }?)
        }
    };
}
pub(crate) use common_driver_api;
