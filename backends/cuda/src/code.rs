//! `CUresult` values the workspace names (the driver's integers): one table, shared by the CUDA
//! backends, the driver model and the simulated libcuda. A code not listed is still a valid
//! answer of a driver (a newer CUDA's): it is carried as an integer, never as an enum.

/// `CUDA_SUCCESS`.
pub const SUCCESS: u32 = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const INVALID_VALUE: u32 = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const OUT_OF_MEMORY: u32 = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const NOT_INITIALIZED: u32 = 3;
/// `CUDA_ERROR_DEINITIALIZED`.
pub const DEINITIALIZED: u32 = 4;
/// `CUDA_ERROR_INVALID_IMAGE`.
pub const INVALID_IMAGE: u32 = 200;
/// `CUDA_ERROR_INVALID_PTX`.
pub const INVALID_PTX: u32 = 218;
/// `CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`.
pub const LAUNCH_OUT_OF_RESOURCES: u32 = 701;
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED`.
pub const CONTEXT_IS_DESTROYED: u32 = 709;
/// `CUDA_ERROR_NO_DEVICE`.
pub const NO_DEVICE: u32 = 100;
/// `CUDA_ERROR_INVALID_DEVICE`.
pub const INVALID_DEVICE: u32 = 101;
/// `CUDA_ERROR_INVALID_CONTEXT`.
pub const INVALID_CONTEXT: u32 = 201;
/// `CUDA_ERROR_INVALID_HANDLE`.
pub const INVALID_HANDLE: u32 = 400;
/// `CUDA_ERROR_NOT_FOUND`.
pub const NOT_FOUND: u32 = 500;
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
pub const HOST_MEMORY_ALREADY_REGISTERED: u32 = 712;
/// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
pub const HOST_MEMORY_NOT_REGISTERED: u32 = 713;
/// `CUDA_ERROR_ILLEGAL_ADDRESS`: sticky for the context, as on a GPU.
pub const ILLEGAL_ADDRESS: u32 = 700;
/// `CUDA_ERROR_ASSERT`: a device-side assert; sticky.
pub const ASSERT: u32 = 710;
/// `CUDA_ERROR_HARDWARE_STACK_ERROR`: sticky.
pub const HARDWARE_STACK_ERROR: u32 = 714;
/// `CUDA_ERROR_ILLEGAL_INSTRUCTION`: sticky.
pub const ILLEGAL_INSTRUCTION: u32 = 715;
/// `CUDA_ERROR_MISALIGNED_ADDRESS`: sticky.
pub const MISALIGNED_ADDRESS: u32 = 716;
/// `CUDA_ERROR_INVALID_ADDRESS_SPACE`: sticky.
pub const INVALID_ADDRESS_SPACE: u32 = 717;
/// `CUDA_ERROR_INVALID_PC`: sticky.
pub const INVALID_PC: u32 = 718;
/// `CUDA_ERROR_LAUNCH_FAILED`: an exception while a kernel ran; sticky.
pub const LAUNCH_FAILED: u32 = 719;
/// `CUDA_ERROR_NOT_READY`.
pub const NOT_READY: u32 = 600;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const NOT_SUPPORTED: u32 = 801;
/// `CUDA_ERROR_UNKNOWN`.
pub const UNKNOWN: u32 = 999;

/// The name and description of a code the model answers (what `cuGetErrorName` and
/// `cuGetErrorString` give); `None` for any other.
#[must_use]
pub fn describe(code: u32) -> Option<(&'static core::ffi::CStr, &'static core::ffi::CStr)> {
    Some(match code {
        SUCCESS => (c"CUDA_SUCCESS", c"no error"),
        INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        NOT_INITIALIZED => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        DEINITIALIZED => (c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
        INVALID_IMAGE => (
            c"CUDA_ERROR_INVALID_IMAGE",
            c"device kernel image is invalid",
        ),
        INVALID_PTX => (c"CUDA_ERROR_INVALID_PTX", c"a PTX JIT compilation failed"),
        LAUNCH_OUT_OF_RESOURCES => (
            c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            c"too many resources requested for launch",
        ),
        CONTEXT_IS_DESTROYED => (c"CUDA_ERROR_CONTEXT_IS_DESTROYED", c"context is destroyed"),
        NO_DEVICE => (
            c"CUDA_ERROR_NO_DEVICE",
            c"no CUDA-capable device is detected",
        ),
        INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        INVALID_CONTEXT => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        NOT_FOUND => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        NOT_READY => (c"CUDA_ERROR_NOT_READY", c"device not ready"),
        ILLEGAL_ADDRESS => (
            c"CUDA_ERROR_ILLEGAL_ADDRESS",
            c"an illegal memory access was encountered",
        ),
        HOST_MEMORY_ALREADY_REGISTERED => (
            c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            c"part or all of the requested memory range is already mapped",
        ),
        HOST_MEMORY_NOT_REGISTERED => (
            c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
            c"pointer does not correspond to a registered memory region",
        ),
        NOT_SUPPORTED => (c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
        ASSERT => (c"CUDA_ERROR_ASSERT", c"device-side assert triggered"),
        HARDWARE_STACK_ERROR => (
            c"CUDA_ERROR_HARDWARE_STACK_ERROR",
            c"an illegal memory access was encountered on the hardware stack",
        ),
        ILLEGAL_INSTRUCTION => (
            c"CUDA_ERROR_ILLEGAL_INSTRUCTION",
            c"an illegal instruction was encountered",
        ),
        MISALIGNED_ADDRESS => (c"CUDA_ERROR_MISALIGNED_ADDRESS", c"misaligned address"),
        INVALID_ADDRESS_SPACE => (
            c"CUDA_ERROR_INVALID_ADDRESS_SPACE",
            c"operation not supported on global/shared address space",
        ),
        INVALID_PC => (c"CUDA_ERROR_INVALID_PC", c"invalid program counter"),
        LAUNCH_FAILED => (c"CUDA_ERROR_LAUNCH_FAILED", c"unspecified launch failure"),
        UNKNOWN => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
        _ => return None,
    })
}

/// The name of a code (`CUDA_ERROR_...`), if the table has it.
#[must_use]
pub fn name(code: u32) -> Option<&'static str> {
    describe(code).and_then(|(name, _)| name.to_str().ok())
}

/// The [`ErrorKind`](tensor_wasm_mem_core::ErrorKind) of a code: out of memory, an invalid
/// argument (value, device, context, handle), no device, unsupported, a context lost to a
/// kernel fault (the sticky codes: an illegal address, a misaligned address, an illegal
/// instruction, a hardware stack error, an invalid address space or program counter, a failed
/// launch, a device-side assert); any other code (one this table does not name included) is a
/// driver failure.
#[must_use]
pub const fn kind(code: u32) -> tensor_wasm_mem_core::ErrorKind {
    use tensor_wasm_mem_core::ErrorKind;
    match code {
        OUT_OF_MEMORY => ErrorKind::OutOfMemory,
        INVALID_VALUE | INVALID_DEVICE | INVALID_CONTEXT | INVALID_HANDLE => {
            ErrorKind::InvalidArgument
        }
        NO_DEVICE => ErrorKind::NoDevice,
        NOT_SUPPORTED => ErrorKind::Unsupported,
        ILLEGAL_ADDRESS
        | ASSERT
        | HARDWARE_STACK_ERROR
        | ILLEGAL_INSTRUCTION
        | MISALIGNED_ADDRESS
        | INVALID_ADDRESS_SPACE
        | INVALID_PC
        | LAUNCH_FAILED => ErrorKind::ContextLost,
        _ => ErrorKind::Driver,
    }
}

#[cfg(test)]
mod tests {
    use tensor_wasm_mem_core::ErrorKind;

    use super::*;

    #[test]
    fn codes_map_to_kinds_and_names() {
        assert_eq!(kind(OUT_OF_MEMORY), ErrorKind::OutOfMemory);
        assert_eq!(kind(INVALID_VALUE), ErrorKind::InvalidArgument);
        for sticky in [ILLEGAL_ADDRESS, LAUNCH_FAILED, MISALIGNED_ADDRESS, ASSERT] {
            assert_eq!(kind(sticky), ErrorKind::ContextLost, "{sticky}");
        }
        assert_eq!(kind(INVALID_HANDLE), ErrorKind::InvalidArgument);
        assert_eq!(kind(NO_DEVICE), ErrorKind::NoDevice);
        assert_eq!(kind(NOT_SUPPORTED), ErrorKind::Unsupported);
        assert_eq!(kind(UNKNOWN), ErrorKind::Driver);
        assert_eq!(kind(4242), ErrorKind::Driver);
        assert_eq!(name(ILLEGAL_ADDRESS), Some("CUDA_ERROR_ILLEGAL_ADDRESS"));
        assert_eq!(name(4242), None);
    }
}
