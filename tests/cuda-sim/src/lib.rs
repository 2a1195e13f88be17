//! A simulated CUDA driver: the subset of `libcuda.so.1` entry points tensor-wasm-mem's driver
//! backends use, implemented on host memory, keeping the driver's rules.
//!
//! - Nothing works before `cuInit` (`CUDA_ERROR_NOT_INITIALIZED`); memory and stream calls need a
//!   current context on the calling thread (`CUDA_ERROR_INVALID_CONTEXT`).
//! - Managed allocations are real, zero-filled host memory (so the host and the "device" see the
//!   same bytes); size 0 is `CUDA_ERROR_INVALID_VALUE`; past the device's memory is
//!   `CUDA_ERROR_OUT_OF_MEMORY`.
//! - `cuMemsetD8Async`, `cuMemAdvise[_v2]` and `cuMemPrefetchAsync[_v2]` must name a range inside
//!   one allocation; devices must exist; prefetch to a device needs concurrent managed access;
//!   stream and context handles must be live.
//!
//! Knobs (exported `twm_sim_*` functions, see [`SimConfig`] and [`SimStats`]): device count and
//! attributes, failure injection (the n-th call of an entry point returns a chosen error), a call
//! trace, and leak counters.
//!
//! Build it as a cdylib with SONAME `libcuda.so.1` (what `tests/build.rs` does). Its file must
//! never be named `libcuda.so` inside `target/`, where it could shadow a real driver.
//!
//! Advice and prefetches are recorded per range (`twm_sim_hints` answers what is in force at an
//! address: read-mostly, preferred location, accessed-by, where it was last prefetched to).
//!
//! Kernels: `cuModuleLoadData` accepts any image, `cuModuleGetFunction` knows the simulated
//! kernels `increment(data, len)` and `fill(data, len, value)`, and `cuLaunchKernel` runs them on
//! the host over the range they are given (outside every allocation: an illegal address).
//!
//! What it does not model: real kernels, real migration, timing, asynchrony (every call
//! completes before it returns), multiple processes.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::{Mutex, MutexGuard, PoisonError};

mod abi;
pub use abi::{SimConfig, SimHints, SimStats, code};

/// Device attributes the simulator answers (others answer 0).
mod attr {
    pub const MANAGED_MEMORY: u32 = 83;
    pub const PAGEABLE_MEMORY_ACCESS: u32 = 88;
    pub const CONCURRENT_MANAGED_ACCESS: u32 = 89;
    pub const COMPUTE_CAPABILITY_MAJOR: u32 = 75;
    pub const COMPUTE_CAPABILITY_MINOR: u32 = 76;
    pub const UNIFIED_ADDRESSING: u32 = 41;
    pub const CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: u32 = 91;
    pub const HOST_REGISTER_SUPPORTED: u32 = 99;
}

/// `CUmemLocation` (CUDA 12.2+): a location type and an id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemLocation {
    /// 1 device, 2 host, 3 host NUMA node, 4 current host NUMA node.
    pub kind: c_uint,
    /// Device ordinal or NUMA node.
    pub id: c_int,
}

const LOCATION_DEVICE: c_uint = 1;
const LOCATION_HOST: c_uint = 2;
const LOCATION_HOST_NUMA: c_uint = 3;
const LOCATION_HOST_NUMA_CURRENT: c_uint = 4;
const CU_DEVICE_CPU: c_int = -1;
const ALIGN: usize = 4096;
const TRACE_LEN: usize = 256;

#[derive(Debug)]
struct Device {
    used: u64,
    primary: Option<u64>,
    primary_refs: u64,
}

#[derive(Debug)]
struct Context {
    device: usize,
    primary: bool,
}

#[derive(Debug)]
struct Allocation {
    len: usize,
    layout: Layout,
    device: usize,
    /// The pool it came from (`None`: managed memory from cuMemAllocManaged).
    pool: Option<u64>,
    /// Advice and prefetches applied, oldest first (see [`Sim::hints_at`]).
    hints: Vec<HintOp>,
}

/// A location as the CUDA 11 calls name it: a device ordinal, or `CU_DEVICE_CPU` for the host.
type Ordinal = c_int;

/// One advice or prefetch over `start..end` of an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HintOp {
    start: u64,
    end: u64,
    what: Hint,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hint {
    ReadMostly(bool),
    Preferred(Option<Ordinal>),
    AccessedBy(Ordinal, bool),
    Resident(Ordinal),
}

impl Hint {
    /// Two hints of the same slot: a later one over a range replaces an earlier one there.
    fn same_slot(self, other: Self) -> bool {
        match (self, other) {
            (Self::AccessedBy(a, _), Self::AccessedBy(b, _)) => a == b,
            _ => core::mem::discriminant(&self) == core::mem::discriminant(&other),
        }
    }

    /// `CU_MEM_ADVISE_*` (1..=6) at `location`.
    fn from_advice(advice: c_uint, location: Ordinal) -> Self {
        match advice {
            1 => Self::ReadMostly(true),
            2 => Self::ReadMostly(false),
            3 => Self::Preferred(Some(location)),
            4 => Self::Preferred(None),
            5 => Self::AccessedBy(location, true),
            _ => Self::AccessedBy(location, false),
        }
    }
}

#[derive(Debug)]
struct Pool {
    device: usize,
    max_size: u64,
    release_threshold: u64,
    reserved: u64,
    reserved_high: u64,
    used: u64,
    used_high: u64,
    /// Freed blocks kept (not zeroed: the driver does not zero pool memory).
    cached: Vec<(u64, Layout)>,
}

/// `CUmemPoolProps` (CUDA 12.6+ layout; `maxSize` since 12.2).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MemPoolProps {
    /// `CUmemAllocationType`: 1 = pinned (the only one pools take).
    pub alloc_type: c_uint,
    /// `CUmemAllocationHandleType`.
    pub handle_types: c_uint,
    /// Where the pool's memory lives.
    pub location: MemLocation,
    /// Windows only.
    pub win32_security_attributes: *mut c_void,
    /// The most the pool may reserve (0: no maximum).
    pub max_size: usize,
    /// Usage flags.
    pub usage: u16,
    /// Must be zero.
    pub reserved: [u8; 54],
}

#[derive(Debug)]
struct Fault {
    name: String,
    call: u64,
    code: u32,
}

#[derive(Debug, Default)]
struct Sim {
    config: Option<SimConfig>,
    initialized: bool,
    devices: Vec<Device>,
    contexts: BTreeMap<u64, Context>,
    streams: BTreeMap<u64, u64>,
    allocations: BTreeMap<u64, Allocation>,
    /// Host ranges registered with `cuMemHostRegister_v2`: base -> length.
    registered: BTreeMap<u64, usize>,
    pools: BTreeMap<u64, Pool>,
    /// Loaded modules (`cuModuleLoadData`), by handle.
    modules: BTreeMap<u64, ()>,
    /// Functions got from them: handle -> (module, simulated kernel).
    functions: BTreeMap<u64, (u64, Kernel)>,
    next_handle: u64,
    calls: BTreeMap<String, u64>,
    faults: Vec<Fault>,
    /// Entry point -> microseconds to sleep after the call, outside the lock (one use each).
    delays: Vec<(String, u64)>,
    trace: VecDeque<String>,
    stats: SimStats,
}

static SIM: Mutex<Option<Sim>> = Mutex::new(None);

/// The simulated kernels a module can name: host functions that run on the launch, over the
/// device pointer and length they are given (the image's code is not read; any image works).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// `increment(u64 data, u64 len)`: adds one to each byte of `data[0..len]`.
    Increment,
    /// `fill(u64 data, u64 len, u32 value)`: sets each byte of `data[0..len]` to `value`.
    Fill,
}

impl Kernel {
    fn by_name(name: &[u8]) -> Option<Self> {
        match name {
            b"increment" => Some(Self::Increment),
            b"fill" => Some(Self::Fill),
            _ => None,
        }
    }
}

thread_local! {
    /// This thread's context stack (CUDA keeps one per thread); the top is current.
    static CONTEXTS: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

fn current_context() -> u64 {
    CONTEXTS.with(|s| s.borrow().last().copied().unwrap_or(0))
}

fn set_current(ctx: u64) {
    CONTEXTS.with(|s| {
        let mut s = s.borrow_mut();
        match s.last_mut() {
            Some(top) if ctx != 0 => *top = ctx,
            Some(_) => {
                s.pop();
            }
            None if ctx != 0 => s.push(ctx),
            None => {}
        }
    });
}

fn lock() -> MutexGuard<'static, Option<Sim>> {
    SIM.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Sim {
    fn config(&self) -> SimConfig {
        self.config.unwrap_or_default()
    }

    fn handle(&mut self) -> u64 {
        self.next_handle += 1;
        0x5100_0000 + self.next_handle * 0x10
    }

    /// Counts the call, traces it, and answers an injected failure if one is due.
    fn enter(&mut self, name: &str) -> Result<(), u32> {
        self.stats.calls += 1;
        let count = self.calls.entry(name.to_string()).or_insert(0);
        *count += 1;
        let call = *count;
        if let Some(i) = self
            .faults
            .iter()
            .position(|f| f.name == name && f.call == call)
        {
            let fault = self.faults.swap_remove(i);
            self.stats.injected += 1;
            return Err(fault.code);
        }
        Ok(())
    }

    fn initialized(&self) -> Result<(), u32> {
        if self.initialized {
            Ok(())
        } else {
            Err(code::NOT_INITIALIZED)
        }
    }

    fn device(&self, ordinal: c_int) -> Result<usize, u32> {
        self.initialized()?;
        usize::try_from(ordinal)
            .ok()
            .filter(|&d| d < self.devices.len())
            .ok_or(code::INVALID_DEVICE)
    }

    /// The current context's device.
    fn context_device(&self) -> Result<usize, u32> {
        self.initialized()?;
        self.contexts
            .get(&current_context())
            .map(|c| c.device)
            .ok_or(code::INVALID_CONTEXT)
    }

    /// The managed allocation holding `ptr..ptr + count` (pool memory is not managed).
    fn managed_range(&self, ptr: u64, count: usize) -> Result<&Allocation, u32> {
        let allocation = self.range(ptr, count)?;
        if allocation.pool.is_some() {
            return Err(code::INVALID_VALUE);
        }
        Ok(allocation)
    }

    /// Gives kept blocks of `pool` back until it holds at most `keep` bytes (or what is live).
    fn release_pool_memory(&mut self, pool: u64, keep: u64) {
        let Some(p) = self.pools.get_mut(&pool) else {
            return;
        };
        while p.reserved > keep.max(p.used) {
            let Some((ptr, layout)) = p.cached.pop() else {
                break;
            };
            p.reserved -= layout.size() as u64;
            self.devices[p.device].used -= layout.size() as u64;
            self.stats.pool_reserved_bytes -= layout.size() as u64;
            // SAFETY: a kept block of this pool, allocated with this layout, held by no one.
            unsafe { dealloc(ptr as *mut u8, layout) };
        }
    }

    /// The allocation holding `ptr..ptr + count`.
    fn range(&self, ptr: u64, count: usize) -> Result<&Allocation, u32> {
        let end = ptr.checked_add(count as u64).ok_or(code::INVALID_VALUE)?;
        let (base, allocation) = self
            .allocations
            .range(..=ptr)
            .next_back()
            .ok_or(code::INVALID_VALUE)?;
        if end > base + allocation.len as u64 {
            return Err(code::INVALID_VALUE);
        }
        Ok(allocation)
    }

    /// Records `what` over `ptr..ptr + count` (a range already checked to be managed memory).
    fn hint(&mut self, ptr: u64, count: usize, what: Hint) {
        let Some((_, allocation)) = self.allocations.range_mut(..=ptr).next_back() else {
            return;
        };
        let (start, end) = (ptr, ptr + count as u64);
        // What the new one covers of the same kind is forgotten: the log stays as long as the
        // number of distinct ranges, not the number of calls.
        allocation
            .hints
            .retain(|h| !(h.what.same_slot(what) && start <= h.start && h.end <= end));
        allocation.hints.push(HintOp { start, end, what });
    }

    /// The advice and residency in force at `ptr`.
    fn hints_at(&self, ptr: u64) -> Result<SimHints, u32> {
        let allocation = self.managed_range(ptr, 1)?;
        let mut out = SimHints {
            read_mostly: 0,
            preferred: SimHints::NONE,
            accessed_by: 0,
            resident: SimHints::NONE,
        };
        let bit = |ordinal: Ordinal| 1u64 << (ordinal + 1).clamp(0, 63);
        for op in allocation
            .hints
            .iter()
            .filter(|h| h.start <= ptr && ptr < h.end)
        {
            match op.what {
                Hint::ReadMostly(on) => out.read_mostly = u32::from(on),
                Hint::Preferred(at) => out.preferred = at.unwrap_or(SimHints::NONE),
                Hint::AccessedBy(at, true) => out.accessed_by |= bit(at),
                Hint::AccessedBy(at, false) => out.accessed_by &= !bit(at),
                Hint::Resident(at) => out.resident = at,
            }
        }
        Ok(out)
    }

    fn stream(&self, stream: u64) -> Result<(), u32> {
        if stream == 0 || self.streams.contains_key(&stream) {
            Ok(())
        } else {
            Err(code::INVALID_HANDLE)
        }
    }

    fn location(&self, location: MemLocation) -> Result<Option<usize>, u32> {
        match location.kind {
            LOCATION_DEVICE => self.device(location.id).map(Some),
            LOCATION_HOST | LOCATION_HOST_NUMA | LOCATION_HOST_NUMA_CURRENT => Ok(None),
            _ => Err(code::INVALID_VALUE),
        }
    }

    fn destroy_stream(&mut self, stream: u64) {
        if self.streams.remove(&stream).is_some() {
            self.stats.live_streams -= 1;
        }
    }
}

/// Runs `body` on the simulator state with the call counted, traced and fault-checked.
fn call(name: &str, body: impl FnOnce(&mut Sim) -> Result<(), u32>) -> u32 {
    let mut guard = lock();
    let sim = guard.get_or_insert_with(Sim::default);
    let result = sim.enter(name).and_then(|()| body(sim));
    let code = result.err().unwrap_or(code::SUCCESS);
    if code != code::SUCCESS {
        sim.stats.failed_calls += 1;
    }
    if sim.trace.len() == TRACE_LEN {
        sim.trace.pop_front();
    }
    sim.trace.push_back(format!("{name} -> {code}"));
    let delay = sim
        .delays
        .iter()
        .position(|(n, _)| n == name)
        .map(|i| sim.delays.swap_remove(i).1);
    drop(guard);
    if let Some(micros) = delay {
        // The call has taken effect; its caller only hears of it later (a slow driver, or a
        // thread preempted right after the call): what other threads do meanwhile is the test.
        std::thread::sleep(std::time::Duration::from_micros(micros));
    }
    code
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

macro_rules! entry {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) |$sim:ident| $body:block) => {
        $(#[$doc])*
        ///
        /// # Safety
        ///
        /// Pointer arguments must be null or valid for what the CUDA driver API says of them.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_uint {
            call(stringify!($name), |$sim: &mut Sim| -> Result<(), u32> {
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

entry! {
    /// `cuInit`.
    fn cuInit(flags: c_uint) |sim| {
        if flags != 0 {
            return Err(code::INVALID_VALUE);
        }
        let config = sim.config();
        if config.device_count == 0 {
            return Err(code::NO_DEVICE);
        }
        if !sim.initialized {
            sim.devices = (0..config.device_count)
                .map(|_| Device { used: 0, primary: None, primary_refs: 0 })
                .collect();
            sim.initialized = true;
        }
        Ok(())
    }
}

entry! {
    /// `cuDriverGetVersion`: 12080.
    fn cuDriverGetVersion(version: *mut c_int) |_sim| {
        put(version, 12080)
    }
}

entry! {
    /// `cuDeviceGetCount`.
    fn cuDeviceGetCount(count: *mut c_int) |sim| {
        sim.initialized()?;
        put(count, sim.devices.len() as c_int)
    }
}

entry! {
    /// `cuDeviceGet`.
    fn cuDeviceGet(device: *mut c_int, ordinal: c_int) |sim| {
        sim.device(ordinal)?;
        put(device, ordinal)
    }
}

entry! {
    /// `cuDeviceGetAttribute`.
    fn cuDeviceGetAttribute(value: *mut c_int, attribute: c_uint, device: c_int) |sim| {
        sim.device(device)?;
        let config = sim.config();
        let v = match attribute {
            attr::MANAGED_MEMORY => config.managed,
            attr::CONCURRENT_MANAGED_ACCESS => config.concurrent,
            attr::PAGEABLE_MEMORY_ACCESS => config.pageable,
            attr::HOST_REGISTER_SUPPORTED | attr::CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM => {
                config.host_register
            }
            attr::UNIFIED_ADDRESSING => 1,
            attr::COMPUTE_CAPABILITY_MAJOR => 9,
            attr::COMPUTE_CAPABILITY_MINOR => 0,
            _ => 0,
        };
        put(value, v as c_int)
    }
}

entry! {
    /// `cuDeviceGetName`: "tensor-wasm-mem simulated device N".
    fn cuDeviceGetName(name: *mut c_char, len: c_int, device: c_int) |sim| {
        let d = sim.device(device)?;
        let text = format!("tensor-wasm-mem simulated device {d}\0");
        let len = usize::try_from(len).map_err(|_| code::INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(code::INVALID_VALUE);
        }
        let n = text.len().min(len);
        // SAFETY: `name` is valid for `len >= n` bytes by the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr().cast(), name, n) };
        // SAFETY: as above; `n - 1 < len`.
        unsafe { name.add(n - 1).write(0) };
        Ok(())
    }
}

entry! {
    /// `cuDeviceCanAccessPeer`: every pair of distinct devices can.
    fn cuDeviceCanAccessPeer(can: *mut c_int, device: c_int, peer: c_int) |sim| {
        sim.device(device)?;
        sim.device(peer)?;
        put(can, c_int::from(device != peer))
    }
}

entry! {
    /// `cuDeviceTotalMem_v2`.
    fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) |sim| {
        sim.device(device)?;
        put(bytes, sim.config().memory_bytes as usize)
    }
}

entry! {
    /// `cuMemGetInfo_v2`: of the current context's device.
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) |sim| {
        let d = sim.context_device()?;
        let memory = sim.config().memory_bytes;
        put(free, memory.saturating_sub(sim.devices[d].used) as usize)?;
        put(total, memory as usize)
    }
}

entry! {
    /// `cuDevicePrimaryCtxRetain`.
    fn cuDevicePrimaryCtxRetain(context: *mut *mut c_void, device: c_int) |sim| {
        let d = sim.device(device)?;
        if context.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let handle = match sim.devices[d].primary {
            Some(h) => h,
            None => {
                let h = sim.handle();
                sim.contexts.insert(h, Context { device: d, primary: true });
                sim.devices[d].primary = Some(h);
                h
            }
        };
        sim.devices[d].primary_refs += 1;
        sim.stats.primary_refs += 1;
        put(context, handle as *mut c_void)
    }
}

entry! {
    /// `cuDevicePrimaryCtxRelease_v2`.
    fn cuDevicePrimaryCtxRelease_v2(device: c_int) |sim| {
        let d = sim.device(device)?;
        if sim.devices[d].primary_refs == 0 {
            return Err(code::INVALID_CONTEXT);
        }
        sim.devices[d].primary_refs -= 1;
        sim.stats.primary_refs -= 1;
        Ok(())
    }
}

entry! {
    /// `cuCtxSetCurrent`.
    fn cuCtxSetCurrent(context: *mut c_void) |sim| {
        sim.initialized()?;
        let ctx = context as u64;
        if ctx != 0 && !sim.contexts.contains_key(&ctx) {
            return Err(code::INVALID_CONTEXT);
        }
        set_current(ctx);
        Ok(())
    }
}

entry! {
    /// `cuCtxGetCurrent`.
    fn cuCtxGetCurrent(context: *mut *mut c_void) |sim| {
        sim.initialized()?;
        put(context, current_context() as *mut c_void)
    }
}

entry! {
    /// `cuCtxPushCurrent_v2`.
    fn cuCtxPushCurrent_v2(context: *mut c_void) |sim| {
        sim.initialized()?;
        let ctx = context as u64;
        if !sim.contexts.contains_key(&ctx) {
            return Err(code::INVALID_CONTEXT);
        }
        CONTEXTS.with(|s| s.borrow_mut().push(ctx));
        Ok(())
    }
}

entry! {
    /// `cuCtxPopCurrent_v2`.
    fn cuCtxPopCurrent_v2(context: *mut *mut c_void) |sim| {
        sim.initialized()?;
        let popped = CONTEXTS.with(|s| s.borrow_mut().pop()).ok_or(code::INVALID_CONTEXT)?;
        if !context.is_null() {
            put(context, popped as *mut c_void)?;
        }
        Ok(())
    }
}

entry! {
    /// `cuCtxCreate_v2`: a new context on `device`, made current on this thread.
    fn cuCtxCreate_v2(context: *mut *mut c_void, flags: c_uint, device: c_int) |sim| {
        let d = sim.device(device)?;
        if context.is_null() || flags > 0x3f {
            return Err(code::INVALID_VALUE);
        }
        let h = sim.handle();
        sim.contexts.insert(h, Context { device: d, primary: false });
        sim.stats.live_contexts += 1;
        CONTEXTS.with(|s| s.borrow_mut().push(h));
        put(context, h as *mut c_void)
    }
}

entry! {
    /// `cuCtxDestroy_v2`: destroys a non-primary context and its streams; popped from the
    /// calling thread's stack if it is current there.
    fn cuCtxDestroy_v2(context: *mut c_void) |sim| {
        sim.initialized()?;
        let ctx = context as u64;
        match sim.contexts.get(&ctx) {
            Some(c) if !c.primary => {}
            _ => return Err(code::INVALID_CONTEXT),
        }
        sim.contexts.remove(&ctx);
        sim.stats.live_contexts -= 1;
        let streams: Vec<u64> = sim
            .streams
            .iter()
            .filter(|&(_, &c)| c == ctx)
            .map(|(&s, _)| s)
            .collect();
        for s in streams {
            sim.destroy_stream(s);
        }
        // As the driver: popped if it is current to the calling thread; anywhere else in a
        // thread's stack it stays, dangling (later calls there fail with INVALID_CONTEXT).
        CONTEXTS.with(|s| {
            let mut s = s.borrow_mut();
            if s.last() == Some(&ctx) {
                s.pop();
            }
        });
        Ok(())
    }
}

entry! {
    /// `cuMemAllocManaged`.
    fn cuMemAllocManaged(ptr: *mut u64, bytes: usize, flags: c_uint) |sim| {
        let d = sim.context_device()?;
        if ptr.is_null() || bytes == 0 || !(flags == 1 || flags == 2) {
            return Err(code::INVALID_VALUE);
        }
        let config = sim.config();
        if config.managed == 0 {
            return Err(code::NOT_SUPPORTED);
        }
        if sim.devices[d].used.saturating_add(bytes as u64) > config.memory_bytes {
            return Err(code::OUT_OF_MEMORY);
        }
        let layout = Layout::from_size_align(bytes, ALIGN).map_err(|_| code::OUT_OF_MEMORY)?;
        // SAFETY: `layout` has a non-zero size.
        let memory = unsafe { alloc_zeroed(layout) };
        if memory.is_null() {
            return Err(code::OUT_OF_MEMORY);
        }
        if config.poison != 0 {
            // SAFETY: a fresh allocation of `bytes` bytes.
            unsafe { memory.write_bytes(0xA5, bytes) };
        }
        let address = memory as u64;
        sim.allocations.insert(address, Allocation { len: bytes, layout, device: d, pool: None, hints: Vec::new() });
        sim.devices[d].used += bytes as u64;
        sim.stats.allocations += 1;
        sim.stats.live_allocations += 1;
        sim.stats.live_bytes += bytes as u64;
        put(ptr, address)
    }
}

entry! {
    /// `cuMemHostRegister_v2`: records a host range for device access (device-mapped). The
    /// simulator cannot pin; it keeps the driver's rules: a non-empty range, no overlap with
    /// another registration, `CUDA_ERROR_NOT_SUPPORTED` where the device cannot.
    fn cuMemHostRegister_v2(ptr: *mut c_void, bytes: usize, flags: c_uint) |sim| {
        sim.context_device()?;
        if sim.config().host_register == 0 {
            return Err(code::NOT_SUPPORTED);
        }
        let start = ptr as u64;
        let end = start.checked_add(bytes as u64).ok_or(code::INVALID_VALUE)?;
        if ptr.is_null() || bytes == 0 || flags & !0xf != 0 {
            return Err(code::INVALID_VALUE);
        }
        let overlaps = sim
            .registered
            .range(..end)
            .next_back()
            .is_some_and(|(&b, &n)| start < b + n as u64);
        if overlaps {
            return Err(code::HOST_MEMORY_ALREADY_REGISTERED);
        }
        sim.registered.insert(start, bytes);
        Ok(())
    }
}

entry! {
    /// `cuMemHostUnregister`: `ptr` must be the base of a registered range.
    fn cuMemHostUnregister(ptr: *mut c_void) |sim| {
        sim.context_device()?;
        sim.registered
            .remove(&(ptr as u64))
            .map(|_| ())
            .ok_or(code::HOST_MEMORY_NOT_REGISTERED)
    }
}

entry! {
    /// `cuMemFree_v2`: `ptr` must be the base of a live allocation.
    fn cuMemFree_v2(ptr: u64) |sim| {
        sim.context_device()?;
        if sim.allocations.get(&ptr).is_none_or(|a| a.pool.is_some()) {
            return Err(code::INVALID_VALUE);
        }
        let allocation = sim.allocations.remove(&ptr).ok_or(code::INVALID_VALUE)?;
        sim.devices[allocation.device].used -= allocation.len as u64;
        sim.stats.frees += 1;
        sim.stats.live_allocations -= 1;
        sim.stats.live_bytes -= allocation.len as u64;
        // SAFETY: `ptr` was returned by `alloc_zeroed` with this layout and is freed once (it
        // was just removed from the table).
        unsafe { dealloc(ptr as *mut u8, allocation.layout) };
        Ok(())
    }
}

entry! {
    /// `cuMemsetD8Async`: completes before returning.
    fn cuMemsetD8Async(ptr: u64, value: u8, count: usize, stream: *mut c_void) |sim| {
        sim.context_device()?;
        sim.stream(stream as u64)?;
        sim.range(ptr, count)?;
        // SAFETY: `ptr..ptr + count` lies inside a live allocation of ours (checked above).
        unsafe { (ptr as *mut u8).write_bytes(value, count) };
        Ok(())
    }
}

entry! {
    /// `cuMemAdvise_v2` (CUDA 12.2+, with `CUmemLocation`).
    fn cuMemAdvise_v2(ptr: u64, count: usize, advice: c_uint, location: MemLocation) |sim| {
        sim.context_device()?;
        if count == 0 || !(1..=6).contains(&advice) {
            return Err(code::INVALID_VALUE);
        }
        sim.managed_range(ptr, count)?;
        let mut at = CU_DEVICE_CPU;
        if matches!(advice, 3 | 5 | 6)
            && let Some(device) = sim.location(location)?
        {
            at = device as Ordinal;
        }
        sim.hint(ptr, count, Hint::from_advice(advice, at));
        Ok(())
    }
}

entry! {
    /// `cuMemAdvise` (the CUDA 11 form: a device ordinal, `-1` for the CPU).
    fn cuMemAdvise(ptr: u64, count: usize, advice: c_uint, device: c_int) |sim| {
        sim.context_device()?;
        if count == 0 || !(1..=6).contains(&advice) {
            return Err(code::INVALID_VALUE);
        }
        sim.managed_range(ptr, count)?;
        if matches!(advice, 3 | 5 | 6) && device != CU_DEVICE_CPU {
            sim.device(device)?;
        }
        sim.hint(ptr, count, Hint::from_advice(advice, device));
        Ok(())
    }
}

#[cfg(not(twm_sim_without_prefetch))]
entry! {
    /// `cuMemPrefetchAsync_v2` (CUDA 12.2+, with `CUmemLocation`).
    fn cuMemPrefetchAsync_v2(ptr: u64, count: usize, location: MemLocation, flags: c_uint, stream: *mut c_void) |sim| {
        sim.context_device()?;
        if count == 0 || flags != 0 {
            return Err(code::INVALID_VALUE);
        }
        sim.managed_range(ptr, count)?;
        sim.stream(stream as u64)?;
        let to = sim.location(location)?;
        if to.is_some() && sim.config().concurrent == 0 {
            return Err(code::INVALID_DEVICE);
        }
        let at = to.map_or(CU_DEVICE_CPU, |d| d as Ordinal);
        sim.hint(ptr, count, Hint::Resident(at));
        Ok(())
    }
}

entry! {
    /// `cuMemPrefetchAsync` (the CUDA 11 form: a device ordinal, `-1` for the CPU).
    fn cuMemPrefetchAsync(ptr: u64, count: usize, device: c_int, stream: *mut c_void) |sim| {
        sim.context_device()?;
        if count == 0 {
            return Err(code::INVALID_VALUE);
        }
        sim.managed_range(ptr, count)?;
        sim.stream(stream as u64)?;
        if device != CU_DEVICE_CPU {
            sim.device(device)?;
            if sim.config().concurrent == 0 {
                return Err(code::INVALID_DEVICE);
            }
        }
        sim.hint(ptr, count, Hint::Resident(device));
        Ok(())
    }
}

entry! {
    /// `cuModuleLoadData`: any image (the simulated kernels are named by `cuModuleGetFunction`).
    fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) |sim| {
        sim.context_device()?;
        if module.is_null() || image.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let h = sim.handle();
        sim.modules.insert(h, ());
        put(module, h as *mut c_void)
    }
}

entry! {
    /// `cuModuleGetFunction`: `increment` and `fill` exist; any other name is
    /// `CUDA_ERROR_NOT_FOUND`.
    fn cuModuleGetFunction(function: *mut *mut c_void, module: *mut c_void, name: *const c_char) |sim| {
        sim.context_device()?;
        if function.is_null() || name.is_null() {
            return Err(code::INVALID_VALUE);
        }
        if !sim.modules.contains_key(&(module as u64)) {
            return Err(code::INVALID_HANDLE);
        }
        // SAFETY: a NUL-terminated string by the caller's contract (checked non-null).
        let name = unsafe { CStr::from_ptr(name) };
        let kernel = Kernel::by_name(name.to_bytes()).ok_or(code::NOT_FOUND)?;
        let h = sim.handle();
        sim.functions.insert(h, (module as u64, kernel));
        put(function, h as *mut c_void)
    }
}

entry! {
    /// `cuModuleUnload`: its functions go with it.
    fn cuModuleUnload(module: *mut c_void) |sim| {
        sim.initialized()?;
        let m = module as u64;
        if sim.modules.remove(&m).is_none() {
            return Err(code::INVALID_HANDLE);
        }
        sim.functions.retain(|_, (owner, _)| *owner != m);
        Ok(())
    }
}

entry! {
    /// `cuLaunchKernel`: runs the simulated kernel at once (completing before the call returns,
    /// like everything here), with its parameters read from `params`. A range outside every
    /// live allocation is `CUDA_ERROR_ILLEGAL_ADDRESS` (not sticky here: the simulator keeps no
    /// per-context error state).
    fn cuLaunchKernel(
        function: *mut c_void,
        grid_x: c_uint, grid_y: c_uint, grid_z: c_uint,
        block_x: c_uint, block_y: c_uint, block_z: c_uint,
        shared_bytes: c_uint, stream: *mut c_void,
        params: *mut *mut c_void, extra: *mut *mut c_void,
    ) |sim| {
        sim.context_device()?;
        let _ = (grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes);
        let &(_, kernel) = sim.functions.get(&(function as u64)).ok_or(code::INVALID_HANDLE)?;
        sim.stream(stream as u64)?;
        if params.is_null() || !extra.is_null() {
            return Err(code::INVALID_VALUE);
        }
        // SAFETY: `params` points to one pointer per kernel parameter, each to its value, by
        // the launch contract: increment (u64, u64), fill (u64, u64, u32).
        let (data, len) = unsafe {
            (
                (*params.add(0)).cast::<u64>().read_unaligned(),
                (*params.add(1)).cast::<u64>().read_unaligned(),
            )
        };
        let len = usize::try_from(len).map_err(|_| code::ILLEGAL_ADDRESS)?;
        // Managed memory, or a registered host range (device-mapped at its own address).
        let end = data.checked_add(len as u64).ok_or(code::ILLEGAL_ADDRESS)?;
        let registered = sim
            .registered
            .range(..=data)
            .next_back()
            .is_some_and(|(&b, &n)| end <= b + n as u64);
        if !registered {
            sim.range(data, len).map_err(|_| code::ILLEGAL_ADDRESS)?;
        }
        // Raw writes, as a device's: no Rust reference to the guest's bytes is made.
        let base = data as *mut u8;
        match kernel {
            Kernel::Increment => {
                for i in 0..len {
                    // SAFETY: `data..data + len` lies inside a live allocation of ours or a
                    // registered host range, whose owner keeps it mapped until it unregisters
                    // (checked above); `i < len`.
                    unsafe { base.add(i).write(base.add(i).read().wrapping_add(1)) };
                }
            }
            Kernel::Fill => {
                // SAFETY: the third parameter of `fill` is a u32, by the launch contract.
                let value = unsafe { (*params.add(2)).cast::<u32>().read_unaligned() };
                // SAFETY: as above, for the whole range.
                unsafe { base.write_bytes(value as u8, len) };
            }
        }
        Ok(())
    }
}

entry! {
    /// `cuStreamCreate`: in the current context.
    fn cuStreamCreate(stream: *mut *mut c_void, flags: c_uint) |sim| {
        sim.context_device()?;
        if stream.is_null() || flags > 1 {
            return Err(code::INVALID_VALUE);
        }
        let h = sim.handle();
        sim.streams.insert(h, current_context());
        sim.stats.live_streams += 1;
        put(stream, h as *mut c_void)
    }
}

entry! {
    /// `cuStreamDestroy_v2`.
    fn cuStreamDestroy_v2(stream: *mut c_void) |sim| {
        sim.initialized()?;
        let s = stream as u64;
        if !sim.streams.contains_key(&s) {
            return Err(code::INVALID_HANDLE);
        }
        sim.destroy_stream(s);
        Ok(())
    }
}

entry! {
    /// `cuStreamSynchronize`: everything already completed.
    fn cuStreamSynchronize(stream: *mut c_void) |sim| {
        sim.context_device()?;
        sim.stream(stream as u64)
    }
}

entry! {
    /// `cuMemPoolCreate`: pinned device memory on one device, `maxSize` honoured.
    fn cuMemPoolCreate(pool: *mut *mut c_void, props: *const MemPoolProps) |sim| {
        sim.initialized()?;
        if pool.is_null() || props.is_null() {
            return Err(code::INVALID_VALUE);
        }
        // SAFETY: non-null, valid by the caller's contract.
        let props = props.read();
        if props.alloc_type != 1 || props.location.kind != LOCATION_DEVICE {
            return Err(code::INVALID_VALUE);
        }
        let device = sim.device(props.location.id)?;
        let h = sim.handle();
        sim.pools.insert(h, Pool {
            device,
            max_size: props.max_size as u64,
            release_threshold: 0,
            reserved: 0,
            reserved_high: 0,
            used: 0,
            used_high: 0,
            cached: Vec::new(),
        });
        sim.stats.live_pools += 1;
        put(pool, h as *mut c_void)
    }
}

entry! {
    /// `cuMemPoolDestroy`: frees what is still allocated from the pool.
    fn cuMemPoolDestroy(pool: *mut c_void) |sim| {
        sim.initialized()?;
        let h = pool as u64;
        if !sim.pools.contains_key(&h) {
            return Err(code::INVALID_VALUE);
        }
        let live: Vec<u64> = sim
            .allocations
            .iter()
            .filter(|(_, a)| a.pool == Some(h))
            .map(|(&p, _)| p)
            .collect();
        for ptr in live {
            if let Some(a) = sim.allocations.remove(&ptr) {
                sim.stats.live_pool_allocations -= 1;
                if let Some(p) = sim.pools.get_mut(&h) {
                    p.used -= a.len as u64;
                    p.cached.push((ptr, a.layout));
                }
            }
        }
        sim.release_pool_memory(h, 0);
        sim.pools.remove(&h);
        sim.stats.live_pools -= 1;
        Ok(())
    }
}

entry! {
    /// `cuMemAllocFromPoolAsync`: memory is not zeroed (a kept block keeps what it held; a new
    /// one is filled with `0xA5`, as uninitialised device memory would hold anything).
    fn cuMemAllocFromPoolAsync(ptr: *mut u64, bytes: usize, pool: *mut c_void, stream: *mut c_void) |sim| {
        sim.context_device()?;
        sim.stream(stream as u64)?;
        let h = pool as u64;
        if ptr.is_null() || bytes == 0 {
            return Err(code::INVALID_VALUE);
        }
        let memory = sim.config().memory_bytes;
        let layout = Layout::from_size_align(bytes, 256).map_err(|_| code::OUT_OF_MEMORY)?;
        let p = sim.pools.get_mut(&h).ok_or(code::INVALID_VALUE)?;
        let device = p.device;
        let address = match p.cached.iter().position(|(_, l)| *l == layout) {
            Some(i) => p.cached.swap_remove(i).0,
            None => {
                let size = layout.size() as u64;
                if (p.max_size > 0 && p.reserved + size > p.max_size)
                    || sim.devices[device].used + size > memory
                {
                    return Err(code::OUT_OF_MEMORY);
                }
                // SAFETY: `layout` has a non-zero size.
                let block = unsafe { alloc_zeroed(layout) };
                if block.is_null() {
                    return Err(code::OUT_OF_MEMORY);
                }
                // SAFETY: a fresh block of `bytes` bytes.
                unsafe { block.write_bytes(0xA5, bytes) };
                p.reserved += size;
                p.reserved_high = p.reserved_high.max(p.reserved);
                sim.devices[device].used += size;
                sim.stats.pool_reserved_bytes += size;
                block as u64
            }
        };
        let p = sim.pools.get_mut(&h).ok_or(code::INVALID_VALUE)?;
        p.used += bytes as u64;
        p.used_high = p.used_high.max(p.used);
        sim.allocations.insert(address, Allocation { len: bytes, layout, device, pool: Some(h), hints: Vec::new() });
        sim.stats.live_pool_allocations += 1;
        put(ptr, address)
    }
}

entry! {
    /// `cuMemFreeAsync`: back to the pool, which keeps up to its release threshold.
    fn cuMemFreeAsync(ptr: u64, stream: *mut c_void) |sim| {
        sim.context_device()?;
        sim.stream(stream as u64)?;
        let Some(h) = sim.allocations.get(&ptr).and_then(|a| a.pool) else {
            return Err(code::INVALID_VALUE);
        };
        let allocation = sim.allocations.remove(&ptr).ok_or(code::INVALID_VALUE)?;
        sim.stats.live_pool_allocations -= 1;
        let threshold = match sim.pools.get_mut(&h) {
            Some(p) => {
                p.used -= allocation.len as u64;
                p.cached.push((ptr, allocation.layout));
                p.release_threshold
            }
            None => return Err(code::INVALID_VALUE),
        };
        sim.release_pool_memory(h, threshold);
        Ok(())
    }
}

entry! {
    /// `cuMemPoolTrimTo`.
    fn cuMemPoolTrimTo(pool: *mut c_void, keep: usize) |sim| {
        sim.initialized()?;
        let h = pool as u64;
        if !sim.pools.contains_key(&h) {
            return Err(code::INVALID_VALUE);
        }
        sim.release_pool_memory(h, keep as u64);
        Ok(())
    }
}

entry! {
    /// `cuMemPoolSetAttribute`: the release threshold (4) and the reuse flags (1-3).
    fn cuMemPoolSetAttribute(pool: *mut c_void, attribute: c_uint, value: *mut c_void) |sim| {
        sim.initialized()?;
        let p = sim.pools.get_mut(&(pool as u64)).ok_or(code::INVALID_VALUE)?;
        if value.is_null() {
            return Err(code::INVALID_VALUE);
        }
        match attribute {
            1..=3 => Ok(()),
            // SAFETY: a `cuuint64_t` for this attribute, by the caller's contract.
            4 => { p.release_threshold = value.cast::<u64>().read(); Ok(()) }
            _ => Err(code::INVALID_VALUE),
        }
    }
}

entry! {
    /// `cuMemPoolGetAttribute`: threshold (4), reserved current/high (5, 6), used current/high
    /// (7, 8).
    fn cuMemPoolGetAttribute(pool: *mut c_void, attribute: c_uint, value: *mut c_void) |sim| {
        sim.initialized()?;
        let p = sim.pools.get(&(pool as u64)).ok_or(code::INVALID_VALUE)?;
        let v = match attribute {
            4 => p.release_threshold,
            5 => p.reserved,
            6 => p.reserved_high,
            7 => p.used,
            8 => p.used_high,
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
        None => code::INVALID_VALUE,
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
        None => code::INVALID_VALUE,
    }
}

// ---- Knobs -------------------------------------------------------------------------------------

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
    let config = unsafe { config.read() };
    lock().get_or_insert_with(Sim::default).config = Some(config);
    code::SUCCESS
}

/// Frees everything still allocated, forgets every context and stream, and clears counters,
/// faults and the trace: the next `cuInit` starts a fresh machine (the configuration is kept).
#[unsafe(no_mangle)]
pub extern "C" fn twm_sim_reset() {
    let mut guard = lock();
    let old = guard.take().unwrap_or_default();
    for (address, allocation) in old.allocations {
        // SAFETY: every table entry is a live allocation made with this layout.
        unsafe { dealloc(address as *mut u8, allocation.layout) };
    }
    for (address, layout) in old.pools.into_values().flat_map(|p| p.cached) {
        // SAFETY: every kept pool block was allocated with this layout and has no holder.
        unsafe { dealloc(address as *mut u8, layout) };
    }
    *guard = Some(Sim {
        config: old.config,
        ..Sim::default()
    });
    CONTEXTS.with(|s| s.borrow_mut().clear());
}

/// Copies the advice and residency in force at `ptr` (inside a live managed allocation) to
/// `out`; `CUDA_ERROR_INVALID_VALUE` for any other address.
///
/// # Safety
///
/// `out` must be valid for a write of [`SimHints`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_hints(ptr: u64, out: *mut SimHints) -> c_uint {
    let hints = lock().get_or_insert_with(Sim::default).hints_at(ptr);
    // SAFETY: guaranteed by the caller.
    match hints.and_then(|h| unsafe { put(out, h) }) {
        Ok(()) => code::SUCCESS,
        Err(e) => e,
    }
}

/// Copies the counters to `out`.
///
/// # Safety
///
/// `out` must be valid for a write of [`SimStats`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_stats(out: *mut SimStats) -> c_uint {
    let stats = lock().get_or_insert_with(Sim::default).stats;
    // SAFETY: guaranteed by the caller.
    match unsafe { put(out, stats) } {
        Ok(()) => code::SUCCESS,
        Err(e) => e,
    }
}

/// Makes the `nth` call from now of the entry point `name` return `error` (a `CUresult` this
/// simulator knows; others are refused with `CUDA_ERROR_INVALID_VALUE`).
///
/// # Safety
///
/// `name` must be a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_fail_nth(name: *const c_char, nth: u64, error: c_uint) -> c_uint {
    if name.is_null() || nth == 0 || error == code::SUCCESS || code::describe(error).is_none() {
        return code::INVALID_VALUE;
    }
    // SAFETY: a valid C string by the caller's contract.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    let mut guard = lock();
    let sim = guard.get_or_insert_with(Sim::default);
    let done = sim.calls.get(&name).copied().unwrap_or(0);
    sim.faults.push(Fault {
        name,
        call: done + nth,
        code: error,
    });
    code::SUCCESS
}

/// Removes every pending injected failure and delay.
#[unsafe(no_mangle)]
pub extern "C" fn twm_sim_clear_faults() {
    let mut guard = lock();
    let sim = guard.get_or_insert_with(Sim::default);
    sim.faults.clear();
    sim.delays.clear();
}

/// Makes the next call of the entry point `name` return to its caller only `micros`
/// microseconds after it has taken effect (the simulator's lock released meanwhile).
///
/// # Safety
///
/// `name` must be a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_delay_next(name: *const c_char, micros: u64) -> c_uint {
    if name.is_null() {
        return code::INVALID_VALUE;
    }
    // SAFETY: a valid C string by the caller's contract.
    let name = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    lock()
        .get_or_insert_with(Sim::default)
        .delays
        .push((name, micros));
    code::SUCCESS
}

/// The depth of the calling thread's context stack.
#[unsafe(no_mangle)]
pub extern "C" fn twm_sim_context_depth() -> u64 {
    CONTEXTS.with(|s| s.borrow().len() as u64)
}

/// Calls of the entry point `name` so far.
///
/// # Safety
///
/// `name` must be a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_calls(name: *const c_char) -> u64 {
    if name.is_null() {
        return 0;
    }
    // SAFETY: a valid C string by the caller's contract.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    lock()
        .get_or_insert_with(Sim::default)
        .calls
        .get(name.as_ref())
        .copied()
        .unwrap_or(0)
}

/// Writes the last calls (`name -> code`, one per line) to `buffer` (at most `capacity` bytes)
/// and returns the length of the whole trace.
///
/// # Safety
///
/// `buffer` must be null or valid for `capacity` bytes of writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn twm_sim_trace(buffer: *mut u8, capacity: usize) -> usize {
    let text: String = lock()
        .get_or_insert_with(Sim::default)
        .trace
        .iter()
        .map(|l| format!("{l}\n"))
        .collect();
    if !buffer.is_null() {
        let n = text.len().min(capacity);
        // SAFETY: `buffer` is valid for `capacity >= n` bytes by the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), buffer, n) };
    }
    text.len()
}

#[cfg(test)]
mod tests {
    //! The simulator's rules, called directly (one test: the state is process-wide).
    use super::*;

    fn location(kind: c_uint, id: c_int) -> MemLocation {
        MemLocation { kind, id }
    }

    #[test]
    fn rules() {
        // SAFETY: every pointer passed below is valid for what the entry point writes.
        unsafe {
            twm_sim_reset();
            let mut ptr = 0u64;
            assert_eq!(cuMemAllocManaged(&mut ptr, 64, 1), code::NOT_INITIALIZED);
            assert_eq!(cuInit(0), code::SUCCESS);
            assert_eq!(cuMemAllocManaged(&mut ptr, 64, 1), code::INVALID_CONTEXT);
            let mut ctx = std::ptr::null_mut();
            assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), code::SUCCESS);
            assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 1), code::INVALID_DEVICE);
            assert_eq!(cuCtxSetCurrent(ctx), code::SUCCESS);
            assert_eq!(cuMemAllocManaged(&mut ptr, 0, 1), code::INVALID_VALUE);
            assert_eq!(cuMemAllocManaged(&mut ptr, 8192, 1), code::SUCCESS);
            assert_eq!(ptr % 4096, 0);
            assert_eq!(
                cuMemAllocManaged(&mut ptr.clone(), 5 << 30, 1),
                code::OUT_OF_MEMORY
            );
            let host = location(LOCATION_HOST, 0);
            let dev = location(LOCATION_DEVICE, 0);
            assert_eq!(cuMemAdvise_v2(ptr, 8192, 1, host), code::SUCCESS);
            assert_eq!(cuMemAdvise_v2(ptr + 1, 8192, 1, host), code::INVALID_VALUE);
            assert_eq!(
                cuMemAdvise_v2(ptr, 16, 3, location(LOCATION_DEVICE, 3)),
                code::INVALID_DEVICE
            );
            assert_eq!(cuMemAdvise_v2(ptr, 16, 7, dev), code::INVALID_VALUE);
            assert_eq!(
                cuMemPrefetchAsync_v2(ptr, 8192, dev, 0, std::ptr::null_mut()),
                code::SUCCESS
            );
            assert_eq!(
                cuMemPrefetchAsync_v2(ptr, 8192, dev, 0, 77 as *mut c_void),
                code::INVALID_HANDLE
            );
            assert_eq!(cuMemAdvise(ptr, 16, 5, CU_DEVICE_CPU), code::SUCCESS);
            assert_eq!(
                cuMemPrefetchAsync(ptr, 16, 4, std::ptr::null_mut()),
                code::INVALID_DEVICE
            );
            (ptr as *mut u8).write_bytes(0xff, 8192);
            let mut stream = std::ptr::null_mut();
            assert_eq!(cuStreamCreate(&mut stream, 1), code::SUCCESS);
            assert_eq!(cuMemsetD8Async(ptr + 100, 0, 50, stream), code::SUCCESS);
            assert_eq!(
                cuMemsetD8Async(ptr + 8000, 0, 193, stream),
                code::INVALID_VALUE
            );
            assert_eq!(*(ptr as *const u8).add(99), 0xff);
            assert_eq!(*(ptr as *const u8).add(100), 0);
            assert_eq!(*(ptr as *const u8).add(150), 0xff);
            assert_eq!(cuStreamSynchronize(stream), code::SUCCESS);
            assert_eq!(cuStreamDestroy_v2(stream), code::SUCCESS);
            assert_eq!(cuStreamDestroy_v2(stream), code::INVALID_HANDLE);
            // Failure injection: the 2nd cuMemFree_v2 from now.
            assert_eq!(
                twm_sim_fail_nth(c"cuMemFree_v2".as_ptr(), 2, code::UNKNOWN),
                0
            );
            let mut other = 0u64;
            assert_eq!(cuMemAllocManaged(&mut other, 16, 1), code::SUCCESS);
            assert_eq!(cuMemFree_v2(other), code::SUCCESS);
            assert_eq!(cuMemFree_v2(ptr), code::UNKNOWN);
            assert_eq!(cuMemFree_v2(ptr), code::SUCCESS);
            assert_eq!(cuMemFree_v2(ptr), code::INVALID_VALUE);
            // Contexts.
            let mut own = std::ptr::null_mut();
            assert_eq!(cuCtxCreate_v2(&mut own, 0, 0), code::SUCCESS);
            assert_eq!(cuStreamCreate(&mut stream, 0), code::SUCCESS);
            let mut stats = SimStats::default();
            twm_sim_stats(&mut stats);
            assert_eq!(
                (
                    stats.live_contexts,
                    stats.live_streams,
                    stats.live_allocations
                ),
                (1, 1, 0)
            );
            assert_eq!(cuCtxDestroy_v2(own), code::SUCCESS);
            assert_eq!(cuCtxDestroy_v2(ctx), code::INVALID_CONTEXT, "primary");
            twm_sim_stats(&mut stats);
            assert_eq!(
                (stats.live_contexts, stats.live_streams),
                (0, 0),
                "streams die with it"
            );
            assert_eq!(stats.injected, 1);
            assert_eq!(twm_sim_calls(c"cuMemFree_v2".as_ptr()), 4);
            let len = twm_sim_trace(std::ptr::null_mut(), 0);
            let mut buf = vec![0u8; len];
            twm_sim_trace(buf.as_mut_ptr(), len);
            assert!(
                String::from_utf8(buf)
                    .unwrap()
                    .contains("cuMemFree_v2 -> 999")
            );
            let mut text = std::ptr::null();
            assert_eq!(cuGetErrorName(code::OUT_OF_MEMORY, &mut text), 0);
            assert_eq!(CStr::from_ptr(text), c"CUDA_ERROR_OUT_OF_MEMORY");
            // Zero devices.
            twm_sim_configure(&SimConfig {
                device_count: 0,
                ..SimConfig::default()
            });
            twm_sim_reset();
            assert_eq!(cuInit(0), code::NO_DEVICE);
            twm_sim_configure(&SimConfig::default());
            twm_sim_reset();
        }
    }
}
