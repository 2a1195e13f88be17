//! The simulated machine: its state, its rules, and `DriverApi` on it.

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};

// The model's tables are keyed by its own handles: foldhash (hashbrown's default), not SipHash,
// which a simulated driver call paid for on every lookup.
use hashbrown::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tensor_wasm_mem_core::{
    Advice, Allocation, DEFAULT_STREAM, DeviceFacts, DeviceId, DriverApi, DriverContext,
    DriverPool, DriverStream, Location, Operation, Stream,
};
use tensor_wasm_mem_cuda::CudaError;

mod api;
mod control;
mod entry;
mod reset;
mod state;
mod work;

pub use reset::ResetReport;

use crate::ranges::RangeMap;
use crate::{
    Call, Event, Function, Hints, Kernel, ModelConfig, ModelDropReport, ModelError, ModelStats,
    Module, code, host,
};

/// Machines made so far: each has its own id, so the per-thread context stacks of two machines
/// never mix.
static MACHINES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's context stack per machine (CUDA keeps one per thread); the top is current.
    static STACKS: RefCell<Vec<(u64, Vec<u64>)>> = const { RefCell::new(Vec::new()) };
}

/// A stream as a call names it: the raw handle and the context it belongs to (its own for a
/// stream handle; for the default stream, the context the caller means).
#[derive(Clone, Copy, Debug)]
struct On {
    context: u64,
    raw: u64,
}

impl From<&Stream> for On {
    fn from(stream: &Stream) -> Self {
        Self {
            context: stream.context(),
            raw: stream.raw(),
        }
    }
}

/// A work queue: a stream, or the legacy default stream of a context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Queue {
    Default(u64),
    Stream(u64),
}

#[derive(Debug)]
struct Context {
    device: u32,
    primary: bool,
    /// A kernel in it hit an illegal address: every later call in it fails (sticky).
    poisoned: bool,
    /// A primary context no one retains (the C shell's `cuDevicePrimaryCtxRelease` of the last
    /// reference): it cannot be made current, and calls in it answer
    /// `CUDA_ERROR_INVALID_CONTEXT`. Always false through the Rust API.
    inactive: bool,
}

#[derive(Debug)]
struct StreamRecord {
    context: u64,
    /// One of the model's zeroing streams (not destroyable, not counted).
    internal: bool,
}

#[derive(Debug)]
struct Record {
    len: usize,
    mapped: usize,
    device: u32,
    /// The pool it came from (`None`: managed memory).
    pool: Option<u64>,
    /// Its advice and residency, by offset.
    hints: HintMaps,
}

/// Advice and residency over a range of addresses (offsets in an allocation, or host addresses
/// for pageable system memory).
#[derive(Debug)]
struct HintMaps {
    read_mostly: RangeMap<()>,
    preferred: RangeMap<Location>,
    accessed_by: Vec<(Location, RangeMap<()>)>,
    residency: RangeMap<Location>,
}

impl Default for HintMaps {
    fn default() -> Self {
        Self {
            read_mostly: RangeMap::new(),
            preferred: RangeMap::new(),
            accessed_by: Vec::new(),
            residency: RangeMap::new(),
        }
    }
}

impl HintMaps {
    fn apply(&mut self, range: std::ops::Range<usize>, advice: Advice) {
        match advice {
            Advice::SetReadMostly => self.read_mostly.set(range, Some(())),
            Advice::UnsetReadMostly => self.read_mostly.set(range, None),
            Advice::SetPreferredLocation(l) => self.preferred.set(range, Some(l)),
            Advice::UnsetPreferredLocation => self.preferred.set(range, None),
            Advice::SetAccessedBy(l) | Advice::UnsetAccessedBy(l) => {
                let on = matches!(advice, Advice::SetAccessedBy(_)).then_some(());
                match self.accessed_by.iter_mut().find(|(at, _)| *at == l) {
                    Some((_, map)) => map.set(range, on),
                    None if on.is_some() => {
                        let mut map = RangeMap::new();
                        map.set(range, on);
                        self.accessed_by.push((l, map));
                    }
                    None => {}
                }
            }
        }
    }

    /// Ranges held over all its maps.
    fn ranges(&self) -> usize {
        self.read_mostly.spans()
            + self.preferred.spans()
            + self.residency.spans()
            + self
                .accessed_by
                .iter()
                .map(|(_, m)| m.spans())
                .sum::<usize>()
    }

    fn at(&self, at: usize) -> Hints {
        let mut accessed_by: Vec<Location> = self
            .accessed_by
            .iter()
            .filter(|(_, m)| m.get(at).is_some())
            .map(|(l, _)| *l)
            .collect();
        accessed_by.sort_by_key(|l| match l {
            Location::Host => 0,
            Location::Device(d) => u64::from(d.0) + 1,
        });
        Hints {
            read_mostly: self.read_mostly.get(at).is_some(),
            preferred_location: self.preferred.get(at).copied(),
            accessed_by,
        }
    }
}

/// A mapping of simulated device memory: its address and the bytes mapped there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mapping {
    address: usize,
    mapped: usize,
}

impl Mapping {
    const fn end(self) -> usize {
        self.address + self.mapped
    }
}

/// A function got from a module (`cuModuleGetFunction`): its module and simulated kernel.
#[derive(Clone, Copy, Debug)]
struct FunctionRecord {
    module: u64,
    kernel: Kernel,
}

/// A host range registered with `cuMemHostRegister`.
#[derive(Debug)]
struct Registration {
    len: usize,
    device: u32,
}

#[derive(Debug)]
struct Pool {
    device: u32,
    max_bytes: u64,
    release_threshold: u64,
    reserved: u64,
    /// Blocks allocated (their frees not yet run).
    live: u64,
    /// Freed blocks kept: (address, mapped bytes).
    cached: Vec<Mapping>,
    /// Destroyed with blocks outstanding: released when the last is freed.
    destroyed: bool,
}

#[derive(Clone, Copy, Debug)]
enum Work {
    Memset {
        start: usize,
        end: usize,
        value: u8,
    },
    Prefetch {
        start: usize,
        end: usize,
        to: Location,
    },
    Kernel {
        kernel: Kernel,
        args: [u64; 4],
    },
    PoolFree {
        ptr: usize,
    },
    Signal {
        event: u64,
        generation: u64,
    },
    /// Waits until `source` (the queue the event's record was on when the wait was queued) has
    /// run its `Signal { event, generation }`: what a later record or a destroy of the event
    /// does cannot change what this wait waits for, as with `cuStreamWaitEvent`.
    Wait {
        event: u64,
        generation: u64,
        source: Option<Queue>,
    },
}

impl Work {
    /// The device byte ranges it touches.
    fn spans(&self) -> [(usize, usize); 2] {
        match *self {
            Self::Memset { start, end, .. } | Self::Prefetch { start, end, .. } => {
                [(start, end), (0, 0)]
            }
            Self::Kernel { kernel, args } => kernel.spans(args).map_or([(0, 0); 2], |s| {
                s.map(|(a, n)| {
                    let a = usize::try_from(a).unwrap_or(usize::MAX);
                    (
                        a,
                        a.saturating_add(usize::try_from(n).unwrap_or(usize::MAX)),
                    )
                })
            }),
            Self::PoolFree { .. } | Self::Signal { .. } | Self::Wait { .. } => [(0, 0); 2],
        }
    }

    fn overlaps(&self, start: usize, end: usize) -> bool {
        self.spans()
            .iter()
            .any(|&(s, e)| s < e && s < end && start < e)
    }
}

#[derive(Debug, Default)]
struct EventRecord {
    /// Records made; the latest is what a wait or a synchronize waits for.
    recorded: u64,
    /// The latest record the device has reached.
    completed: u64,
    /// Where the latest record is queued.
    queue: Option<Queue>,
    /// The context of the latest record's stream (its sticky fault is the event's).
    context: u64,
    /// The context current at `cuEventCreate`, which the event belongs to: it is recorded only
    /// on that context's streams (0: made with no context current, through the Rust API: any).
    owner: u64,
}

#[derive(Debug)]
struct Fault {
    call: Call,
    nth: u64,
    code: u32,
}

#[derive(Debug, Default)]
struct State {
    contexts: HashMap<u64, Context>,
    primaries: Vec<u64>,
    scrub_streams: Vec<u64>,
    streams: HashMap<u64, StreamRecord>,
    allocations: BTreeMap<usize, Record>,
    used: Vec<u64>,
    pools: HashMap<u64, Pool>,
    queues: HashMap<Queue, VecDeque<Work>>,
    events: HashMap<u64, EventRecord>,
    /// Loaded modules, and the context each was loaded in.
    modules: HashMap<u64, u64>,
    functions: HashMap<u64, FunctionRecord>,
    next_handle: u64,
    faults: Vec<Fault>,
    /// Mappings freed while queued work still targeted them: never unmapped before the machine
    /// goes, so the address cannot be handed to a new allocation that the stale work would then
    /// write (it finds no allocation and faults, as on a GPU).
    quarantine: Vec<Mapping>,
    /// Per device: the code every call that is not teardown answers there, once the device is
    /// failed with [`ModelDriver::fail_device`].
    failed_devices: Vec<Option<u32>>,
    /// Host ranges registered with `cuMemHostRegister`, by base address.
    registered: BTreeMap<usize, Registration>,
    /// Advice and residency of pageable system memory, by host address.
    system: HintMaps,
    stats: ModelStats,
    /// The configuration's pageable memory access (read by work as it runs).
    pageable: bool,
}

/// One simulated CUDA driver: devices, contexts (with a per-thread current-context stack),
/// managed memory in host memory, streams whose work completes later than the call (with
/// [`deferred_streams`](ModelConfig::deferred_streams)), events, stream-ordered pools, simulated
/// kernels, sticky illegal-address faults, hints and residency, fault injection per entry point,
/// and counters. It implements the core's [`DriverApi`], so `DriverBackend<ModelDriver>` is the
/// same code the real backends run, over a driver that keeps a GPU's rules.
///
/// Every value of it is its own machine (tests make as many as they like, in parallel).
#[derive(Debug)]
pub struct ModelDriver {
    id: u64,
    config: ModelConfig,
    page: usize,
    state: Arc<Mutex<State>>,
    /// The background worker ([`ModelConfig::worker_interval`]), stopped and joined at drop.
    worker: Option<Worker>,
    /// Calls held after they took effect, until a test releases them.
    holds: Arc<crate::hold::Holds>,
    /// What its drop found still mapped.
    drop_report: ModelDropReport,
}

/// A thread that runs one work item of every queue per interval, as a device gets to work on
/// its own.
#[derive(Debug)]
struct Worker {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    fn start(state: &Arc<Mutex<State>>, interval: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (state, stopped) = (Arc::downgrade(state), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("twm-model-device".into())
            .spawn(move || {
                while !stopped.load(Ordering::Acquire) {
                    // Woken early by the drop (`unpark`), so a long interval never delays it.
                    std::thread::park_timeout(interval);
                    if stopped.load(Ordering::Acquire) {
                        return;
                    }
                    let Some(state) = state.upgrade() else {
                        return;
                    };
                    let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
                    let queues: Vec<Queue> = state.queues.keys().copied().collect();
                    for queue in queues {
                        state.run_one(queue);
                    }
                }
            })
            .ok();
        Self { stop, thread }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

impl Default for ModelDriver {
    fn default() -> Self {
        Self::new(ModelConfig::default())
    }
}

fn error(call: Call, code: u32) -> ModelError {
    ModelError::Driver(CudaError {
        call: call.name(),
        code,
    })
}

impl Drop for ModelDriver {
    /// Unmaps whatever is still mapped (counted in its [`ModelDropReport`]).
    fn drop(&mut self) {
        // The worker first: nothing runs behind the unmapping below.
        drop(self.worker.take());
        let mut state = self.state();
        // A pool block whose free is still queued was given back by its caller: run the frees
        // (nothing else) so it is not counted as leaked.
        let frees: Vec<usize> = state
            .queues
            .values()
            .flatten()
            .filter_map(|w| match w {
                Work::PoolFree { ptr } => Some(*ptr),
                _ => None,
            })
            .collect();
        state.queues.clear();
        for ptr in frees {
            state.release_pool_block(ptr);
        }
        for Mapping { address, mapped } in std::mem::take(&mut state.quarantine) {
            if let Some(p) = core::ptr::NonNull::new(address as *mut u8) {
                // SAFETY: a freed mapping of ours kept back from reuse; nothing uses it now.
                unsafe { host::unmap(p, mapped) };
            }
        }
        let mut leaked = 0;
        for (address, record) in std::mem::take(&mut state.allocations) {
            leaked += 1;
            if let Some(p) = core::ptr::NonNull::new(address as *mut u8) {
                // SAFETY: a mapping of ours; the machine is going away, nothing uses it.
                unsafe { host::unmap(p, record.mapped) };
            }
        }
        for (_, pool) in std::mem::take(&mut state.pools) {
            for Mapping { address, mapped } in pool.cached {
                if let Some(p) = core::ptr::NonNull::new(address as *mut u8) {
                    // SAFETY: a kept pool block of ours, held by no one.
                    unsafe { host::unmap(p, mapped) };
                }
            }
        }
        self.drop_report.0.fetch_add(leaked, Ordering::AcqRel);
    }
}
