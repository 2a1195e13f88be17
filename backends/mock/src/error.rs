//! The mock backend's error.

use tensor_wasm_mem_core::{BackendError, DeviceId, ErrorKind, Operation, RangeError};

/// Everything the simulated device can say no with. Each variant mirrors the driver error a real
/// GPU would give in the same situation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MockError {
    /// `CUDA_ERROR_INVALID_VALUE`: a size of zero or another malformed argument.
    #[error("invalid value: {0}")]
    InvalidValue(&'static str),
    /// `CUDA_ERROR_INVALID_DEVICE`: no such device.
    #[error("{device} does not exist ({count} simulated devices)")]
    InvalidDevice {
        /// The device asked for.
        device: DeviceId,
        /// Devices the mock simulates.
        count: u32,
    },
    /// The device cannot do this (prefetch to a device without concurrent managed access).
    #[error("{device} does not support {what}")]
    NotSupported {
        /// The device.
        device: DeviceId,
        /// What it lacks.
        what: &'static str,
    },
    /// `CUDA_ERROR_INVALID_VALUE` for a range outside its allocation.
    #[error(transparent)]
    Range(#[from] RangeError),
    /// `CUDA_ERROR_OUT_OF_MEMORY`: the simulated device memory is used up.
    #[error("{device} out of memory: {requested} bytes requested, {available} available")]
    OutOfMemory {
        /// The device.
        device: DeviceId,
        /// Bytes requested.
        requested: u64,
        /// Bytes still free on the device.
        available: u64,
    },
    /// The host refused the mapping (errno).
    #[error("host mapping of {requested} bytes failed (errno {errno})")]
    HostMapFailed {
        /// Bytes requested.
        requested: u64,
        /// The OS error number.
        errno: i32,
    },
    /// `CUDA_ERROR_INVALID_HANDLE`: an allocation this mock does not know (or freed already).
    #[error("unknown allocation at {address:#x}")]
    UnknownAllocation {
        /// The base address given.
        address: u64,
    },
    /// `CUDA_ERROR_INVALID_HANDLE`: a stream this mock did not hand out (or took back).
    #[error("unknown stream {raw}")]
    UnknownStream {
        /// The raw stream value given.
        raw: u64,
    },
    /// A pool this mock did not make (or destroyed), or an allocation not from it.
    #[error("unknown pool {raw:#x} (or an allocation not from it)")]
    UnknownPool {
        /// The raw pool handle.
        raw: u64,
    },
    /// A stream that is not the pool's tenant's (nor the shared default stream).
    #[error("stream {raw:#x} is not a stream of pool {pool:#x}'s tenant")]
    ForeignStream {
        /// The raw stream handle.
        raw: u64,
        /// The raw pool handle.
        pool: u64,
    },
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`: device work named memory outside every live allocation.
    #[error("illegal address: {len} bytes at {address:#x} are not in a live allocation")]
    IllegalAddress {
        /// The device pointer given.
        address: u64,
        /// The length given.
        len: usize,
    },
    /// A kernel in this context hit an illegal address: the context is unusable (sticky, as
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` is on a GPU) until it is destroyed.
    #[error(
        "context {context:#x} is unusable: a kernel in it hit an illegal address (sticky until \
         the context is destroyed)"
    )]
    ContextPoisoned {
        /// The context.
        context: u64,
    },
    /// A failure injected with [`MockBackend::fail_nth`](crate::MockBackend::fail_nth).
    #[error("injected failure of {op} call #{call}")]
    Injected {
        /// The operation.
        op: Operation,
        /// Which call (1-based, counted since the mock was made) failed.
        call: u64,
        /// The kind the failure reports.
        kind: ErrorKind,
    },
}

impl BackendError for MockError {
    fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidValue(_)
            | Self::InvalidDevice { .. }
            | Self::UnknownAllocation { .. }
            | Self::UnknownStream { .. }
            | Self::UnknownPool { .. }
            | Self::ForeignStream { .. }
            | Self::IllegalAddress { .. } => ErrorKind::InvalidArgument,
            Self::NotSupported { .. } => ErrorKind::Unsupported,
            Self::ContextPoisoned { .. } => ErrorKind::Driver,
            Self::Range(e) => e.kind(),
            Self::OutOfMemory { .. } | Self::HostMapFailed { .. } => ErrorKind::OutOfMemory,
            Self::Injected { kind, .. } => *kind,
        }
    }
}
