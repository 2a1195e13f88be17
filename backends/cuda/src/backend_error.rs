//! The one error of the backends that reach the real CUDA driver (cudarc's loader and cust's
//! link are two ways to reach one driver: they share this type).

use std::fmt;

use tensor_wasm_mem_core::{BackendError, DeviceId, ErrorKind, Refusal};

use crate::{CudaError, StartError};

/// Everything a backend over the CUDA driver ([`CudaDriver`](crate::CudaDriver) under
/// `DriverBackend`) can fail or refuse with, whichever way it reached the driver: the cudarc
/// backend's `CudarcError` and the cust backend's `CustError` are this type. (A linked driver,
/// cust's, never reports [`DriverNotFound`](Self::DriverNotFound) or
/// [`MissingSymbol`](Self::MissingSymbol).)
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CudaBackendError {
    /// No CUDA driver library could be loaded.
    DriverNotFound(String),
    /// The driver lacks an entry point this backend needs.
    MissingSymbol {
        /// The missing entry point.
        symbol: &'static str,
    },
    /// The driver sees no device.
    NoDevice,
    /// A device cannot allocate managed memory.
    NoManagedMemory {
        /// The device.
        device: DeviceId,
    },
    /// A driver call failed.
    Driver(CudaError),
    /// Refused before the driver was asked (a bad range, device or handle).
    Refused(Refusal),
}

impl fmt::Display for CudaBackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DriverNotFound(why) => write!(f, "no CUDA driver found: {why}"),
            Self::MissingSymbol { symbol } => write!(
                f,
                "the CUDA driver lacks `{symbol}` (this backend needs CUDA 12.2 or newer: \
                 cuMemAdvise_v2 / cuMemPrefetchAsync_v2)"
            ),
            Self::NoDevice => f.write_str("the CUDA driver reports no device"),
            Self::NoManagedMemory { device } => write!(
                f,
                "{device} does not support managed memory (CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 0)"
            ),
            Self::Driver(e) => fmt::Display::fmt(e, f),
            Self::Refused(r) => fmt::Display::fmt(r, f),
        }
    }
}

impl std::error::Error for CudaBackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // Transparent, as the Display is: the wrapped error's source is this one's.
        match self {
            Self::Driver(e) => e.source(),
            Self::Refused(r) => r.source(),
            _ => None,
        }
    }
}

impl From<CudaError> for CudaBackendError {
    fn from(e: CudaError) -> Self {
        Self::Driver(e)
    }
}

impl From<Refusal> for CudaBackendError {
    fn from(r: Refusal) -> Self {
        Self::Refused(r)
    }
}

impl From<StartError> for CudaBackendError {
    fn from(e: StartError) -> Self {
        match e {
            StartError::NoDevice => Self::NoDevice,
            StartError::NoManagedMemory(device) => Self::NoManagedMemory { device },
            StartError::Call(e) => Self::Driver(e),
        }
    }
}

impl BackendError for CudaBackendError {
    fn kind(&self) -> ErrorKind {
        match self {
            Self::DriverNotFound(_) | Self::MissingSymbol { .. } => ErrorKind::DriverUnavailable,
            Self::NoDevice => ErrorKind::NoDevice,
            Self::NoManagedMemory { .. } => ErrorKind::Unsupported,
            Self::Driver(e) => e.kind(),
            Self::Refused(r) => r.kind(),
        }
    }

    fn driver_code(&self) -> Option<u32> {
        match self {
            Self::Driver(e) => Some(e.code),
            _ => None,
        }
    }

    fn hint(&self) -> Option<&'static str> {
        match self {
            Self::Driver(e) => e.hint(),
            _ => None,
        }
    }
}
