//! The simulated machine: its state, its rules, and `DriverApi` on it.

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};

// The model's tables are keyed by its own handles: foldhash (hashbrown's default), not SipHash,
// which a simulated driver call paid for on every lookup.
use hashbrown::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tensor_wasm_mem_core::{
    Advice, Allocation, DEFAULT_STREAM, DeviceFacts, DeviceId, DriverApi, DriverContext,
    DriverPool, DriverStream, Location, Operation, Stream,
};
use tensor_wasm_mem_cuda::CudaError;

mod entry;

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
    modules: HashSet<u64>,
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

impl State {
    fn handle(&mut self) -> u64 {
        self.next_handle += 1;
        0x7100_0000 + self.next_handle * 0x10
    }

    fn queue_context(&self, queue: Queue) -> Option<u64> {
        match queue {
            Queue::Default(ctx) => Some(ctx),
            Queue::Stream(s) => self.streams.get(&s).map(|r| r.context),
        }
    }

    /// The allocation (managed or pool) holding `start..end`: its base and record.
    fn containing(&self, start: usize, end: usize) -> Option<(usize, &Record)> {
        let (&base, record) = self.allocations.range(..=start).next_back()?;
        (end <= base + record.len).then_some((base, record))
    }

    fn containing_mut(&mut self, start: usize, end: usize) -> Option<(usize, &mut Record)> {
        let (&base, record) = self.allocations.range_mut(..=start).next_back()?;
        (end <= base + record.len).then_some((base, record))
    }

    /// Whether `start..end` is covered by host ranges registered for `device`, one or several
    /// adjacent ones (the device maps each at its own address, so a kernel may run across the
    /// boundary of two registrations, as on a GPU; a registration without
    /// `CU_MEMHOSTREGISTER_PORTABLE` is for its context's device only).
    fn registered_over(&self, start: usize, end: usize, device: Option<u32>) -> bool {
        let mut at = start;
        while at < end {
            let covering = self
                .registered
                .range(..=at)
                .next_back()
                .filter(|&(&base, r)| at < base + r.len && Some(r.device) == device);
            match covering {
                Some((&base, r)) => at = base + r.len,
                None => return false,
            }
        }
        true
    }

    /// Whether any registered host range overlaps `start..end`.
    fn registration_overlaps(&self, start: usize, end: usize) -> bool {
        self.registered
            .range(..end)
            .next_back()
            .is_some_and(|(&base, r)| start < base + r.len)
    }

    /// Whether work queued anywhere but `except` touches `start..end`.
    fn pending_over(&self, start: usize, end: usize, except: Option<Queue>) -> bool {
        self.queues
            .iter()
            .filter(|(q, _)| Some(**q) != except)
            .flat_map(|(_, w)| w)
            .any(|w| w.overlaps(start, end))
    }

    fn is_scrub_queue(&self, queue: Queue) -> bool {
        matches!(queue, Queue::Stream(s) if self.scrub_streams.contains(&s))
    }

    /// Queues `work` on `queue`, and counts a scrub over another queue's pending work: a memset
    /// on any stream (the backends' own zeroing streams are streams like any other), or a
    /// prefetch on the model's zeroing stream.
    fn enqueue(&mut self, queue: Queue, work: Work) {
        if matches!(work, Work::Memset { .. }) || self.is_scrub_queue(queue) {
            let [(start, end), _] = work.spans();
            if start < end && self.pending_over(start, end, Some(queue)) {
                self.stats.scrubs_over_pending_work += 1;
            }
        }
        self.queues.entry(queue).or_default().push_back(work);
    }

    /// Runs everything queued on `queue`, in order.
    fn drain(&mut self, queue: Queue) {
        while self.run_one(queue) {}
    }

    /// Runs the oldest item queued on `queue`; `false` if there was none.
    fn run_one(&mut self, queue: Queue) -> bool {
        let Some(work) = self.queues.get_mut(&queue).and_then(VecDeque::pop_front) else {
            self.queues.remove(&queue);
            return false;
        };
        match work {
            Work::Wait {
                event,
                generation,
                source,
            } => {
                // The device waits for the record's stream to reach the record (abandoned work,
                // after a fault, is gone from the queue and waits for nothing).
                if let Some(source) = source.filter(|&q| q != queue) {
                    while self.queues.get(&source).is_some_and(|w| {
                        w.iter().any(|w| {
                            matches!(*w, Work::Signal { event: e, generation: g }
                                if e == event && g == generation)
                        })
                    }) && self.run_one(source)
                    {}
                }
            }
            Work::Signal { event, generation } => self.signal(event, generation),
            Work::PoolFree { ptr } => self.release_pool_block(ptr),
            Work::Memset { start, end, value } => {
                if self.containing(start, end).is_some() {
                    let (ptr, len) = (start as *mut u8, end - start);
                    if value == 0 {
                        // SAFETY: `start..end` lies inside a live mapping of ours (found just
                        // now); a device write races host readers as it does on a GPU, which is
                        // what this simulates.
                        unsafe { host::zero(ptr, len) };
                    } else {
                        // SAFETY: as above.
                        unsafe { ptr.write_bytes(value, len) };
                    }
                }
            }
            Work::Prefetch { start, end, to } => {
                if let Some((base, record)) = self.containing_mut(start, end) {
                    record
                        .hints
                        .residency
                        .set(start - base..end - base, Some(to));
                } else if self.pageable {
                    self.system.residency.set(start..end, Some(to));
                }
            }
            Work::Kernel { kernel, args } => {
                let device = self
                    .queue_context(queue)
                    .and_then(|c| self.contexts.get(&c))
                    .map(|c| c.device);
                let legal = work.spans().iter().all(|&(s, e)| {
                    s == e
                        || self.containing(s, e).is_some()
                        || self.registered_over(s, e, device)
                        || (self.pageable && host::accessible(s, e - s))
                });
                if !legal {
                    self.fault(queue);
                    return true;
                }
                // SAFETY: every range the kernel touches lies inside a live mapping of ours, a
                // registered host range (pinned: mapped readable and writable while registered,
                // by `cuMemHostRegister`'s own check), or host memory found readable and writable
                // just now with pageable access on (checked just now); the launch's caller
                // guaranteed nothing else accesses them.
                unsafe { run_kernel(kernel, args) };
            }
        }
        self.stats.work_completed += 1;
        true
    }

    /// A kernel on `queue` hit an illegal address: its context is poisoned and the work queued
    /// in it is abandoned (pool frees still return their blocks, records still complete, so no
    /// memory is lost to the fault).
    fn fault(&mut self, queue: Queue) {
        self.stats.kernel_faults += 1;
        let Some(context) = self.queue_context(queue) else {
            return;
        };
        if let Some(c) = self.contexts.get_mut(&context) {
            c.poisoned = true;
        }
        let mine: Vec<Queue> = self
            .queues
            .keys()
            .copied()
            .filter(|&q| self.queue_context(q) == Some(context))
            .collect();
        for q in mine {
            for work in self.queues.remove(&q).unwrap_or_default() {
                match work {
                    Work::PoolFree { ptr } => self.release_pool_block(ptr),
                    Work::Signal { event, generation } => self.signal(event, generation),
                    _ => {}
                }
            }
        }
    }

    /// The device reached record `generation` of `event`.
    fn signal(&mut self, event: u64, generation: u64) {
        if let Some(e) = self.events.get_mut(&event) {
            e.completed = e.completed.max(generation);
        }
    }

    /// A pool block's free has run: kept for reuse, or given back past the release threshold
    /// (or when its pool is destroyed).
    fn release_pool_block(&mut self, ptr: usize) {
        let Some(record) = self.allocations.remove(&ptr) else {
            return;
        };
        let Some(pool_raw) = record.pool else {
            self.allocations.insert(ptr, record);
            return;
        };
        let Some(pool) = self.pools.get_mut(&pool_raw) else {
            // Its pool is gone: the block goes back to the device at once.
            self.used[record.device as usize] -= record.mapped as u64;
            self.stats.pool_reserved_bytes -= record.mapped as u64;
            if let Some(ptr) = core::ptr::NonNull::new(ptr as *mut u8) {
                // SAFETY: a block of a pool that no longer exists, mapped with this length and
                // just taken out of the table: no one else holds it.
                unsafe { host::unmap(ptr, record.mapped) };
            }
            return;
        };
        pool.live -= 1;
        pool.cached.push(Mapping {
            address: ptr,
            mapped: record.mapped,
        });
        let keep = if pool.destroyed {
            0
        } else {
            pool.release_threshold
        };
        self.trim(pool_raw, keep);
        if let Some(pool) = self.pools.get(&pool_raw)
            && pool.destroyed
            && pool.live == 0
        {
            self.pools.remove(&pool_raw);
        }
    }

    /// Gives kept blocks of `pool` back until it holds at most `keep` bytes (or what is live).
    fn trim(&mut self, pool_raw: u64, keep: u64) {
        while let Some(pool) = self.pools.get(&pool_raw)
            && pool.reserved > keep
        {
            // A block that queued work still targets stays (unmapping it would let the address
            // go to another allocation that the stale work would then write).
            let free = pool
                .cached
                .iter()
                .rposition(|b| !self.pending_over(b.address, b.end(), None));
            let Some(pool) = self.pools.get_mut(&pool_raw) else {
                break;
            };
            let Some(Mapping {
                address: ptr,
                mapped,
            }) = free.map(|i| pool.cached.swap_remove(i))
            else {
                break;
            };
            pool.reserved -= mapped as u64;
            self.used[pool.device as usize] -= mapped as u64;
            self.stats.pool_reserved_bytes -= mapped as u64;
            if let Some(ptr) = core::ptr::NonNull::new(ptr as *mut u8) {
                // SAFETY: a kept block of this pool, mapped with this length, held by no one.
                unsafe { host::unmap(ptr, mapped) };
            }
        }
    }
}

/// Runs a simulated kernel.
///
/// # Safety
///
/// Every range it touches lies inside a live mapping, and nothing else accesses them meanwhile
/// (beyond what a GPU's concurrent host access would race).
unsafe fn run_kernel(kernel: Kernel, args: [u64; 4]) {
    let ptr = |a: u64| a as usize as *mut u8;
    let len = |n: u64| usize::try_from(n).unwrap_or(0);
    match kernel {
        Kernel::Fill => {
            // SAFETY: the caller's contract; raw accesses, no references formed.
            unsafe { ptr(args[0]).write_bytes(args[2] as u8, len(args[1])) }
        }
        Kernel::Increment => {
            for i in 0..len(args[1]) {
                let p = ptr(args[0]).wrapping_add(i);
                // SAFETY: `i < len`, inside the checked range.
                let byte = unsafe { p.read() };
                // SAFETY: as above.
                unsafe { p.write(byte.wrapping_add(1)) };
            }
        }
        // SAFETY: both ranges checked; `copy` allows overlap.
        Kernel::Copy => unsafe { std::ptr::copy(ptr(args[1]), ptr(args[0]), len(args[2])) },
        Kernel::Axpy => {
            let a = f32::from_bits(args[0] as u32);
            for i in 0..len(args[3]) {
                let x = ptr(args[1]).cast::<f32>().wrapping_add(i);
                let y = ptr(args[2]).cast::<f32>().wrapping_add(i);
                // SAFETY: `i < n`, inside both checked ranges (`n * 4` bytes each); unaligned
                // accesses, as device pointers need not be aligned here.
                let xv = unsafe { x.read_unaligned() };
                // SAFETY: as above.
                let yv = unsafe { y.read_unaligned() };
                // SAFETY: as above.
                unsafe { y.write_unaligned(a * xv + yv) };
            }
        }
    }
}

impl ModelDriver {
    /// A simulated machine as `config` describes. Its `device_count` is taken within 1 (a
    /// driver backend does not start without a device) and [`MAX_DEVICES`](crate::MAX_DEVICES)
    /// (each device has tables of its own: a count from a command line must not size them).
    #[must_use]
    pub fn new(config: ModelConfig) -> Self {
        let config = ModelConfig {
            device_count: config.device_count.clamp(1, crate::MAX_DEVICES),
            ..config
        };
        let mut state = State {
            used: vec![0; config.device_count as usize],
            failed_devices: vec![None; config.device_count as usize],
            pageable: config.pageable_memory_access,
            ..State::default()
        };
        for device in 0..config.device_count {
            let primary = state.handle();
            state.contexts.insert(
                primary,
                Context {
                    device,
                    primary: true,
                    poisoned: false,
                    inactive: false,
                },
            );
            state.primaries.push(primary);
            let scrub = state.handle();
            state.streams.insert(
                scrub,
                StreamRecord {
                    context: primary,
                    internal: true,
                },
            );
            state.scrub_streams.push(scrub);
        }
        let state = Arc::new(Mutex::new(state));
        let worker = config
            .worker_interval
            .filter(|_| config.deferred_streams)
            .map(|interval| Worker::start(&state, interval));
        Self {
            id: MACHINES.fetch_add(1, Ordering::Relaxed),
            config,
            page: host::page_size(),
            worker,
            state,
            holds: Arc::default(),
            drop_report: ModelDropReport::default(),
        }
    }

    /// The report of this machine's drop (what was still mapped then), readable once it has
    /// gone.
    #[must_use]
    pub fn drop_report(&self) -> ModelDropReport {
        self.drop_report.clone()
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every update of the state is complete before anything that can panic; keep serving.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A snapshot of the counters.
    #[must_use]
    pub fn stats(&self) -> ModelStats {
        self.state().stats.clone()
    }

    /// Makes the `n`-th call from now (`n = 1`: the next) of the entry point `DriverBackend`
    /// calls for `op` fail: with `CUDA_ERROR_OUT_OF_MEMORY` for `Allocate`,
    /// `CUDA_ERROR_UNKNOWN` otherwise. `false` for an operation with no entry point of its own.
    pub fn fail_nth(&self, op: Operation, n: u64) -> bool {
        let Some(call) = Call::for_operation(op) else {
            return false;
        };
        let code = if op == Operation::Allocate {
            code::OUT_OF_MEMORY
        } else {
            code::UNKNOWN
        };
        self.fail_call(call, n, code);
        true
    }

    /// Makes the `n`-th call of `call` from now answer `code`: any integer, including codes no
    /// CUDA enum knows (to prove they are reported, not undefined behaviour).
    pub fn fail_call(&self, call: Call, n: u64, code: u32) {
        let mut state = self.state();
        let done = state.stats.entry_calls(call);
        state.faults.push(Fault {
            call,
            nth: done.saturating_add(n.max(1)),
            code,
        });
    }

    /// Fails `device` as a whole: from now on every call there (in a context of that device, or
    /// creating a context or pool on it) answers `code`, except teardown
    /// ([`Call::is_teardown`]: frees, destroys, pops, synchronises), until
    /// [`restore_device`](Self::restore_device). Other devices go on. (A real lost device,
    /// `CUDA_ERROR_ECC_UNCORRECTABLE` or an Xid, also fails teardown; the model keeps it working
    /// so tests can prove nothing of the other tenants leaks.) `false` for a device the machine
    /// does not have.
    pub fn fail_device(&self, device: DeviceId, code: u32) -> bool {
        let mut state = self.state();
        match state.failed_devices.get_mut(device.0 as usize) {
            Some(slot) => {
                *slot = Some(code);
                true
            }
            None => false,
        }
    }

    /// Undoes [`fail_device`](Self::fail_device).
    pub fn restore_device(&self, device: DeviceId) {
        if let Some(slot) = self.state().failed_devices.get_mut(device.0 as usize) {
            *slot = None;
        }
    }

    /// The code a call of `call` on `device` answers because the device is failed, if it is.
    fn device_down(state: &State, call: Call, device: u32) -> Result<(), ModelError> {
        match state.failed_devices.get(device as usize).copied().flatten() {
            Some(code) if !call.is_teardown() => Err(error(call, code)),
            _ => Ok(()),
        }
    }

    /// Removes every pending injected failure and hold (and lets held calls return).
    pub fn clear_faults(&self) {
        self.state().faults.clear();
        self.holds.clear();
    }

    /// Holds the next call of the entry point `call` after it took effect, with the machine
    /// unlocked (a slow driver, or a thread preempted right after the call), until
    /// the [`HeldCall`](crate::HeldCall) is released (or dropped): races are staged by the
    /// test, not by time.
    pub fn hold_next(&self, call: Call) -> crate::HeldCall {
        crate::HeldCall::new(Arc::clone(&self.holds), call)
    }

    /// Holds the next call of `call` as [`hold_next`](Self::hold_next) does, until
    /// [`release_held`](Self::release_held) (for a caller that names calls, not handles: the
    /// simulated libcuda's controls).
    pub fn arm_hold(&self, call: Call) {
        self.holds.arm(call);
    }

    /// Waits until a call of `call` is held by [`hold_next`](Self::hold_next); `false` if none
    /// was within `limit` (a bound for a broken test, never a timing the test relies on).
    #[must_use]
    pub fn wait_held(&self, call: Call, limit: Duration) -> bool {
        self.holds.wait_held(call, limit)
    }

    /// Lets a held call of `call` return to its caller (or disarms a hold not reached yet).
    pub fn release_held(&self, call: Call) {
        self.holds.release(call);
    }

    /// Counts a call, answers an injected failure if one is due, and checks that the calling
    /// thread's current context is live and usable (for `needs_context` calls): its device.
    fn enter(&self, state: &mut State, call: Call, needs_context: bool) -> Result<u32, ModelError> {
        state.stats.calls[call.index()] += 1;
        let nth = state.stats.calls[call.index()];
        if let Some(i) = state
            .faults
            .iter()
            .position(|f| f.call == call && f.nth == nth)
        {
            let fault = state.faults.swap_remove(i);
            state.stats.injected_failures += 1;
            return Err(error(call, fault.code));
        }
        if !needs_context {
            return Ok(0);
        }
        let current = self.current();
        match state.contexts.get(&current) {
            Some(c) if c.inactive => Err(error(call, code::INVALID_CONTEXT)),
            Some(c) if c.poisoned => Err(error(call, code::ILLEGAL_ADDRESS)),
            Some(c) => Self::device_down(state, call, c.device).map(|()| c.device),
            None => Err(error(call, code::INVALID_CONTEXT)),
        }
    }

    /// Holds the caller while a hold is armed for `call` (called with the state unlocked).
    fn late_return(&self, call: Call) {
        self.holds.reached(call);
    }

    /// Runs `f` on the calling thread's context stack of this machine. A thread whose
    /// thread-locals are being torn down (a driver call from a TLS destructor) has an empty stack
    /// that keeps nothing, rather than a panic.
    fn with_stack<T>(&self, f: impl FnOnce(&mut Vec<u64>) -> T) -> T {
        let mut f = Some(f);
        let result = STACKS.try_with(|stacks| {
            let f = f.take().expect("called once");
            let mut stacks = stacks.borrow_mut();
            let i = match stacks.iter().position(|(id, _)| *id == self.id) {
                Some(i) => i,
                None => {
                    stacks.push((self.id, Vec::new()));
                    stacks.len() - 1
                }
            };
            let result = f(&mut stacks[i].1);
            if stacks[i].1.is_empty() {
                stacks.swap_remove(i);
            }
            result
        });
        match (result, f) {
            (Ok(result), _) => result,
            (Err(_), Some(f)) => f(&mut Vec::new()),
            (Err(_), None) => unreachable!("the stack's closure runs only if the stack exists"),
        }
    }

    /// The calling thread's current context of this machine (0: none).
    #[must_use]
    pub fn current(&self) -> u64 {
        self.with_stack(|s| s.last().copied().unwrap_or(0))
    }

    /// The depth of the calling thread's context stack of this machine.
    #[must_use]
    pub fn context_depth(&self) -> usize {
        self.with_stack(|s| s.len())
    }

    /// The queue a stream handle of the current context names (0: its legacy default stream).
    fn queue_in(state: &State, call: Call, context: u64, stream: u64) -> Result<Queue, ModelError> {
        if stream == DEFAULT_STREAM {
            return Ok(Queue::Default(context));
        }
        match state.streams.get(&stream) {
            Some(s) if s.context == context => Ok(Queue::Stream(stream)),
            _ => Err(error(call, code::INVALID_HANDLE)),
        }
    }

    /// The queue of a `Stream` handed out by `DriverBackend` over this machine, checked live.
    fn queue_of(state: &State, call: Call, stream: On) -> Result<Queue, ModelError> {
        if !state.contexts.contains_key(&stream.context) {
            return Err(error(call, code::INVALID_CONTEXT));
        }
        Self::queue_in(state, call, stream.context, stream.raw)
    }

    fn check_poison(state: &State, call: Call, context: u64) -> Result<(), ModelError> {
        match state.contexts.get(&context) {
            Some(c) if c.poisoned => Err(error(call, code::ILLEGAL_ADDRESS)),
            Some(c) => Self::device_down(state, call, c.device),
            None => Err(error(call, code::INVALID_CONTEXT)),
        }
    }

    /// Runs `queue` now if streams are not deferred.
    fn settle(&self, state: &mut State, queue: Queue) {
        if !self.config.deferred_streams {
            state.drain(queue);
        }
    }

    fn location(&self, call: Call, location: Location) -> Result<(), ModelError> {
        match location {
            Location::Device(d) if d.0 >= self.config.device_count => {
                Err(error(call, code::INVALID_DEVICE))
            }
            _ => Ok(()),
        }
    }

    /// What advice and prefetch may name at `ptr..ptr + len` (non-empty): the managed
    /// allocation holding it (`Some(base)`), or, with pageable memory access, host memory
    /// outside every allocation (`None`).
    fn advisable(
        &self,
        state: &State,
        call: Call,
        ptr: u64,
        len: usize,
    ) -> Result<Option<usize>, ModelError> {
        let invalid = error(call, code::INVALID_VALUE);
        let start = usize::try_from(ptr).map_err(|_| invalid)?;
        let end = start.checked_add(len).ok_or(invalid)?;
        if len == 0 {
            return Err(invalid);
        }
        match state.allocations.range(..end).next_back() {
            Some((&base, r)) if start >= base && end <= base + r.len && r.pool.is_none() => {
                Ok(Some(base))
            }
            // Overlapping an allocation without lying inside it, or a pool block.
            Some((&base, r)) if start < base + r.len => Err(invalid),
            _ if self.config.pageable_memory_access => Ok(None),
            _ => Err(invalid),
        }
    }

    /// The hint maps `allocation` is read through and the offset of its base in them: its own
    /// record, or the system memory's (pageable memory access) for attached host memory.
    fn hint_maps<'s>(
        &self,
        state: &'s State,
        allocation: &Allocation,
    ) -> Result<(&'s HintMaps, usize), ModelError> {
        let base = allocation.as_ptr() as usize;
        allocation
            .range(0, 1)
            .map_err(|e| ModelError::Refused(e.into()))?;
        match state.allocations.get(&base) {
            Some(r) if r.len == allocation.len() => Ok((&r.hints, 0)),
            None if self.config.pageable_memory_access
                && state.containing(base, base).is_none() =>
            {
                Ok((&state.system, base))
            }
            _ => Err(error(Call::Advise, code::INVALID_VALUE)),
        }
    }

    /// The hints in force at `offset` of `allocation` (managed, or attached host memory with
    /// pageable memory access).
    pub fn hints(&self, allocation: &Allocation, offset: usize) -> Result<Hints, ModelError> {
        let state = self.state();
        let (maps, base) = self.hint_maps(&state, allocation)?;
        allocation
            .range(offset, 1)
            .map_err(|e| ModelError::Refused(e.into()))?;
        Ok(maps.at(base + offset))
    }

    /// Advice and residency ranges the driver tracks now, over every allocation and the system
    /// memory (pageable memory access): what hints can make it hold.
    #[must_use]
    pub fn hint_ranges(&self) -> usize {
        let state = self.state();
        state.system.ranges()
            + state
                .allocations
                .values()
                .map(|r| r.hints.ranges())
                .sum::<usize>()
    }

    /// The host ranges registered now, as `(base, len)` in address order.
    #[must_use]
    pub fn registered_ranges(&self) -> Vec<(usize, usize)> {
        let state = self.state();
        state.registered.iter().map(|(&b, r)| (b, r.len)).collect()
    }

    /// Where `offset` of `allocation` was last prefetched to, by work that has run (`None`:
    /// never).
    pub fn residency(
        &self,
        allocation: &Allocation,
        offset: usize,
    ) -> Result<Option<Location>, ModelError> {
        let state = self.state();
        let (maps, base) = self.hint_maps(&state, allocation)?;
        allocation
            .range(offset, 1)
            .map_err(|e| ModelError::Refused(e.into()))?;
        Ok(maps.residency.get(base + offset).copied())
    }

    /// Work items queued and not yet run, over all streams.
    #[must_use]
    pub fn pending_work(&self) -> usize {
        self.state().queues.values().map(VecDeque::len).sum()
    }

    /// Bytes the device's memory holds now (managed allocations and pool reservations).
    #[must_use]
    pub fn device_bytes_used(&self, device: DeviceId) -> u64 {
        self.state()
            .used
            .get(device.0 as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Whether a kernel fault poisoned `context` (sticky until it is destroyed).
    #[must_use]
    pub fn is_poisoned(&self, context: u64) -> bool {
        self.state()
            .contexts
            .get(&context)
            .is_some_and(|c| c.poisoned)
    }

    /// Runs the oldest work item queued on `stream`, as the device would get to it
    /// (deterministic stepping for tests); `false` if nothing was queued.
    pub fn step(&self, stream: &Stream) -> Result<bool, ModelError> {
        let mut state = self.state();
        let queue = Self::queue_of(&state, Call::StreamSynchronize, stream.into())?;
        Ok(state.run_one(queue))
    }

    /// `cuModuleLoadData`: any image loads (its code is not read); its functions are the
    /// simulated [`Kernel`]s.
    pub fn load_module(&self) -> Result<Module, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::ModuleLoad, true)?;
        let handle = state.handle();
        state.modules.insert(handle);
        Ok(Module(handle))
    }

    /// `cuModuleGetFunction`: `CUDA_ERROR_NOT_FOUND` for a name that is no simulated kernel.
    pub fn get_function(&self, module: Module, name: &str) -> Result<Function, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::ModuleGetFunction, true)?;
        if !state.modules.contains(&module.0) {
            return Err(error(Call::ModuleGetFunction, code::INVALID_HANDLE));
        }
        let kernel =
            Kernel::by_name(name).ok_or(error(Call::ModuleGetFunction, code::NOT_FOUND))?;
        let handle = state.handle();
        state.functions.insert(
            handle,
            FunctionRecord {
                module: module.0,
                kernel,
            },
        );
        Ok(Function(handle))
    }

    /// `cuLaunchKernel` on `stream`, in its context: queued, and run when the device gets to it.
    /// Wrong argument counts and overflowing lengths are refused at the call; memory outside
    /// every live allocation is found when it runs (an illegal address: the context is poisoned,
    /// its queued work abandoned, and every later call in it answers
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`).
    ///
    /// # Safety
    ///
    /// As for a kernel launch: when it runs, nothing else may access the bytes it touches (no
    /// Rust reference to them, no host view such as Wasmtime's `Memory::data`), typically
    /// because the memory is held by a device-access scope that waits for the stream.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        function: Function,
        args: &[u64],
    ) -> Result<(), ModelError> {
        let kernel = self.state().functions.get(&function.0).map(|f| f.kernel);
        // SAFETY: the caller's contract is this call's.
        unsafe { self.launch_kernel(stream.into(), kernel, args) }
    }

    /// [`launch`](Self::launch) of `kernel` (`None`: an unknown function handle).
    ///
    /// # Safety
    ///
    /// As for [`launch`](Self::launch).
    unsafe fn launch_kernel(
        &self,
        stream: On,
        kernel: Option<Kernel>,
        args: &[u64],
    ) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::Launch, false)?;
        let queue = Self::queue_of(&state, Call::Launch, stream)?;
        Self::check_poison(&state, Call::Launch, stream.context)?;
        let kernel = kernel.ok_or(error(Call::Launch, code::INVALID_HANDLE))?;
        if args.len() != kernel.arity() {
            return Err(error(Call::Launch, code::INVALID_VALUE));
        }
        let mut all = [0u64; 4];
        all[..args.len()].copy_from_slice(args);
        let spans = kernel
            .spans(all)
            .ok_or(error(Call::Launch, code::INVALID_VALUE))?;
        if spans.iter().any(|&(a, n)| a.checked_add(n).is_none()) {
            return Err(error(Call::Launch, code::INVALID_VALUE));
        }
        state.enqueue(queue, Work::Kernel { kernel, args: all });
        self.settle(&mut state, queue);
        Self::check_poison(&state, Call::Launch, stream.context)
    }

    /// The simulated `fill` kernel over `device_ptr..device_ptr + len` with `byte`, launched on
    /// `stream` (a `cuLaunchKernel` of `fill`, without a module to load first).
    ///
    /// # Safety
    ///
    /// As for [`launch`](Self::launch).
    pub unsafe fn enqueue_fill(
        &self,
        stream: &Stream,
        device_ptr: u64,
        len: usize,
        byte: u8,
    ) -> Result<(), ModelError> {
        let args = [device_ptr, len as u64, u64::from(byte)];
        // SAFETY: the caller's contract is `launch`'s.
        unsafe { self.launch_kernel(stream.into(), Some(Kernel::Fill), &args) }
    }

    /// `cuEventCreate`.
    ///
    /// The event belongs to the calling thread's current context, if one is: it is recorded
    /// only on that context's streams (`CUDA_ERROR_INVALID_HANDLE` elsewhere), while a stream of
    /// any context may wait on it. With no context current (the Rust API's convenience) it
    /// belongs to none and any stream may record it.
    pub fn event_create(&self) -> Result<Event, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventCreate, false)?;
        let owner = self.current();
        let handle = state.handle();
        state.events.insert(
            handle,
            EventRecord {
                owner,
                ..EventRecord::default()
            },
        );
        state.stats.live_events += 1;
        Ok(Event(handle))
    }

    fn event(state: &mut State, call: Call, event: Event) -> Result<&mut EventRecord, ModelError> {
        state
            .events
            .get_mut(&event.0)
            .ok_or(error(call, code::INVALID_HANDLE))
    }

    /// `cuEventRecord`: the event completes when `stream` gets to this point.
    pub fn event_record(&self, event: Event, stream: &Stream) -> Result<(), ModelError> {
        self.record_on(event, stream.into())
    }

    fn record_on(&self, event: Event, stream: On) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventRecord, false)?;
        let queue = Self::queue_of(&state, Call::EventRecord, stream)?;
        Self::check_poison(&state, Call::EventRecord, stream.context)?;
        let e = Self::event(&mut state, Call::EventRecord, event)?;
        if e.owner != 0 && e.owner != stream.context {
            return Err(error(Call::EventRecord, code::INVALID_HANDLE));
        }
        e.recorded += 1;
        e.queue = Some(queue);
        e.context = stream.context;
        let generation = e.recorded;
        state.enqueue(
            queue,
            Work::Signal {
                event: event.0,
                generation,
            },
        );
        self.settle(&mut state, queue);
        Ok(())
    }

    /// `cuStreamWaitEvent`: work queued on `stream` after this waits for the event's latest
    /// record (an event never recorded: nothing to wait for).
    pub fn stream_wait_event(&self, stream: &Stream, event: Event) -> Result<(), ModelError> {
        self.wait_on(stream.into(), event)
    }

    fn wait_on(&self, stream: On, event: Event) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::StreamWaitEvent, false)?;
        let queue = Self::queue_of(&state, Call::StreamWaitEvent, stream)?;
        Self::check_poison(&state, Call::StreamWaitEvent, stream.context)?;
        let e = Self::event(&mut state, Call::StreamWaitEvent, event)?;
        let (generation, source) = (e.recorded, e.queue.filter(|_| e.completed < e.recorded));
        state.enqueue(
            queue,
            Work::Wait {
                event: event.0,
                generation,
                source,
            },
        );
        self.settle(&mut state, queue);
        Ok(())
    }

    /// `cuEventQuery`: `true` once the device reached the latest record (`CUDA_ERROR_NOT_READY`
    /// is `false` here).
    pub fn event_query(&self, event: Event) -> Result<bool, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventQuery, false)?;
        let e = Self::event(&mut state, Call::EventQuery, event)?;
        let (done, context) = (e.completed >= e.recorded, e.context);
        if context != 0 {
            // A fault in the record's context is the event's answer, as the driver gives it.
            Self::check_poison(&state, Call::EventQuery, context)?;
        }
        Ok(done)
    }

    /// `cuEventSynchronize`: runs the event's stream up to its latest record.
    pub fn event_synchronize(&self, event: Event) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventSynchronize, false)?;
        loop {
            let e = Self::event(&mut state, Call::EventSynchronize, event)?;
            let (done, context, queue) = (e.completed >= e.recorded, e.context, e.queue);
            if context != 0 {
                Self::check_poison(&state, Call::EventSynchronize, context)?;
            }
            let Some(queue) = queue.filter(|_| !done) else {
                return Ok(());
            };
            if !state.run_one(queue) {
                // Abandoned by a fault: the record will never be reached.
                let context = state.queue_context(queue).unwrap_or(0);
                return Self::check_poison(&state, Call::EventSynchronize, context);
            }
        }
    }

    /// `cuEventDestroy_v2` (a wait already queued on it still completes).
    pub fn event_destroy(&self, event: Event) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::EventDestroy, false)?;
        state
            .events
            .remove(&event.0)
            .ok_or(error(Call::EventDestroy, code::INVALID_HANDLE))?;
        state.stats.live_events -= 1;
        Ok(())
    }

    /// `cuMemAllocFromPoolAsync`, zero-filled in stream order when `zero` (the `DriverApi`
    /// contract), else holding what the block held (the driver's own behaviour).
    fn pool_alloc_inner(
        &self,
        pool: u64,
        bytes: usize,
        stream: u64,
        zero: bool,
    ) -> Result<u64, ModelError> {
        let call = Call::PoolAlloc;
        let mut state = self.state();
        let device = self.enter(&mut state, call, true)?;
        let context = self.current();
        let queue = Self::queue_in(&state, call, context, stream)?;
        let mapped = bytes
            .checked_next_multiple_of(self.page)
            .filter(|_| bytes > 0)
            .ok_or(error(call, code::INVALID_VALUE))?;
        let reuse = match state.pools.get(&pool) {
            // Only a block whose free has run is reused (a free still queued on another stream
            // is not ordered before this stream's work; an event between them would be), and
            // only one no queued work targets any more.
            Some(p) if !p.destroyed && p.device == device => p
                .cached
                .iter()
                .position(|b| b.mapped == mapped && !state.pending_over(b.address, b.end(), None)),
            Some(p) if !p.destroyed => return Err(error(call, code::INVALID_CONTEXT)),
            _ => return Err(error(call, code::INVALID_HANDLE)),
        };
        let p = state
            .pools
            .get_mut(&pool)
            .ok_or(error(call, code::INVALID_HANDLE))?;
        let reused = reuse.map(|i| p.cached.swap_remove(i));
        let address = match reused {
            Some(block) => block.address,
            None => {
                if p.max_bytes != 0 && p.reserved.saturating_add(mapped as u64) > p.max_bytes {
                    return Err(error(call, code::OUT_OF_MEMORY));
                }
                let ptr = self.map_device(&mut state, call, device, mapped)?;
                let p = state
                    .pools
                    .get_mut(&pool)
                    .ok_or(error(call, code::INVALID_HANDLE))?;
                p.reserved += mapped as u64;
                state.stats.pool_reserved_bytes += mapped as u64;
                ptr.as_ptr() as usize
            }
        };
        if let Some(p) = state.pools.get_mut(&pool) {
            p.live += 1;
        }
        state
            .allocations
            .insert(address, Self::new_record(bytes, mapped, device, Some(pool)));
        state.stats.live_pool_allocations += 1;
        if zero {
            state.enqueue(
                queue,
                Work::Memset {
                    start: address,
                    end: address + bytes,
                    value: 0,
                },
            );
            self.settle(&mut state, queue);
        }
        Ok(address as u64)
    }

    fn new_record(len: usize, mapped: usize, device: u32, pool: Option<u64>) -> Record {
        Record {
            len,
            mapped,
            device,
            pool,
            hints: HintMaps::default(),
        }
    }

    /// Maps `mapped` bytes of device memory on `device`, or answers out-of-memory.
    fn map_device(
        &self,
        state: &mut State,
        call: Call,
        device: u32,
        mapped: usize,
    ) -> Result<core::ptr::NonNull<u8>, ModelError> {
        let used = state.used[device as usize];
        if used.saturating_add(mapped as u64) > self.config.device_memory_bytes {
            return Err(error(call, code::OUT_OF_MEMORY));
        }
        let ptr = host::map(mapped).map_err(|errno| ModelError::HostMapFailed {
            requested: mapped as u64,
            errno,
        })?;
        state.used[device as usize] += mapped as u64;
        Ok(ptr)
    }
}

// SAFETY: `alloc_managed` returns a fresh private anonymous mapping of at least `bytes` bytes
// (page aligned, so aligned to MIN_ALIGN), host memory the simulated device "accesses" by being
// the host, never overlapping another live one; `zero` writes zeros to exactly the range, checked
// inside a live allocation, and returns once they are visible (it runs the zeroing stream);
// `device_facts` reports the configuration.
unsafe impl DriverApi for ModelDriver {
    type Error = ModelError;

    fn device_count(&self) -> u32 {
        self.config.device_count
    }

    fn device_facts(&self, _device: DeviceId) -> DeviceFacts {
        DeviceFacts {
            concurrent_managed_access: self.config.concurrent_managed_access,
            pageable_memory_access: self.config.pageable_memory_access,
            pageable_uses_host_page_tables: false,
            host_registration: self.config.host_registration,
        }
    }

    fn allocations_come_zeroed(&self) -> bool {
        !self.config.poison_fresh_allocations
    }

    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> bool {
        let count = self.config.device_count;
        self.config.peer_access && device != peer && device.0 < count && peer.0 < count
    }

    fn memory_info(&self) -> Result<Option<(u64, u64)>, ModelError> {
        let mut state = self.state();
        let device = self.enter(&mut state, Call::MemGetInfo, true)?;
        let total = self.config.device_memory_bytes;
        let used = state.used.get(device as usize).copied().unwrap_or(0);
        Ok(Some((total.saturating_sub(used), total)))
    }

    fn primary_context(&self, device: DeviceId) -> DriverContext {
        let state = self.state();
        DriverContext::from_raw(state.primaries.get(device.0 as usize).copied().unwrap_or(0))
    }

    fn push_current(&self, context: DriverContext) -> Result<(), ModelError> {
        let context = context.raw();
        let mut state = self.state();
        self.enter(&mut state, Call::CtxPush, false)?;
        if state.contexts.get(&context).is_none_or(|c| c.inactive) {
            return Err(error(Call::CtxPush, code::INVALID_CONTEXT));
        }
        drop(state);
        self.with_stack(|s| s.push(context));
        Ok(())
    }

    fn pop_current(&self) -> Result<(), ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::CtxPop, false)?;
        drop(state);
        self.with_stack(|s| s.pop())
            .map(|_| ())
            .ok_or(error(Call::CtxPop, code::INVALID_CONTEXT))
    }

    fn alloc_managed(&self, device: DeviceId, bytes: usize) -> Result<u64, ModelError> {
        let call = Call::AllocManaged;
        let mut state = self.state();
        let current = self.enter(&mut state, call, true)?;
        if current != device.0 {
            return Err(error(call, code::INVALID_CONTEXT));
        }
        let mapped = bytes
            .checked_next_multiple_of(self.page)
            .filter(|_| bytes > 0)
            .ok_or(error(call, code::INVALID_VALUE))?;
        let ptr = self.map_device(&mut state, call, current, mapped)?;
        if self.config.poison_fresh_allocations {
            // SAFETY: a fresh mapping of `mapped >= bytes` bytes that only we know.
            unsafe { ptr.as_ptr().write_bytes(0xA5, bytes) };
        }
        let address = ptr.as_ptr() as usize;
        state
            .allocations
            .insert(address, Self::new_record(bytes, mapped, current, None));
        let stats = &mut state.stats;
        stats.allocations += 1;
        stats.live_allocations += 1;
        stats.live_bytes += bytes as u64;
        stats.peak_bytes = stats.peak_bytes.max(stats.live_bytes);
        Ok(address as u64)
    }

    unsafe fn free(&self, ptr: u64) -> Result<(), ModelError> {
        let call = Call::Free;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let address = usize::try_from(ptr).map_err(|_| error(call, code::INVALID_VALUE))?;
        if state
            .allocations
            .get(&address)
            .is_none_or(|r| r.pool.is_some())
        {
            return Err(error(call, code::INVALID_VALUE));
        }
        let record = state
            .allocations
            .remove(&address)
            .ok_or(error(call, code::INVALID_VALUE))?;
        let pending = state.pending_over(address, address + record.len, None);
        if pending {
            // What is still queued over it finds no memory when it runs (a kernel faults).
            state.stats.frees_over_pending_work += 1;
        }
        state.used[record.device as usize] -= record.mapped as u64;
        state.stats.frees += 1;
        state.stats.live_allocations -= 1;
        state.stats.live_bytes -= record.len as u64;
        if pending {
            state.quarantine.push(Mapping {
                address,
                mapped: record.mapped,
            });
        } else if let Some(p) = core::ptr::NonNull::new(address as *mut u8) {
            // SAFETY: the mapping made for this allocation (taken out of the table just now);
            // the caller guarantees it is not used afterwards, and no queued work targets it.
            unsafe { host::unmap(p, record.mapped) };
        }
        drop(state);
        self.late_return(call);
        Ok(())
    }

    unsafe fn zero(&self, device: DeviceId, ptr: u64, len: usize) -> Result<(), ModelError> {
        let call = Call::Memset;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let invalid = error(call, code::INVALID_VALUE);
        let start = usize::try_from(ptr).map_err(|_| invalid)?;
        let end = start.checked_add(len).ok_or(invalid)?;
        if state.containing(start, end).is_none() || len == 0 {
            return Err(invalid);
        }
        let scrub = *state
            .scrub_streams
            .get(device.0 as usize)
            .ok_or(error(call, code::INVALID_DEVICE))?;
        let queue = Queue::Stream(scrub);
        state.enqueue(
            queue,
            Work::Memset {
                start,
                end,
                value: 0,
            },
        );
        // The zeroing waits for its stream (and only for it).
        state.drain(queue);
        Ok(())
    }

    fn advise(&self, ptr: u64, len: usize, advice: Advice) -> Result<(), ModelError> {
        let call = Call::Advise;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let base = self.advisable(&state, call, ptr, len)?;
        if let Some(location) = advice.location() {
            self.location(call, location)?;
        }
        let start = ptr as usize;
        match base {
            Some(base) => {
                let record = state
                    .allocations
                    .get_mut(&base)
                    .ok_or(error(call, code::INVALID_VALUE))?;
                record.hints.apply(start - base..start - base + len, advice);
            }
            None => state.system.apply(start..start + len, advice),
        }
        Ok(())
    }

    fn prefetch(
        &self,
        ptr: u64,
        len: usize,
        to: Location,
        stream: DriverStream,
    ) -> Result<(), ModelError> {
        let stream = stream.raw();
        let call = Call::Prefetch;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let context = self.current();
        let queue = Self::queue_in(&state, call, context, stream)?;
        self.advisable(&state, call, ptr, len)?;
        self.location(call, to)?;
        if matches!(to, Location::Device(_)) && !self.config.concurrent_managed_access {
            return Err(error(call, code::NOT_SUPPORTED));
        }
        let start = ptr as usize;
        state.enqueue(
            queue,
            Work::Prefetch {
                start,
                end: start + len,
                to,
            },
        );
        self.settle(&mut state, queue);
        Ok(())
    }

    fn scrub_stream(&self, device: DeviceId) -> DriverStream {
        let state = self.state();
        DriverStream::from_raw(
            state
                .scrub_streams
                .get(device.0 as usize)
                .copied()
                .unwrap_or(0),
        )
    }

    fn stream_create(&self) -> Result<DriverStream, ModelError> {
        let mut state = self.state();
        self.enter(&mut state, Call::StreamCreate, true)?;
        let context = self.current();
        let handle = state.handle();
        state.streams.insert(
            handle,
            StreamRecord {
                context,
                internal: false,
            },
        );
        state.stats.live_streams += 1;
        state.stats.streams_created += 1;
        Ok(DriverStream::from_raw(handle))
    }

    /// Work still queued completes (the driver finishes it after the call returns; the model
    /// runs it here), then the stream goes. In a context a kernel fault poisoned, it answers the
    /// sticky `CUDA_ERROR_ILLEGAL_ADDRESS` and the stream stays, until the context is destroyed.
    fn stream_destroy(&self, stream: DriverStream) -> Result<(), ModelError> {
        let stream = stream.raw();
        let call = Call::StreamDestroy;
        let mut state = self.state();
        self.enter(&mut state, call, false)?;
        let context = match state.streams.get(&stream) {
            Some(s) if !s.internal => s.context,
            _ => return Err(error(call, code::INVALID_HANDLE)),
        };
        // After a kernel fault every call in the context answers the sticky error, destroys
        // included; only destroying the context itself (which takes its streams) recovers.
        Self::check_poison(&state, call, context)?;
        state.drain(Queue::Stream(stream));
        state.streams.remove(&stream);
        state.stats.live_streams -= 1;
        state.stats.streams_destroyed += 1;
        Ok(())
    }

    fn synchronize(&self, stream: DriverStream) -> Result<(), ModelError> {
        let stream = stream.raw();
        let call = Call::StreamSynchronize;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let context = self.current();
        let queue = Self::queue_in(&state, call, context, stream)?;
        state.drain(queue);
        Self::check_poison(&state, call, context)
    }

    fn context_create(&self, device: DeviceId) -> Result<DriverContext, ModelError> {
        let call = Call::CtxCreate;
        let mut state = self.state();
        self.enter(&mut state, call, false)?;
        if device.0 >= self.config.device_count {
            return Err(error(call, code::INVALID_DEVICE));
        }
        Self::device_down(&state, call, device.0)?;
        let handle = state.handle();
        state.contexts.insert(
            handle,
            Context {
                device: device.0,
                primary: false,
                poisoned: false,
                inactive: false,
            },
        );
        state.stats.live_contexts += 1;
        state.stats.contexts_created += 1;
        // `cuCtxCreate` pushes the new context; the contract is to leave the stack as it was,
        // so the push and its pop cancel out.
        Ok(DriverContext::from_raw(handle))
    }

    /// Destroys a non-primary context with its streams. The device first finishes the work the
    /// context queued (a wait on another stream for one of its events is then satisfied); a
    /// poisoned context's abandoned work only gives back its pool blocks and reaches its records.
    fn context_destroy(&self, context: DriverContext) -> Result<(), ModelError> {
        let context = context.raw();
        let call = Call::CtxDestroy;
        let mut state = self.state();
        self.enter(&mut state, call, false)?;
        match state.contexts.get(&context) {
            Some(c) if !c.primary => {}
            _ => return Err(error(call, code::INVALID_CONTEXT)),
        }
        let streams: Vec<u64> = state
            .streams
            .iter()
            .filter(|(_, s)| s.context == context)
            .map(|(&h, _)| h)
            .collect();
        // The device finishes what the context queued before it goes (a poisoned context's
        // work was abandoned at the fault); whatever is left still gives back its pool blocks
        // and reaches its event records, so no wait elsewhere waits forever.
        let poisoned = state.contexts.get(&context).is_some_and(|c| c.poisoned);
        for queue in streams
            .iter()
            .map(|&s| Queue::Stream(s))
            .chain([Queue::Default(context)])
        {
            if !poisoned {
                state.drain(queue);
            }
            for work in state.queues.remove(&queue).unwrap_or_default() {
                match work {
                    Work::PoolFree { ptr } => state.release_pool_block(ptr),
                    Work::Signal { event, generation } => state.signal(event, generation),
                    _ => {}
                }
            }
        }
        for s in streams {
            state.streams.remove(&s);
            state.stats.live_streams -= 1;
            state.stats.streams_destroyed += 1;
        }
        state.contexts.remove(&context);
        state.stats.live_contexts -= 1;
        state.stats.contexts_destroyed += 1;
        Ok(())
    }

    fn host_register(&self, ptr: u64, len: usize) -> Result<(), ModelError> {
        let call = Call::HostRegister;
        let mut state = self.state();
        let device = self.enter(&mut state, call, true)?;
        if !self.config.host_registration {
            return Err(error(call, code::NOT_SUPPORTED));
        }
        let invalid = error(call, code::INVALID_VALUE);
        let start = usize::try_from(ptr).map_err(|_| invalid)?;
        let end = start.checked_add(len).ok_or(invalid)?;
        if len == 0 || !start.is_multiple_of(self.page) || !len.is_multiple_of(self.page) {
            return Err(invalid);
        }
        if state.registration_overlaps(start, end) {
            return Err(error(call, code::HOST_MEMORY_ALREADY_REGISTERED));
        }
        // Device memory is not host memory to pin, and pinning needs every page mapped
        // readable and writable (a PROT_NONE guard cannot be pinned).
        let over_allocation = state
            .allocations
            .range(..end)
            .next_back()
            .is_some_and(|(&b, r)| start < b + r.mapped);
        if over_allocation || !host::accessible(start, len) {
            return Err(invalid);
        }
        state.registered.insert(start, Registration { len, device });
        state.stats.registered_ranges += 1;
        state.stats.registered_bytes += len as u64;
        Ok(())
    }

    unsafe fn host_unregister(&self, ptr: u64) -> Result<(), ModelError> {
        let call = Call::HostUnregister;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let start = usize::try_from(ptr).map_err(|_| error(call, code::INVALID_VALUE))?;
        let record = state
            .registered
            .remove(&start)
            .ok_or(error(call, code::HOST_MEMORY_NOT_REGISTERED))?;
        if state.pending_over(start, start + record.len, None) {
            state.stats.unregisters_over_pending_work += 1;
        }
        state.stats.registered_ranges -= 1;
        state.stats.registered_bytes -= record.len as u64;
        Ok(())
    }

    fn pool_create(
        &self,
        device: DeviceId,
        max_bytes: u64,
        release_threshold: u64,
    ) -> Result<DriverPool, ModelError> {
        let call = Call::PoolCreate;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        if device.0 >= self.config.device_count {
            return Err(error(call, code::INVALID_DEVICE));
        }
        Self::device_down(&state, call, device.0)?;
        let handle = state.handle();
        state.pools.insert(
            handle,
            Pool {
                device: device.0,
                max_bytes,
                release_threshold,
                reserved: 0,
                live: 0,
                cached: Vec::new(),
                destroyed: false,
            },
        );
        state.stats.live_pools += 1;
        Ok(DriverPool::from_raw(handle))
    }

    /// Kept blocks are given back; blocks still allocated (or with frees queued) keep the pool
    /// until their frees run, as the driver documents.
    fn pool_destroy(&self, pool: DriverPool) -> Result<(), ModelError> {
        let pool = pool.raw();
        let call = Call::PoolDestroy;
        let mut state = self.state();
        self.enter(&mut state, call, false)?;
        match state.pools.get_mut(&pool) {
            Some(p) if !p.destroyed => p.destroyed = true,
            _ => return Err(error(call, code::INVALID_HANDLE)),
        }
        state.trim(pool, 0);
        state.stats.live_pools -= 1;
        if state.pools.get(&pool).is_some_and(|p| p.live == 0) {
            state.pools.remove(&pool);
        }
        Ok(())
    }

    fn pool_alloc(
        &self,
        pool: DriverPool,
        bytes: usize,
        stream: DriverStream,
    ) -> Result<u64, ModelError> {
        // The contract: zero-filled in stream order.
        self.pool_alloc_inner(pool.raw(), bytes, stream.raw(), true)
    }

    fn pool_free(&self, ptr: u64, stream: DriverStream) -> Result<(), ModelError> {
        let stream = stream.raw();
        let call = Call::PoolFree;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        let context = self.current();
        let queue = Self::queue_in(&state, call, context, stream)?;
        let address = usize::try_from(ptr).map_err(|_| error(call, code::INVALID_VALUE))?;
        if state
            .allocations
            .get(&address)
            .is_none_or(|r| r.pool.is_none())
            || state
                .queues
                .values()
                .flatten()
                .any(|w| matches!(w, Work::PoolFree { ptr } if *ptr == address))
        {
            return Err(error(call, code::INVALID_VALUE));
        }
        state.enqueue(queue, Work::PoolFree { ptr: address });
        state.stats.live_pool_allocations -= 1;
        self.settle(&mut state, queue);
        drop(state);
        self.late_return(call);
        Ok(())
    }

    fn pool_trim(&self, pool: DriverPool, keep_bytes: u64) -> Result<(), ModelError> {
        let pool = pool.raw();
        let call = Call::PoolTrim;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        if state.pools.get(&pool).is_none_or(|p| p.destroyed) {
            return Err(error(call, code::INVALID_HANDLE));
        }
        state.trim(pool, keep_bytes);
        Ok(())
    }

    fn pool_reserved(&self, pool: DriverPool) -> Result<u64, ModelError> {
        let pool = pool.raw();
        let call = Call::PoolReserved;
        let mut state = self.state();
        self.enter(&mut state, call, true)?;
        match state.pools.get(&pool) {
            Some(p) if !p.destroyed => Ok(p.reserved),
            _ => Err(error(call, code::INVALID_HANDLE)),
        }
    }
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
