//! The `increment` PTX kernel and its launcher, shared by the GPU kit's zero-copy step and the
//! `scope_kernel` example. On a GPU the PTX runs; on the simulated libcuda the module loads and
//! the simulator's host kernel of the same name runs.

use std::ffi::{CString, c_void};

use cudarc::driver::sys;

/// Adds one to each byte of `data[0..len]`, one thread per byte.
pub const INCREMENT_PTX: &str = r#"
.version 7.0
.target sm_75
.address_size 64

.visible .entry increment(
    .param .u64 data,
    .param .u64 len
)
{
    .reg .pred  %p<2>;
    .reg .b16   %rs<3>;
    .reg .b32   %r<5>;
    .reg .b64   %rd<6>;

    ld.param.u64        %rd1, [data];
    ld.param.u64        %rd2, [len];
    mov.u32             %r1, %ctaid.x;
    mov.u32             %r2, %ntid.x;
    mov.u32             %r3, %tid.x;
    mad.lo.s32          %r4, %r1, %r2, %r3;
    cvt.u64.u32         %rd3, %r4;
    setp.ge.u64         %p1, %rd3, %rd2;
    @%p1 bra            DONE;
    cvta.to.global.u64  %rd4, %rd1;
    add.s64             %rd5, %rd4, %rd3;
    ld.global.u8        %rs1, [%rd5];
    add.s16             %rs2, %rs1, 1;
    st.global.u8        [%rd5], %rs2;
DONE:
    ret;
}
"#;

fn check(call: &str, result: sys::CUresult) -> Result<(), String> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {result:?}"))
    }
}

/// Launches the increment kernel on `data..data + len`, ordered on `stream`, and waits (the
/// module is unloaded after, which must not happen while its kernel runs), with `context` pushed
/// current for the call and popped after: the caller's context stack is left as it was. A
/// device-access scope's own wait at close is then already satisfied; the mock's deferred
/// streams test that wait.
pub fn launch_increment(data: u64, len: u64, stream: u64, context: u64) -> Result<(), String> {
    let ptx = CString::new(INCREMENT_PTX).map_err(|e| e.to_string())?;
    let name = CString::new("increment").map_err(|e| e.to_string())?;
    // SAFETY: a live context of the backend (the stream's).
    check("cuCtxPushCurrent", unsafe {
        sys::cuCtxPushCurrent_v2(context as sys::CUcontext)
    })?;
    let launched = load_and_launch(&ptx, &name, data, len, stream);
    let mut popped: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: pops what was pushed above; `popped` is a valid out-pointer.
    let popped = check("cuCtxPopCurrent", unsafe {
        sys::cuCtxPopCurrent_v2(&mut popped)
    });
    launched.and(popped)
}

fn load_and_launch(
    ptx: &CString,
    name: &CString,
    data: u64,
    len: u64,
    stream: u64,
) -> Result<(), String> {
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `module` is a valid out-pointer; `ptx` is a NUL-terminated PTX image.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast())
    })?;
    let mut function: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: `module` was just loaded; `name` is a NUL-terminated string.
    let got = check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut function, module, name.as_ptr())
    });
    let launched = got.and_then(|()| {
        let (mut data, mut len) = (data, len);
        let mut params = [
            (&raw mut data).cast::<c_void>(),
            (&raw mut len).cast::<c_void>(),
        ];
        let blocks = len.div_ceil(256) as u32;
        // SAFETY: the kernel takes two u64 parameters, passed by address; the range lies inside
        // the guest's live memory (resolved and checked by the creator); the stream is live.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                blocks,
                1,
                1,
                256,
                1,
                1,
                0,
                stream as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        // SAFETY: a live stream of the backend.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream as sys::CUstream)
        })
    });
    // SAFETY: the module is not used after this.
    let _ = unsafe { sys::cuModuleUnload(module) };
    launched
}
