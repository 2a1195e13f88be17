//! The simulated libcuda, seen from the tests: where it is, and its knobs.

use std::ffi::{CString, c_char};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

/// `CUresult` values: the model's (one table, shared by the model, the simulator and the tests).
pub use tensor_wasm_mem_model::code;
pub use tensor_wasm_mem_model::shell::{SimConfig, SimHints, SimStats};

/// The simulator built by `build.rs` (SONAME `libcuda.so.1`).
pub const SIM_PATH: &str = env!("TWM_CUDA_SIM_PATH");

/// A build of the simulator without `cuMemPrefetchAsync_v2` (for the missing-symbol test).
pub const SIM_WITHOUT_PREFETCH_PATH: &str = env!("TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH");

/// What loads by the driver's name in this process.
enum ByName {
    /// Nothing: no driver on this machine.
    Nothing,
    /// The simulator (linked in by a backend that links libcuda, or preloaded).
    Simulator(libloading::Library),
    /// A real driver.
    Real,
}

fn by_name() -> ByName {
    for name in ["libcuda.so.1", "libcuda.so"] {
        // SAFETY: loading the driver library runs its initialisers; nothing is called.
        if let Ok(lib) = unsafe { libloading::Library::new(name) } {
            // SAFETY: only looks a symbol up.
            let simulated = unsafe { lib.get::<unsafe extern "C" fn()>("twm_sim_reset") }.is_ok();
            return if simulated {
                ByName::Simulator(lib)
            } else {
                ByName::Real
            };
        }
    }
    ByName::Nothing
}

/// `true` when a real CUDA driver loads by name in this process: then the driver backends run
/// on it, and the simulator's knobs are not used.
pub fn real_driver() -> bool {
    matches!(by_name(), ByName::Real)
}

/// The knobs of the loaded simulator.
pub struct Sim {
    lib: libloading::Library,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sim")
    }
}

impl Sim {
    /// The simulator this process uses (once loaded, for good), or `None` on a machine with a
    /// real driver. A simulator already loaded under the driver's name (by a backend that links
    /// libcuda) is the one used, so the knobs act on the driver the backends call.
    pub fn get() -> Option<&'static Sim> {
        static SIM: OnceLock<Option<Sim>> = OnceLock::new();
        SIM.get_or_init(|| match by_name() {
            ByName::Real => None,
            ByName::Simulator(lib) => Some(Sim { lib }),
            ByName::Nothing => {
                // SAFETY: the simulator's initialisers are Rust statics; loading runs nothing
                // else.
                let lib = unsafe { libloading::Library::new(SIM_PATH) }
                    .unwrap_or_else(|e| panic!("loading the simulated libcuda {SIM_PATH}: {e}"));
                Some(Sim { lib })
            }
        })
        .as_ref()
    }

    fn f<T: Copy>(&self, name: &str) -> T {
        // SAFETY: each knob is looked up with its exact C signature (see cuda-sim/src/lib.rs).
        *unsafe { self.lib.get::<T>(name) }.unwrap_or_else(|e| panic!("simulator knob {name}: {e}"))
    }

    /// Sets the machine (devices, attributes) for the next `cuInit` after [`reset`](Self::reset).
    pub fn configure(&self, config: &SimConfig) {
        let f: unsafe extern "C" fn(*const SimConfig) -> u32 = self.f("twm_sim_configure");
        // SAFETY: `config` is a valid pointer for the call.
        assert_eq!(unsafe { f(config) }, 0);
    }

    /// Forgets everything: a fresh machine at the next `cuInit`.
    pub fn reset(&self) {
        let f: extern "C" fn() = self.f("twm_sim_reset");
        f();
    }

    /// The counters.
    pub fn stats(&self) -> SimStats {
        let f: unsafe extern "C" fn(*mut SimStats) -> u32 = self.f("twm_sim_stats");
        let mut stats = SimStats::default();
        // SAFETY: `stats` is a valid out-pointer.
        assert_eq!(unsafe { f(&mut stats) }, 0);
        stats
    }

    /// The advice and residency in force at `ptr` (`None`: not in a live managed allocation).
    pub fn hints(&self, ptr: u64) -> Option<SimHints> {
        let f: unsafe extern "C" fn(u64, *mut SimHints) -> u32 = self.f("twm_sim_hints");
        let mut hints = SimHints {
            read_mostly: 0,
            preferred: SimHints::NONE,
            accessed_by: 0,
            resident: SimHints::NONE,
        };
        // SAFETY: `hints` is a valid out-pointer.
        (unsafe { f(ptr, &mut hints) } == 0).then_some(hints)
    }

    /// Makes the `nth` call of `entry_point` from now return `error`.
    pub fn fail_nth(&self, entry_point: &str, nth: u64, error: u32) {
        let f: unsafe extern "C" fn(*const c_char, u64, u32) -> u32 = self.f("twm_sim_fail_nth");
        let name = CString::new(entry_point).expect("no NUL in entry point names");
        // SAFETY: `name` is a valid C string for the call.
        let result = unsafe { f(name.as_ptr(), nth, error) };
        assert_eq!(result, 0, "fail_nth({entry_point})");
    }

    /// Holds the next call of `entry_point` after it took effect (the simulator unlocked)
    /// until [`release_held`](Self::release_held).
    pub fn hold_next(&self, entry_point: &str) {
        let f: unsafe extern "C" fn(*const c_char) -> u32 = self.f("twm_sim_hold_next");
        let name = CString::new(entry_point).expect("no NUL in entry point names");
        // SAFETY: `name` is a valid C string for the call.
        assert_eq!(unsafe { f(name.as_ptr()) }, 0);
    }

    /// Waits until a call of `entry_point` is held; `false` if none was within `limit_ms`.
    pub fn wait_held(&self, entry_point: &str, limit_ms: u64) -> bool {
        let f: unsafe extern "C" fn(*const c_char, u64) -> u32 = self.f("twm_sim_wait_held");
        let name = CString::new(entry_point).expect("no NUL in entry point names");
        // SAFETY: `name` is a valid C string for the call.
        unsafe { f(name.as_ptr(), limit_ms) == 0 }
    }

    /// Lets a held call of `entry_point` return.
    pub fn release_held(&self, entry_point: &str) {
        let f: unsafe extern "C" fn(*const c_char) -> u32 = self.f("twm_sim_release_held");
        let name = CString::new(entry_point).expect("no NUL in entry point names");
        // SAFETY: `name` is a valid C string for the call.
        assert_eq!(unsafe { f(name.as_ptr()) }, 0);
    }

    /// The calling thread's context stack: its depth and its top (0: none current).
    pub fn context_stack(&self) -> (u64, u64) {
        let depth: extern "C" fn() -> u64 = self.f("twm_sim_context_depth");
        let current: unsafe extern "C" fn(*mut usize) -> u32 = self.f("cuCtxGetCurrent");
        let mut top = 0usize;
        // SAFETY: `top` is a valid out-pointer for a context handle.
        let code = unsafe { current(&mut top) };
        (depth(), if code == 0 { top as u64 } else { 0 })
    }

    /// Pushes `context` on the calling thread's context stack (as an embedder's own code would).
    pub fn push_context(&self, context: u64) {
        let push: unsafe extern "C" fn(usize) -> u32 = self.f("cuCtxPushCurrent_v2");
        // SAFETY: the simulator checks the handle.
        assert_eq!(unsafe { push(context as usize) }, 0, "push {context:#x}");
    }

    /// Pops the calling thread's context stack.
    pub fn pop_context(&self) {
        let pop: unsafe extern "C" fn(*mut usize) -> u32 = self.f("cuCtxPopCurrent_v2");
        let mut popped = 0usize;
        // SAFETY: `popped` is a valid out-pointer.
        assert_eq!(unsafe { pop(&mut popped) }, 0, "pop");
    }

    /// Clears pending injected failures.
    pub fn clear_faults(&self) {
        let f: extern "C" fn() = self.f("twm_sim_clear_faults");
        f();
    }

    /// Launches the simulated `fill(data, len, value)` kernel on `stream` of `context` (loaded
    /// through `cuModuleLoadData` / `cuModuleGetFunction` / `cuLaunchKernel`, as a guest's
    /// embedder would): queued, it lands when the stream gets to it.
    ///
    /// # Safety
    ///
    /// When the kernel runs, nothing else may access `ptr..ptr + len`.
    pub unsafe fn launch_fill(
        &self,
        context: u64,
        stream: u64,
        ptr: u64,
        len: u64,
        byte: u8,
    ) -> Result<(), String> {
        let (mut data, mut count, mut value) = (ptr, len, u32::from(byte));
        let mut params = [
            (&raw mut data).cast::<std::ffi::c_void>(),
            (&raw mut count).cast(),
            (&raw mut value).cast(),
        ];
        let launch = crate::kernels::Launch {
            image: c"simulated",
            name: c"fill",
            blocks: 1,
            threads: 1,
            stream,
            context,
            wait: false,
        };
        // SAFETY: `fill` takes (u64, u64, u32), passed by address; the range's exclusivity is
        // the caller's contract.
        unsafe { launch.run(&mut params) }
    }

    /// Calls of `entry_point` so far.
    pub fn calls(&self, entry_point: &str) -> u64 {
        let f: unsafe extern "C" fn(*const c_char) -> u64 = self.f("twm_sim_calls");
        let name = CString::new(entry_point).expect("no NUL in entry point names");
        // SAFETY: `name` is a valid C string for the call.
        unsafe { f(name.as_ptr()) }
    }
}

/// Serialises the tests that use the process-wide driver: the first call on a thread takes a
/// process-wide lock, held until the thread (one test) ends.
pub fn exclusive() {
    static LOCK: Mutex<()> = Mutex::new(());
    thread_local! {
        static HELD: std::cell::RefCell<Option<MutexGuard<'static, ()>>> =
            const { std::cell::RefCell::new(None) };
    }
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        if held.is_none() {
            *held = Some(LOCK.lock().unwrap_or_else(PoisonError::into_inner));
        }
    });
}
