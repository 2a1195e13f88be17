//! The model's error: what the simulated driver answers, and what `DriverBackend` refuses before
//! asking it.

use tensor_wasm_mem_core::{BackendError, ErrorKind, Refusal};
use tensor_wasm_mem_cuda::CudaError;

/// An error of the simulated driver (or of `DriverBackend` over it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// Refused by `DriverBackend` before the driver was called (a range outside its
    /// allocation, an unknown stream or device, ...).
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// A driver entry point answered a `CUresult` other than success: the code as an integer,
    /// so a code no enum knows (a newer CUDA's) is reported, never undefined behaviour.
    #[error(transparent)]
    Driver(#[from] CudaError),
    /// The host refused the mapping that backs simulated memory (errno).
    #[error("host mapping of {requested} bytes failed (errno {errno})")]
    HostMapFailed {
        /// Bytes requested.
        requested: u64,
        /// The OS error number.
        errno: i32,
    },
}

impl ModelError {
    /// The driver's `CUresult`, where the driver answered.
    #[must_use]
    pub const fn code(&self) -> Option<u32> {
        match self {
            Self::Driver(e) => Some(e.code),
            _ => None,
        }
    }
}

impl BackendError for ModelError {
    fn kind(&self) -> ErrorKind {
        match self {
            Self::Refused(r) => r.kind(),
            Self::Driver(e) => e.kind(),
            Self::HostMapFailed { .. } => ErrorKind::OutOfMemory,
        }
    }

    fn driver_code(&self) -> Option<u32> {
        self.code()
    }

    fn hint(&self) -> Option<&'static str> {
        match self {
            Self::Driver(e) => e.hint(),
            _ => None,
        }
    }
}
