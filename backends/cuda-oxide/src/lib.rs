#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

use tensor_wasm_mem_core::{
    Advice, Advisor, Allocation, BackendError, Capabilities, DeviceId, DevicePoolConfig,
    DevicePoolStats, DevicePools, ErrorKind, ErrorType, HostAccess, HostMemory, IsolationLevel,
    Location, ManagedAllocator, Operation, PoolAllocation, PoolHandle, Refused, Stream, StreamKey,
    StreamProvider, TenantKey,
};

/// The only error of the reserved slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OxideError {
    /// The cuda-oxide backend is a reserved slot: nothing is wired to a driver yet.
    #[error(
        "the cuda-oxide backend is a reserved slot and is not wired to a driver yet: cannot \
         {operation} (use the cudarc or cust backend)"
    )]
    NotYetWired {
        /// The operation asked for.
        operation: Operation,
    },
    /// Device memory pools are not offered by this slot.
    #[error("the cuda-oxide slot has no device memory pools: cannot {operation}")]
    NoDevicePools {
        /// The operation asked for.
        operation: Operation,
    },
}

impl BackendError for OxideError {
    fn kind(&self) -> ErrorKind {
        match self {
            Self::NotYetWired { .. } => ErrorKind::NotYetWired,
            Self::NoDevicePools { .. } => ErrorKind::Unsupported,
        }
    }
}

fn not_yet(operation: Operation) -> OxideError {
    OxideError::NotYetWired { operation }
}

/// The reserved cuda-oxide slot: every operation answers [`OxideError::NotYetWired`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaOxideBackend {
    _private: (),
}

impl CudaOxideBackend {
    /// The slot.
    #[must_use]
    pub const fn new() -> Self {
        Self { _private: () }
    }
}

impl ErrorType for CudaOxideBackend {
    type Error = OxideError;
}

// SAFETY: `allocate` never returns an allocation, `zero` never writes, and the capabilities claim
// nothing, so no guarantee of the contract can be broken.
unsafe impl ManagedAllocator for CudaOxideBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities::NONE
    }

    fn device_count(&self) -> u32 {
        0
    }

    fn allocate(&self, _device: DeviceId, _bytes: usize) -> Result<Allocation, OxideError> {
        Err(not_yet(Operation::Allocate))
    }

    unsafe fn free(&self, allocation: Allocation) -> Result<(), Refused<Allocation, OxideError>> {
        // Nothing can have come from `allocate`; the handle goes back untouched.
        Err(Refused {
            resource: allocation,
            error: not_yet(Operation::Free),
        })
    }

    unsafe fn zero(&self, _: &Allocation, _: usize, _: usize) -> Result<(), OxideError> {
        Err(not_yet(Operation::Zero))
    }
}

impl Advisor for CudaOxideBackend {
    fn advise(&self, _: &Allocation, _: usize, _: usize, _: Advice) -> Result<(), OxideError> {
        Err(not_yet(Operation::Advise))
    }

    fn prefetch(
        &self,
        _: &Allocation,
        _: usize,
        _: usize,
        _: Location,
        _: &Stream,
    ) -> Result<(), OxideError> {
        Err(not_yet(Operation::Prefetch))
    }

    fn reset_hints(&self, _: &Allocation, _: usize, _: usize) -> Result<(), OxideError> {
        Err(not_yet(Operation::ResetHints))
    }
}

impl StreamProvider for CudaOxideBackend {
    fn acquire_stream_on(
        &self,
        _: TenantKey,
        _: IsolationLevel,
        _: tensor_wasm_mem_core::DeviceId,
    ) -> Result<Stream, OxideError> {
        Err(not_yet(Operation::AcquireStream))
    }

    fn release_stream(&self, _: Stream) -> Result<(), OxideError> {
        Err(not_yet(Operation::ReleaseStream))
    }

    fn wait_for(&self, _: StreamKey) -> Result<(), OxideError> {
        Err(not_yet(Operation::Synchronize))
    }
}

// SAFETY: no host memory is ever attached: `can_attach_host` answers `false` and every call
// answers `NotYetWired` without touching the range.
unsafe impl HostMemory for CudaOxideBackend {
    fn can_attach_host(&self, _: DeviceId, _: HostAccess) -> bool {
        false
    }

    unsafe fn attach_host(
        &self,
        _: DeviceId,
        _: HostAccess,
        _: core::ptr::NonNull<u8>,
        _: usize,
    ) -> Result<Allocation, OxideError> {
        Err(not_yet(Operation::AttachHost))
    }

    unsafe fn detach_host(
        &self,
        allocation: Allocation,
    ) -> Result<(), Refused<Allocation, OxideError>> {
        Err(Refused {
            resource: allocation,
            error: not_yet(Operation::DetachHost),
        })
    }
}

fn no_pools(operation: Operation) -> OxideError {
    OxideError::NoDevicePools { operation }
}

/// The slot has no device memory pools: every call answers [`OxideError::NoDevicePools`]
/// (kind `Unsupported`).
impl DevicePools for CudaOxideBackend {
    fn create_pool(
        &self,
        _: TenantKey,
        _: DeviceId,
        _: &DevicePoolConfig,
    ) -> Result<PoolHandle, OxideError> {
        Err(no_pools(Operation::CreatePool))
    }

    fn pool_allocate(
        &self,
        _: &PoolHandle,
        _: usize,
        _: &Stream,
    ) -> Result<PoolAllocation, OxideError> {
        Err(no_pools(Operation::PoolAllocate))
    }

    fn pool_free(&self, _: &PoolHandle, _: PoolAllocation, _: &Stream) -> Result<(), OxideError> {
        Err(no_pools(Operation::PoolFree))
    }

    fn pool_free_at_teardown(&self, _: &PoolHandle, _: PoolAllocation) -> Result<(), OxideError> {
        Err(no_pools(Operation::PoolFree))
    }

    fn trim_pool(&self, _: &PoolHandle, _: u64) -> Result<(), OxideError> {
        Err(no_pools(Operation::TrimPool))
    }

    fn pool_stats(&self, _: &PoolHandle) -> Result<DevicePoolStats, OxideError> {
        Err(no_pools(Operation::PoolStats))
    }

    fn destroy_pool(&self, _: PoolHandle) -> Result<(), OxideError> {
        Err(no_pools(Operation::DestroyPool))
    }
}
