//! The simulator's C ABI types and codes, shared (by `#[path]`) with the tests that drive it.
#![allow(dead_code)]

/// `CUresult` values used here.
pub mod code {
    /// Success.
    pub const SUCCESS: u32 = 0;
    /// `CUDA_ERROR_INVALID_VALUE`.
    pub const INVALID_VALUE: u32 = 1;
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: u32 = 2;
    /// `CUDA_ERROR_NOT_INITIALIZED`.
    pub const NOT_INITIALIZED: u32 = 3;
    /// `CUDA_ERROR_NO_DEVICE`.
    pub const NO_DEVICE: u32 = 100;
    /// `CUDA_ERROR_INVALID_DEVICE`.
    pub const INVALID_DEVICE: u32 = 101;
    /// `CUDA_ERROR_INVALID_CONTEXT`.
    pub const INVALID_CONTEXT: u32 = 201;
    /// `CUDA_ERROR_INVALID_HANDLE`.
    pub const INVALID_HANDLE: u32 = 400;
    /// `CUDA_ERROR_NOT_FOUND`.
    pub const NOT_FOUND: u32 = 500;
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
    pub const HOST_MEMORY_ALREADY_REGISTERED: u32 = 712;
    /// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
    pub const HOST_MEMORY_NOT_REGISTERED: u32 = 713;
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`.
    pub const ILLEGAL_ADDRESS: u32 = 700;
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: u32 = 801;
    /// `CUDA_ERROR_UNKNOWN`.
    pub const UNKNOWN: u32 = 999;

    /// Name and description of a code.
    pub fn describe(code: u32) -> Option<(&'static std::ffi::CStr, &'static std::ffi::CStr)> {
        Some(match code {
            SUCCESS => (c"CUDA_SUCCESS", c"no error"),
            INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
            OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
            NOT_INITIALIZED => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
            NO_DEVICE => (
                c"CUDA_ERROR_NO_DEVICE",
                c"no CUDA-capable device is detected",
            ),
            INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
            INVALID_CONTEXT => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
            INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
            NOT_FOUND => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
            ILLEGAL_ADDRESS => (
                c"CUDA_ERROR_ILLEGAL_ADDRESS",
                c"an illegal memory access was encountered",
            ),
            NOT_SUPPORTED => (c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
            UNKNOWN => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
            _ => return None,
        })
    }
}

/// How the simulated machine looks (`twm_sim_configure`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Devices (0 makes `cuDeviceGetCount` say 0, and `cuInit` `CUDA_ERROR_NO_DEVICE`).
    pub device_count: u32,
    /// Memory per device in bytes.
    pub memory_bytes: u64,
    /// `CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY` (0 or 1).
    pub managed: u32,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS` (0 or 1).
    pub concurrent: u32,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS` (0 or 1).
    pub pageable: u32,
    /// Fill fresh managed allocations with `0xA5` (the driver does not zero them).
    pub poison: u32,
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` and
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` (0 or 1): whether
    /// `cuMemHostRegister_v2` registers host ranges.
    pub host_register: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            device_count: 1,
            memory_bytes: 4 << 30,
            managed: 1,
            concurrent: 1,
            pageable: 0,
            poison: 0,
            host_register: 0,
        }
    }
}

/// Counters (`twm_sim_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Managed allocations alive.
    pub live_allocations: u64,
    /// Bytes in them.
    pub live_bytes: u64,
    /// Allocations ever made.
    pub allocations: u64,
    /// Successful frees.
    pub frees: u64,
    /// Streams alive.
    pub live_streams: u64,
    /// Non-primary contexts alive.
    pub live_contexts: u64,
    /// Primary-context references held.
    pub primary_refs: u64,
    /// Entry-point calls made.
    pub calls: u64,
    /// Calls that returned an error.
    pub failed_calls: u64,
    /// Failures injected.
    pub injected: u64,
    /// Memory pools alive.
    pub live_pools: u64,
    /// Bytes the pools hold from the devices (live plus kept free memory).
    pub pool_reserved_bytes: u64,
    /// Pool allocations alive.
    pub live_pool_allocations: u64,
}

/// The advice and residency in force at one address (`twm_sim_hints`). Locations are device
/// ordinals, `-1` for the host (`CU_DEVICE_CPU`), [`SimHints::NONE`] for none.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimHints {
    /// `CU_MEM_ADVISE_SET_READ_MOSTLY` in force (0 or 1).
    pub read_mostly: u32,
    /// The preferred location.
    pub preferred: i32,
    /// Accessed-by locations: bit 0 the host, bit `d + 1` device `d`.
    pub accessed_by: u64,
    /// Where the address was last prefetched to.
    pub resident: i32,
}

impl SimHints {
    /// No location.
    pub const NONE: i32 = -2;
}
