#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod error;
mod hold;
pub use hold::HeldCall;
mod host;
mod machine;
mod ranges;
pub mod shell;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tensor_wasm_mem_core::{Location, Operation};

pub use error::ModelError;
pub use machine::{ModelDriver, ResetReport};

/// The most devices a simulated machine has (a larger `device_count` is taken as this many).
pub const MAX_DEVICES: u32 = 1024;

/// `CUresult` codes (the one table: `tensor-wasm-mem-cuda`'s, shared with the CUDA backends and
/// the simulated libcuda).
pub use tensor_wasm_mem_cuda::code;

/// What one [`ModelDriver`] found at its drop, readable after it has gone (take it with
/// [`ModelDriver::drop_report`]). Clones read the same count.
#[derive(Clone, Debug, Default)]
pub struct ModelDropReport(std::sync::Arc<AtomicU64>);

impl ModelDropReport {
    /// Allocations (managed memory and pool blocks) still mapped when the machine dropped: it
    /// unmaps them (nothing is lost for real) and counts them here for leak tests.
    /// `DriverBackend` frees what it holds before its driver drops, so a non-zero count is
    /// something the backend could not give back.
    #[must_use]
    pub fn leaked(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// How the simulated machine looks and behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Devices simulated (ordinals `0..device_count`; at least 1).
    pub device_count: u32,
    /// Memory per device in bytes; allocations past it fail with out-of-memory.
    pub device_memory_bytes: u64,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`. Without it, a prefetch to a device is
    /// `CUDA_ERROR_NOT_SUPPORTED`, as the driver answers.
    pub concurrent_managed_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS` (HMM): any host memory is device-accessible
    /// at its own address. On, advice and prefetch accept host ranges outside every managed
    /// allocation, and kernels may touch host memory that is mapped readable and writable (a
    /// `PROT_NONE` guard page is an illegal address, as through the host's page tables). Off,
    /// they are `CUDA_ERROR_INVALID_VALUE` and an illegal address.
    pub pageable_memory_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` and
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`: `cuMemHostRegister`
    /// (device-mapped) pins host ranges that kernels may then touch at their own address. Off,
    /// it answers `CUDA_ERROR_NOT_SUPPORTED`.
    pub host_registration: bool,
    /// Every pair of distinct devices can access each other's memory (`cuDeviceCanAccessPeer`
    /// answers 1), as on an NVLink server; off, none can.
    pub peer_access: bool,
    /// Fill fresh managed allocations with `0xA5`, as `cuMemAllocManaged` does not zero (the
    /// backend then reports `comes_zeroed = false` and the core zeroes). Commits the memory: for
    /// tests.
    pub poison_fresh_allocations: bool,
    /// Stream work (memsets, prefetches, kernels, pool frees, event records) completes only when
    /// the device gets to it: when the stream (or an event after the work) is synchronised, the
    /// stream is destroyed, or [`ModelDriver::step`] runs it, later than the call that queued
    /// it, as on a GPU. A host read before then sees the old bytes. Off: every call completes
    /// before it returns.
    pub deferred_streams: bool,
    /// With [`deferred_streams`](Self::deferred_streams), a background thread (the "device")
    /// that runs the oldest work item of every queue once per interval, so work also completes
    /// with no one waiting for it, at times the test does not choose; `None` (the default):
    /// deferred work runs only when waited for or stepped.
    pub worker_interval: Option<Duration>,
}

impl Default for ModelConfig {
    /// One device with 16 GiB, concurrent managed access, peer access between devices, memory
    /// that comes zeroed, work that completes at the call.
    fn default() -> Self {
        Self {
            device_count: 1,
            device_memory_bytes: 16 << 30,
            concurrent_managed_access: true,
            pageable_memory_access: false,
            host_registration: false,
            peer_access: true,
            poison_fresh_allocations: false,
            deferred_streams: false,
            worker_interval: None,
        }
    }
}

/// The driver entry points the model implements, named as libcuda names them (fault injection,
/// holds and call counts are per entry point).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Call {
    /// `cuCtxPushCurrent_v2`.
    CtxPush,
    /// `cuCtxPopCurrent_v2`.
    CtxPop,
    /// `cuCtxCreate_v2`.
    CtxCreate,
    /// `cuCtxDestroy_v2`.
    CtxDestroy,
    /// `cuMemAllocManaged`.
    AllocManaged,
    /// `cuMemFree_v2`.
    Free,
    /// `cuMemsetD8Async`.
    Memset,
    /// `cuMemAdvise_v2`.
    Advise,
    /// `cuMemPrefetchAsync_v2`.
    Prefetch,
    /// `cuStreamCreate`.
    StreamCreate,
    /// `cuStreamDestroy_v2`.
    StreamDestroy,
    /// `cuStreamSynchronize`.
    StreamSynchronize,
    /// `cuMemPoolCreate`.
    PoolCreate,
    /// `cuMemPoolDestroy`.
    PoolDestroy,
    /// `cuMemAllocFromPoolAsync`.
    PoolAlloc,
    /// `cuMemFreeAsync`.
    PoolFree,
    /// `cuMemPoolTrimTo`.
    PoolTrim,
    /// `cuMemPoolGetAttribute` (reserved memory).
    PoolReserved,
    /// `cuModuleLoadData`.
    ModuleLoad,
    /// `cuModuleGetFunction`.
    ModuleGetFunction,
    /// `cuLaunchKernel`.
    Launch,
    /// `cuEventCreate`.
    EventCreate,
    /// `cuEventRecord`.
    EventRecord,
    /// `cuStreamWaitEvent`.
    StreamWaitEvent,
    /// `cuEventSynchronize`.
    EventSynchronize,
    /// `cuEventQuery`.
    EventQuery,
    /// `cuEventDestroy_v2`.
    EventDestroy,
    /// `cuMemGetInfo_v2`.
    MemGetInfo,
    /// `cuMemHostRegister_v2`.
    HostRegister,
    /// `cuMemHostUnregister`.
    HostUnregister,
    /// `cuDevicePrimaryCtxReset_v2`.
    PrimaryCtxReset,
}

impl Call {
    /// Every entry point, in declaration order.
    pub const ALL: [Self; 31] = [
        Self::CtxPush,
        Self::CtxPop,
        Self::CtxCreate,
        Self::CtxDestroy,
        Self::AllocManaged,
        Self::Free,
        Self::Memset,
        Self::Advise,
        Self::Prefetch,
        Self::StreamCreate,
        Self::StreamDestroy,
        Self::StreamSynchronize,
        Self::PoolCreate,
        Self::PoolDestroy,
        Self::PoolAlloc,
        Self::PoolFree,
        Self::PoolTrim,
        Self::PoolReserved,
        Self::ModuleLoad,
        Self::ModuleGetFunction,
        Self::Launch,
        Self::EventCreate,
        Self::EventRecord,
        Self::StreamWaitEvent,
        Self::EventSynchronize,
        Self::EventQuery,
        Self::EventDestroy,
        Self::MemGetInfo,
        Self::HostRegister,
        Self::HostUnregister,
        Self::PrimaryCtxReset,
    ];

    /// The libcuda entry point's name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::CtxPush => "cuCtxPushCurrent_v2",
            Self::CtxPop => "cuCtxPopCurrent_v2",
            Self::CtxCreate => "cuCtxCreate_v2",
            Self::CtxDestroy => "cuCtxDestroy_v2",
            Self::AllocManaged => "cuMemAllocManaged",
            Self::Free => "cuMemFree_v2",
            Self::Memset => "cuMemsetD8Async",
            Self::Advise => "cuMemAdvise_v2",
            Self::Prefetch => "cuMemPrefetchAsync_v2",
            Self::StreamCreate => "cuStreamCreate",
            Self::StreamDestroy => "cuStreamDestroy_v2",
            Self::StreamSynchronize => "cuStreamSynchronize",
            Self::PoolCreate => "cuMemPoolCreate",
            Self::PoolDestroy => "cuMemPoolDestroy",
            Self::PoolAlloc => "cuMemAllocFromPoolAsync",
            Self::PoolFree => "cuMemFreeAsync",
            Self::PoolTrim => "cuMemPoolTrimTo",
            Self::PoolReserved => "cuMemPoolGetAttribute",
            Self::ModuleLoad => "cuModuleLoadData",
            Self::ModuleGetFunction => "cuModuleGetFunction",
            Self::Launch => "cuLaunchKernel",
            Self::EventCreate => "cuEventCreate",
            Self::EventRecord => "cuEventRecord",
            Self::StreamWaitEvent => "cuStreamWaitEvent",
            Self::EventSynchronize => "cuEventSynchronize",
            Self::EventQuery => "cuEventQuery",
            Self::EventDestroy => "cuEventDestroy_v2",
            Self::MemGetInfo => "cuMemGetInfo_v2",
            Self::HostRegister => "cuMemHostRegister_v2",
            Self::HostUnregister => "cuMemHostUnregister",
            Self::PrimaryCtxReset => "cuDevicePrimaryCtxReset_v2",
        }
    }

    /// The entry point `DriverBackend` calls first for a backend operation (what a test that
    /// fails "the n-th allocate" makes fail). `None` for operations with no driver call of their
    /// own.
    #[must_use]
    pub const fn for_operation(op: Operation) -> Option<Self> {
        Some(match op {
            Operation::Allocate => Self::AllocManaged,
            Operation::Free => Self::Free,
            Operation::Zero => Self::Memset,
            // A reset begins with an unset advice.
            Operation::Advise | Operation::ResetHints => Self::Advise,
            Operation::Prefetch => Self::Prefetch,
            Operation::AcquireStream => Self::StreamCreate,
            Operation::ReleaseStream => Self::StreamDestroy,
            Operation::Synchronize => Self::StreamSynchronize,
            Operation::CreatePool => Self::PoolCreate,
            Operation::PoolAllocate => Self::PoolAlloc,
            Operation::PoolFree => Self::PoolFree,
            Operation::TrimPool => Self::PoolTrim,
            Operation::DestroyPool => Self::PoolDestroy,
            Operation::PoolStats => Self::PoolReserved,
            Operation::AttachHost => Self::HostRegister,
            Operation::DetachHost => Self::HostUnregister,
            Operation::RecoverDevice => Self::PrimaryCtxReset,
            _ => return None,
        })
    }

    /// Calls that give something back or wait (frees, destroys, pops, synchronises): what a
    /// device failed with [`ModelDriver::fail_device`] still answers, so a test can check that
    /// nothing leaks after the failure.
    #[must_use]
    pub const fn is_teardown(self) -> bool {
        matches!(
            self,
            Self::CtxPop
                | Self::CtxDestroy
                | Self::Free
                | Self::StreamDestroy
                | Self::StreamSynchronize
                | Self::PoolDestroy
                | Self::PoolFree
                | Self::PoolTrim
                | Self::PoolReserved
                | Self::EventSynchronize
                | Self::EventQuery
                | Self::EventDestroy
                | Self::HostUnregister
        )
    }

    /// The entry point named `name` (the CUDA 11 forms `cuMemAdvise` and `cuMemPrefetchAsync`
    /// are the same calls as their `_v2` forms).
    #[must_use]
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "cuMemAdvise" => Some(Self::Advise),
            "cuMemPrefetchAsync" => Some(Self::Prefetch),
            _ => Self::ALL.into_iter().find(|c| c.name() == name),
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// The simulated kernels a module can name: host functions that run on the stream's queue when
/// the device gets to them, over the device pointers they are given. Arguments are `u64`s, in
/// order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Kernel {
    /// `fill(data, len, value)`: sets each byte of `data[0..len]` to `value`.
    Fill,
    /// `increment(data, len)`: adds one (wrapping) to each byte of `data[0..len]`.
    Increment,
    /// `copy(dst, src, len)`: copies `len` bytes (the ranges may overlap).
    Copy,
    /// `axpy(a, x, y, n)`: `y[i] = a * x[i] + y[i]` over `n` `f32`s (`a` is the `f32`'s bits).
    Axpy,
    /// `poke(data, len, index, value)`: sets byte `data[index]` to `value`, with a device-side
    /// `assert(index < len)`: an index past the end fails the assert, which (as
    /// `CUDA_ERROR_ASSERT` on a GPU) is sticky for the context. A trusted kernel that a tenant's
    /// data makes fault, touching nothing outside its buffer.
    Poke,
}

impl Kernel {
    /// The kernel a module names `name`.
    #[must_use]
    pub fn by_name(name: &str) -> Option<Self> {
        Some(match name {
            "fill" => Self::Fill,
            "increment" => Self::Increment,
            "copy" => Self::Copy,
            "axpy" => Self::Axpy,
            "poke" => Self::Poke,
            _ => return None,
        })
    }

    /// The arguments it takes.
    #[must_use]
    pub const fn arity(self) -> usize {
        match self {
            Self::Increment => 2,
            Self::Fill | Self::Copy => 3,
            Self::Axpy | Self::Poke => 4,
        }
    }

    /// The device byte ranges it touches, `(start, len)`, from its arguments (`None`: a length
    /// that overflows).
    fn spans(self, args: [u64; 4]) -> Option<[(u64, u64); 2]> {
        Some(match self {
            Self::Fill | Self::Increment => [(args[0], args[1]), (0, 0)],
            Self::Copy => [(args[0], args[2]), (args[1], args[2])],
            Self::Axpy => {
                let bytes = args[3].checked_mul(4)?;
                [(args[1], bytes), (args[2], bytes)]
            }
            Self::Poke => [(args[0], args[1]), (0, 0)],
        })
    }

    /// Whether its device-side assertion fails on these arguments (a fault, sticky for the
    /// context, before it touches anything).
    fn asserts(self, args: [u64; 4]) -> bool {
        matches!(self, Self::Poke) && args[2] >= args[1]
    }
}

/// The C ABI value of a handle, and a handle from one (the model checks it at every use).
macro_rules! raw_handle {
    ($($t:ty),*) => {$(
        impl $t {
            /// The handle as the C ABI passes it.
            #[must_use]
            pub const fn raw(self) -> u64 {
                self.0
            }

            /// A handle from its C ABI value (the model checks it at every use).
            #[must_use]
            pub const fn from_raw(raw: u64) -> Self {
                Self(raw)
            }
        }
    )*};
}

raw_handle!(Module, Function, Event);

/// A loaded module (`CUmodule`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Module(u64);

/// A kernel got from a module (`CUfunction`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Function(u64);

/// An event (`CUevent`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Event(u64);

/// The hints in force at one byte of an allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    /// `SetReadMostly` is in force.
    pub read_mostly: bool,
    /// The preferred location, if set.
    pub preferred_location: Option<Location>,
    /// Locations the byte is marked as accessed by (the host first, then devices ascending).
    pub accessed_by: Vec<Location>,
}

/// Counters of a [`ModelDriver`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelStats {
    calls: [u64; Call::ALL.len()],
    /// Managed allocations alive (pool blocks not counted).
    pub live_allocations: u64,
    /// Bytes in them (requested sizes).
    pub live_bytes: u64,
    /// The most managed bytes ever allocated at once.
    pub peak_bytes: u64,
    /// Managed allocations ever made.
    pub allocations: u64,
    /// Managed frees that succeeded.
    pub frees: u64,
    /// Streams made by `cuStreamCreate` and not destroyed (the per-device zeroing streams the
    /// model keeps for `DriverApi::scrub_stream` are not counted).
    pub live_streams: u64,
    /// Streams ever made by `cuStreamCreate`.
    pub streams_created: u64,
    /// Streams ever destroyed.
    pub streams_destroyed: u64,
    /// Non-primary contexts alive.
    pub live_contexts: u64,
    /// Non-primary contexts ever made.
    pub contexts_created: u64,
    /// Non-primary contexts ever destroyed.
    pub contexts_destroyed: u64,
    /// Failures injected so far.
    pub injected_failures: u64,
    /// Pools alive (not destroyed; a destroyed pool whose queued frees have not run yet keeps
    /// its memory until they do, counted in `pool_reserved_bytes`).
    pub live_pools: u64,
    /// Pool blocks allocated and not freed (a free counts from its call, as the API sees it;
    /// the block is reusable only once the free has run).
    pub live_pool_allocations: u64,
    /// Bytes the pools hold (live plus kept free blocks).
    pub pool_reserved_bytes: u64,
    /// Stream work items completed.
    pub work_completed: u64,
    /// Scrubs (a memset on any stream, a prefetch on the model's zeroing stream) of a range
    /// that work queued on another stream still targets: the tenant's work may land after the
    /// scrub (a cross-tenant leak on a GPU).
    pub scrubs_over_pending_work: u64,
    /// Frees of an allocation that queued work still targets.
    pub frees_over_pending_work: u64,
    /// Kernels that touched memory outside every live allocation when they ran (an illegal
    /// address: their context is poisoned, sticky, as on a GPU).
    pub kernel_faults: u64,
    /// Primary contexts reset (`cuDevicePrimaryCtxReset`).
    pub primary_resets: u64,
    /// Events alive.
    pub live_events: u64,
    /// Host ranges registered with `cuMemHostRegister` and not unregistered.
    pub registered_ranges: u64,
    /// Bytes in them.
    pub registered_bytes: u64,
    /// Unregistrations of a range that queued work still targets.
    pub unregisters_over_pending_work: u64,
    /// Bytes of managed memory moved from the host to a device: by a prefetch to a device, or
    /// by device work (a memset, a kernel) on pages that were on the host (pages never placed
    /// are on the host: the model cannot see host touches).
    pub migrated_to_device_bytes: u64,
    /// Bytes of managed memory moved to the host (or between devices, counted here too): by a
    /// prefetch to the host of pages on a device.
    pub migrated_to_host_bytes: u64,
}

impl ModelStats {
    /// Calls of the entry point `DriverBackend` calls for `op` (see [`Call::for_operation`]).
    #[must_use]
    pub fn calls(&self, op: Operation) -> u64 {
        Call::for_operation(op).map_or(0, |c| self.entry_calls(c))
    }

    /// Calls of one entry point so far (failed ones included).
    #[must_use]
    pub fn entry_calls(&self, call: Call) -> u64 {
        self.calls[call.index()]
    }
}
