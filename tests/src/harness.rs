//! How the suite reaches a backend: [`Harness`], and the harnesses of the backends in this
//! workspace.

use std::sync::Arc;

use tensor_wasm_mem_core::{Allocation, Location, Operation, Stream};
use tensor_wasm_mem_mock::{MockBackend, MockConfig};

/// A driver call held after it took effect ([`Harness::hold_next`]): the test waits for it to
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

/// What the suite needs from a backend.
///
/// Counters and fault injection are optional: a backend that has none (a real driver) returns
/// `None`/`false`, and the cases that need them print that they were skipped for it.
pub trait Harness: 'static {
    /// The backend type (every backend trait, as the Wasmtime integration needs them: one
    /// bound list, the integration's).
    type Backend: tensor_wasm_mem_wasmtime::Backend;

    /// A fresh backend instance with at least one device.
    fn backend() -> Arc<Self::Backend>;

    /// Allocations alive now, if the backend counts them.
    fn live_allocations(_backend: &Self::Backend) -> Option<u64> {
        None
    }

    /// Streams alive now (the shared default stream not counted), if counted.
    fn live_streams(_backend: &Self::Backend) -> Option<u64> {
        None
    }

    /// Per-tenant contexts alive now, if counted.
    fn live_contexts(_backend: &Self::Backend) -> Option<u64> {
        None
    }

    /// Device memory pools alive now, if counted.
    fn live_pools(_backend: &Self::Backend) -> Option<u64> {
        None
    }

    /// `true` when the backend has device memory pools (others must answer `Unsupported`).
    fn has_device_pools(_backend: &Self::Backend) -> bool {
        false
    }

    /// `true` when pool memory can be read from the host (a simulated device): the suite then
    /// checks that pool allocations come zero-filled.
    fn pool_memory_host_readable(_backend: &Self::Backend) -> bool {
        false
    }

    /// Makes the `n`-th call of `op` from now fail; `false` if the backend cannot inject.
    fn fail_nth(_backend: &Self::Backend, _op: Operation, _n: u64) -> bool {
        false
    }

    /// Makes the `n`-th driver call for `op` from now answer `code`, any integer (a code no
    /// CUDA enum knows included); `false` if the backend cannot inject it.
    fn fail_nth_with(_backend: &Self::Backend, _op: Operation, _n: u64, _code: u32) -> bool {
        false
    }

    /// Removes pending injected failures.
    fn clear_faults(_backend: &Self::Backend) {}

    /// `true` when stream work completes later than the call that queued it (the model with
    /// deferred streams): the cases that see a host read the old bytes before a synchronise
    /// check that only then.
    fn deferred(_backend: &Self::Backend) -> bool {
        false
    }

    /// `true` when a background "device" completes stream work at times the test does not
    /// choose (the model's worker): a case may then see work done, or not yet, at any point
    /// before it waits.
    fn worker(_backend: &Self::Backend) -> bool {
        false
    }

    /// Queues the simulated `fill` kernel (`len` bytes of `byte` at `ptr`) on `stream`; `false`
    /// where the harness cannot launch one (a real GPU here: no PTX for it).
    ///
    /// # Safety
    ///
    /// When the kernel runs, nothing else may access `ptr..ptr + len`.
    unsafe fn fill(
        _backend: &Self::Backend,
        _stream: &Stream,
        _ptr: u64,
        _len: usize,
        _byte: u8,
    ) -> bool {
        false
    }

    /// Makes `stream`'s context fault for good, as a kernel writing outside every allocation
    /// does (a sticky error: every later call in that context fails); `false` where the harness
    /// cannot launch one.
    fn fault(backend: &Self::Backend, stream: &Stream) -> bool {
        let _ = (backend, stream);
        false
    }

    /// Orders `to`'s later work after `from`'s work so far, with an event (`cuEventRecord` on
    /// `from`, `cuStreamWaitEvent` on `to`); `false` where the harness cannot.
    fn event_between(_backend: &Self::Backend, _from: &Stream, _to: &Stream) -> bool {
        false
    }

    /// The driver's hazard counters, where it has them: memsets queued over another stream's
    /// pending work, frees of memory queued work still targets, kernel faults.
    fn hazards(_backend: &Self::Backend) -> Option<[u64; 3]> {
        None
    }

    /// Makes the `n`-th driver release of `what` from now fail; `false` if the backend cannot
    /// inject it.
    fn fail_release(_backend: &Self::Backend, _what: Release, _n: u64) -> bool {
        false
    }

    /// Holds the next call of `op` (`PoolFree` at least) after it took effect, until the test
    /// releases it ([`Held`]); `None` if the backend cannot.
    fn hold_next(_backend: &Self::Backend, _op: Operation) -> Option<Held> {
        None
    }

    /// The calling thread's driver context stack (depth, current context), where the driver has
    /// one to inspect.
    fn context_stack(_backend: &Self::Backend) -> Option<(u64, u64)> {
        None
    }

    /// Pushes `context` on the calling thread's context stack, as an embedder's own CUDA code
    /// would; `false` where there is no context stack.
    fn push_context(_backend: &Self::Backend, _context: u64) -> bool {
        false
    }

    /// Pops the calling thread's context stack.
    fn pop_context(_backend: &Self::Backend) {}

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

    /// The largest request that must fail with out-of-memory on this backend.
    fn too_much(_backend: &Self::Backend) -> usize {
        usize::MAX / 2
    }

    /// The advice and residency in force at `offset` of `allocation`, where the backend (or the
    /// driver below it) can be inspected.
    fn hints(
        _backend: &Self::Backend,
        _allocation: &Allocation,
        _offset: usize,
    ) -> Option<HintState> {
        None
    }
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

macro_rules! mock_harness {
    ($name:ty, $config:expr) => {
        impl $crate::Harness for $name {
            type Backend = MockBackend;

            fn backend() -> Arc<MockBackend> {
                mock_harness_impl($config)
            }
            fn live_allocations(b: &MockBackend) -> Option<u64> {
                let ours = b.stats().live_allocations;
                assert_eq!(
                    b.driver().stats().live_allocations,
                    ours,
                    "model and backend disagree"
                );
                Some(ours)
            }
            fn live_streams(b: &MockBackend) -> Option<u64> {
                let ours = b.stats().live_streams;
                assert_eq!(
                    b.driver().stats().live_streams,
                    ours,
                    "model and backend disagree"
                );
                Some(ours)
            }
            fn live_contexts(b: &MockBackend) -> Option<u64> {
                let ours = b.stats().live_contexts;
                assert_eq!(
                    b.driver().stats().live_contexts,
                    ours,
                    "model and backend disagree"
                );
                Some(ours)
            }
            fn live_pools(b: &MockBackend) -> Option<u64> {
                let ours = b.stats().live_pools;
                let model = b.driver().stats();
                assert_eq!(model.live_pools, ours, "model and backend disagree");
                assert_eq!(model.live_pool_allocations, b.stats().live_pool_allocations);
                Some(ours)
            }
            fn has_device_pools(_: &MockBackend) -> bool {
                true
            }
            fn pool_memory_host_readable(_: &MockBackend) -> bool {
                true
            }
            fn fail_nth(b: &MockBackend, op: Operation, n: u64) -> bool {
                b.driver().fail_nth(op, n)
            }
            fn fail_nth_with(b: &MockBackend, op: Operation, n: u64, code: u32) -> bool {
                match tensor_wasm_mem_mock::Call::for_operation(op) {
                    Some(call) => {
                        b.driver().fail_call(call, n, code);
                        true
                    }
                    None => false,
                }
            }
            fn clear_faults(b: &MockBackend) {
                b.driver().clear_faults();
            }
            fn deferred(b: &MockBackend) -> bool {
                let c = b.driver().config();
                c.deferred_streams && c.worker_interval.is_none()
            }
            fn worker(b: &MockBackend) -> bool {
                let c = b.driver().config();
                c.deferred_streams && c.worker_interval.is_some()
            }
            unsafe fn fill(
                b: &MockBackend,
                stream: &tensor_wasm_mem_core::Stream,
                ptr: u64,
                len: usize,
                byte: u8,
            ) -> bool {
                // SAFETY: the caller's contract is the launch's.
                unsafe { b.driver().enqueue_fill(stream, ptr, len, byte) }.expect("fill");
                true
            }
            fn fault(b: &MockBackend, stream: &tensor_wasm_mem_core::Stream) -> bool {
                // SAFETY: the address lies outside every allocation: the simulated kernel
                // faults instead of writing. The launch may report it at once (synchronous
                // streams) or at the next wait.
                let _ = unsafe {
                    b.driver()
                        .enqueue_fill(stream, $crate::harness::FAULT_AT, 64, 1)
                };
                true
            }
            fn event_between(
                b: &MockBackend,
                from: &tensor_wasm_mem_core::Stream,
                to: &tensor_wasm_mem_core::Stream,
            ) -> bool {
                let model = b.driver();
                let event = model.event_create().expect("event");
                model.event_record(event, from).expect("record");
                model.stream_wait_event(to, event).expect("wait");
                model.event_destroy(event).expect("destroy");
                true
            }
            fn hazards(b: &MockBackend) -> Option<[u64; 3]> {
                let s = b.driver().stats();
                Some([
                    s.scrubs_over_pending_work,
                    s.frees_over_pending_work,
                    s.kernel_faults,
                ])
            }
            fn fail_release(b: &MockBackend, what: $crate::harness::Release, n: u64) -> bool {
                use tensor_wasm_mem_mock::{Call, code};
                use $crate::harness::Release;
                let call = match what {
                    Release::StreamDestroy => Call::StreamDestroy,
                    Release::PoolDestroy => Call::PoolDestroy,
                    Release::ContextDestroy => Call::CtxDestroy,
                    Release::ContextPush => Call::CtxPush,
                };
                b.driver().fail_call(call, n, code::UNKNOWN);
                true
            }
            fn hold_next(b: &MockBackend, op: Operation) -> Option<Held> {
                let call = tensor_wasm_mem_mock::Call::for_operation(op)?;
                let held = Arc::new(b.driver().hold_next(call));
                let waiting = Arc::clone(&held);
                Some(Held::new(
                    move |limit| waiting.wait(limit),
                    move || held.release(),
                ))
            }
            fn context_stack(b: &MockBackend) -> Option<(u64, u64)> {
                Some((b.driver().context_depth() as u64, b.driver().current()))
            }
            fn push_context(b: &MockBackend, context: u64) -> bool {
                use tensor_wasm_mem_core::DriverApi;
                b.driver()
                    .push_current(tensor_wasm_mem_core::DriverContext::from_raw(context))
                    .is_ok()
            }
            fn pop_context(b: &MockBackend) {
                use tensor_wasm_mem_core::DriverApi;
                let _ = b.driver().pop_current();
            }
            fn too_much(b: &MockBackend) -> usize {
                usize::try_from(b.driver().config().device_memory_bytes).unwrap_or(usize::MAX) + 1
            }
            fn hints(
                b: &MockBackend,
                allocation: &tensor_wasm_mem_core::Allocation,
                offset: usize,
            ) -> Option<$crate::harness::HintState> {
                let model = b.driver();
                let hints = model.hints(allocation, offset).ok()?;
                Some($crate::harness::HintState {
                    read_mostly: hints.read_mostly,
                    preferred: hints.preferred_location,
                    accessed_by: hints.accessed_by,
                    resident: model.residency(allocation, offset).ok()?,
                })
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

/// Implements [`Harness`] for a backend built on the core's `DriverBackend`: counters from the
/// backend (cross-checked against the simulator's, so nothing leaks below the backend either),
/// faults injected through the simulator at the entry points the backend calls.
///
/// A backend that links libcuda at link time (cust) is given its harness in the test file that
/// uses it, so other test binaries do not need `libcuda.so.1` to load.
#[macro_export]
macro_rules! driver_harness {
    ($(#[$doc:meta])* $name:ident, $backend:ty, $start:expr, machine: $machine:expr, advise: $advise:literal, prefetch: $prefetch:literal, pools: $pools:expr) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name;

        impl $crate::Harness for $name {
            type Backend = $backend;

            fn backend() -> std::sync::Arc<Self::Backend> {
                $crate::harness::fresh_driver(&$machine);
                std::sync::Arc::new($start.unwrap_or_else(|e| panic!("the backend did not start: {e}")))
            }

            fn live_allocations(b: &Self::Backend) -> Option<u64> {
                let ours = b.stats().live_allocations;
                if let Some(sim) = $crate::sim::Sim::get() {
                    assert_eq!(sim.stats().live_allocations, ours, "driver and backend disagree");
                }
                Some(ours)
            }

            fn live_streams(b: &Self::Backend) -> Option<u64> {
                let ours = b.stats().live_streams;
                if let Some(sim) = $crate::sim::Sim::get() {
                    // The simulator also counts the backend's per-device zeroing stream.
                    let zeroing = u64::from($crate::core::ManagedAllocator::device_count(b));
                    assert_eq!(sim.stats().live_streams, ours + zeroing, "driver and backend disagree");
                }
                Some(ours)
            }

            fn live_contexts(b: &Self::Backend) -> Option<u64> {
                let ours = b.stats().live_contexts;
                if let Some(sim) = $crate::sim::Sim::get() {
                    assert_eq!(sim.stats().live_contexts, ours, "driver and backend disagree");
                }
                Some(ours)
            }

            fn live_pools(b: &Self::Backend) -> Option<u64> {
                let ours = b.stats().live_pools;
                if let Some(sim) = $crate::sim::Sim::get() {
                    let s = sim.stats();
                    assert_eq!(s.live_pools, ours, "driver and backend disagree");
                    assert_eq!(s.live_pool_allocations, b.stats().live_pool_allocations);
                }
                Some(ours)
            }

            fn has_device_pools(b: &Self::Backend) -> bool {
                let pools: fn(&Self::Backend) -> bool = $pools;
                pools(b)
            }

            fn pool_memory_host_readable(_: &Self::Backend) -> bool {
                $crate::sim::Sim::get().is_some()
            }

            fn fail_nth(b: &Self::Backend, op: $crate::core::Operation, n: u64) -> bool {
                let code = if op == $crate::core::Operation::Allocate {
                    $crate::sim::code::OUT_OF_MEMORY
                } else {
                    $crate::sim::code::UNKNOWN
                };
                Self::fail_nth_with(b, op, n, code)
            }

            fn fail_nth_with(_: &Self::Backend, op: $crate::core::Operation, n: u64, code: u32) -> bool {
                use $crate::core::Operation;
                let entry = match op {
                    Operation::Allocate => "cuMemAllocManaged",
                    Operation::Free => "cuMemFree_v2",
                    Operation::Zero => "cuMemsetD8Async",
                    Operation::Advise => $advise,
                    Operation::Prefetch => $prefetch,
                    // A reset begins with an unset advice.
                    Operation::ResetHints => $advise,
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
                let Some(sim) = $crate::sim::Sim::get() else {
                    return false;
                };
                sim.fail_nth(entry, n, code);
                true
            }

            fn clear_faults(_: &Self::Backend) {
                if let Some(sim) = $crate::sim::Sim::get() {
                    sim.clear_faults();
                }
            }

            fn deferred(_: &Self::Backend) -> bool {
                let m = $machine;
                $crate::sim::Sim::get().is_some() && m.deferred != 0 && m.worker_micros == 0
            }

            fn worker(_: &Self::Backend) -> bool {
                let m = $machine;
                $crate::sim::Sim::get().is_some() && m.deferred != 0 && m.worker_micros > 0
            }

            unsafe fn fill(
                _: &Self::Backend,
                stream: &$crate::core::Stream,
                ptr: u64,
                len: usize,
                byte: u8,
            ) -> bool {
                let Some(sim) = $crate::sim::Sim::get() else {
                    return false;
                };
                // SAFETY: the caller's contract is the launch's.
                let launched = unsafe {
                    sim.launch_fill(stream.context(), stream.raw(), ptr, len as u64, byte)
                };
                launched.unwrap_or_else(|e| panic!("fill: {e}"));
                true
            }

            fn fault(_: &Self::Backend, stream: &$crate::core::Stream) -> bool {
                let Some(sim) = $crate::sim::Sim::get() else {
                    return false;
                };
                // SAFETY: the address lies outside every allocation: the simulated kernel faults
                // instead of writing (at the launch, or at the next wait).
                let _ = unsafe {
                    sim.launch_fill(stream.context(), stream.raw(), $crate::harness::FAULT_AT, 64, 1)
                };
                true
            }

            fn event_between(_: &Self::Backend, from: &$crate::core::Stream, to: &$crate::core::Stream) -> bool {
                // Only where the simulator is the driver, as the other driver hooks.
                if $crate::sim::Sim::get().is_none() {
                    return false;
                }
                $crate::kernels::event_between(from.context(), from.raw(), to.context(), to.raw())
                    .unwrap_or_else(|e| panic!("event: {e}"));
                true
            }

            fn hazards(_: &Self::Backend) -> Option<[u64; 3]> {
                $crate::sim::Sim::get().map(|sim| {
                    let s = sim.stats();
                    [s.scrubs_over_pending_work, s.frees_over_pending_work, s.kernel_faults]
                })
            }

            fn fail_release(_: &Self::Backend, what: $crate::harness::Release, n: u64) -> bool {
                use $crate::harness::Release;
                let entry = match what {
                    Release::StreamDestroy => "cuStreamDestroy_v2",
                    Release::ContextDestroy => "cuCtxDestroy_v2",
                    Release::PoolDestroy => "cuMemPoolDestroy",
                    Release::ContextPush => "cuCtxPushCurrent_v2",
                };
                let Some(sim) = $crate::sim::Sim::get() else {
                    return false;
                };
                sim.fail_nth(entry, n, $crate::sim::code::UNKNOWN);
                true
            }

            fn hold_next(
                _: &Self::Backend,
                op: $crate::core::Operation,
            ) -> Option<$crate::harness::Held> {
                use $crate::core::Operation;
                let entry = match op {
                    Operation::PoolFree => "cuMemFreeAsync",
                    Operation::Free => "cuMemFree_v2",
                    Operation::Allocate => "cuMemAllocManaged",
                    _ => return None,
                };
                let sim = $crate::sim::Sim::get()?;
                sim.hold_next(entry);
                Some($crate::harness::Held::new(
                    move |limit| {
                        $crate::sim::Sim::get().is_some_and(|sim| {
                            sim.wait_held(
                                entry,
                                u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
                            )
                        })
                    },
                    move || {
                        if let Some(sim) = $crate::sim::Sim::get() {
                            sim.release_held(entry);
                        }
                    },
                ))
            }

            fn context_stack(_: &Self::Backend) -> Option<(u64, u64)> {
                $crate::sim::Sim::get().map(|sim| sim.context_stack())
            }

            fn push_context(_: &Self::Backend, context: u64) -> bool {
                let Some(sim) = $crate::sim::Sim::get() else {
                    return false;
                };
                sim.push_context(context);
                true
            }

            fn pop_context(_: &Self::Backend) {
                if let Some(sim) = $crate::sim::Sim::get() {
                    sim.pop_context();
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

            fn hints(
                _: &Self::Backend,
                allocation: &$crate::core::Allocation,
                offset: usize,
            ) -> Option<$crate::harness::HintState> {
                let sim = $crate::sim::Sim::get()?;
                let hints = sim.hints(allocation.device_ptr() + offset as u64)?;
                Some($crate::harness::HintState::from_sim(hints))
            }

            fn too_much(_: &Self::Backend) -> usize {
                if $crate::sim::Sim::get().is_some() {
                    $crate::harness::SIM_MEMORY as usize + 1
                } else {
                    1 << 50
                }
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
