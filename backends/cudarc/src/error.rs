//! The cudarc backend's error.

use tensor_wasm_mem_core::{BackendError, DeviceId, ErrorKind, Refusal};
use tensor_wasm_mem_cuda::CudaError;

use tensor_wasm_mem_cuda::StartError;

/// Everything the cudarc backend can fail or refuse with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudarcError {
    /// No CUDA driver library could be loaded.
    #[error("no CUDA driver found: {0}")]
    DriverNotFound(String),
    /// The driver lacks an entry point this backend needs.
    #[error(
        "the CUDA driver lacks `{symbol}` (this backend needs CUDA 12.2 or newer: \
         cuMemAdvise_v2 / cuMemPrefetchAsync_v2)"
    )]
    MissingSymbol {
        /// The missing entry point.
        symbol: &'static str,
    },
    /// The driver sees no device.
    #[error("the CUDA driver reports no device")]
    NoDevice,
    /// A device cannot allocate managed memory.
    #[error("{device} does not support managed memory (CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 0)")]
    NoManagedMemory {
        /// The device.
        device: DeviceId,
    },
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] CudaError),
    /// Refused before the driver was asked (a bad range, device or handle).
    #[error(transparent)]
    Refused(#[from] Refusal),
}

impl From<StartError> for CudarcError {
    fn from(e: StartError) -> Self {
        match e {
            StartError::NoDevice => Self::NoDevice,
            StartError::NoManagedMemory(device) => Self::NoManagedMemory { device },
            StartError::Call(e) => Self::Driver(e),
        }
    }
}

impl BackendError for CudarcError {
    fn kind(&self) -> ErrorKind {
        match self {
            Self::DriverNotFound(_) | Self::MissingSymbol { .. } => ErrorKind::DriverUnavailable,
            Self::NoDevice => ErrorKind::NoDevice,
            Self::NoManagedMemory { .. } => ErrorKind::Unsupported,
            Self::Driver(e) => e.kind(),
            Self::Refused(r) => r.kind(),
        }
    }
}
