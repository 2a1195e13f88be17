#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod error;
mod host;
mod ranges;

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use ranges::RangeMap;
use tensor_wasm_mem_core::{
    Advice, Advisor, Allocation, Capabilities, DEFAULT_STREAM, DeviceId, DevicePoolConfig,
    DevicePoolStats, DevicePools, ErrorKind, ErrorType, IsolationLevel, Location, ManagedAllocator,
    Operation, PoolAllocation, PoolHandle, Stream, StreamProvider, TenantKey,
};

pub use error::MockError;

/// The raw context value of the simulated primary context.
pub const PRIMARY_CONTEXT: u64 = 1;

/// Allocations leaked by mocks that have been dropped, process-wide.
static LEAKED_AT_DROP: AtomicU64 = AtomicU64::new(0);

/// Allocations that were still live when their [`MockBackend`] dropped, over the whole process.
/// The mock unmaps them (so nothing is lost for real) and counts them here for leak tests.
#[must_use]
pub fn leaked_at_drop() -> u64 {
    LEAKED_AT_DROP.load(Ordering::Acquire)
}

/// How the simulated device looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MockConfig {
    /// Devices simulated (ids `0..device_count`).
    pub device_count: u32,
    /// Memory per device in bytes; allocations past it fail with out-of-memory.
    pub device_memory_bytes: u64,
    /// Whether host and device may touch managed memory concurrently. Without it, prefetch to a
    /// device is refused, as the CUDA driver does.
    pub concurrent_managed_access: bool,
    /// Whether the device can access pageable host memory (reported only).
    pub pageable_memory_access: bool,
    /// Fill fresh allocations with `0xA5` and report `comes_zeroed = false`, like
    /// `cuMemAllocManaged` (which does not zero). Costs resident memory: for tests only.
    pub poison_fresh_allocations: bool,
    /// Work queued on a stream (prefetches, [`MockBackend::enqueue_fill`] kernels) completes
    /// only when the stream is synchronised or released, later than the call that queued it,
    /// as on a GPU: a host read before then sees the old bytes, and a scrub or free meanwhile is
    /// counted ([`MockStats::scrubs_over_pending_work`]) and lets the work land afterwards, as
    /// it would. Off (the default): every call completes before it returns.
    pub deferred_streams: bool,
}

impl Default for MockConfig {
    /// One device with 16 GiB, concurrent managed access, memory that comes zeroed.
    fn default() -> Self {
        Self {
            device_count: 1,
            device_memory_bytes: 16 << 30,
            concurrent_managed_access: true,
            pageable_memory_access: false,
            poison_fresh_allocations: false,
            deferred_streams: false,
        }
    }
}

/// The hints set at one byte of an allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    /// `SetReadMostly` is in force.
    pub read_mostly: bool,
    /// The preferred location, if set.
    pub preferred_location: Option<Location>,
    /// Locations the byte is marked as accessed by.
    pub accessed_by: Vec<Location>,
}

/// Counters of a [`MockBackend`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MockStats {
    /// Calls per operation: allocate, free, zero, advise, prefetch,
    /// acquire_stream, release_stream, synchronize, create_pool, pool_allocate, pool_free,
    /// trim_pool, destroy_pool, pool_stats, reset_hints (read them with [`calls`](Self::calls)).
    pub calls: [u64; 15],
    /// Allocations alive now.
    pub live_allocations: u64,
    /// Bytes allocated now (requested sizes).
    pub live_bytes: u64,
    /// The most bytes ever allocated at once.
    pub peak_bytes: u64,
    /// Allocations ever made.
    pub allocations: u64,
    /// Frees that succeeded.
    pub frees: u64,
    /// Streams alive now (the shared default stream is not counted).
    pub live_streams: u64,
    /// Streams ever created.
    pub streams_created: u64,
    /// Streams ever destroyed.
    pub streams_destroyed: u64,
    /// Per-tenant contexts alive now.
    pub live_contexts: u64,
    /// Per-tenant contexts ever created.
    pub contexts_created: u64,
    /// Per-tenant contexts ever destroyed.
    pub contexts_destroyed: u64,
    /// Failures injected so far.
    pub injected_failures: u64,
    /// Device memory pools alive.
    pub live_pools: u64,
    /// Pool allocations alive.
    pub live_pool_allocations: u64,
    /// Bytes the pools hold (live plus kept free memory).
    pub pool_reserved_bytes: u64,
    /// Stream work items completed (deferred mode: when their stream was drained).
    pub work_completed: u64,
    /// Zeroings or hint resets of a range that queued work still targets: with deferred
    /// streams, a scrub the tenant's work can land after (a cross-tenant leak on a GPU).
    pub scrubs_over_pending_work: u64,
    /// Frees of an allocation that queued work still targets.
    pub frees_over_pending_work: u64,
    /// Simulated kernels that wrote outside every live allocation when they ran (an illegal
    /// address: their context is poisoned, see [`MockError::ContextPoisoned`]).
    pub kernel_faults: u64,
}

impl MockStats {
    /// Calls of `op` so far.
    #[must_use]
    pub fn calls(&self, op: Operation) -> u64 {
        op_index(op).map_or(0, |i| self.calls[i])
    }
}

fn op_index(op: Operation) -> Option<usize> {
    Some(match op {
        Operation::Allocate => 0,
        Operation::Free => 1,
        Operation::Zero => 2,
        Operation::Advise => 3,
        Operation::Prefetch => 4,
        Operation::AcquireStream => 5,
        Operation::ReleaseStream => 6,
        Operation::Synchronize => 7,
        Operation::CreatePool => 8,
        Operation::PoolAllocate => 9,
        Operation::PoolFree => 10,
        Operation::TrimPool => 11,
        Operation::DestroyPool => 12,
        Operation::PoolStats => 13,
        Operation::ResetHints => 14,
        _ => return None,
    })
}

#[derive(Debug)]
struct Record {
    len: usize,
    mapped: usize,
    device: DeviceId,
    read_mostly: RangeMap<()>,
    preferred: RangeMap<Location>,
    accessed_by: Vec<(Location, RangeMap<()>)>,
    residency: RangeMap<Location>,
}

#[derive(Debug)]
struct PoolBlock {
    ptr: usize,
    layout: Layout,
}

#[derive(Debug)]
struct MockPool {
    device: DeviceId,
    tenant: TenantKey,
    max_bytes: u64,
    release_threshold: u64,
    /// Freed blocks the pool keeps, by size.
    cached: Vec<PoolBlock>,
    /// ptr -> block
    live: HashMap<usize, PoolBlock>,
    used: u64,
    peak: u64,
    reserved: u64,
}

#[derive(Debug)]
struct StreamRecord {
    tenant: TenantKey,
    level: IsolationLevel,
    context: u64,
    /// Its release failed: refused to callers, still counted.
    retired: bool,
}

/// One item of work queued on a stream.
#[derive(Debug, Clone, Copy)]
enum Work {
    /// A prefetch of `start..end` (addresses) to `to`.
    Prefetch {
        start: usize,
        end: usize,
        to: Location,
    },
    /// A simulated kernel writing `byte` over `start..end` (addresses), in `context`.
    Fill {
        start: usize,
        end: usize,
        byte: u8,
        context: u64,
    },
}

impl Work {
    fn span(&self) -> (usize, usize) {
        match *self {
            Self::Prefetch { start, end, .. } | Self::Fill { start, end, .. } => (start, end),
        }
    }
}

#[derive(Debug)]
struct Fault {
    op: Operation,
    call: u64,
    kind: ErrorKind,
}

#[derive(Debug, Default)]
struct State {
    allocations: HashMap<usize, Record>,
    used: Vec<u64>,
    streams: HashMap<u64, StreamRecord>,
    /// tenant -> (context, live streams in it)
    contexts: HashMap<TenantKey, (u64, u64)>,
    next_stream: u64,
    next_context: u64,
    faults: Vec<Fault>,
    /// Operations whose next call returns late, after taking effect (see `delay_next`).
    delays: Vec<(Operation, std::time::Duration)>,
    pools: HashMap<u64, MockPool>,
    next_pool: u64,
    /// Raw stream -> work queued on it, oldest first (deferred mode only).
    pending: HashMap<u64, std::collections::VecDeque<Work>>,
    /// Contexts a kernel fault made unusable (sticky, as on a GPU).
    poisoned: std::collections::HashSet<u64>,
    stats: MockStats,
}

impl State {
    /// The allocation holding `start..end` (addresses): its base and record.
    fn containing(&mut self, start: usize, end: usize) -> Option<(usize, &mut Record)> {
        self.allocations
            .iter_mut()
            .find(|(base, r)| **base <= start && end <= **base + r.len)
            .map(|(base, r)| (*base, r))
    }

    /// Whether queued work targets any of `range` of `allocation` (an empty range: no).
    fn pending_in(&self, allocation: &Allocation, range: &std::ops::Range<usize>) -> bool {
        let base = allocation.as_ptr() as usize;
        !range.is_empty() && self.pending_over(base + range.start, base + range.end)
    }

    /// Whether queued work targets any of `start..end` (addresses).
    fn pending_over(&self, start: usize, end: usize) -> bool {
        self.pending.values().flatten().any(|w| {
            let (s, e) = w.span();
            s < end && start < e
        })
    }

    /// Runs the work queued on `raw`, in order, as the device gets to it.
    fn drain(&mut self, raw: u64) {
        let Some(queue) = self.pending.remove(&raw) else {
            return;
        };
        for work in queue {
            let (start, end) = work.span();
            let Some((base, record)) = self.containing(start, end) else {
                if let Work::Fill { context, .. } = work {
                    // An illegal address: the context is unusable from now on, and the driver
                    // abandons what is queued on any of its streams.
                    self.poisoned.insert(context);
                    self.stats.kernel_faults += 1;
                    let streams = &self.streams;
                    self.pending.retain(|raw, _| {
                        let of = if *raw == DEFAULT_STREAM {
                            PRIMARY_CONTEXT
                        } else {
                            streams.get(raw).map_or(0, |s| s.context)
                        };
                        of != context
                    });
                    break;
                }
                continue;
            };
            match work {
                Work::Prefetch { to, .. } => {
                    record.residency.set(start - base..end - base, Some(to))
                }
                Work::Fill { byte, .. } => {
                    // SAFETY: `start..end` lies inside a live mapping of ours (found in the
                    // table just now); a device write races host readers as it does on a GPU,
                    // which is what this simulates.
                    unsafe { std::ptr::write_bytes(start as *mut u8, byte, end - start) };
                }
            }
            self.stats.work_completed += 1;
        }
    }
}

/// A simulated CUDA device with managed memory, in host memory.
///
/// Implements [`ManagedAllocator`], [`Advisor`] and [`StreamProvider`] with the rules a driver
/// keeps (sizes, bounds, devices, stream handles, device memory), fault injection
/// ([`fail_nth`](Self::fail_nth)), call counters and leak accounting ([`stats`](Self::stats),
/// [`leaked_at_drop`]).
#[derive(Debug)]
pub struct MockBackend {
    config: MockConfig,
    page: usize,
    state: Mutex<State>,
}

impl Default for MockBackend {
    fn default() -> Self {
        Self::new(MockConfig::default())
    }
}

impl MockBackend {
    /// A simulated device as `config` describes.
    #[must_use]
    pub fn new(config: MockConfig) -> Self {
        Self {
            config,
            page: host::page_size(),
            state: Mutex::new(State {
                used: vec![0; config.device_count as usize],
                next_stream: 1000,
                next_context: PRIMARY_CONTEXT + 1,
                ..State::default()
            }),
        }
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &MockConfig {
        &self.config
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-updated in a way that
        // matters to counters; keep serving.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A snapshot of the counters.
    #[must_use]
    pub fn stats(&self) -> MockStats {
        self.state().stats.clone()
    }

    /// Makes the `n`-th call of `op` from now fail (`n = 1`: the next call) with the kind a driver
    /// would give for that operation (out-of-memory for `Allocate`, a driver error otherwise).
    pub fn fail_nth(&self, op: Operation, n: u64) {
        let kind = if op == Operation::Allocate {
            ErrorKind::OutOfMemory
        } else {
            ErrorKind::Driver
        };
        self.fail_nth_with(op, n, kind);
    }

    /// Makes the `n`-th call of `op` from now fail with an error of `kind`.
    pub fn fail_nth_with(&self, op: Operation, n: u64, kind: ErrorKind) {
        let mut state = self.state();
        let done = op_index(op).map_or(0, |i| state.stats.calls[i]);
        state.faults.push(Fault {
            op,
            call: done.saturating_add(n.max(1)),
            kind,
        });
    }

    /// Removes every pending injected failure and delay.
    pub fn clear_faults(&self) {
        let mut state = self.state();
        state.faults.clear();
        state.delays.clear();
    }

    /// Makes the next call of `op` return to its caller `delay` after it has taken effect, with
    /// the mock unlocked meanwhile (a slow driver, or a thread preempted right after the call):
    /// for tests of what other threads may do in that window. Honoured by
    /// [`DevicePools::pool_free`] and [`ManagedAllocator::free`].
    pub fn delay_next(&self, op: Operation, delay: std::time::Duration) {
        self.state().delays.push((op, delay));
    }

    /// Sleeps for the delay set for `op`, if any (called with the state unlocked).
    fn late_return(&self, op: Operation) {
        let delay = {
            let mut state = self.state();
            let i = state.delays.iter().position(|(o, _)| *o == op);
            i.map(|i| state.delays.swap_remove(i).1)
        };
        if let Some(delay) = delay {
            std::thread::sleep(delay);
        }
    }

    /// Where `offset` of `allocation` was last prefetched to (`None`: never prefetched).
    pub fn residency(
        &self,
        allocation: &Allocation,
        offset: usize,
    ) -> Result<Option<Location>, MockError> {
        let state = self.state();
        let record = Self::record(&state, allocation)?;
        allocation.range(offset, 1)?;
        Ok(record.residency.get(offset).copied())
    }

    /// A simulated kernel: queues, on `stream`, a device write of `byte` over
    /// `device_ptr..device_ptr + len`. It runs at once, or with
    /// [`deferred_streams`](MockConfig::deferred_streams) when the stream is drained. When it
    /// runs outside every live allocation (an illegal address, found by the device, not at the
    /// launch) the stream's context is poisoned, as on a GPU: every later use of it is
    /// [`MockError::ContextPoisoned`], other contexts are unaffected. A range that overflows is
    /// refused at the call.
    ///
    /// # Safety
    ///
    /// As for a kernel launch: when it runs, nothing else may access the bytes it writes (no
    /// Rust reference to them, no host view such as Wasmtime's `Memory::data`), typically
    /// because the memory is held by a device-access scope that waits for the stream.
    pub unsafe fn enqueue_fill(
        &self,
        stream: &Stream,
        device_ptr: u64,
        len: usize,
        byte: u8,
    ) -> Result<(), MockError> {
        let mut state = self.state();
        Self::check_stream(&state, stream)?;
        let illegal = MockError::IllegalAddress {
            address: device_ptr,
            len,
        };
        let start = usize::try_from(device_ptr).map_err(|_| illegal)?;
        let end = start.checked_add(len).ok_or(illegal)?;
        if len == 0 {
            return Ok(());
        }
        let context = stream.context();
        state
            .pending
            .entry(stream.raw())
            .or_default()
            .push_back(Work::Fill {
                start,
                end,
                byte,
                context,
            });
        if !self.config.deferred_streams {
            state.drain(stream.raw());
            Self::check_poison(&state, context)?;
        }
        Ok(())
    }

    fn check_poison(state: &State, context: u64) -> Result<(), MockError> {
        if state.poisoned.contains(&context) {
            Err(MockError::ContextPoisoned { context })
        } else {
            Ok(())
        }
    }

    /// Work items queued and not yet completed, over all streams.
    #[must_use]
    pub fn pending_work(&self) -> usize {
        self.state()
            .pending
            .values()
            .map(std::collections::VecDeque::len)
            .sum()
    }

    /// The hints in force at `offset` of `allocation`.
    pub fn hints(&self, allocation: &Allocation, offset: usize) -> Result<Hints, MockError> {
        let state = self.state();
        let record = Self::record(&state, allocation)?;
        allocation.range(offset, 1)?;
        Ok(Hints {
            read_mostly: record.read_mostly.get(offset).is_some(),
            preferred_location: record.preferred.get(offset).copied(),
            accessed_by: record
                .accessed_by
                .iter()
                .filter(|(_, m)| m.get(offset).is_some())
                .map(|(l, _)| *l)
                .collect(),
        })
    }

    /// Bytes allocated on `device` now.
    #[must_use]
    pub fn device_bytes_used(&self, device: DeviceId) -> u64 {
        self.state()
            .used
            .get(device.0 as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Counts a call of `op` and answers an injected failure if one is due.
    fn enter(&self, state: &mut State, op: Operation) -> Result<(), MockError> {
        let Some(i) = op_index(op) else {
            return Ok(());
        };
        state.stats.calls[i] += 1;
        let call = state.stats.calls[i];
        if let Some(pos) = state
            .faults
            .iter()
            .position(|f| f.op == op && f.call == call)
        {
            let fault = state.faults.swap_remove(pos);
            state.stats.injected_failures += 1;
            return Err(MockError::Injected {
                op,
                call,
                kind: fault.kind,
            });
        }
        Ok(())
    }

    fn check_device(&self, device: DeviceId) -> Result<(), MockError> {
        if device.0 >= self.config.device_count {
            return Err(MockError::InvalidDevice {
                device,
                count: self.config.device_count,
            });
        }
        Ok(())
    }

    fn check_location(&self, location: Location) -> Result<(), MockError> {
        match location {
            Location::Host => Ok(()),
            Location::Device(d) => self.check_device(d),
        }
    }

    fn record<'s>(state: &'s State, allocation: &Allocation) -> Result<&'s Record, MockError> {
        state
            .allocations
            .get(&(allocation.as_ptr() as usize))
            .filter(|r| r.len == allocation.len())
            .ok_or(MockError::UnknownAllocation {
                address: allocation.device_ptr(),
            })
    }

    fn record_mut<'s>(
        state: &'s mut State,
        allocation: &Allocation,
    ) -> Result<&'s mut Record, MockError> {
        state
            .allocations
            .get_mut(&(allocation.as_ptr() as usize))
            .filter(|r| r.len == allocation.len())
            .ok_or(MockError::UnknownAllocation {
                address: allocation.device_ptr(),
            })
    }

    /// Refuses a stream that is not `pool`'s tenant's (the shared default stream serves all).
    fn check_pool_stream(pool: &PoolHandle, stream: &Stream) -> Result<(), MockError> {
        if stream.is_shared() || stream.tenant_key() == pool.tenant_key() {
            Ok(())
        } else {
            Err(MockError::ForeignStream {
                raw: stream.raw(),
                pool: pool.raw(),
            })
        }
    }

    /// A live stream of ours, in a usable context.
    fn check_stream(state: &State, stream: &Stream) -> Result<(), MockError> {
        Self::check_stream_known(state, stream)?;
        Self::check_poison(state, stream.context())
    }

    fn check_stream_known(state: &State, stream: &Stream) -> Result<(), MockError> {
        let known = if stream.raw() == DEFAULT_STREAM {
            stream.is_shared()
        } else {
            state.streams.get(&stream.raw()).is_some_and(|s| {
                !s.retired && s.tenant == stream.tenant_key() && s.context == stream.context()
            })
        };
        if known {
            Ok(())
        } else {
            Err(MockError::UnknownStream { raw: stream.raw() })
        }
    }
}

impl ErrorType for MockBackend {
    type Error = MockError;
}

// SAFETY: `allocate` returns a fresh private mapping of at least the requested size (page aligned,
// so aligned to MIN_ALIGN), tracked until freed; mappings never overlap. `zero` checks the range
// against the tracked allocation before writing. Capabilities: the memory is host memory the
// simulated device "accesses" by being the host, comes zeroed unless poisoning is configured, and
// has no guard pages.
unsafe impl ManagedAllocator for MockBackend {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            host_accessible: true,
            device_accessible: true,
            managed: true,
            comes_zeroed: !self.config.poison_fresh_allocations,
            guard_pages: false,
            concurrent_managed_access: self.config.concurrent_managed_access,
            pageable_memory_access: self.config.pageable_memory_access,
        }
    }

    fn device_count(&self) -> u32 {
        self.config.device_count
    }

    fn allocate(&self, device: DeviceId, bytes: usize) -> Result<Allocation, MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::Allocate)?;
        if bytes == 0 {
            return Err(MockError::InvalidValue("allocation size is zero"));
        }
        self.check_device(device)?;
        let used = state.used[device.0 as usize];
        let available = self.config.device_memory_bytes.saturating_sub(used);
        let requested = bytes as u64;
        let mapped = bytes.checked_next_multiple_of(self.page);
        let Some(mapped) = mapped.filter(|_| requested <= available) else {
            return Err(MockError::OutOfMemory {
                device,
                requested,
                available,
            });
        };
        let ptr =
            host::map(mapped).map_err(|errno| MockError::HostMapFailed { requested, errno })?;
        if self.config.poison_fresh_allocations {
            // SAFETY: `ptr` is a fresh mapping of `mapped >= bytes` bytes that only we know.
            unsafe { ptr.as_ptr().write_bytes(0xA5, bytes) };
        }
        state.used[device.0 as usize] += requested;
        state.allocations.insert(
            ptr.as_ptr() as usize,
            Record {
                len: bytes,
                mapped,
                device,
                read_mostly: RangeMap::new(),
                preferred: RangeMap::new(),
                accessed_by: Vec::new(),
                residency: RangeMap::new(),
            },
        );
        let stats = &mut state.stats;
        stats.allocations += 1;
        stats.live_allocations += 1;
        stats.live_bytes += requested;
        stats.peak_bytes = stats.peak_bytes.max(stats.live_bytes);
        // SAFETY: a fresh private mapping of `mapped >= bytes` bytes, page aligned, owned by this
        // allocation until `free`.
        Ok(unsafe { Allocation::from_raw_parts(ptr, bytes, device) })
    }

    unsafe fn free(&self, allocation: Allocation) -> Result<(), MockError> {
        let mut state = self.state();
        // An injected failure leaves the memory allocated, as a failing driver would.
        self.enter(&mut state, Operation::Free)?;
        let address = allocation.as_ptr() as usize;
        Self::record(&state, &allocation)?;
        if state.pending_in(&allocation, &(0..allocation.len())) {
            state.stats.frees_over_pending_work += 1;
        }
        let Some(record) = state.allocations.remove(&address) else {
            return Err(MockError::UnknownAllocation {
                address: address as u64,
            });
        };
        state.used[record.device.0 as usize] -= record.len as u64;
        state.stats.frees += 1;
        state.stats.live_allocations -= 1;
        state.stats.live_bytes -= record.len as u64;
        drop(state);
        let (ptr, _, _) = allocation.into_raw_parts();
        // SAFETY: `ptr..ptr + mapped` is the mapping made for this allocation (found in our
        // table and removed from it), and the caller guarantees it is not used afterwards.
        unsafe { host::unmap(ptr, record.mapped) };
        self.late_return(Operation::Free);
        Ok(())
    }

    unsafe fn zero(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::Zero)?;
        Self::record(&state, allocation)?;
        let range = allocation.range(offset, len)?;
        if state.pending_in(allocation, &range) {
            state.stats.scrubs_over_pending_work += 1;
        }
        // SAFETY: `range` lies inside a live allocation of ours (checked against our table), and
        // the caller guarantees nothing else accesses it meanwhile.
        unsafe { host::zero(allocation.as_ptr().wrapping_add(range.start), range.len()) };
        Ok(())
    }
}

impl Advisor for MockBackend {
    fn advise(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
        advice: Advice,
    ) -> Result<(), MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::Advise)?;
        Self::record(&state, allocation)?;
        let range = allocation.range(offset, len)?;
        if let Some(location) = advice.location() {
            self.check_location(location)?;
        }
        let record = Self::record_mut(&mut state, allocation)?;
        let accessed_by = |record: &mut Record, location: Location| -> usize {
            match record.accessed_by.iter().position(|(l, _)| *l == location) {
                Some(i) => i,
                None => {
                    record.accessed_by.push((location, RangeMap::new()));
                    record.accessed_by.len() - 1
                }
            }
        };
        match advice {
            Advice::SetReadMostly => record.read_mostly.set(range, Some(())),
            Advice::UnsetReadMostly => record.read_mostly.set(range, None),
            Advice::SetPreferredLocation(l) => record.preferred.set(range, Some(l)),
            Advice::UnsetPreferredLocation => record.preferred.set(range, None),
            Advice::SetAccessedBy(l) => {
                let i = accessed_by(record, l);
                record.accessed_by[i].1.set(range, Some(()));
            }
            Advice::UnsetAccessedBy(l) => {
                let i = accessed_by(record, l);
                record.accessed_by[i].1.set(range, None);
            }
        }
        Ok(())
    }

    fn prefetch(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
        to: Location,
        stream: &Stream,
    ) -> Result<(), MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::Prefetch)?;
        Self::record(&state, allocation)?;
        let range = allocation.range(offset, len)?;
        self.check_location(to)?;
        if let Location::Device(device) = to
            && !self.config.concurrent_managed_access
        {
            return Err(MockError::NotSupported {
                device,
                what: "prefetch to the device (no concurrent managed access)",
            });
        }
        Self::check_stream(&state, stream)?;
        if self.config.deferred_streams && !range.is_empty() {
            let base = allocation.as_ptr() as usize;
            let work = Work::Prefetch {
                start: base + range.start,
                end: base + range.end,
                to,
            };
            state
                .pending
                .entry(stream.raw())
                .or_default()
                .push_back(work);
            return Ok(());
        }
        Self::record_mut(&mut state, allocation)?
            .residency
            .set(range, Some(to));
        state.stats.work_completed += 1;
        Ok(())
    }

    /// Clears every hint and the residency over the range: it reads as never advised and never
    /// prefetched, as a fresh allocation does.
    fn reset_hints(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::ResetHints)?;
        Self::record(&state, allocation)?;
        let range = allocation.range(offset, len)?;
        if state.pending_in(allocation, &range) {
            // A prefetch still queued would land after the reset.
            state.stats.scrubs_over_pending_work += 1;
        }
        let record = Self::record_mut(&mut state, allocation)?;
        record.read_mostly.set(range.clone(), None);
        record.preferred.set(range.clone(), None);
        for (_, by) in &mut record.accessed_by {
            by.set(range.clone(), None);
        }
        record.residency.set(range, None);
        Ok(())
    }
}

impl StreamProvider for MockBackend {
    fn acquire_stream(
        &self,
        tenant: TenantKey,
        level: IsolationLevel,
    ) -> Result<Stream, MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::AcquireStream)?;
        let context = match level {
            IsolationLevel::Shared => {
                return Ok(Stream::new(DEFAULT_STREAM, PRIMARY_CONTEXT, level, tenant));
            }
            IsolationLevel::StreamIsolated => PRIMARY_CONTEXT,
            IsolationLevel::ContextIsolated => {
                let next = state.next_context;
                let created = !state.contexts.contains_key(&tenant);
                let entry = state.contexts.entry(tenant).or_insert((next, 0));
                entry.1 += 1;
                let context = entry.0;
                if created {
                    state.next_context += 1;
                    state.stats.contexts_created += 1;
                    state.stats.live_contexts += 1;
                }
                context
            }
        };
        let raw = state.next_stream;
        state.next_stream += 1;
        state.streams.insert(
            raw,
            StreamRecord {
                tenant,
                level,
                context,
                retired: false,
            },
        );
        state.stats.streams_created += 1;
        state.stats.live_streams += 1;
        Ok(Stream::new(raw, context, level, tenant))
    }

    /// Waits for the stream's queued work (the shared default stream's too: what every shared
    /// tenant queued), then destroys it.
    fn release_stream(&self, stream: Stream) -> Result<(), MockError> {
        let mut state = self.state();
        Self::check_stream_known(&state, &stream)?;
        state.drain(stream.raw());
        let context = stream.context();
        // A poisoned context: the wait fails, the stream is destroyed all the same.
        let waited = Self::check_poison(&state, context);
        if let Err(e) = self.enter(&mut state, Operation::ReleaseStream) {
            // As a driver that refused to destroy it: the stream stays, counted, handed to no
            // one.
            if let Some(record) = state.streams.get_mut(&stream.raw()) {
                record.retired = true;
            }
            return Err(e);
        }
        if stream.raw() == DEFAULT_STREAM {
            return waited;
        }
        let Some(record) = state.streams.remove(&stream.raw()) else {
            return Err(MockError::UnknownStream { raw: stream.raw() });
        };
        state.stats.streams_destroyed += 1;
        state.stats.live_streams -= 1;
        if record.level == IsolationLevel::ContextIsolated
            && let Some(entry) = state.contexts.get_mut(&record.tenant)
        {
            entry.1 -= 1;
            if entry.1 == 0 {
                state.contexts.remove(&record.tenant);
                state.stats.contexts_destroyed += 1;
                state.stats.live_contexts -= 1;
                // A destroyed context takes its sticky error with it: the tenant's next
                // context is a fresh one.
                state.poisoned.remove(&record.context);
            }
        }
        waited
    }

    fn synchronize(&self, stream: &Stream) -> Result<(), MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::Synchronize)?;
        Self::check_stream(&state, stream)?;
        state.drain(stream.raw());
        Self::check_poison(&state, stream.context())
    }
}

impl MockPool {
    /// Gives kept blocks back until the pool holds at most `keep` bytes (or what is live).
    fn release_down_to(&mut self, keep: u64, device_used: &mut u64, stats: &mut MockStats) {
        while self.reserved > keep.max(self.used) {
            let Some(block) = self.cached.pop() else {
                break;
            };
            let size = block.layout.size() as u64;
            self.reserved -= size;
            *device_used -= size;
            stats.pool_reserved_bytes -= size;
            // SAFETY: a block this pool allocated with this layout, kept free (no holder).
            unsafe { dealloc(block.ptr as *mut u8, block.layout) };
        }
    }

    /// Frees every block (live and kept).
    fn release_all(&mut self, device_used: &mut u64, stats: &mut MockStats) {
        let live: Vec<_> = self.live.drain().map(|(_, b)| b).collect();
        stats.live_pool_allocations -= live.len() as u64;
        self.used = 0;
        self.cached.extend(live);
        self.release_down_to(0, device_used, stats);
    }
}

impl MockBackend {
    fn pool<'s>(
        pools: &'s mut HashMap<u64, MockPool>,
        pool: &PoolHandle,
    ) -> Result<&'s mut MockPool, MockError> {
        pools
            .get_mut(&pool.raw())
            .filter(|p| p.device == pool.device() && p.tenant == pool.tenant_key())
            .ok_or(MockError::UnknownPool { raw: pool.raw() })
    }
}

/// Device memory pools on host memory: per tenant, capped by `max_bytes` (as the driver's
/// `maxSize`), keeping freed blocks up to the release threshold, every allocation zero-filled.
impl DevicePools for MockBackend {
    fn create_pool(
        &self,
        tenant: TenantKey,
        device: DeviceId,
        config: &DevicePoolConfig,
    ) -> Result<PoolHandle, MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::CreatePool)?;
        self.check_device(device)?;
        state.next_pool += 1;
        let raw = 0x9000 + state.next_pool;
        state.pools.insert(
            raw,
            MockPool {
                device,
                tenant,
                max_bytes: config.max_bytes,
                release_threshold: config.release_threshold,
                cached: Vec::new(),
                live: HashMap::new(),
                used: 0,
                peak: 0,
                reserved: 0,
            },
        );
        state.stats.live_pools += 1;
        Ok(PoolHandle::new(raw, device, tenant))
    }

    fn pool_allocate(
        &self,
        pool: &PoolHandle,
        bytes: usize,
        stream: &Stream,
    ) -> Result<PoolAllocation, MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::PoolAllocate)?;
        if bytes == 0 {
            return Err(MockError::InvalidValue("pool allocation size is zero"));
        }
        Self::check_stream(&state, stream)?;
        Self::check_pool_stream(pool, stream)?;
        let layout = Layout::from_size_align(bytes, 256).map_err(|_| MockError::OutOfMemory {
            device: pool.device(),
            requested: bytes as u64,
            available: 0,
        })?;
        let device_memory = self.config.device_memory_bytes;
        let state = &mut *state;
        let device_used = &mut state.used[pool.device().0 as usize];
        let p = Self::pool(&mut state.pools, pool)?;
        let block = match p.cached.iter().position(|b| b.layout == layout) {
            Some(i) => p.cached.swap_remove(i),
            None => {
                let size = layout.size() as u64;
                let over_pool = p.max_bytes > 0 && p.reserved + size > p.max_bytes;
                if over_pool || *device_used + size > device_memory {
                    return Err(MockError::OutOfMemory {
                        device: pool.device(),
                        requested: size,
                        available: if over_pool {
                            p.max_bytes.saturating_sub(p.reserved)
                        } else {
                            device_memory.saturating_sub(*device_used)
                        },
                    });
                }
                // SAFETY: `layout` has a non-zero size.
                let ptr = unsafe { alloc_zeroed(layout) };
                if ptr.is_null() {
                    return Err(MockError::HostMapFailed {
                        requested: size,
                        errno: 12,
                    });
                }
                p.reserved += size;
                *device_used += size;
                state.stats.pool_reserved_bytes += size;
                PoolBlock {
                    ptr: ptr as usize,
                    layout,
                }
            }
        };
        // Zero-filled whatever the block held before (a freed block of this tenant's).
        // SAFETY: the block is `layout.size()` bytes of ours, held by no one.
        unsafe { (block.ptr as *mut u8).write_bytes(0, layout.size()) };
        let ptr = block.ptr;
        p.live.insert(ptr, block);
        p.used += bytes as u64;
        p.peak = p.peak.max(p.used);
        state.stats.live_pool_allocations += 1;
        Ok(PoolAllocation::new(ptr as u64, bytes))
    }

    fn pool_free(
        &self,
        pool: &PoolHandle,
        allocation: PoolAllocation,
        stream: &Stream,
    ) -> Result<(), MockError> {
        let mut guard = self.state();
        self.enter(&mut guard, Operation::PoolFree)?;
        Self::check_stream(&guard, stream)?;
        Self::check_pool_stream(pool, stream)?;
        let state = &mut *guard;
        let device_used = &mut state.used[pool.device().0 as usize];
        let p = Self::pool(&mut state.pools, pool)?;
        let ptr = allocation.device_ptr() as usize;
        match p.live.get(&ptr) {
            Some(b) if b.layout.size() == allocation.len() => {}
            _ => return Err(MockError::UnknownPool { raw: pool.raw() }),
        }
        if let Some(block) = p.live.remove(&ptr) {
            p.used -= block.layout.size() as u64;
            p.cached.push(block);
            state.stats.live_pool_allocations -= 1;
        }
        let threshold = p.release_threshold;
        p.release_down_to(threshold, device_used, &mut state.stats);
        drop(guard);
        self.late_return(Operation::PoolFree);
        Ok(())
    }

    fn trim_pool(&self, pool: &PoolHandle, keep_bytes: u64) -> Result<(), MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::TrimPool)?;
        let state = &mut *state;
        let device_used = &mut state.used[pool.device().0 as usize];
        let p = Self::pool(&mut state.pools, pool)?;
        p.release_down_to(keep_bytes, device_used, &mut state.stats);
        Ok(())
    }

    fn pool_stats(&self, pool: &PoolHandle) -> Result<DevicePoolStats, MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::PoolStats)?;
        let p = Self::pool(&mut state.pools, pool)?;
        Ok(DevicePoolStats {
            live_bytes: p.used,
            peak_bytes: p.peak,
            reserved_bytes: p.reserved,
            live_allocations: p.live.len() as u64,
        })
    }

    fn destroy_pool(&self, pool: PoolHandle) -> Result<(), MockError> {
        let mut state = self.state();
        self.enter(&mut state, Operation::DestroyPool)?;
        Self::pool(&mut state.pools, &pool)?;
        let state = &mut *state;
        let device_used = &mut state.used[pool.device().0 as usize];
        if let Some(mut p) = state.pools.remove(&pool.raw()) {
            p.release_all(device_used, &mut state.stats);
            state.stats.live_pools -= 1;
        }
        Ok(())
    }
}

impl Drop for MockBackend {
    fn drop(&mut self) {
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let leaked_pools = state.pools.len() as u64;
        for (_, mut p) in state.pools.drain() {
            let mut unused = 0u64;
            let device_used = state
                .used
                .get_mut(p.device.0 as usize)
                .unwrap_or(&mut unused);
            p.release_all(device_used, &mut state.stats);
        }
        let leaked = state.allocations.len() as u64 + leaked_pools;
        for (address, record) in state.allocations.drain() {
            if let Some(ptr) = core::ptr::NonNull::new(address as *mut u8) {
                // SAFETY: every table entry is a live mapping of ours; the backend is being
                // dropped, so no allocation of it can be used any more by contract.
                unsafe { host::unmap(ptr, record.mapped) };
            }
        }
        if leaked > 0 {
            LEAKED_AT_DROP.fetch_add(leaked, Ordering::AcqRel);
            eprintln!("tensor-wasm-mem-mock: {leaked} allocation(s) still live at drop (unmapped)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensor_wasm_mem_core::BackendError;

    const PAGE: usize = 1 << 16;

    fn small(devices: u32, memory: u64) -> MockBackend {
        MockBackend::new(MockConfig {
            device_count: devices,
            device_memory_bytes: memory,
            ..MockConfig::default()
        })
    }

    #[test]
    fn device_memory_is_finite() {
        let mock = small(2, 4 * PAGE as u64);
        let a = mock.allocate(DeviceId(0), 3 * PAGE).unwrap();
        let err = mock.allocate(DeviceId(0), 2 * PAGE).unwrap_err();
        assert_eq!(
            err,
            MockError::OutOfMemory {
                device: DeviceId(0),
                requested: 2 * PAGE as u64,
                available: PAGE as u64
            }
        );
        assert_eq!(err.kind(), ErrorKind::OutOfMemory);
        // The other device has its own memory.
        let b = mock.allocate(DeviceId(1), 4 * PAGE).unwrap();
        assert_eq!(mock.device_bytes_used(DeviceId(1)), 4 * PAGE as u64);
        assert!(matches!(
            mock.allocate(DeviceId(2), 1),
            Err(MockError::InvalidDevice { .. })
        ));
        assert!(matches!(
            mock.allocate(DeviceId(0), usize::MAX),
            Err(MockError::OutOfMemory { .. })
        ));
        // SAFETY: `a` came from `mock` and is not used again.
        unsafe { mock.free(a).unwrap() };
        // SAFETY: `b` came from `mock` and is not used again.
        unsafe { mock.free(b).unwrap() };
        assert_eq!(mock.device_bytes_used(DeviceId(0)), 0);
        assert_eq!(mock.stats().live_allocations, 0);
    }

    #[test]
    fn nth_call_fails_once() {
        let mock = MockBackend::default();
        mock.fail_nth(Operation::Allocate, 2);
        let a = mock.allocate(DeviceId(0), 10).unwrap();
        let err = mock.allocate(DeviceId(0), 10).unwrap_err();
        assert_eq!(
            err,
            MockError::Injected {
                op: Operation::Allocate,
                call: 2,
                kind: ErrorKind::OutOfMemory
            }
        );
        let b = mock.allocate(DeviceId(0), 10).unwrap();
        mock.fail_nth_with(Operation::Zero, 1, ErrorKind::Driver);
        // SAFETY: `a` is live and unaliased.
        let zeroed = unsafe { mock.zero(&a, 0, 10) };
        assert_eq!(zeroed.unwrap_err().kind(), ErrorKind::Driver);
        let s = mock.stats();
        assert_eq!(s.calls(Operation::Allocate), 3);
        assert_eq!(s.calls(Operation::Zero), 1);
        assert_eq!(s.injected_failures, 2);
        // SAFETY: `a` came from `mock` and is not used again.
        unsafe { mock.free(a).unwrap() };
        // SAFETY: `b` came from `mock` and is not used again.
        unsafe { mock.free(b).unwrap() };
    }

    #[test]
    fn failed_free_keeps_the_memory_accounted() {
        let mock = MockBackend::default();
        let a = mock.allocate(DeviceId(0), 10).unwrap();
        mock.fail_nth(Operation::Free, 1);
        // SAFETY: `a` came from `mock`.
        assert!(unsafe { mock.free(a) }.is_err());
        assert_eq!(
            mock.stats().live_allocations,
            1,
            "a failed free frees nothing"
        );
        let before = leaked_at_drop();
        drop(mock);
        assert!(leaked_at_drop() > before, "the leak is reported at drop");
    }

    fn deferred() -> MockBackend {
        MockBackend::new(MockConfig {
            deferred_streams: true,
            ..MockConfig::default()
        })
    }

    fn read(a: &Allocation, offset: usize) -> u8 {
        // SAFETY: host-accessible memory of a live allocation, read in bounds.
        unsafe { a.as_ptr().wrapping_add(offset).read() }
    }

    fn key(id: u64) -> TenantKey {
        TenantKey::fresh(tensor_wasm_mem_core::TenantId(id))
    }

    /// With deferred streams, a kernel's write and a prefetch land when their stream is
    /// synchronised, in order, never at the call; host reads see the old bytes until then.
    #[test]
    fn deferred_work_lands_when_the_stream_is_drained() {
        let mock = deferred();
        let a = mock.allocate(DeviceId(0), 2 * PAGE).unwrap();
        let s = mock
            .acquire_stream(key(1), IsolationLevel::StreamIsolated)
            .unwrap();
        let d0 = Location::Device(DeviceId(0));
        // SAFETY: the test holds no reference to the bytes while the fill can run.
        unsafe { mock.enqueue_fill(&s, a.device_ptr(), PAGE, 0xaa).unwrap() };
        // SAFETY: the test holds no reference to the bytes while the fill can run.
        unsafe { mock.enqueue_fill(&s, a.device_ptr() + 8, 8, 0xbb).unwrap() };
        mock.prefetch(&a, 0, PAGE, d0, &s).unwrap();
        assert_eq!((read(&a, 0), read(&a, 8)), (0, 0), "nothing landed yet");
        assert_eq!(mock.residency(&a, 0).unwrap(), None);
        assert_eq!(mock.pending_work(), 3);
        mock.synchronize(&s).unwrap();
        assert_eq!(
            (read(&a, 0), read(&a, 8), read(&a, 16)),
            (0xaa, 0xbb, 0xaa),
            "in order"
        );
        assert_eq!(read(&a, PAGE), 0, "only the range");
        assert_eq!(mock.residency(&a, 0).unwrap(), Some(d0));
        assert_eq!((mock.pending_work(), mock.stats().work_completed), (0, 3));
        // Release waits too, for the shared stream as well.
        // SAFETY: the test holds no reference to the bytes while the fill can run.
        unsafe { mock.enqueue_fill(&s, a.device_ptr(), 1, 1).unwrap() };
        mock.release_stream(s).unwrap();
        assert_eq!(read(&a, 0), 1);
        let shared = mock.acquire_stream(key(2), IsolationLevel::Shared).unwrap();
        // SAFETY: the test holds no reference to the bytes while the fill can run.
        unsafe { mock.enqueue_fill(&shared, a.device_ptr(), 1, 2).unwrap() };
        assert_eq!(read(&a, 0), 1);
        mock.release_stream(shared).unwrap();
        assert_eq!(read(&a, 0), 2);
        // SAFETY: `a` came from `mock`.
        unsafe { mock.free(a).unwrap() };
    }

    /// A scrub or free while work still targets the range is counted, and the work lands after
    /// it: the ordering bug a GPU would not report, made visible.
    #[test]
    fn deferred_work_outlives_a_scrub_done_too_early() {
        let mock = deferred();
        let a = mock.allocate(DeviceId(0), PAGE).unwrap();
        let s = mock
            .acquire_stream(key(1), IsolationLevel::StreamIsolated)
            .unwrap();
        // SAFETY: the test holds no reference to the bytes while the fill can run.
        unsafe { mock.enqueue_fill(&s, a.device_ptr(), PAGE, 0xaa).unwrap() };
        // SAFETY: `a` is live and not accessed meanwhile.
        unsafe { mock.zero(&a, 0, PAGE).unwrap() };
        assert_eq!(mock.stats().scrubs_over_pending_work, 1);
        mock.synchronize(&s).unwrap();
        assert_eq!(read(&a, 0), 0xaa, "the write landed after the scrub");
        // A write queued for memory that is freed before it runs faults: the stream's
        // context is poisoned, and its release reports it (destroying the stream all the same).
        // SAFETY: the test holds no reference to the bytes while the fill can run.
        unsafe { mock.enqueue_fill(&s, a.device_ptr(), PAGE, 0xcc).unwrap() };
        // SAFETY: `a` came from `mock`.
        unsafe { mock.free(a).unwrap() };
        assert_eq!(mock.stats().frees_over_pending_work, 1);
        let err = mock.release_stream(s).unwrap_err();
        assert!(matches!(err, MockError::ContextPoisoned { .. }), "{err}");
        let st = mock.stats();
        assert_eq!((st.kernel_faults, st.live_streams), (1, 0));
    }

    /// A kernel fault is sticky for its context and nothing else: a context-isolated tenant's
    /// fault leaves the primary context (and other tenants' contexts) working; its own context
    /// comes back fresh once destroyed.
    #[test]
    fn a_kernel_fault_poisons_its_context_only() {
        let mock = deferred();
        let a = mock.allocate(DeviceId(0), PAGE).unwrap();
        let bad = mock
            .acquire_stream(key(1), IsolationLevel::ContextIsolated)
            .unwrap();
        let good = mock
            .acquire_stream(key(2), IsolationLevel::ContextIsolated)
            .unwrap();
        let primary = mock
            .acquire_stream(key(3), IsolationLevel::StreamIsolated)
            .unwrap();
        // SAFETY: the test holds no reference to the bytes while the fill can run.
        unsafe { mock.enqueue_fill(&bad, a.device_ptr() + PAGE as u64, 1, 1) }.unwrap(); // launches
        // SAFETY: the test holds no reference to the bytes while the fill can run.
        unsafe { mock.enqueue_fill(&bad, a.device_ptr(), 1, 1) }.unwrap(); // after the fault: never runs
        let err = mock.synchronize(&bad).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Driver, "{err}");
        assert!(
            mock.prefetch(&a, 0, PAGE, Location::Host, &bad).is_err(),
            "sticky"
        );
        assert_eq!(read(&a, 0), 0, "work after the fault did not run");
        for s in [&good, &primary] {
            // SAFETY: the test holds no reference to the bytes while the fill can run.
            unsafe { mock.enqueue_fill(s, a.device_ptr(), 1, 2).unwrap() };
            mock.synchronize(s).unwrap();
        }
        assert_eq!(read(&a, 0), 2);
        assert!(
            mock.release_stream(bad).is_err(),
            "the release reports the fault"
        );
        let again = mock
            .acquire_stream(key(1), IsolationLevel::ContextIsolated)
            .unwrap();
        mock.synchronize(&again).unwrap();
        for s in [again, good, primary] {
            mock.release_stream(s).unwrap();
        }
        // SAFETY: `a` came from `mock`.
        unsafe { mock.free(a).unwrap() };
    }

    /// Without deferred streams a kernel runs at the call: a range outside every live
    /// allocation faults there (and poisons the context), an overflowing one is refused.
    #[test]
    fn fills_name_live_memory_only() {
        for (offset, len) in [(PAGE as u64, 1), (1, PAGE), (0, usize::MAX)] {
            let mock = small(1, 1 << 30);
            let a = mock.allocate(DeviceId(0), PAGE).unwrap();
            let s = mock
                .acquire_stream(key(1), IsolationLevel::ContextIsolated)
                .unwrap();
            // SAFETY: the range is outside the allocation or overflows: nothing is written.
            let err =
                unsafe { mock.enqueue_fill(&s, a.device_ptr() + offset, len, 1) }.unwrap_err();
            assert!(
                matches!(
                    err,
                    MockError::ContextPoisoned { .. } | MockError::IllegalAddress { .. }
                ),
                "{offset}+{len}: {err}"
            );
            assert_eq!(mock.pending_work(), 0);
            let _ = mock.release_stream(s);
            // SAFETY: `a` came from `mock`.
            unsafe { mock.free(a).unwrap() };
        }
        let mock = small(1, 1 << 30);
        let a = mock.allocate(DeviceId(0), PAGE).unwrap();
        let s = mock
            .acquire_stream(key(1), IsolationLevel::StreamIsolated)
            .unwrap();
        // SAFETY: the test holds no reference to the bytes while the fill can run.
        unsafe { mock.enqueue_fill(&s, a.device_ptr(), PAGE, 7).unwrap() };
        assert_eq!(read(&a, PAGE - 1), 7, "not deferred: done at the call");
        mock.release_stream(s).unwrap();
        // SAFETY: `a` came from `mock`.
        unsafe { mock.free(a).unwrap() };
    }

    #[test]
    fn hints_and_residency_are_tracked_per_range() {
        let mock = small(2, 1 << 30);
        let a = mock.allocate(DeviceId(0), 4 * PAGE).unwrap();
        let d1 = Location::Device(DeviceId(1));
        mock.advise(&a, 0, 2 * PAGE, Advice::SetReadMostly).unwrap();
        mock.advise(&a, PAGE, 3 * PAGE, Advice::SetPreferredLocation(d1))
            .unwrap();
        mock.advise(&a, 0, 4 * PAGE, Advice::SetAccessedBy(Location::Host))
            .unwrap();
        mock.advise(&a, 3 * PAGE, PAGE, Advice::UnsetAccessedBy(Location::Host))
            .unwrap();
        assert_eq!(
            mock.hints(&a, PAGE).unwrap(),
            Hints {
                read_mostly: true,
                preferred_location: Some(d1),
                accessed_by: vec![Location::Host]
            }
        );
        assert_eq!(
            mock.hints(&a, 3 * PAGE).unwrap(),
            Hints {
                read_mostly: false,
                preferred_location: Some(d1),
                accessed_by: vec![]
            }
        );
        let stream = mock
            .acquire_stream(
                TenantKey::fresh(tensor_wasm_mem_core::TenantId(1)),
                IsolationLevel::StreamIsolated,
            )
            .unwrap();
        assert_eq!(mock.residency(&a, 0).unwrap(), None);
        mock.prefetch(&a, 0, 4 * PAGE, d1, &stream).unwrap();
        mock.prefetch(&a, PAGE, PAGE, Location::Host, &stream)
            .unwrap();
        assert_eq!(mock.residency(&a, 0).unwrap(), Some(d1));
        assert_eq!(mock.residency(&a, PAGE).unwrap(), Some(Location::Host));
        assert_eq!(mock.residency(&a, 2 * PAGE).unwrap(), Some(d1));
        assert!(mock.residency(&a, 4 * PAGE).is_err());
        mock.release_stream(stream).unwrap();
        // SAFETY: `a` came from `mock`.
        unsafe { mock.free(a).unwrap() };
    }

    #[test]
    fn prefetch_needs_a_live_stream_and_concurrent_access() {
        let mock = MockBackend::new(MockConfig {
            concurrent_managed_access: false,
            ..MockConfig::default()
        });
        let a = mock.allocate(DeviceId(0), PAGE).unwrap();
        let shared = mock
            .acquire_stream(
                TenantKey::fresh(tensor_wasm_mem_core::TenantId(1)),
                IsolationLevel::Shared,
            )
            .unwrap();
        let err = mock
            .prefetch(&a, 0, PAGE, Location::Device(DeviceId(0)), &shared)
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsupported);
        mock.prefetch(&a, 0, PAGE, Location::Host, &shared).unwrap();
        let forged = Stream::new(
            77,
            PRIMARY_CONTEXT,
            IsolationLevel::StreamIsolated,
            TenantKey::fresh(tensor_wasm_mem_core::TenantId(1)),
        );
        assert_eq!(
            mock.prefetch(&a, 0, PAGE, Location::Host, &forged),
            Err(MockError::UnknownStream { raw: 77 })
        );
        // SAFETY: `a` came from `mock`.
        unsafe { mock.free(a).unwrap() };
    }

    #[test]
    fn poisoned_allocations_are_not_zero() {
        let mock = MockBackend::new(MockConfig {
            poison_fresh_allocations: true,
            ..MockConfig::default()
        });
        assert!(!mock.capabilities().comes_zeroed);
        let a = mock.allocate(DeviceId(0), 100).unwrap();
        // SAFETY: `a` is a live host-accessible allocation of 100 bytes.
        let first = unsafe { a.as_ptr().read() };
        assert_eq!(first, 0xA5);
        // SAFETY: `a` is live and unaliased.
        unsafe { mock.zero(&a, 0, 100).unwrap() };
        // SAFETY: as above.
        assert_eq!(unsafe { a.as_ptr().wrapping_add(99).read() }, 0);
        // SAFETY: `a` came from `mock`.
        unsafe { mock.free(a).unwrap() };
    }

    #[test]
    fn large_zero_gives_pages_back_and_zeroes_edges() {
        let mock = MockBackend::default();
        let len = 1 << 20;
        let a = mock.allocate(DeviceId(0), len).unwrap();
        // SAFETY: live, host-accessible, unaliased.
        unsafe { a.as_ptr().write_bytes(0xff, len) };
        // SAFETY: live and unaliased.
        unsafe { mock.zero(&a, 100, len - 200).unwrap() };
        // SAFETY: reads inside the live allocation.
        let byte = |i: usize| unsafe { a.as_ptr().wrapping_add(i).read() };
        assert_eq!(byte(99), 0xff);
        assert_eq!(byte(100), 0);
        assert_eq!(byte(len / 2), 0);
        assert_eq!(byte(len - 101), 0);
        assert_eq!(byte(len - 100), 0xff);
        // SAFETY: `a` came from `mock`.
        unsafe { mock.free(a).unwrap() };
    }

    #[test]
    fn foreign_allocations_are_refused() {
        let one = MockBackend::default();
        let two = MockBackend::default();
        let a = one.allocate(DeviceId(0), PAGE).unwrap();
        assert!(matches!(
            two.advise(&a, 0, 1, Advice::SetReadMostly),
            Err(MockError::UnknownAllocation { .. })
        ));
        // SAFETY: `a` is live in `one`; `two` must refuse to touch it.
        assert!(unsafe { two.zero(&a, 0, 1) }.is_err());
        // SAFETY: `a` came from `one`.
        unsafe { one.free(a).unwrap() };
    }
}
