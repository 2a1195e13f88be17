//! The `increment` PTX kernel and its launcher, shared by the GPU kit's zero-copy step and the
//! `scope_kernel` example. On a GPU the PTX runs; on the simulated libcuda the module loads and
//! the simulator's host kernel of the same name runs.

use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::OnceLock;

use tensor_wasm_mem_cuda::code;

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

/// `y[i] = a * x[i] + y[i]` over `n` floats, one thread per element: the `saxpy` a C guest
/// launches (tests/guests/saxpy.c), as the embedder's own PTX.
pub const AXPY_PTX: &str = r#"
.version 7.0
.target sm_75
.address_size 64

.visible .entry axpy(
    .param .f32 a,
    .param .u64 x,
    .param .u64 y,
    .param .u64 n
)
{
    .reg .pred  %p<2>;
    .reg .f32   %f<5>;
    .reg .b32   %r<5>;
    .reg .b64   %rd<9>;

    ld.param.f32        %f1, [a];
    ld.param.u64        %rd1, [x];
    ld.param.u64        %rd2, [y];
    ld.param.u64        %rd3, [n];
    mov.u32             %r1, %ctaid.x;
    mov.u32             %r2, %ntid.x;
    mov.u32             %r3, %tid.x;
    mad.lo.s32          %r4, %r1, %r2, %r3;
    cvt.u64.u32         %rd4, %r4;
    setp.ge.u64         %p1, %rd4, %rd3;
    @%p1 bra            DONE;
    cvta.to.global.u64  %rd5, %rd1;
    cvta.to.global.u64  %rd6, %rd2;
    shl.b64             %rd7, %rd4, 2;
    add.s64             %rd8, %rd5, %rd7;
    ld.global.f32       %f2, [%rd8];
    add.s64             %rd8, %rd6, %rd7;
    ld.global.f32       %f3, [%rd8];
    fma.rn.f32          %f4, %f1, %f2, %f3;
    st.global.f32       [%rd8], %f4;
DONE:
    ret;
}
"#;

/// Launches `axpy(a, x, y, n)` over `n` floats at device pointers `x` and `y`, ordered on
/// `stream` of `context`, and waits (as [`launch_increment`]).
pub fn launch_axpy(
    a: f32,
    (x, y): (u64, u64),
    n: u64,
    (stream, context): (u64, u64),
) -> Result<(), String> {
    let ptx = CString::new(AXPY_PTX).map_err(|e| e.to_string())?;
    let (mut a, mut x, mut y, mut count) = (a, x, y, n);
    let mut params = [
        (&raw mut a).cast::<c_void>(),
        (&raw mut x).cast::<c_void>(),
        (&raw mut y).cast::<c_void>(),
        (&raw mut count).cast::<c_void>(),
    ];
    let launch = Launch {
        image: &ptx,
        name: c"axpy",
        blocks: u32::try_from(n.div_ceil(256)).map_err(|e| e.to_string())?,
        threads: 256,
        stream,
        context,
        wait: true,
    };
    // SAFETY: the kernel takes an f32 and three u64 parameters, passed by address; `x` and `y`
    // hold `n` floats each inside the guest's live memory (resolved and checked by the creator);
    // the stream is live.
    unsafe { launch.run(&mut params) }
}

type Handle = *mut c_void;

/// The entry points the launcher and the event helper call, with raw-integer results (cudarc's enum-typed
/// signatures would make a `CUresult` its enum does not know undefined behaviour).
#[derive(Debug)]
pub struct Raw {
    push: unsafe extern "C" fn(Handle) -> u32,
    pop: unsafe extern "C" fn(*mut Handle) -> u32,
    load: unsafe extern "C" fn(*mut Handle, *const c_void) -> u32,
    get: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> u32,
    #[allow(clippy::type_complexity)]
    launch: unsafe extern "C" fn(
        Handle,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        Handle,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> u32,
    sync: unsafe extern "C" fn(Handle) -> u32,
    unload: unsafe extern "C" fn(Handle) -> u32,
    event_create: unsafe extern "C" fn(*mut Handle, u32) -> u32,
    event_record: unsafe extern "C" fn(Handle, Handle) -> u32,
    wait_event: unsafe extern "C" fn(Handle, Handle, u32) -> u32,
    event_destroy: unsafe extern "C" fn(Handle) -> u32,
}

/// The driver the process loaded (`libcuda.so.1`: the backend loaded it first), kept for good.
fn raw() -> Result<&'static Raw, String> {
    static RAW: OnceLock<Result<Raw, String>> = OnceLock::new();
    RAW.get_or_init(|| {
        // SAFETY: the CUDA driver the backend already loaded; loading it again runs nothing.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| e.to_string())?;
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the driver's entry point of that name, with its C signature.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{}: {e}", $name))?
            };
        }
        Ok(Raw {
            push: sym!("cuCtxPushCurrent_v2"),
            pop: sym!("cuCtxPopCurrent_v2"),
            load: sym!("cuModuleLoadData"),
            get: sym!("cuModuleGetFunction"),
            launch: sym!("cuLaunchKernel"),
            sync: sym!("cuStreamSynchronize"),
            unload: sym!("cuModuleUnload"),
            event_create: sym!("cuEventCreate"),
            event_record: sym!("cuEventRecord"),
            wait_event: sym!("cuStreamWaitEvent"),
            event_destroy: sym!("cuEventDestroy_v2"),
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Runs `f` with `context` pushed on the calling thread's context stack, and pops it after
/// (the stack is left as it was): `f`'s error first, else the pop's.
pub fn in_context<T>(context: u64, f: impl FnOnce(&Raw) -> Result<T, String>) -> Result<T, String> {
    let raw = raw()?;
    // SAFETY: a live context (the driver checks it).
    check("cuCtxPushCurrent", unsafe {
        (raw.push)(context as usize as Handle)
    })?;
    let result = f(raw);
    let mut popped: Handle = std::ptr::null_mut();
    // SAFETY: pops what was pushed above; `popped` is a valid out-pointer.
    let popped = check("cuCtxPopCurrent", unsafe { (raw.pop)(&mut popped) });
    let value = result?;
    popped.map(|()| value)
}

/// Records an event on `from` (of `from_context`) and makes `to` (of `to_context`) wait for it:
/// `to`'s later work runs after `from`'s work so far. The event belongs to the recording
/// stream's context (made and recorded there) and is destroyed after (a queued wait still
/// completes).
pub fn event_between(from_context: u64, from: u64, to_context: u64, to: u64) -> Result<(), String> {
    let (from, to) = (from as usize as Handle, to as usize as Handle);
    let event = in_context(from_context, |raw| {
        let mut event: Handle = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check("cuEventCreate", unsafe {
            (raw.event_create)(&mut event, 0)
        })?;
        // SAFETY: live handles (the driver checks them).
        let recorded = check("cuEventRecord", unsafe { (raw.event_record)(event, from) });
        Ok((event, recorded))
    })?;
    let (event, recorded) = event;
    let waited = recorded.and_then(|()| {
        in_context(to_context, |raw| {
            // SAFETY: live handles (the driver checks them).
            check("cuStreamWaitEvent", unsafe {
                (raw.wait_event)(to, event, 0)
            })
        })
    });
    let raw = raw()?;
    // SAFETY: made above, destroyed once.
    let destroyed = check("cuEventDestroy", unsafe { (raw.event_destroy)(event) });
    waited.and(destroyed)
}

fn check(call: &str, result: u32) -> Result<(), String> {
    if result == code::SUCCESS {
        Ok(())
    } else {
        let name = code::name(result).unwrap_or("a code this build does not name");
        Err(format!("{call} failed: {name} ({result})"))
    }
}

/// Launches the increment kernel on `data..data + len`, ordered on `stream`, and waits (the
/// module is unloaded after, which must not happen while its kernel runs), with `context` pushed
/// current for the call and popped after: the caller's context stack is left as it was. A
/// device-access scope's own wait at close is then already satisfied; the mock's deferred
/// streams test that wait.
pub fn launch_increment(data: u64, len: u64, stream: u64, context: u64) -> Result<(), String> {
    let ptx = CString::new(INCREMENT_PTX).map_err(|e| e.to_string())?;
    let (mut data, mut count) = (data, len);
    let mut params = [
        (&raw mut data).cast::<c_void>(),
        (&raw mut count).cast::<c_void>(),
    ];
    let launch = Launch {
        image: &ptx,
        name: c"increment",
        blocks: len.div_ceil(256) as u32,
        threads: 256,
        stream,
        context,
        wait: true,
    };
    // SAFETY: the kernel takes two u64 parameters, passed by address; the range lies inside the
    // guest's live memory (resolved and checked by the creator); the stream is live.
    unsafe { launch.run(&mut params) }
}

/// One kernel launch through the driver the process loaded: load `image`, get `name`, launch
/// it on `stream` of `context` (pushed for the call, popped after), wait if asked, unload.
#[derive(Debug)]
pub struct Launch<'a> {
    /// The module image (PTX; the simulator accepts any).
    pub image: &'a CStr,
    /// The kernel's name.
    pub name: &'a CStr,
    /// Blocks in the grid.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
    /// The stream (0: the context's default stream).
    pub stream: u64,
    /// The stream's context.
    pub context: u64,
    /// Wait for the stream after the launch.
    pub wait: bool,
}

impl Launch<'_> {
    /// Runs the launch with `params` (one pointer per kernel parameter, to its value).
    ///
    /// # Safety
    ///
    /// `params` must match the kernel's parameters; when the kernel runs, nothing else may
    /// access the memory it touches.
    pub unsafe fn run(&self, params: &mut [*mut c_void]) -> Result<(), String> {
        // SAFETY: the caller's contract.
        in_context(self.context, |raw| unsafe {
            self.load_and_launch(raw, params)
        })
    }

    /// # Safety
    ///
    /// As [`run`](Self::run).
    unsafe fn load_and_launch(&self, raw: &Raw, params: &mut [*mut c_void]) -> Result<(), String> {
        let stream = self.stream as usize as Handle;
        let mut module: Handle = std::ptr::null_mut();
        // SAFETY: `module` is a valid out-pointer; `image` is NUL-terminated.
        check("cuModuleLoadData", unsafe {
            (raw.load)(&mut module, self.image.as_ptr().cast())
        })?;
        let mut function: Handle = std::ptr::null_mut();
        // SAFETY: `module` was just loaded; `name` is a NUL-terminated string.
        let got = check("cuModuleGetFunction", unsafe {
            (raw.get)(&mut function, module, self.name.as_ptr())
        });
        let launched = got.and_then(|()| {
            // SAFETY: the caller's contract (parameters, memory); the stream is live.
            check("cuLaunchKernel", unsafe {
                (raw.launch)(
                    function,
                    self.blocks,
                    1,
                    1,
                    self.threads,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            })?;
            if self.wait {
                // SAFETY: a live stream.
                check("cuStreamSynchronize", unsafe { (raw.sync)(stream) })
            } else {
                Ok(())
            }
        });
        // SAFETY: the module is not used after this (a queued launch keeps its kernel).
        let _ = unsafe { (raw.unload)(module) };
        launched
    }
}
