//! Choosing a backend at compile time.
//!
//! Each backend is a cargo feature of this crate (and of the `twm` CLI): `mock` (the default),
//! `cudarc`, `cust`, `cuda-oxide`.
//!
//! | features on | [`DefaultBackend`] / [`default_backend`] |
//! |---|---|
//! | `mock` only (the default) | `MockBackend`, a simulated device in host memory |
//! | `cudarc` only | `CudarcBackend` on the system's driver |
//! | `cust` only | `CustBackend` |
//! | `cuda-oxide` only | `CudaOxideBackend` (every operation answers `NotYetWired`) |
//! | several | none: [`DefaultBackend`] is [`NoDefaultBackend`] (not a backend) and [`default_backend`] answers [`DefaultBackendError::Ambiguous`]; name the backend's type instead, e.g. `TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))` |
//! | none | a compile error saying which features exist |
//!
//! The `twm` CLI picks with `--backend`; without it, the first of [`ENABLED`] (the one place
//! the order is written), and starts the real backends with `start_cudarc` / `start_cust` (features `cudarc`, `cust`).

use std::sync::Arc;

#[cfg(not(any(
    feature = "mock",
    feature = "cudarc",
    feature = "cust",
    feature = "cuda-oxide"
)))]
compile_error!(
    "tensor-wasm-mem-wasmtime needs a backend: enable one of its features `mock` (the \
     default: a simulated device, no GPU needed), `cudarc`, `cust` or `cuda-oxide`"
);

#[cfg(feature = "cuda-oxide")]
pub use tensor_wasm_mem_cuda_oxide as cuda_oxide;
#[cfg(feature = "cudarc")]
pub use tensor_wasm_mem_cudarc as cudarc;
#[cfg(feature = "cust")]
pub use tensor_wasm_mem_cust as cust;
#[cfg(feature = "mock")]
pub use tensor_wasm_mem_mock as mock;

/// The backend features compiled in, in the CLI's order of precedence.
pub const ENABLED: &[&str] = &[
    #[cfg(feature = "cudarc")]
    "cudarc",
    #[cfg(feature = "cust")]
    "cust",
    #[cfg(feature = "mock")]
    "mock",
    #[cfg(feature = "cuda-oxide")]
    "cuda-oxide",
];

/// Why [`default_backend`] gave no backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DefaultBackendError {
    /// Several backend features are on: there is no default; choose one by type.
    #[error(
        "several backends are compiled in ({enabled:?}): there is no default; build the creator \
         with the backend's type (e.g. TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())))"
    )]
    Ambiguous {
        /// The backends compiled in.
        enabled: &'static [&'static str],
    },
    /// The backend did not start (no driver, no device, ...).
    #[error("the {backend} backend did not start: {source}")]
    Start {
        /// Its name.
        backend: &'static str,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

/// Starts the cudarc backend on the system's driver: how this crate's default and the `twm` CLI
/// start it.
#[cfg(feature = "cudarc")]
pub fn start_cudarc() -> Result<tensor_wasm_mem_cudarc::CudarcBackend, DefaultBackendError> {
    tensor_wasm_mem_cudarc::start(&tensor_wasm_mem_cudarc::DriverSource::System).map_err(|e| {
        DefaultBackendError::Start {
            backend: "cudarc",
            source: Box::new(e),
        }
    })
}

/// Starts the cust backend: how this crate's default and the `twm` CLI start it.
#[cfg(feature = "cust")]
pub fn start_cust() -> Result<tensor_wasm_mem_cust::CustBackend, DefaultBackendError> {
    tensor_wasm_mem_cust::start().map_err(|e| DefaultBackendError::Start {
        backend: "cust",
        source: Box::new(e),
    })
}

/// What [`DefaultBackend`] is when several backend features are on: not a backend, so code that
/// relies on a default fails to compile; name the backend's type instead.
#[derive(Debug)]
pub struct NoDefaultBackend {
    _private: (),
}

#[cfg(all(
    feature = "mock",
    not(any(feature = "cudarc", feature = "cust", feature = "cuda-oxide"))
))]
mod chosen {
    /// The default backend of this build.
    pub type DefaultBackend = tensor_wasm_mem_mock::MockBackend;
    pub(super) fn start() -> Result<DefaultBackend, super::DefaultBackendError> {
        Ok(tensor_wasm_mem_mock::MockBackend::default())
    }
}

#[cfg(all(
    feature = "cudarc",
    not(any(feature = "mock", feature = "cust", feature = "cuda-oxide"))
))]
mod chosen {
    /// The default backend of this build.
    pub type DefaultBackend = tensor_wasm_mem_cudarc::CudarcBackend;
    pub(super) fn start() -> Result<DefaultBackend, super::DefaultBackendError> {
        super::start_cudarc()
    }
}

#[cfg(all(
    feature = "cust",
    not(any(feature = "mock", feature = "cudarc", feature = "cuda-oxide"))
))]
mod chosen {
    /// The default backend of this build.
    pub type DefaultBackend = tensor_wasm_mem_cust::CustBackend;
    pub(super) fn start() -> Result<DefaultBackend, super::DefaultBackendError> {
        super::start_cust()
    }
}

#[cfg(all(
    feature = "cuda-oxide",
    not(any(feature = "mock", feature = "cudarc", feature = "cust"))
))]
mod chosen {
    /// The default backend of this build.
    pub type DefaultBackend = tensor_wasm_mem_cuda_oxide::CudaOxideBackend;
    pub(super) fn start() -> Result<DefaultBackend, super::DefaultBackendError> {
        Ok(tensor_wasm_mem_cuda_oxide::CudaOxideBackend::new())
    }
}

#[cfg(not(any(
    all(
        feature = "mock",
        not(any(feature = "cudarc", feature = "cust", feature = "cuda-oxide"))
    ),
    all(
        feature = "cudarc",
        not(any(feature = "mock", feature = "cust", feature = "cuda-oxide"))
    ),
    all(
        feature = "cust",
        not(any(feature = "mock", feature = "cudarc", feature = "cuda-oxide"))
    ),
    all(
        feature = "cuda-oxide",
        not(any(feature = "mock", feature = "cudarc", feature = "cust"))
    ),
)))]
mod chosen {
    /// Several backends (or none) are compiled in: no default.
    pub type DefaultBackend = super::NoDefaultBackend;
    pub(super) fn start() -> Result<DefaultBackend, super::DefaultBackendError> {
        Err(super::DefaultBackendError::Ambiguous {
            enabled: super::ENABLED,
        })
    }
}

pub use chosen::DefaultBackend;

/// Starts the default backend of this build (see the [module docs](self) for which it is).
pub fn default_backend() -> Result<Arc<DefaultBackend>, DefaultBackendError> {
    chosen::start().map(Arc::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_one_backend_is_the_default_several_are_ambiguous() {
        let result = default_backend();
        if ENABLED.len() == 1 {
            // The real backends may not start here (no GPU); the mock and the slot always do.
            if ENABLED == ["mock"] || ENABLED == ["cuda-oxide"] {
                assert!(result.is_ok(), "{:?}", result.err());
            } else {
                assert!(!matches!(
                    result,
                    Err(DefaultBackendError::Ambiguous { .. })
                ));
            }
        } else {
            match result {
                Err(DefaultBackendError::Ambiguous { enabled }) => {
                    assert_eq!(enabled, ENABLED);
                    let message = DefaultBackendError::Ambiguous { enabled }.to_string();
                    assert!(
                        message.contains("choose") || message.contains("type"),
                        "{message}"
                    );
                }
                other => panic!("several backends must have no default: {other:?}"),
            }
        }
    }
}
