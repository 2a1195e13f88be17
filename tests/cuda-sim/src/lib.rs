//! A simulated CUDA driver (`libcuda.so.1`): a thin C-ABI shell over the one model of the
//! driver's rules, [`tensor_wasm_mem_model::ModelDriver`]. Every rule (contexts and their
//! per-thread stacks, managed memory, streams whose work completes later than the call, events,
//! pools, kernels, sticky illegal-address faults, host registration, pageable memory access),
//! every table and every counter is the model's; this crate only turns C arguments into model
//! calls and model answers into `CUresult` integers. The mock backend runs `DriverBackend` over
//! the same model, so the mock, cudarc and cust backends cannot disagree about the driver.
//!
//! What the shell itself keeps: whether `cuInit` ran (`CUDA_ERROR_NOT_INITIALIZED` before it),
//! the device attributes the model does not have (`CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY`, the
//! compute capability, the name), primary-context reference counts, and the counters and
//! injected failures of the entry points the model has no call for (`cuInit`, device queries).
//!
//! Knobs (exported `twm_sim_*` functions, see [`SimConfig`] and [`SimStats`]): the machine's
//! shape (devices, memory, attributes, deferred streams), failure injection by entry point (any
//! non-zero code, including codes no CUDA enum knows), held calls, call counts, hints, counters.
//!
//! Built as a cdylib with SONAME `libcuda.so.1` by the tests crate's build script
//! (`tests/build.rs`). Its file is never named `libcuda.so`
//! inside `target/`, where it could shadow a real driver.

use std::collections::BTreeMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tensor_wasm_mem_core::{
    Advice, DeviceId, DriverApi, DriverContext, DriverPool, DriverStream, Location,
};
use tensor_wasm_mem_model::{
    Call, Event, Function, Kernel, ModelConfig, ModelDriver, ModelError, Module,
};

pub use tensor_wasm_mem_model::code;
pub use tensor_wasm_mem_model::shell::{SimConfig, SimHints, SimStats};

// The one table of attribute numbers, location kinds and structures: backends/cuda's.
use tensor_wasm_mem_cuda::attr;
use tensor_wasm_mem_cuda::location::{
    DEVICE as LOCATION_DEVICE, DEVICE_CPU as CU_DEVICE_CPU, HOST as LOCATION_HOST,
    HOST_NUMA as LOCATION_HOST_NUMA, HOST_NUMA_CURRENT as LOCATION_HOST_NUMA_CURRENT,
};
pub use tensor_wasm_mem_cuda::{MemLocation, MemPoolProps};

/// Every entry point of the one list (`__cuda_entries!` in backends/cuda) is exported here with
/// the declared signature, and named in [`ENTRY_POINTS`] (so faults can be injected in it):
/// checked when this crate compiles, so an entry point added there and not here (or with another
/// signature) is a build error, not a test that fails at run time.
macro_rules! exported_as_listed {
    ($($group:ident { $($name:ident($($arg:ty),*);)* })*) => {
        $($(
            const _: unsafe extern "C" fn($($arg),*) -> u32 = $name;
            const _: () = assert!(
                listed(stringify!($name)),
                concat!(stringify!($name), " is exported but missing from ENTRY_POINTS")
            );
        )*)*
    };
}

/// Whether `name` is in [`ENTRY_POINTS`] (at compile time).
const fn listed(name: &str) -> bool {
    let mut i = 0;
    while i < ENTRY_POINTS.len() {
        let (a, b) = (ENTRY_POINTS[i].as_bytes(), name.as_bytes());
        if a.len() == b.len() {
            let mut j = 0;
            while j < a.len() && a[j] == b[j] {
                j += 1;
            }
            if j == a.len() {
                return true;
            }
        }
        i += 1;
    }
    false
}
tensor_wasm_mem_cuda::__cuda_entries!(exported_as_listed);

// And the advice and prefetch forms of `HintEntries`.
const _: unsafe extern "C" fn(u64, usize, u32, MemLocation) -> u32 = cuMemAdvise_v2;
const _: unsafe extern "C" fn(u64, usize, u32, c_int) -> u32 = cuMemAdvise;
#[cfg(not(feature = "without-prefetch"))]
const _: unsafe extern "C" fn(u64, usize, MemLocation, u32, tensor_wasm_mem_cuda::Handle) -> u32 =
    cuMemPrefetchAsync_v2;
#[cfg(not(feature = "without-prefetch"))]
const _: unsafe extern "C" fn(u64, usize, c_int, tensor_wasm_mem_cuda::Handle) -> u32 =
    cuMemPrefetchAsync;

/// One simulated machine: the model, and what the shell keeps beside it.
#[derive(Debug)]
struct Machine {
    driver: ModelDriver,
    config: SimConfig,
    /// Primary-context references retained, per device.
    primary_refs: Mutex<Vec<u64>>,
}

/// The process-wide shell state.
#[derive(Debug)]
struct Shell {
    config: SimConfig,
    /// The machine `cuInit` started (`None` before it and after a reset).
    machine: Option<Arc<Machine>>,
    /// Calls of entry points the model has no call for, by name.
    calls: BTreeMap<String, u64>,
    /// Injected failures of those.
    faults: Vec<Fault>,
    /// Every entry-point call, and those that returned an error.
    total_calls: u64,
    failed_calls: u64,
    /// Failures the shell injected (the model counts its own).
    injected: u64,
}

/// An injected failure of an entry point the model has no call for.
#[derive(Debug)]
struct Fault {
    name: String,
    /// The call (counted from the machine's start) that fails.
    nth: u64,
    code: u32,
}

static SHELL: Mutex<Shell> = Mutex::new(Shell {
    config: SimConfig::DEFAULT,
    machine: None,
    calls: BTreeMap::new(),
    faults: Vec::new(),
    total_calls: 0,
    failed_calls: 0,
    injected: 0,
});

fn lock() -> MutexGuard<'static, Shell> {
    SHELL.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shell {
    /// Counts a call of `name` and, for an entry point the model has no call for, answers an
    /// injected failure if one is due (the model counts and injects its own).
    fn count(&mut self, name: &str) -> Result<(), u32> {
        self.total_calls += 1;
        if Call::by_name(name).is_some() {
            return Ok(());
        }
        let count = self.calls.entry(name.to_string()).or_insert(0);
        *count += 1;
        let nth = *count;
        if let Some(i) = self
            .faults
            .iter()
            .position(|f| f.name == name && f.nth == nth)
        {
            let code = self.faults.swap_remove(i).code;
            self.injected += 1;
            self.failed_calls += 1;
            return Err(code);
        }
        Ok(())
    }

    /// `cuInit`'s work: starts the configured machine (once; later calls keep it).
    fn init(&mut self, flags: c_uint) -> Result<(), u32> {
        self.count("cuInit")?;
        if flags != 0 {
            return Err(code::INVALID_VALUE);
        }
        let config = self.config;
        if config.device_count == 0 {
            return Err(code::NO_DEVICE);
        }
        if self.machine.is_none() {
            self.machine = Some(Arc::new(Machine {
                driver: ModelDriver::new(ModelConfig {
                    device_count: config.device_count,
                    device_memory_bytes: config.memory_bytes,
                    concurrent_managed_access: config.concurrent != 0,
                    pageable_memory_access: config.pageable != 0,
                    host_registration: config.host_register != 0,
                    peer_access: config.peer != 0,
                    poison_fresh_allocations: config.poison != 0,
                    deferred_streams: config.deferred != 0,
                    worker_interval: (config.worker_micros > 0)
                        .then(|| Duration::from_micros(config.worker_micros)),
                }),
                config,
                primary_refs: Mutex::new(vec![0; config.device_count as usize]),
            }));
            // No primary context is active before someone retains it.
            if let Some(m) = &self.machine {
                for d in 0..m.driver.device_count() {
                    m.driver.set_primary_active(DeviceId(d), false);
                }
            }
        }
        Ok(())
    }
}

/// The `CUresult` of a model error.
fn code_of(e: ModelError) -> u32 {
    match e {
        ModelError::Driver(e) => e.code,
        ModelError::HostMapFailed { .. } => code::OUT_OF_MEMORY,
        // The model refuses nothing itself (refusals are `DriverBackend`'s); any other answer
        // is the driver's catch-all.
        _ => code::INVALID_VALUE,
    }
}

/// Runs `body` on the machine (none before `cuInit`: `CUDA_ERROR_NOT_INITIALIZED`), with the
/// call counted and, for an entry point the model has no call for, fault-checked here (the
/// model counts and injects its own). The shell's lock is not held while the model runs.
fn entry(name: &str, body: impl FnOnce(&Machine) -> Result<(), u32>) -> u32 {
    let machine = {
        let mut shell = lock();
        if let Err(code) = shell.count(name) {
            return code;
        }
        shell.machine.clone()
    };
    let result = match machine {
        Some(machine) => body(&machine),
        None => Err(code::NOT_INITIALIZED),
    };
    match result {
        Ok(()) => code::SUCCESS,
        Err(code) => {
            lock().failed_calls += 1;
            code
        }
    }
}

/// Writes `value` through `out`, or `CUDA_ERROR_INVALID_VALUE` for a null pointer.
///
/// # Safety
///
/// `out` must be null or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), u32> {
    if out.is_null() {
        return Err(code::INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for a write by the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

impl Machine {
    fn device(&self, ordinal: c_int) -> Result<DeviceId, u32> {
        u32::try_from(ordinal)
            .ok()
            .filter(|&d| d < self.driver.device_count())
            .map(DeviceId)
            .ok_or(code::INVALID_DEVICE)
    }

    /// The calling thread's current context's device.
    fn current_device(&self) -> Result<DeviceId, u32> {
        self.driver
            .context_device(self.driver.current())
            .ok_or(code::INVALID_CONTEXT)
    }

    /// A location as a `CUmemLocation` names it.
    fn location(&self, location: MemLocation) -> Result<Location, u32> {
        match location.kind {
            LOCATION_DEVICE => self.device(location.id).map(Location::Device),
            LOCATION_HOST | LOCATION_HOST_NUMA | LOCATION_HOST_NUMA_CURRENT => Ok(Location::Host),
            _ => Err(code::INVALID_VALUE),
        }
    }

    /// A location as the CUDA 11 calls name it: a device ordinal, or `CU_DEVICE_CPU`.
    fn ordinal(&self, ordinal: c_int) -> Result<Location, u32> {
        if ordinal == CU_DEVICE_CPU {
            Ok(Location::Host)
        } else {
            self.device(ordinal).map(Location::Device)
        }
    }

    fn advise(&self, ptr: u64, count: usize, advice: c_uint, at: Location) -> Result<(), u32> {
        let advice = match advice {
            1 => Advice::SetReadMostly,
            2 => Advice::UnsetReadMostly,
            3 => Advice::SetPreferredLocation(at),
            4 => Advice::UnsetPreferredLocation,
            5 => Advice::SetAccessedBy(at),
            6 => Advice::UnsetAccessedBy(at),
            _ => return Err(code::INVALID_VALUE),
        };
        self.driver.advise(ptr, count, advice).map_err(code_of)
    }
}

macro_rules! entry {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) |$m:ident| $body:block) => {
        $(#[$doc])*
        ///
        /// # Safety
        ///
        /// Pointer arguments must be null or valid for what the CUDA driver API says of them.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_uint {
            entry(stringify!($name), |$m: &Machine| -> Result<(), u32> {
                #[allow(unused_unsafe)]
                // SAFETY: the pointer arguments are valid by this entry point's contract; each
                // unsafe operation inside the body says what it relies on.
                unsafe {
                    $body
                }
            })
        }
    };
}

/// `cuInit`: starts the configured machine (once; later calls keep it).
///
/// # Safety
///
/// None beyond the C ABI.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> c_uint {
    let mut shell = lock();
    match shell.init(flags) {
        Ok(()) => code::SUCCESS,
        Err(code) => {
            shell.failed_calls += 1;
            code
        }
    }
}

/// `cuDriverGetVersion`: 12080; it answers before `cuInit` too, as the driver does.
///
/// # Safety
///
/// `version` must be null or valid for a write of an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> c_uint {
    let mut shell = lock();
    let answer = shell.count("cuDriverGetVersion").and_then(|()| {
        // SAFETY: guaranteed by the caller.
        unsafe { put(version, 12080) }
    });
    match answer {
        Ok(()) => code::SUCCESS,
        Err(code) => {
            shell.failed_calls += 1;
            code
        }
    }
}

entry! {
    /// `cuDeviceGetCount`.
    fn cuDeviceGetCount(count: *mut c_int) |m| {
        put(count, m.driver.device_count() as c_int)
    }
}

entry! {
    /// `cuDeviceGet`.
    fn cuDeviceGet(device: *mut c_int, ordinal: c_int) |m| {
        m.device(ordinal)?;
        put(device, ordinal)
    }
}

entry! {
    /// `cuDeviceGetAttribute`: the model's device facts, and the shell's own attributes.
    fn cuDeviceGetAttribute(value: *mut c_int, attribute: c_uint, device: c_int) |m| {
        let d = m.device(device)?;
        let facts = m.driver.device_facts(d);
        let v = match attribute {
            attr::MANAGED_MEMORY => m.config.managed != 0,
            attr::CONCURRENT_MANAGED_ACCESS => facts.concurrent_managed_access,
            attr::PAGEABLE_MEMORY_ACCESS => facts.pageable_memory_access,
            attr::HOST_REGISTER_SUPPORTED | attr::CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM => {
                facts.host_registration
            }
            attr::UNIFIED_ADDRESSING => true,
            attr::COMPUTE_CAPABILITY_MAJOR => return put(value, 9),
            _ => false,
        };
        put(value, c_int::from(v))
    }
}

entry! {
    /// `cuDeviceGetName`: "tensor-wasm-mem simulated device N".
    fn cuDeviceGetName(name: *mut c_char, len: c_int, device: c_int) |m| {
        let d = m.device(device)?;
        let text = format!("tensor-wasm-mem simulated device {}\0", d.0);
        let len = usize::try_from(len).map_err(|_| code::INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(code::INVALID_VALUE);
        }
        let n = text.len().min(len);
        // SAFETY: `name` is valid for `len >= n` bytes by the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr().cast(), name, n) };
        // SAFETY: as above; `n - 1 < len`.
        let last = unsafe { name.add(n - 1) };
        // SAFETY: inside the caller's buffer (just above).
        unsafe { last.write(0) };
        Ok(())
    }
}

entry! {
    /// `cuDeviceCanAccessPeer`: the model's peer access.
    fn cuDeviceCanAccessPeer(can: *mut c_int, device: c_int, peer: c_int) |m| {
        let (d, p) = (m.device(device)?, m.device(peer)?);
        put(can, c_int::from(m.driver.can_access_peer(d, p)))
    }
}

entry! {
    /// `cuDeviceTotalMem_v2`.
    fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) |m| {
        m.device(device)?;
        put(bytes, m.driver.config().device_memory_bytes as usize)
    }
}

entry! {
    /// `cuMemGetInfo_v2`: of the current context's device.
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) |m| {
        let (f, t) = m.driver.memory_info().map_err(code_of)?.unwrap_or((0, 0));
        put(free, f as usize)?;
        put(total, t as usize)
    }
}

entry! {
    /// `cuDevicePrimaryCtxRetain`.
    fn cuDevicePrimaryCtxRetain(context: *mut *mut c_void, device: c_int) |m| {
        let d = m.device(device)?;
        if context.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let primary = m.driver.primary_context(d);
        let mut refs = m.primary_refs.lock().unwrap_or_else(PoisonError::into_inner);
        refs[d.0 as usize] += 1;
        m.driver.set_primary_active(d, true);
        put(context, primary.raw() as *mut c_void)
    }
}

entry! {
    /// `cuDevicePrimaryCtxReset_v2`: the model's reset of the device's primary context (what a
    /// real reset destroys, destroyed; its sticky fault cleared; the handle kept).
    fn cuDevicePrimaryCtxReset_v2(device: c_int) |m| {
        let d = m.device(device)?;
        // SAFETY: the caller's contract (as libcuda's): nothing made in the context is used
        // afterwards.
        unsafe { m.driver.reset_primary(d) }.map_err(code_of)?;
        Ok(())
    }
}

entry! {
    /// `cuDevicePrimaryCtxRelease_v2`.
    fn cuDevicePrimaryCtxRelease_v2(device: c_int) |m| {
        let d = m.device(device)?;
        let mut refs = m.primary_refs.lock().unwrap_or_else(PoisonError::into_inner);
        let r = &mut refs[d.0 as usize];
        *r = r.checked_sub(1).ok_or(code::INVALID_CONTEXT)?;
        if *r == 0 {
            // The last reference: the primary context goes inactive (the driver resets it;
            // what it still held is not torn down here: the backends give everything back
            // first, and a test of the order sees later calls in it refused).
            m.driver.set_primary_active(d, false);
        }
        Ok(())
    }
}

entry! {
    /// `cuCtxSetCurrent`.
    fn cuCtxSetCurrent(context: *mut c_void) |m| {
        m.driver.set_current(context as u64).map_err(code_of)
    }
}

entry! {
    /// `cuCtxGetCurrent`.
    fn cuCtxGetCurrent(context: *mut *mut c_void) |m| {
        put(context, m.driver.current() as *mut c_void)
    }
}

entry! {
    /// `cuCtxPushCurrent_v2`.
    fn cuCtxPushCurrent_v2(context: *mut c_void) |m| {
        m.driver.push_current(DriverContext::from_raw(context as u64)).map_err(code_of)
    }
}

entry! {
    /// `cuCtxPopCurrent_v2`.
    fn cuCtxPopCurrent_v2(context: *mut *mut c_void) |m| {
        let top = m.driver.current();
        m.driver.pop_current().map_err(code_of)?;
        if !context.is_null() {
            put(context, top as *mut c_void)?;
        }
        Ok(())
    }
}

entry! {
    /// `cuCtxCreate_v2`: a new context on `device`, pushed on this thread's stack.
    fn cuCtxCreate_v2(context: *mut *mut c_void, flags: c_uint, device: c_int) |m| {
        let d = m.device(device)?;
        if context.is_null() || flags > 0x3f {
            return Err(code::INVALID_VALUE);
        }
        let ctx = m.driver.context_create_pushed(d).map_err(code_of)?;
        put(context, ctx as *mut c_void)
    }
}

entry! {
    /// `cuCtxDestroy_v2`: the device finishes the context's work; its streams go with it.
    fn cuCtxDestroy_v2(context: *mut c_void) |m| {
        m.driver.context_destroy_popping(context as u64).map_err(code_of)
    }
}

entry! {
    /// `cuMemAllocManaged` on the current context's device.
    fn cuMemAllocManaged(ptr: *mut u64, bytes: usize, flags: c_uint) |m| {
        if ptr.is_null() || !(flags == 1 || flags == 2) {
            return Err(code::INVALID_VALUE);
        }
        if m.config.managed == 0 {
            return Err(code::NOT_SUPPORTED);
        }
        let device = m.current_device()?;
        let address = m.driver.alloc_managed(device, bytes).map_err(code_of)?;
        put(ptr, address)
    }
}

entry! {
    /// `cuMemHostRegister_v2` (device-mapped): the model's registration rules.
    fn cuMemHostRegister_v2(ptr: *mut c_void, bytes: usize, flags: c_uint) |m| {
        if flags & !0xf != 0 {
            return Err(code::INVALID_VALUE);
        }
        m.driver.host_register(ptr as u64, bytes).map_err(code_of)
    }
}

entry! {
    /// `cuMemHostUnregister`.
    fn cuMemHostUnregister(ptr: *mut c_void) |m| {
        // SAFETY: the caller gives the range up, by the driver's contract.
        unsafe { m.driver.host_unregister(ptr as u64) }.map_err(code_of)
    }
}

entry! {
    /// `cuMemFree_v2`.
    fn cuMemFree_v2(ptr: u64) |m| {
        // SAFETY: the caller gives the allocation up, by the driver's contract.
        unsafe { m.driver.free(ptr) }.map_err(code_of)
    }
}

entry! {
    /// `cuMemsetD8Async`: done when the stream gets to it.
    fn cuMemsetD8Async(ptr: u64, value: u8, count: usize, stream: *mut c_void) |m| {
        // SAFETY: the caller orders its own accesses after the stream, by the driver's contract.
        unsafe { m.driver.memset_async(ptr, value, count, stream as u64) }.map_err(code_of)
    }
}

entry! {
    /// `cuMemAdvise_v2` (CUDA 12.2+, with `CUmemLocation`).
    fn cuMemAdvise_v2(ptr: u64, count: usize, advice: c_uint, location: MemLocation) |m| {
        let at = if matches!(advice, 3 | 5 | 6) { m.location(location)? } else { Location::Host };
        m.advise(ptr, count, advice, at)
    }
}

entry! {
    /// `cuMemAdvise` (the CUDA 11 form: a device ordinal, `-1` for the CPU).
    fn cuMemAdvise(ptr: u64, count: usize, advice: c_uint, device: c_int) |m| {
        let at = if matches!(advice, 3 | 5 | 6) { m.ordinal(device)? } else { Location::Host };
        m.advise(ptr, count, advice, at)
    }
}

#[cfg(not(feature = "without-prefetch"))]
entry! {
    /// `cuMemPrefetchAsync_v2` (CUDA 12.2+, with `CUmemLocation`).
    fn cuMemPrefetchAsync_v2(ptr: u64, count: usize, location: MemLocation, flags: c_uint, stream: *mut c_void) |m| {
        if flags != 0 {
            return Err(code::INVALID_VALUE);
        }
        let to = m.location(location)?;
        m.driver.prefetch(ptr, count, to, DriverStream::from_raw(stream as u64)).map_err(code_of)
    }
}

#[cfg(not(feature = "without-prefetch"))]
entry! {
    /// `cuMemPrefetchAsync` (the CUDA 11 form: a device ordinal, `-1` for the CPU).
    fn cuMemPrefetchAsync(ptr: u64, count: usize, device: c_int, stream: *mut c_void) |m| {
        let to = m.ordinal(device)?;
        m.driver.prefetch(ptr, count, to, DriverStream::from_raw(stream as u64)).map_err(code_of)
    }
}

entry! {
    /// `cuModuleLoadData`: any image (the simulated kernels are named by `cuModuleGetFunction`).
    fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) |m| {
        if module.is_null() || image.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let loaded = m.driver.load_module().map_err(code_of)?;
        put(module, loaded.raw() as *mut c_void)
    }
}

entry! {
    /// `cuModuleGetFunction`: the model's simulated kernels (`fill`, `increment`, `copy`,
    /// `axpy`); any other name is `CUDA_ERROR_NOT_FOUND`.
    fn cuModuleGetFunction(function: *mut *mut c_void, module: *mut c_void, name: *const c_char) |m| {
        if function.is_null() || name.is_null() {
            return Err(code::INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated string by the caller's contract (checked non-null).
        let name = unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| code::NOT_FOUND)?;
        let f = m.driver.get_function(Module::from_raw(module as u64), name).map_err(code_of)?;
        put(function, f.raw() as *mut c_void)
    }
}

entry! {
    /// `cuModuleUnload`: its functions go with it.
    fn cuModuleUnload(module: *mut c_void) |m| {
        m.driver.unload_module(Module::from_raw(module as u64)).map_err(code_of)
    }
}

/// The width in bytes of each parameter of a simulated kernel, as its PTX declares them:
/// `fill(u64 data, u64 len, u32 value)`, `increment(u64 data, u64 len)`,
/// `copy(u64 dst, u64 src, u64 len)`, `axpy(f32 a, u64 x, u64 y, u64 n)`,
/// `poke(u64 data, u64 len, u64 index, u32 value)`.
fn param_widths(kernel: Kernel) -> &'static [usize] {
    match kernel {
        Kernel::Fill => &[8, 8, 4],
        Kernel::Increment => &[8, 8],
        Kernel::Copy => &[8, 8, 8],
        Kernel::Axpy => &[4, 8, 8, 8],
        Kernel::Poke => &[8, 8, 8, 4],
        _ => &[],
    }
}

entry! {
    /// `cuLaunchKernel`: queued on the stream, run when the device gets to it; memory outside
    /// every live allocation is an illegal address, sticky for the context.
    fn cuLaunchKernel(
        function: *mut c_void,
        grid_x: c_uint, grid_y: c_uint, grid_z: c_uint,
        block_x: c_uint, block_y: c_uint, block_z: c_uint,
        shared_bytes: c_uint, stream: *mut c_void,
        params: *mut *mut c_void, extra: *mut *mut c_void,
    ) |m| {
        // The launch configuration the driver checks: no empty grid or block, at most 1024
        // threads per block (the simulated kernels then cover their whole range, whatever the
        // grid: how many threads a real kernel needs is its own business).
        let _ = shared_bytes;
        let threads = u64::from(block_x) * u64::from(block_y) * u64::from(block_z);
        if [grid_x, grid_y, grid_z, block_x, block_y, block_z].contains(&0) || threads > 1024 {
            return Err(code::INVALID_VALUE);
        }
        let function = Function::from_raw(function as u64);
        let kernel = m.driver.function_kernel(function).ok_or(code::INVALID_HANDLE)?;
        if params.is_null() || !extra.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let mut args = [0u64; 4];
        for (i, width) in param_widths(kernel).iter().enumerate() {
            // SAFETY: `params` holds one pointer per kernel parameter, each to a value of the
            // parameter's declared width, by the launch contract.
            let slot = unsafe { params.add(i) };
            // SAFETY: as above, `slot` is one of them.
            let p = unsafe { *slot };
            if p.is_null() {
                return Err(code::INVALID_VALUE);
            }
            args[i] = match width {
                // SAFETY: as above, a 4-byte parameter.
                4 => u64::from(unsafe { p.cast::<u32>().read_unaligned() }),
                // SAFETY: as above, an 8-byte parameter.
                _ => unsafe { p.cast::<u64>().read_unaligned() },
            };
        }
        let args = &args[..param_widths(kernel).len()];
        // SAFETY: the caller orders its own accesses after the stream, by the driver's contract.
        unsafe { m.driver.launch_raw(stream as u64, function, args) }.map_err(code_of)
    }
}

entry! {
    /// `cuStreamCreate`: in the current context.
    fn cuStreamCreate(stream: *mut *mut c_void, flags: c_uint) |m| {
        if stream.is_null() || flags > 1 {
            return Err(code::INVALID_VALUE);
        }
        let s = m.driver.stream_create().map_err(code_of)?;
        put(stream, s.raw() as *mut c_void)
    }
}

entry! {
    /// `cuStreamDestroy_v2`: its queued work still completes.
    fn cuStreamDestroy_v2(stream: *mut c_void) |m| {
        m.driver.stream_destroy(DriverStream::from_raw(stream as u64)).map_err(code_of)
    }
}

entry! {
    /// `cuStreamSynchronize`: runs the stream's queue; a sticky fault is its answer.
    fn cuStreamSynchronize(stream: *mut c_void) |m| {
        m.driver.synchronize(DriverStream::from_raw(stream as u64)).map_err(code_of)
    }
}

entry! {
    /// `cuEventCreate`.
    fn cuEventCreate(event: *mut *mut c_void, flags: c_uint) |m| {
        if event.is_null() || flags > 0xf {
            return Err(code::INVALID_VALUE);
        }
        // An event belongs to the current context.
        m.current_device()?;
        let e = m.driver.event_create().map_err(code_of)?;
        put(event, e.raw() as *mut c_void)
    }
}

entry! {
    /// `cuEventRecord`: completes when the stream gets to this point.
    fn cuEventRecord(event: *mut c_void, stream: *mut c_void) |m| {
        m.driver.event_record_raw(Event::from_raw(event as u64), stream as u64).map_err(code_of)
    }
}

entry! {
    /// `cuStreamWaitEvent`: later work on the stream waits for the event's latest record.
    fn cuStreamWaitEvent(stream: *mut c_void, event: *mut c_void, flags: c_uint) |m| {
        if flags != 0 {
            return Err(code::INVALID_VALUE);
        }
        m.driver.stream_wait_event_raw(stream as u64, Event::from_raw(event as u64)).map_err(code_of)
    }
}

entry! {
    /// `cuEventSynchronize`.
    fn cuEventSynchronize(event: *mut c_void) |m| {
        m.driver.event_synchronize(Event::from_raw(event as u64)).map_err(code_of)
    }
}

entry! {
    /// `cuEventQuery`: `CUDA_ERROR_NOT_READY` until the device reaches the record.
    fn cuEventQuery(event: *mut c_void) |m| {
        match m.driver.event_query(Event::from_raw(event as u64)).map_err(code_of)? {
            true => Ok(()),
            false => Err(code::NOT_READY),
        }
    }
}

entry! {
    /// `cuEventDestroy_v2`.
    fn cuEventDestroy_v2(event: *mut c_void) |m| {
        m.driver.event_destroy(Event::from_raw(event as u64)).map_err(code_of)
    }
}

entry! {
    /// `cuMemPoolCreate`: pinned device memory on one device, `maxSize` honoured.
    fn cuMemPoolCreate(pool: *mut *mut c_void, props: *const MemPoolProps) |m| {
        if pool.is_null() || props.is_null() {
            return Err(code::INVALID_VALUE);
        }
        // SAFETY: non-null, valid by the caller's contract.
        let props = props.read();
        if props.alloc_type != 1 || props.location.kind != LOCATION_DEVICE {
            return Err(code::INVALID_VALUE);
        }
        let device = m.device(props.location.id)?;
        let p = m.driver.pool_create(device, props.max_size as u64, 0).map_err(code_of)?;
        put(pool, p.raw() as *mut c_void)
    }
}

entry! {
    /// `cuMemPoolDestroy`: blocks still allocated keep the pool until they are freed.
    fn cuMemPoolDestroy(pool: *mut c_void) |m| {
        m.driver.pool_destroy(DriverPool::from_raw(pool as u64)).map_err(code_of)
    }
}

entry! {
    /// `cuMemAllocFromPoolAsync`: not zeroed (a kept block keeps what it held).
    fn cuMemAllocFromPoolAsync(ptr: *mut u64, bytes: usize, pool: *mut c_void, stream: *mut c_void) |m| {
        if ptr.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let address = m.driver.pool_alloc_async(pool as u64, bytes, stream as u64).map_err(code_of)?;
        put(ptr, address)
    }
}

entry! {
    /// `cuMemFreeAsync`: back to the pool when the stream gets to it.
    fn cuMemFreeAsync(ptr: u64, stream: *mut c_void) |m| {
        m.driver.pool_free(ptr, DriverStream::from_raw(stream as u64)).map_err(code_of)
    }
}

entry! {
    /// `cuMemPoolTrimTo`.
    fn cuMemPoolTrimTo(pool: *mut c_void, keep: usize) |m| {
        m.driver.pool_trim(DriverPool::from_raw(pool as u64), keep as u64).map_err(code_of)
    }
}

entry! {
    /// `cuMemPoolSetAttribute`: the release threshold (4) and the reuse flags (1-3, accepted).
    fn cuMemPoolSetAttribute(pool: *mut c_void, attribute: c_uint, value: *mut c_void) |m| {
        if value.is_null() {
            return Err(code::INVALID_VALUE);
        }
        match attribute {
            1..=3 => m.driver.pool_release_threshold(pool as u64).map(drop).map_err(code_of),
            4 => {
                // SAFETY: a `cuuint64_t` for this attribute, by the caller's contract.
                let threshold = unsafe { value.cast::<u64>().read_unaligned() };
                m.driver.set_pool_release_threshold(pool as u64, threshold).map_err(code_of)
            }
            _ => Err(code::INVALID_VALUE),
        }
    }
}

entry! {
    /// `cuMemPoolGetAttribute`: the release threshold (4), reserved memory (5).
    fn cuMemPoolGetAttribute(pool: *mut c_void, attribute: c_uint, value: *mut c_void) |m| {
        let v = match attribute {
            4 => m.driver.pool_release_threshold(pool as u64).map_err(code_of)?,
            5 => m.driver.pool_reserved(DriverPool::from_raw(pool as u64)).map_err(code_of)?,
            _ => return Err(code::INVALID_VALUE),
        };
        put(value.cast::<u64>(), v)
    }
}

/// `cuGetErrorString`.
///
/// # Safety
///
/// `text` must be null or valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: c_uint, text: *mut *const c_char) -> c_uint {
    match code::describe(error) {
        // SAFETY: guaranteed by the caller.
        Some((_, description)) => match unsafe { put(text, description.as_ptr()) } {
            Ok(()) => code::SUCCESS,
            Err(e) => e,
        },
        // As the driver documents: `*pStr` is set to NULL.
        // SAFETY: guaranteed by the caller.
        None => unsafe { put(text, std::ptr::null()) }.map_or_else(|e| e, |()| code::INVALID_VALUE),
    }
}

/// `cuGetErrorName`.
///
/// # Safety
///
/// `text` must be null or valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: c_uint, text: *mut *const c_char) -> c_uint {
    match code::describe(error) {
        // SAFETY: guaranteed by the caller.
        Some((name, _)) => match unsafe { put(text, name.as_ptr()) } {
            Ok(()) => code::SUCCESS,
            Err(e) => e,
        },
        // As the driver documents: `*pStr` is set to NULL.
        // SAFETY: guaranteed by the caller.
        None => unsafe { put(text, std::ptr::null()) }.map_or_else(|e| e, |()| code::INVALID_VALUE),
    }
}

// ---- Knobs -------------------------------------------------------------------------------------

/// Every entry point this library exports (what `twm_sim_fail_nth` may name).
const ENTRY_POINTS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceCanAccessPeer",
    "cuDeviceTotalMem_v2",
    "cuMemGetInfo_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuDevicePrimaryCtxReset_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxCreate_v2",
    "cuCtxDestroy_v2",
    "cuMemAllocManaged",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemFree_v2",
    "cuMemsetD8Async",
    "cuMemAdvise_v2",
    "cuMemAdvise",
    #[cfg(not(feature = "without-prefetch"))]
    "cuMemPrefetchAsync_v2",
    #[cfg(not(feature = "without-prefetch"))]
    "cuMemPrefetchAsync",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuStreamWaitEvent",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemPoolTrimTo",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
];

/// Sets the simulated machine; takes effect at the next `cuInit` after [`twm_sim_reset`].
///
/// # Safety
///
/// `config` must point to a valid [`SimConfig`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_configure(config: *const SimConfig) -> c_uint {
    if config.is_null() {
        return code::INVALID_VALUE;
    }
    // SAFETY: non-null and valid by the caller's contract.
    lock().config = unsafe { config.read() };
    code::SUCCESS
}

/// Drops the machine (the model unmaps what is still allocated) and clears counters and
/// faults: the next `cuInit` starts a fresh machine (the configuration is kept).
#[unsafe(no_mangle)]
pub extern "C" fn twm_sim_reset() {
    let old = {
        let mut shell = lock();
        shell.calls.clear();
        shell.faults.clear();
        shell.total_calls = 0;
        shell.failed_calls = 0;
        shell.injected = 0;
        shell.machine.take()
    };
    // Dropped outside the lock (unmapping takes a while).
    drop(old);
}

/// The machine, if `cuInit` started one.
fn machine() -> Option<Arc<Machine>> {
    lock().machine.clone()
}

/// A location as [`SimHints`] names it.
fn ordinal_of(location: Option<Location>) -> i32 {
    match location {
        None => SimHints::NONE,
        Some(Location::Host) => CU_DEVICE_CPU,
        Some(Location::Device(d)) => i32::try_from(d.0).unwrap_or(SimHints::NONE),
    }
}

/// Copies the advice and residency in force at `ptr` (inside a live managed allocation) to
/// `out`; `CUDA_ERROR_INVALID_VALUE` for any other address.
///
/// # Safety
///
/// `out` must be valid for a write of [`SimHints`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_hints(ptr: u64, out: *mut SimHints) -> c_uint {
    let Some(m) = machine() else {
        return code::NOT_INITIALIZED;
    };
    let (hints, resident) = match m.driver.hints_at(ptr) {
        Ok(h) => h,
        Err(e) => return code_of(e),
    };
    let bit = |l: &Location| 1u64 << (ordinal_of(Some(*l)) + 1).clamp(0, 63);
    let answer = SimHints {
        read_mostly: u32::from(hints.read_mostly),
        preferred: ordinal_of(hints.preferred_location),
        accessed_by: hints.accessed_by.iter().map(bit).fold(0, |a, b| a | b),
        resident: ordinal_of(resident),
    };
    // SAFETY: guaranteed by the caller.
    match unsafe { put(out, answer) } {
        Ok(()) => code::SUCCESS,
        Err(e) => e,
    }
}

/// Copies the counters to `out` (all zero before `cuInit`).
///
/// # Safety
///
/// `out` must be valid for a write of [`SimStats`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_stats(out: *mut SimStats) -> c_uint {
    let (m, calls, failed_calls, injected) = {
        let shell = lock();
        (
            shell.machine.clone(),
            shell.total_calls,
            shell.failed_calls,
            shell.injected,
        )
    };
    let mut stats = SimStats {
        calls,
        failed_calls,
        injected,
        ..SimStats::default()
    };
    if let Some(m) = m {
        let s = m.driver.stats();
        let primary: u64 = m
            .primary_refs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .sum();
        stats = SimStats {
            live_allocations: s.live_allocations,
            live_bytes: s.live_bytes,
            allocations: s.allocations,
            frees: s.frees,
            live_streams: s.live_streams,
            live_contexts: s.live_contexts,
            primary_refs: primary,
            injected: injected + s.injected_failures,
            live_pools: s.live_pools,
            pool_reserved_bytes: s.pool_reserved_bytes,
            live_pool_allocations: s.live_pool_allocations,
            scrubs_over_pending_work: s.scrubs_over_pending_work,
            frees_over_pending_work: s.frees_over_pending_work,
            kernel_faults: s.kernel_faults,
            ..stats
        };
    }
    // SAFETY: guaranteed by the caller.
    match unsafe { put(out, stats) } {
        Ok(()) => code::SUCCESS,
        Err(e) => e,
    }
}

/// A C string argument as text.
///
/// # Safety
///
/// `name` must be null or a valid NUL-terminated string.
unsafe fn text(name: *const c_char) -> Option<String> {
    if name.is_null() {
        return None;
    }
    // SAFETY: a valid C string by the caller's contract.
    Some(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// Makes the `nth` call from now of the entry point `name` return `error`: any non-zero code,
/// including codes no CUDA enum knows (the backends must report them, not misread them). A name
/// this library does not export is refused (`CUDA_ERROR_NOT_FOUND`).
/// Entry points of the model are failed in the model (`CUDA_ERROR_NOT_INITIALIZED` before
/// `cuInit`); the others here.
///
/// # Safety
///
/// `name` must be a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_fail_nth(name: *const c_char, nth: u64, error: c_uint) -> c_uint {
    // SAFETY: guaranteed by the caller.
    let Some(name) = (unsafe { text(name) }) else {
        return code::INVALID_VALUE;
    };
    if nth == 0 || error == code::SUCCESS {
        return code::INVALID_VALUE;
    }
    if !ENTRY_POINTS.contains(&name.as_str()) {
        // A typo would never fire: refused.
        return code::NOT_FOUND;
    }
    let mut shell = lock();
    match Call::by_name(&name) {
        Some(call) => match &shell.machine {
            Some(m) => m.driver.fail_call(call, nth, error),
            None => return code::NOT_INITIALIZED,
        },
        None => {
            let done = shell.calls.get(&name).copied().unwrap_or(0);
            shell.faults.push(Fault {
                name,
                nth: done + nth,
                code: error,
            });
        }
    }
    code::SUCCESS
}

/// Removes every pending injected failure and hold (held calls return).
#[unsafe(no_mangle)]
pub extern "C" fn twm_sim_clear_faults() {
    let mut shell = lock();
    shell.faults.clear();
    if let Some(m) = &shell.machine {
        m.driver.clear_faults();
    }
}

/// The call of an entry point name, and the machine, for the hold controls.
///
/// # Safety
///
/// `name` must be a valid NUL-terminated string.
unsafe fn held_call(name: *const c_char) -> Result<(Call, Arc<Machine>), c_uint> {
    // SAFETY: guaranteed by the caller.
    let call = unsafe { text(name) }.and_then(|n| Call::by_name(&n));
    match (call, machine()) {
        (Some(call), Some(m)) => Ok((call, m)),
        (None, _) => Err(code::INVALID_VALUE),
        (_, None) => Err(code::NOT_INITIALIZED),
    }
}

/// Holds the next call of the entry point `name` (one the model has: `cuMemFree_v2`,
/// `cuMemFreeAsync`, ...) after it has taken effect, with the model unlocked, until
/// `twm_sim_release_held(name)`.
///
/// # Safety
///
/// `name` must be a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_hold_next(name: *const c_char) -> c_uint {
    // SAFETY: guaranteed by the caller.
    match unsafe { held_call(name) } {
        Ok((call, m)) => {
            m.driver.arm_hold(call);
            code::SUCCESS
        }
        Err(code) => code,
    }
}

/// Waits until a call of `name` is held; `CUDA_ERROR_NOT_READY` if none was within
/// `limit_ms` milliseconds (a bound for a broken test).
///
/// # Safety
///
/// `name` must be a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_wait_held(name: *const c_char, limit_ms: u64) -> c_uint {
    // SAFETY: guaranteed by the caller.
    match unsafe { held_call(name) } {
        Ok((call, m)) if m.driver.wait_held(call, Duration::from_millis(limit_ms)) => code::SUCCESS,
        Ok(_) => code::NOT_READY,
        Err(code) => code,
    }
}

/// Lets a held call of `name` return (or disarms a hold not reached yet).
///
/// # Safety
///
/// `name` must be a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_release_held(name: *const c_char) -> c_uint {
    // SAFETY: guaranteed by the caller.
    match unsafe { held_call(name) } {
        Ok((call, m)) => {
            m.driver.release_held(call);
            code::SUCCESS
        }
        Err(code) => code,
    }
}

/// The depth of the calling thread's context stack.
#[unsafe(no_mangle)]
pub extern "C" fn twm_sim_context_depth() -> u64 {
    machine().map_or(0, |m| m.driver.context_depth() as u64)
}

/// Calls of the entry point `name` so far (for `cuMemAdvise[_v2]` and
/// `cuMemPrefetchAsync[_v2]`, both forms together).
///
/// # Safety
///
/// `name` must be a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_calls(name: *const c_char) -> u64 {
    // SAFETY: guaranteed by the caller.
    let Some(name) = (unsafe { text(name) }) else {
        return 0;
    };
    let shell = lock();
    match (Call::by_name(&name), &shell.machine) {
        (Some(call), Some(m)) => m.driver.stats().entry_calls(call),
        (Some(_), None) => 0,
        (None, _) => shell.calls.get(&name).copied().unwrap_or(0),
    }
}

#[cfg(test)]
mod tests;
