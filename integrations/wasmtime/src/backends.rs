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
//! | several | the first of [`ENABLED`] compiled in (cudarc, cust, mock, cuda-oxide): features only add, so code written against [`DefaultBackend`] keeps compiling when another crate turns on a second backend, and code that names a backend's type (`MockBackend`, ...) keeps that backend |
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
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-oxide")))]
pub use tensor_wasm_mem_cuda_oxide as cuda_oxide;
#[cfg(feature = "cudarc")]
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
pub use tensor_wasm_mem_cudarc as cudarc;
#[cfg(feature = "cust")]
#[cfg_attr(docsrs, doc(cfg(feature = "cust")))]
pub use tensor_wasm_mem_cust as cust;
#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
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
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
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
#[cfg_attr(docsrs, doc(cfg(feature = "cust")))]
pub fn start_cust() -> Result<tensor_wasm_mem_cust::CustBackend, DefaultBackendError> {
    tensor_wasm_mem_cust::start().map_err(|e| DefaultBackendError::Start {
        backend: "cust",
        source: Box::new(e),
    })
}

// The default is the first backend compiled in, in the order of [`ENABLED`]: features only
// add, so a crate built against `DefaultBackend` keeps compiling when another crate in the same
// build turns on a second backend (every backend implements [`crate::Backend`]).
#[cfg(feature = "cudarc")]
mod chosen {
    /// The default backend of this build.
    pub type DefaultBackend = tensor_wasm_mem_cudarc::CudarcBackend;
    pub(super) fn start() -> Result<DefaultBackend, super::DefaultBackendError> {
        super::start_cudarc()
    }
}

#[cfg(all(feature = "cust", not(feature = "cudarc")))]
mod chosen {
    /// The default backend of this build.
    pub type DefaultBackend = tensor_wasm_mem_cust::CustBackend;
    pub(super) fn start() -> Result<DefaultBackend, super::DefaultBackendError> {
        super::start_cust()
    }
}

#[cfg(all(feature = "mock", not(any(feature = "cudarc", feature = "cust"))))]
mod chosen {
    /// The default backend of this build.
    pub type DefaultBackend = tensor_wasm_mem_mock::MockBackend;
    pub(super) fn start() -> Result<DefaultBackend, super::DefaultBackendError> {
        Ok(tensor_wasm_mem_mock::MockBackend::default())
    }
}

#[cfg(all(
    feature = "cuda-oxide",
    not(any(feature = "cudarc", feature = "cust", feature = "mock"))
))]
mod chosen {
    /// The default backend of this build.
    pub type DefaultBackend = tensor_wasm_mem_cuda_oxide::CudaOxideBackend;
    pub(super) fn start() -> Result<DefaultBackend, super::DefaultBackendError> {
        Ok(tensor_wasm_mem_cuda_oxide::CudaOxideBackend::new())
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
    fn the_default_is_the_first_backend_in_the_documented_order() {
        use std::any::TypeId;
        let first = ENABLED[0];
        let default = TypeId::of::<DefaultBackend>();
        let named: &[(&str, TypeId)] = &[
            #[cfg(feature = "cudarc")]
            (
                "cudarc",
                TypeId::of::<tensor_wasm_mem_cudarc::CudarcBackend>(),
            ),
            #[cfg(feature = "cust")]
            ("cust", TypeId::of::<tensor_wasm_mem_cust::CustBackend>()),
            #[cfg(feature = "mock")]
            ("mock", TypeId::of::<tensor_wasm_mem_mock::MockBackend>()),
            #[cfg(feature = "cuda-oxide")]
            (
                "cuda-oxide",
                TypeId::of::<tensor_wasm_mem_cuda_oxide::CudaOxideBackend>(),
            ),
        ];
        let is: Vec<&str> = named
            .iter()
            .filter(|(_, id)| *id == default)
            .map(|(name, _)| *name)
            .collect();
        assert_eq!(is, [first], "features on: {ENABLED:?}");
        let result = default_backend();
        // The real backends may not start here (no GPU); the mock and the slot always do.
        if first == "mock" || first == "cuda-oxide" {
            assert!(result.is_ok(), "{:?}", result.err());
        } else if let Err(e) = result {
            assert!(
                matches!(&e, DefaultBackendError::Start { backend, .. } if *backend == first),
                "{e}"
            );
        }
    }

    // Features only add: a function written against a mock-only build's default compiles
    // whatever else is on, because it asks only for what every backend is.
    fn _written_for_any_default(
        backend: Arc<DefaultBackend>,
    ) -> crate::TensorWasmMemoryCreator<DefaultBackend> {
        crate::TensorWasmMemoryCreator::builder(backend)
            .build()
            .expect("a default plan builds")
    }
}
