//! A failed driver call, typed: the entry point, the `CUresult` integer, its name and kind.

use std::fmt;

use tensor_wasm_mem_core::ErrorKind;

use crate::code;

/// A CUDA driver call that failed: the entry point and the `CUresult` it returned, as the
/// integer (a code no table names, a newer CUDA's, is carried as it came).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaError {
    /// The entry point.
    pub call: &'static str,
    /// The `CUresult` it returned.
    pub code: u32,
}

impl CudaError {
    /// The code's `CUDA_ERROR_*` name, where [`code`] names it.
    #[must_use]
    pub fn name(&self) -> Option<&'static str> {
        code::name(self.code)
    }

    /// The kind of this error ([`code::kind`]).
    #[must_use]
    pub const fn kind(&self) -> ErrorKind {
        code::kind(self.code)
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{} failed: {name} ({})", self.call, self.code),
            None => write!(
                f,
                "{} failed: CUresult {} (a code this build does not name)",
                self.call, self.code
            ),
        }
    }
}

impl std::error::Error for CudaError {}
