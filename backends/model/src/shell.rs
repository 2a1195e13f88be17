//! The C layouts a C-ABI shell over the model answers with: the knobs of the simulated libcuda
//! (`tests/cuda-sim`: `twm_sim_configure`, `twm_sim_stats`, `twm_sim_hints`), shared by that shell
//! and the tests that drive it through its C interface. Its `CUresult` values are [`crate::code`].

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
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS` (0 or 1): the model's pageable memory access
    /// (advice, prefetch and kernels on host memory).
    pub pageable: u32,
    /// Fill fresh managed allocations with `0xA5` (the driver does not zero them).
    pub poison: u32,
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` and
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` (0 or 1): whether
    /// `cuMemHostRegister_v2` registers host ranges.
    pub host_register: u32,
    /// Stream work completes only when the device gets to it (the model's deferred streams):
    /// a synchronise, an event, a stream's destruction (0 or 1).
    pub deferred: u32,
    /// Every pair of distinct devices can access each other (`cuDeviceCanAccessPeer`; 0 or 1).
    pub peer: u32,
    /// With `deferred`: a background "device" thread runs every queue's oldest item each this
    /// many microseconds (0: none; deferred work runs only when waited for).
    pub worker_micros: u64,
}

impl SimConfig {
    /// One device with 4 GiB, managed memory and concurrent managed access, no pageable access
    /// or registration, work that completes at the call.
    pub const DEFAULT: Self = Self {
        device_count: 1,
        memory_bytes: 4 << 30,
        managed: 1,
        concurrent: 1,
        pageable: 0,
        poison: 0,
        host_register: 0,
        deferred: 0,
        peer: 1,
        worker_micros: 0,
    };
}

impl Default for SimConfig {
    fn default() -> Self {
        Self::DEFAULT
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
    /// Memsets queued over a range that work on another stream still targets (the model's
    /// `scrubs_over_pending_work`).
    pub scrubs_over_pending_work: u64,
    /// Frees of memory that queued work still targets.
    pub frees_over_pending_work: u64,
    /// Kernels that touched memory outside every live allocation.
    pub kernel_faults: u64,
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
