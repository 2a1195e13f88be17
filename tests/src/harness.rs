//! How the suite reaches a backend: [`Harness`], and the harnesses of the backends in this
//! workspace.

use std::sync::Arc;

use tensor_wasm_mem_core::{Allocation, Location, Operation, Stream};
use tensor_wasm_mem_mock::{MockBackend, MockConfig};

/// A driver call held after it took effect ([`FaultControl::hold_next`]): the test waits for it to
/// be held, does what the race needs, then lets it return. Dropped, it lets the call return.
pub struct Held {
    wait: Box<dyn Fn(std::time::Duration) -> bool + Send + Sync>,
    release: Box<dyn Fn() + Send + Sync>,
}

impl Held {
    /// A hold over a backend's own controls: `wait` waits up to its limit for the call to be
    /// held, `release` lets it go (called once; again is harmless).
    pub fn new(
        wait: impl Fn(std::time::Duration) -> bool + Send + Sync + 'static,
        release: impl Fn() + Send + Sync + 'static,
    ) -> Self {
        Self {
            wait: Box::new(wait),
            release: Box::new(release),
        }
    }

    /// Waits until the call has taken effect and is held. Panics if it was not within a minute:
    /// a bound for a broken test, never a timing the case relies on.
    pub fn wait_held(&self) {
        assert!(
            (self.wait)(std::time::Duration::from_secs(60)),
            "the held call never took effect"
        );
    }

    /// Lets the held call return to its caller.
    pub fn release(self) {}
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").finish_non_exhaustive()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        (self.release)();
    }
}

/// When stream work completes, as a case can count on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// At the call that queued it (the mock and the simulated driver by default).
    AtCall,
    /// Only when the device gets to it (a wait, a synchronise): a case may check that a host
    /// read before the wait sees the old bytes.
    Deferred,
    /// At times the test does not choose (a background "device", a real GPU): a case may see
    /// work done, or not yet, at any point before it waits.
    OnItsOwn,
}

/// What the suite needs from a backend: a small core (the backend, and the facts every backend
/// has), plus optional capabilities a backend has or lacks as a whole ([`Counters`],
/// [`FaultControl`], [`DeviceWork`], [`Inspection`]). A case that needs a capability the backend
/// lacks (a real driver has no fault knobs) calls [`skip`](crate::runner::skip) and is reported
/// as ignored, never as passed.
pub trait Harness: 'static {
    /// The backend type (every backend trait, as the Wasmtime integration needs them: one
    /// bound list, the integration's).
    type Backend: tensor_wasm_mem_wasmtime::Backend;

    /// A fresh backend instance with at least one device.
    fn backend() -> Arc<Self::Backend>;

    /// `true` when the backend has device memory pools (others must answer `Unsupported`).
    fn has_device_pools(backend: &Self::Backend) -> bool;

    /// When stream work completes.
    fn completion(_backend: &Self::Backend) -> Completion {
        Completion::AtCall
    }

    /// The largest request that must fail with out-of-memory on this backend.
    fn too_much(_backend: &Self::Backend) -> usize {
        usize::MAX / 2
    }

    /// `true` on a real GPU driver, where a context costs tens of milliseconds: the thread
    /// cases then run fewer rounds (see [`rounds`](Self::rounds)).
    fn real_driver() -> bool {
        false
    }

    /// How many rounds a thread case runs: `full` on the mock and the simulated driver, a
    /// fiftieth (at least 20) on a real GPU, so the GPU kit stays inside its time budget.
    fn rounds(full: usize) -> usize {
        if Self::real_driver() {
            (full / 50).max(20)
        } else {
            full
        }
    }

    /// What the driver below still holds (allocations, streams, contexts, pools) once every
    /// backend has dropped, where it can be inspected.
    fn driver_holds() -> Option<[u64; 4]> {
        None
    }

    /// The backend's live counters, where it has them.
    fn counters(_backend: &Self::Backend) -> Option<Box<dyn Counters + '_>> {
        None
    }

    /// Control over the driver's calls (failures, holds), where the driver offers it.
    fn faults(_backend: &Self::Backend) -> Option<Box<dyn FaultControl + '_>> {
        None
    }

    /// Simulated kernels and events the harness can queue, where it has them (a real GPU here
    /// has no PTX for them).
    fn kernels(_backend: &Self::Backend) -> Option<Box<dyn DeviceWork + '_>> {
        None
    }

    /// What the driver lets a test look at (hazards, hints, the context stack).
    fn inspect(_backend: &Self::Backend) -> Option<Box<dyn Inspection + '_>> {
        None
    }
}

/// What a backend holds now, cross-checked against the driver below it where that can be
/// read (so nothing leaks below the backend either).
pub trait Counters {
    /// Allocations alive now.
    fn live_allocations(&self) -> u64;
    /// Streams alive now (the shared default stream not counted).
    fn live_streams(&self) -> u64;
    /// Per-tenant contexts alive now.
    fn live_contexts(&self) -> u64;
    /// Device memory pools alive now.
    fn live_pools(&self) -> u64;
    /// Allocations a recovery's reset destroyed whose owners may still free them (lost
    /// records).
    fn lost_allocations(&self) -> u64;
}

/// Making the driver's calls fail, or hold, on purpose.
pub trait FaultControl {
    /// Makes the `n`-th call of `op` from now fail (out of memory for an allocation, an
    /// unknown error otherwise); `false` if `op` cannot be made to fail here.
    fn fail_nth(&self, op: Operation, n: u64) -> bool;
    /// Makes the `n`-th driver call for `op` from now answer `code`, any integer (a code no
    /// CUDA enum knows included); `false` if `op` cannot be made to fail here.
    fn fail_nth_with(&self, op: Operation, n: u64, code: u32) -> bool;
    /// Makes the `n`-th driver release of `what` from now fail.
    fn fail_release(&self, what: Release, n: u64);
    /// Removes pending injected failures.
    fn clear(&self);
    /// Holds the next call of `op` (`PoolFree`, `Free` and `Allocate` at least) after it took
    /// effect, until the test releases it ([`Held`]); `None` for another `op`.
    fn hold_next(&self, op: Operation) -> Option<Held>;
}

/// Work the harness queues on a device itself: simulated kernels and events.
pub trait DeviceWork {
    /// Queues the simulated `fill` kernel (`len` bytes of `byte` at `ptr`) on `stream`.
    ///
    /// # Safety
    ///
    /// When the kernel runs, nothing else may access `ptr..ptr + len`.
    unsafe fn fill(&self, stream: &Stream, ptr: u64, len: usize, byte: u8);
    /// Makes `stream`'s context fault for good, as a kernel writing outside every allocation
    /// does (a sticky error: every later call in that context fails).
    fn fault(&self, stream: &Stream);
    /// Orders `to`'s later work after `from`'s work so far, with an event (`cuEventRecord` on
    /// `from`, `cuStreamWaitEvent` on `to`).
    fn event_between(&self, from: &Stream, to: &Stream);
}

/// What the driver lets a test look at.
pub trait Inspection {
    /// The driver's hazard counters: memsets queued over another stream's pending work, frees
    /// of memory queued work still targets, kernel faults.
    fn hazards(&self) -> [u64; 3];
    /// The advice and residency in force at `offset` of `allocation`.
    fn hints(&self, allocation: &Allocation, offset: usize) -> Option<HintState>;
    /// `true` when pool memory can be read from the host (a simulated device): the suite then
    /// checks that pool allocations come zero-filled.
    fn pool_memory_host_readable(&self) -> bool;
    /// The calling thread's driver context stack (depth, current context).
    fn context_stack(&self) -> (u64, u64);
    /// Pushes `context` on the calling thread's context stack, as an embedder's own CUDA code
    /// would.
    fn push_context(&self, context: u64);
    /// Pops the calling thread's context stack.
    fn pop_context(&self);
}

/// An address no allocation ever covers: a simulated kernel that writes there faults.
pub const FAULT_AT: u64 = 0x10;

/// The advice and residency at one address, as the suite compares them across backends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HintState {
    /// Read-mostly is in force.
    pub read_mostly: bool,
    /// The preferred location, if any.
    pub preferred: Option<Location>,
    /// Accessed-by locations, in ascending order (the host first).
    pub accessed_by: Vec<Location>,
    /// Where the address was last placed by device work or a prefetch (`None`: never).
    /// Residency is where the pages are, not a hint: a reset leaves it.
    pub resident: Option<Location>,
}

impl HintState {
    /// What a fresh allocation has: no advice. (Where its pages are is not a hint: a reset
    /// leaves them where they are, and a scrub never moves them.)
    #[must_use]
    pub fn is_pristine(&self) -> bool {
        !self.read_mostly && self.preferred.is_none() && self.accessed_by.is_empty()
    }

    /// From the simulated libcuda's answer.
    #[must_use]
    pub fn from_sim(hints: crate::sim::SimHints) -> Self {
        let location = |ordinal: i32| match ordinal {
            crate::sim::SimHints::NONE => None,
            -1 => Some(Location::Host),
            d => u32::try_from(d)
                .ok()
                .map(|d| Location::Device(tensor_wasm_mem_core::DeviceId(d))),
        };
        Self {
            read_mostly: hints.read_mostly != 0,
            preferred: location(hints.preferred),
            accessed_by: (0..64)
                .filter(|bit| hints.accessed_by & (1 << bit) != 0)
                .filter_map(|bit| location(bit - 1))
                .collect(),
            resident: location(hints.resident),
        }
    }
}

/// A driver release a case makes fail (beyond the trait operations of `Operation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Destroying a stream (`cuStreamDestroy`).
    StreamDestroy,
    /// Destroying a tenant's context (`cuCtxDestroy`).
    ContextDestroy,
    /// Destroying a device pool (`cuMemPoolDestroy`).
    PoolDestroy,
    /// Making a context current (`cuCtxPushCurrent`).
    ContextPush,
}

/// The mock backend, in its default configuration (memory comes zeroed).
#[derive(Debug)]
pub struct MockHarness;

/// The mock backend with poisoned fresh memory (`comes_zeroed = false`), like a real driver: every
/// zeroing path of the core is exercised.
#[derive(Debug)]
pub struct PoisonedMockHarness;

/// The mock backend with deferred streams: stream work (memsets, prefetches, kernels, pool
/// frees, event records) completes only when the device gets to it, as on a GPU.
#[derive(Debug)]
pub struct DeferredMockHarness;

/// The mock backend with eight devices and deferred streams: every case on a machine shaped like
/// a GPU server (the cases that name a device use each of them).
#[derive(Debug)]
pub struct EightDeviceDeferredMockHarness;

fn mock_harness_impl(config: MockConfig) -> Arc<MockBackend> {
    Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
        device_memory_bytes: 4 << 30,
        // As on nearly every real GPU: device-mapped host registration; and pageable memory
        // access (HMM), so the suite runs the guarded backing's pageable path on every mock.
        host_registration: true,
        pageable_memory_access: true,
        ..config
    }))
}

/// Every capability of the model, over one mock backend.
struct ModelControls<'a>(&'a MockBackend);

impl Counters for ModelControls<'_> {
    fn live_allocations(&self) -> u64 {
        let (ours, model) = (self.0.stats(), self.0.driver().stats());
        agree("allocations", ours.live_allocations, model.live_allocations)
    }
    fn live_streams(&self) -> u64 {
        let (ours, model) = (self.0.stats(), self.0.driver().stats());
        agree("streams", ours.live_streams, model.live_streams)
    }
    fn live_contexts(&self) -> u64 {
        let (ours, model) = (self.0.stats(), self.0.driver().stats());
        agree("contexts", ours.live_contexts, model.live_contexts)
    }
    fn live_pools(&self) -> u64 {
        let (ours, model) = (self.0.stats(), self.0.driver().stats());
        agree(
            "pool allocations",
            ours.live_pool_allocations,
            model.live_pool_allocations,
        );
        agree("pools", ours.live_pools, model.live_pools)
    }
    fn lost_allocations(&self) -> u64 {
        self.0.stats().lost_allocations
    }
}

/// `ours`, once the driver below agrees.
fn agree(what: &str, ours: u64, driver: u64) -> u64 {
    assert_eq!(driver, ours, "{what}: the driver and the backend disagree");
    ours
}

impl FaultControl for ModelControls<'_> {
    fn fail_nth(&self, op: Operation, n: u64) -> bool {
        self.0.driver().fail_nth(op, n)
    }
    fn fail_nth_with(&self, op: Operation, n: u64, code: u32) -> bool {
        match tensor_wasm_mem_mock::Call::for_operation(op) {
            Some(call) => {
                self.0.driver().fail_call(call, n, code);
                true
            }
            None => false,
        }
    }
    fn fail_release(&self, what: Release, n: u64) {
        use tensor_wasm_mem_mock::{Call, code};
        let call = match what {
            Release::StreamDestroy => Call::StreamDestroy,
            Release::PoolDestroy => Call::PoolDestroy,
            Release::ContextDestroy => Call::CtxDestroy,
            Release::ContextPush => Call::CtxPush,
        };
        self.0.driver().fail_call(call, n, code::UNKNOWN);
    }
    fn clear(&self) {
        self.0.driver().clear_faults();
    }
    fn hold_next(&self, op: Operation) -> Option<Held> {
        let call = tensor_wasm_mem_mock::Call::for_operation(op)?;
        let held = Arc::new(self.0.driver().hold_next(call));
        let waiting = Arc::clone(&held);
        Some(Held::new(
            move |limit| waiting.wait(limit),
            move || held.release(),
        ))
    }
}

impl DeviceWork for ModelControls<'_> {
    unsafe fn fill(&self, stream: &Stream, ptr: u64, len: usize, byte: u8) {
        // SAFETY: the caller's contract is the launch's.
        unsafe { self.0.driver().enqueue_fill(stream, ptr, len, byte) }.expect("fill");
    }
    fn fault(&self, stream: &Stream) {
        // SAFETY: the address lies outside every allocation: the simulated kernel faults
        // instead of writing. The launch may report it at once (synchronous streams) or at
        // the next wait.
        let _ = unsafe { self.0.driver().enqueue_fill(stream, FAULT_AT, 64, 1) };
    }
    fn event_between(&self, from: &Stream, to: &Stream) {
        let model = self.0.driver();
        let event = model.event_create().expect("event");
        model.event_record(event, from).expect("record");
        model.stream_wait_event(to, event).expect("wait");
        model.event_destroy(event).expect("destroy");
    }
}

impl Inspection for ModelControls<'_> {
    fn hazards(&self) -> [u64; 3] {
        let s = self.0.driver().stats();
        [
            s.scrubs_over_pending_work,
            s.frees_over_pending_work,
            s.kernel_faults,
        ]
    }
    fn hints(&self, allocation: &Allocation, offset: usize) -> Option<HintState> {
        let model = self.0.driver();
        let hints = model.hints(allocation, offset).ok()?;
        Some(HintState {
            read_mostly: hints.read_mostly,
            preferred: hints.preferred_location,
            accessed_by: hints.accessed_by,
            resident: model.residency(allocation, offset).ok()?,
        })
    }
    fn pool_memory_host_readable(&self) -> bool {
        true
    }
    fn context_stack(&self) -> (u64, u64) {
        let model = self.0.driver();
        (model.context_depth() as u64, model.current())
    }
    fn push_context(&self, context: u64) {
        use tensor_wasm_mem_core::DriverApi;
        self.0
            .driver()
            .push_current(tensor_wasm_mem_core::DriverContext::from_raw(context))
            .expect("push");
    }
    fn pop_context(&self) {
        use tensor_wasm_mem_core::DriverApi;
        let _ = self.0.driver().pop_current();
    }
}

macro_rules! mock_harness {
    ($name:ty, $config:expr) => {
        impl $crate::Harness for $name {
            type Backend = MockBackend;

            fn backend() -> Arc<MockBackend> {
                mock_harness_impl($config)
            }
            fn has_device_pools(_: &MockBackend) -> bool {
                true
            }
            fn completion(b: &MockBackend) -> Completion {
                let c = b.driver().config();
                match (c.deferred_streams, c.worker_interval) {
                    (false, _) => Completion::AtCall,
                    (true, None) => Completion::Deferred,
                    (true, Some(_)) => Completion::OnItsOwn,
                }
            }
            fn too_much(b: &MockBackend) -> usize {
                usize::try_from(b.driver().config().device_memory_bytes).unwrap_or(usize::MAX) + 1
            }
            fn counters(b: &MockBackend) -> Option<Box<dyn Counters + '_>> {
                Some(Box::new(ModelControls(b)))
            }
            fn faults(b: &MockBackend) -> Option<Box<dyn FaultControl + '_>> {
                Some(Box::new(ModelControls(b)))
            }
            fn kernels(b: &MockBackend) -> Option<Box<dyn DeviceWork + '_>> {
                Some(Box::new(ModelControls(b)))
            }
            fn inspect(b: &MockBackend) -> Option<Box<dyn Inspection + '_>> {
                Some(Box::new(ModelControls(b)))
            }
        }
    };
}

mock_harness!(MockHarness, MockConfig::default());
mock_harness!(
    PoisonedMockHarness,
    MockConfig {
        poison_fresh_allocations: true,
        ..MockConfig::default()
    }
);

mock_harness!(
    EightDeviceDeferredMockHarness,
    MockConfig {
        device_count: 8,
        deferred_streams: true,
        ..MockConfig::default()
    }
);

/// The mock backend with two devices, deferred streams and a background "device" that
/// completes work every 50 µs on its own: every case with work landing at times it does not
/// choose.
#[derive(Debug)]
pub struct WorkerMockHarness;

mock_harness!(
    WorkerMockHarness,
    MockConfig {
        device_count: 2,
        deferred_streams: true,
        worker_interval: Some(std::time::Duration::from_micros(50)),
        ..MockConfig::default()
    }
);

mock_harness!(
    DeferredMockHarness,
    MockConfig {
        deferred_streams: true,
        ..MockConfig::default()
    }
);

/// The mock backend as the suite sees a real GPU driver: work completes on its own (deferred
/// streams, a background "device"), device pools, and none of the optional controls (no
/// counters, no fault injection, no held calls, no hints to inspect). The cases that need one
/// are reported as ignored: this harness is how the suite proves that a case a backend cannot
/// run is never counted as passed.
#[derive(Debug)]
pub struct KnoblessMockHarness;

impl Harness for KnoblessMockHarness {
    type Backend = MockBackend;

    fn backend() -> Arc<MockBackend> {
        mock_harness_impl(MockConfig {
            deferred_streams: true,
            worker_interval: Some(std::time::Duration::from_micros(50)),
            ..MockConfig::default()
        })
    }

    fn has_device_pools(_: &MockBackend) -> bool {
        true
    }

    fn completion(_: &MockBackend) -> Completion {
        Completion::OnItsOwn
    }
}

/// Simulated device memory per device for the conformance cases.
pub const SIM_MEMORY: u64 = 4 << 30;

/// The simulated machine the driver harnesses run on by default: one device with
/// [`SIM_MEMORY`], device-mapped host registration and pageable memory access (as the mock
/// harnesses), work that completes at the call.
#[must_use]
pub fn sim_machine() -> crate::sim::SimConfig {
    crate::sim::SimConfig {
        memory_bytes: SIM_MEMORY,
        host_register: 1,
        pageable: 1,
        ..crate::sim::SimConfig::default()
    }
}

/// [`sim_machine`] with four devices and deferred streams: stream work completes when the
/// device gets to it, as on a GPU server.
#[must_use]
pub fn four_device_deferred_machine() -> crate::sim::SimConfig {
    crate::sim::SimConfig {
        device_count: 4,
        deferred: 1,
        ..sim_machine()
    }
}

/// [`four_device_deferred_machine`] with a background "device" that completes work every
/// 50 µs on its own.
#[must_use]
pub fn four_device_worker_machine() -> crate::sim::SimConfig {
    crate::sim::SimConfig {
        worker_micros: 50,
        ..four_device_deferred_machine()
    }
}

/// Prepares the process-wide driver for one case: serialises the cases that use it and, on the
/// simulator, starts a fresh simulated machine shaped as `machine` says.
pub fn fresh_driver(machine: &crate::sim::SimConfig) {
    crate::sim::exclusive();
    if let Some(sim) = crate::sim::Sim::get() {
        sim.configure(machine);
        sim.reset();
    }
}

/// The simulated libcuda's capabilities, over one backend on it (`DriverBackend` over
/// cudarc's or cust's driver): faults injected at the entry points the backend calls (named by
/// the binding: `advise` and `prefetch` differ between cudarc and cust), kernels, events and
/// inspection.
#[derive(Debug)]
pub struct SimControls {
    sim: &'static crate::sim::Sim,
    advise: &'static str,
    prefetch: &'static str,
}

impl SimControls {
    /// The controls, where the simulator is the driver.
    #[must_use]
    pub fn new(advise: &'static str, prefetch: &'static str) -> Option<Self> {
        Some(Self {
            sim: crate::sim::Sim::get()?,
            advise,
            prefetch,
        })
    }
}

/// The counters of a backend on the core's `DriverBackend` (cudarc's or cust's driver),
/// cross-checked against the simulator's where it is the driver.
#[derive(Debug)]
pub struct DriverCounters<'a, D: tensor_wasm_mem_core::DriverApi>(
    pub &'a tensor_wasm_mem_core::DriverBackend<D>,
);

impl<D: tensor_wasm_mem_core::DriverApi> DriverCounters<'_, D> {
    fn check(&self, what: &str, ours: u64, sim: impl Fn(&crate::sim::SimStats) -> u64) -> u64 {
        match crate::sim::Sim::get() {
            Some(driver) => agree(what, ours, sim(&driver.stats())),
            None => ours,
        }
    }
}

impl<D: tensor_wasm_mem_core::DriverApi> Counters for DriverCounters<'_, D> {
    fn live_allocations(&self) -> u64 {
        let ours = self.0.stats().live_allocations;
        self.check("allocations", ours, |s| s.live_allocations)
    }
    fn live_streams(&self) -> u64 {
        let ours = self.0.stats().live_streams;
        // The simulator also counts the backend's per-device zeroing stream.
        let zeroing = u64::from(tensor_wasm_mem_core::ManagedAllocator::device_count(self.0));
        self.check("streams", ours + zeroing, |s| s.live_streams) - zeroing
    }
    fn live_contexts(&self) -> u64 {
        let ours = self.0.stats().live_contexts;
        self.check("contexts", ours, |s| s.live_contexts)
    }
    fn live_pools(&self) -> u64 {
        let ours = self.0.stats();
        self.check("pool allocations", ours.live_pool_allocations, |s| {
            s.live_pool_allocations
        });
        self.check("pools", ours.live_pools, |s| s.live_pools)
    }
    fn lost_allocations(&self) -> u64 {
        self.0.stats().lost_allocations
    }
}

impl FaultControl for SimControls {
    fn fail_nth(&self, op: Operation, n: u64) -> bool {
        let code = if op == Operation::Allocate {
            crate::sim::code::OUT_OF_MEMORY
        } else {
            crate::sim::code::UNKNOWN
        };
        self.fail_nth_with(op, n, code)
    }
    fn fail_nth_with(&self, op: Operation, n: u64, code: u32) -> bool {
        let entry = match op {
            Operation::Allocate => "cuMemAllocManaged",
            Operation::Free => "cuMemFree_v2",
            Operation::Zero => "cuMemsetD8Async",
            // A reset begins with an unset advice.
            Operation::Advise | Operation::ResetHints => self.advise,
            Operation::Prefetch => self.prefetch,
            Operation::AcquireStream => "cuStreamCreate",
            Operation::ReleaseStream => "cuStreamDestroy_v2",
            Operation::Synchronize => "cuStreamSynchronize",
            Operation::CreatePool => "cuMemPoolCreate",
            Operation::PoolAllocate => "cuMemAllocFromPoolAsync",
            Operation::PoolFree => "cuMemFreeAsync",
            Operation::AttachHost => "cuMemHostRegister_v2",
            Operation::DetachHost => "cuMemHostUnregister",
            Operation::RecoverDevice => "cuDevicePrimaryCtxReset_v2",
            _ => return false,
        };
        self.sim.fail_nth(entry, n, code);
        true
    }
    fn fail_release(&self, what: Release, n: u64) {
        let entry = match what {
            Release::StreamDestroy => "cuStreamDestroy_v2",
            Release::ContextDestroy => "cuCtxDestroy_v2",
            Release::PoolDestroy => "cuMemPoolDestroy",
            Release::ContextPush => "cuCtxPushCurrent_v2",
        };
        self.sim.fail_nth(entry, n, crate::sim::code::UNKNOWN);
    }
    fn clear(&self) {
        self.sim.clear_faults();
    }
    fn hold_next(&self, op: Operation) -> Option<Held> {
        let entry = match op {
            Operation::PoolFree => "cuMemFreeAsync",
            Operation::TrimPool => "cuMemPoolTrimTo",
            Operation::DestroyPool => "cuMemPoolDestroy",
            Operation::Free => "cuMemFree_v2",
            Operation::Allocate => "cuMemAllocManaged",
            _ => return None,
        };
        let sim = self.sim;
        sim.hold_next(entry);
        Some(Held::new(
            move |limit| sim.wait_held(entry, u64::try_from(limit.as_millis()).unwrap_or(u64::MAX)),
            move || sim.release_held(entry),
        ))
    }
}

impl DeviceWork for SimControls {
    unsafe fn fill(&self, stream: &Stream, ptr: u64, len: usize, byte: u8) {
        // SAFETY: the caller's contract is the launch's.
        let launched = unsafe {
            self.sim
                .launch_fill(stream.context(), stream.raw(), ptr, len as u64, byte)
        };
        launched.unwrap_or_else(|e| panic!("fill: {e}"));
    }
    fn fault(&self, stream: &Stream) {
        // SAFETY: the address lies outside every allocation: the simulated kernel faults
        // instead of writing (at the launch, or at the next wait).
        let _ = unsafe {
            self.sim
                .launch_fill(stream.context(), stream.raw(), FAULT_AT, 64, 1)
        };
    }
    fn event_between(&self, from: &Stream, to: &Stream) {
        crate::kernels::event_between(from.context(), from.raw(), to.context(), to.raw())
            .unwrap_or_else(|e| panic!("event: {e}"));
    }
}

impl Inspection for SimControls {
    fn hazards(&self) -> [u64; 3] {
        let s = self.sim.stats();
        [
            s.scrubs_over_pending_work,
            s.frees_over_pending_work,
            s.kernel_faults,
        ]
    }
    fn hints(&self, allocation: &Allocation, offset: usize) -> Option<HintState> {
        let hints = self.sim.hints(allocation.device_ptr() + offset as u64)?;
        Some(HintState::from_sim(hints))
    }
    fn pool_memory_host_readable(&self) -> bool {
        true
    }
    fn context_stack(&self) -> (u64, u64) {
        self.sim.context_stack()
    }
    fn push_context(&self, context: u64) {
        self.sim.push_context(context);
    }
    fn pop_context(&self) {
        self.sim.pop_context();
    }
}

/// Implements [`Harness`] for a backend built on the core's `DriverBackend`, over the real
/// driver or the simulated libcuda: on the simulator every capability ([`SimControls`]), on a
/// real driver none.
///
/// A backend that links libcuda at link time (cust) is given its harness in the test file that
/// uses it, so other test binaries do not need `libcuda.so.1` to load.
#[macro_export]
macro_rules! driver_harness {
    ($(#[$doc:meta])* $name:ident, $backend:ty, $start:expr, machine: $machine:expr, advise: $advise:literal, prefetch: $prefetch:literal, pools: $pools:expr) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name;

        impl $name {
            fn controls() -> Option<$crate::harness::SimControls> {
                $crate::harness::SimControls::new($advise, $prefetch)
            }
        }

        impl $crate::Harness for $name {
            type Backend = $backend;

            fn backend() -> std::sync::Arc<Self::Backend> {
                $crate::harness::fresh_driver(&$machine);
                std::sync::Arc::new($start.unwrap_or_else(|e| panic!("the backend did not start: {e}")))
            }

            fn has_device_pools(b: &Self::Backend) -> bool {
                let pools: fn(&Self::Backend) -> bool = $pools;
                pools(b)
            }

            fn completion(_: &Self::Backend) -> $crate::harness::Completion {
                use $crate::harness::Completion;
                let m = $machine;
                match ($crate::sim::Sim::get(), m.deferred, m.worker_micros) {
                    (None, _, _) => Completion::OnItsOwn,
                    (Some(_), 0, _) => Completion::AtCall,
                    (Some(_), _, 0) => Completion::Deferred,
                    (Some(_), _, _) => Completion::OnItsOwn,
                }
            }

            fn real_driver() -> bool {
                $crate::sim::Sim::get().is_none()
            }

            fn driver_holds() -> Option<[u64; 4]> {
                $crate::sim::Sim::get().map(|sim| {
                    let s = sim.stats();
                    [s.live_allocations, s.live_streams, s.live_contexts, s.live_pools]
                })
            }

            fn too_much(_: &Self::Backend) -> usize {
                if $crate::sim::Sim::get().is_some() {
                    $crate::harness::SIM_MEMORY as usize + 1
                } else {
                    1 << 50
                }
            }

            fn counters(b: &Self::Backend) -> Option<Box<dyn $crate::harness::Counters + '_>> {
                Some(Box::new($crate::harness::DriverCounters(b)))
            }

            fn faults(_: &Self::Backend) -> Option<Box<dyn $crate::harness::FaultControl + '_>> {
                Some(Box::new(Self::controls()?))
            }

            fn kernels(_: &Self::Backend) -> Option<Box<dyn $crate::harness::DeviceWork + '_>> {
                Some(Box::new(Self::controls()?))
            }

            fn inspect(_: &Self::Backend) -> Option<Box<dyn $crate::harness::Inspection + '_>> {
                Some(Box::new(Self::controls()?))
            }
        }
    };
}

driver_harness!(
    /// The cudarc backend: on the real driver where one loads, otherwise on the simulated
    /// libcuda (`tests/cuda-sim`). Cases are serialised (the driver is process-wide).
    CudarcHarness,
    tensor_wasm_mem_cudarc::CudarcBackend,
    tensor_wasm_mem_cudarc::start(&tensor_wasm_mem_cudarc::DriverSource::SystemOr(
        crate::sim::SIM_PATH.into()
    )),
    machine: crate::harness::sim_machine(),
    advise: "cuMemAdvise_v2",
    prefetch: "cuMemPrefetchAsync_v2",
    pools: |b| b.driver().has_pools()
);

driver_harness!(
    /// The cudarc backend on four simulated devices with deferred streams (on a real driver,
    /// the same as [`CudarcHarness`]).
    FourDeviceDeferredCudarcHarness,
    tensor_wasm_mem_cudarc::CudarcBackend,
    tensor_wasm_mem_cudarc::start(&tensor_wasm_mem_cudarc::DriverSource::SystemOr(
        crate::sim::SIM_PATH.into()
    )),
    machine: crate::harness::four_device_deferred_machine(),
    advise: "cuMemAdvise_v2",
    prefetch: "cuMemPrefetchAsync_v2",
    pools: |b| b.driver().has_pools()
);
