//! The cust backend's error.

use tensor_wasm_mem_core::{BackendError, DeviceId, ErrorKind, Refusal};
use tensor_wasm_mem_cuda::CudaError;

use tensor_wasm_mem_cuda::StartError;

/// Everything the cust backend can fail or refuse with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CustError {
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

impl From<StartError> for CustError {
    fn from(e: StartError) -> Self {
        match e {
            StartError::NoDevice => Self::NoDevice,
            StartError::NoManagedMemory(device) => Self::NoManagedMemory { device },
            StartError::Call(e) => Self::Driver(e),
        }
    }
}

impl BackendError for CustError {
    fn kind(&self) -> ErrorKind {
        match self {
            Self::NoDevice => ErrorKind::NoDevice,
            Self::NoManagedMemory { .. } => ErrorKind::Unsupported,
            Self::Driver(e) => e.kind(),
            Self::Refused(r) => r.kind(),
        }
    }
}
