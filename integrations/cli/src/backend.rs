//! The backends this build of `twm` can use, chosen with `--backend`.

use std::fmt;

/// A backend compiled into this `twm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The simulated device in host memory (always available).
    Mock,
}

impl BackendKind {
    /// The default backend of this build.
    pub const DEFAULT: Self = Self::Mock;

    /// The stable name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Mock => "mock",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Calls `$body` with `$b` bound to an `Arc` of the chosen backend, or returns an error that says
/// why the backend could not start.
#[macro_export]
macro_rules! with_backend {
    ($kind:expr, |$b:ident| $body:expr) => {
        match $kind {
            $crate::backend::BackendKind::Mock => {
                let $b = std::sync::Arc::new(tensor_wasm_mem_mock::MockBackend::default());
                $body
            }
        }
    };
}
