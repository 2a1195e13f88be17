//! The cust backend's error.

use tensor_wasm_mem_core::{BackendError, DeviceId, ErrorKind, Refusal, cuda_result_kind};

/// A driver call that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed with CUresult {code}")]
pub struct DriverError {
    /// The entry point.
    pub call: &'static str,
    /// The `CUresult` it returned.
    pub code: u32,
}

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
    Driver(#[from] DriverError),
    /// Refused before the driver was asked (a bad range, device or handle).
    #[error(transparent)]
    Refused(#[from] Refusal),
}

impl BackendError for CustError {
    fn kind(&self) -> ErrorKind {
        match self {
            Self::NoDevice => ErrorKind::NoDevice,
            Self::NoManagedMemory { .. } => ErrorKind::Unsupported,
            Self::Driver(e) => cuda_result_kind(e.code),
            Self::Refused(r) => r.kind(),
        }
    }
}
