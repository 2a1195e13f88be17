//! A failed driver call, typed: the entry point, the `CUresult` integer, its name and kind.

use std::fmt;

use tensor_wasm_mem_core::ErrorKind;

use crate::code;

/// A CUDA driver call that failed: the entry point and the `CUresult` it returned, as the
/// integer (a code no table names, a newer CUDA's, is carried as it came). Its Display and Debug
/// name the code (`CUDA_ERROR_INVALID_CONTEXT (201)`), and Display says what to do where this
/// layer knows ([`hint`](Self::hint)).
#[derive(Clone, Copy, PartialEq, Eq)]
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

impl CudaError {
    /// What to do about this error, where this layer knows: the usual cause of a code in this
    /// workspace and its fix.
    #[must_use]
    pub fn hint(&self) -> Option<&'static str> {
        Some(match self.code {
            code::INVALID_CONTEXT => {
                "no CUDA context is current on this thread: make the context of the stream you \
                 launch on current first (`cuCtxPushCurrent` with a device-access scope's \
                 `stream().context()`, popped after the launch)"
            }
            code::OUT_OF_MEMORY => {
                "the device is out of memory: free memories, or cap tenants so their sum fits"
            }
            code::ILLEGAL_ADDRESS
            | code::ASSERT
            | code::LAUNCH_FAILED
            | code::MISALIGNED_ADDRESS
            | code::ILLEGAL_INSTRUCTION
            | code::HARDWARE_STACK_ERROR
            | code::INVALID_ADDRESS_SPACE
            | code::INVALID_PC => {
                "a kernel faulted: the error is sticky for its context, whose work is lost; drop \
                 the Stores whose state lived there, and the device is recovered (its primary \
                 context reset: docs/SAFETY.md section 6b)"
            }
            code::NOT_INITIALIZED | code::DEINITIALIZED => {
                "the driver is not initialised (or is shutting down): start the backend first"
            }
            _ => return None,
        })
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{} failed: {name} ({})", self.call, self.code)?,
            None => write!(
                f,
                "{} failed: CUresult {} (a code this build does not name)",
                self.call, self.code
            )?,
        }
        match self.hint() {
            Some(hint) => write!(f, "; {hint}"),
            None => Ok(()),
        }
    }
}

impl fmt::Debug for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let code = match self.name() {
            Some(name) => format!("{} ({name})", self.code),
            None => self.code.to_string(),
        };
        f.debug_struct("CudaError")
            .field("call", &self.call)
            .field("code", &format_args!("{code}"))
            .finish()
    }
}

impl std::error::Error for CudaError {}
