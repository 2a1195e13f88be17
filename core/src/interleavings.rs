//! Exhaustive interleaving tests of the driver layer's state machines: a context-isolated
//! tenant's context (first user makes it, last user destroys it), a device pool's records (a
//! free racing an allocation of the same address), and (in `review`) teardown racing
//! releases, handle values the driver reuses, and forged duplicate handles.
//!
//! Real threads run the real `DriverBackend` and `TenantDevicePool` over a strict fake driver,
//! but a scheduler lets exactly one of them run at a time and switches only at the fake's switch
//! points: stream and context creation and destruction, synchronize, pool allocation and free
//! (after the free has taken effect), managed allocation and free where a test turns them on,
//! and context pushes where a test asks for them. Those are where the state machines leave
//! their lock; a lock section between two of them is atomic to the other threads. Every
//! schedule is enumerated (depth-first over the choice at each switch), and after each the
//! invariants are checked: one context per tenant, every stream usable, nothing used after it
//! was destroyed, nothing left in the driver, the ledger equal to what the driver holds. Each
//! test fails when the old steps are put back.
//!
//! Why not `loom`: the state machines are `spin::Mutex`-guarded tables inside `DriverBackend`,
//! and loom needs its own primitives in the code under test; switching at driver calls covers
//! the same decisions on the code as shipped.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec;
use alloc::vec::Vec;
use core::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use crate::device::{Advice, DeviceId, Location};
use crate::driver::{
    DeviceFacts, DriverApi, DriverBackend, DriverContext, DriverPool, DriverStream, Refusal,
};
use crate::error::{BackendError, ErrorKind};
use crate::isolation::IsolationLevel;
use crate::ledger::{TenantId, TenantKey, TenantLedger};
use crate::pools::{DevicePoolConfig, TenantDevicePool};
use crate::stream::{DEFAULT_STREAM, Stream, StreamProvider};

/// One thread runs at a time; the running one hands over at each driver call.
#[derive(Default)]
struct Scheduler {
    state: Mutex<Schedule>,
    turn: Condvar,
}

#[derive(Default)]
struct Schedule {
    threads: usize,
    running: Option<usize>,
    /// Threads parked at a switch point, waiting for their turn.
    waiting: BTreeSet<usize>,
    done: usize,
    /// Choices to replay, then the lowest enabled thread.
    script: Vec<usize>,
    /// Each switch: the enabled threads and the one chosen.
    trace: Vec<(Vec<usize>, usize)>,
}

std::thread_local! {
    static ME: RefCell<Option<(Arc<Scheduler>, usize)>> = const { RefCell::new(None) };
}

impl Scheduler {
    fn lock(&self) -> MutexGuard<'_, Schedule> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Picks the next thread to run (with the lock held) and wakes everyone.
    fn pick(&self, s: &mut Schedule) {
        let enabled: Vec<usize> = s.waiting.iter().copied().collect();
        if enabled.is_empty() {
            s.running = None;
        } else {
            let step = s.trace.len();
            let choice = s
                .script
                .get(step)
                .copied()
                .filter(|c| enabled.contains(c))
                .unwrap_or(enabled[0]);
            s.trace.push((enabled, choice));
            s.waiting.remove(&choice);
            s.running = Some(choice);
        }
        self.turn.notify_all();
    }

    /// Parks thread `me` until it is chosen.
    fn park(&self, me: usize, mut s: MutexGuard<'_, Schedule>) {
        while s.running != Some(me) {
            s = self.turn.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The running thread reaches a switch point.
    fn switch(&self, me: usize) {
        let mut s = self.lock();
        s.waiting.insert(me);
        self.pick(&mut s);
        self.park(me, s);
    }

    /// Runs `bodies` as threads under `script`; returns the trace.
    fn run(
        script: Vec<usize>,
        bodies: Vec<Box<dyn FnOnce() + Send + '_>>,
    ) -> Vec<(Vec<usize>, usize)> {
        let sched = Arc::new(Scheduler::default());
        sched.lock().script = script;
        sched.lock().threads = bodies.len();
        std::thread::scope(|scope| {
            for (me, body) in bodies.into_iter().enumerate() {
                let sched = Arc::clone(&sched);
                scope.spawn(move || {
                    /// Hands over when the body ends, by returning or by a failed assertion.
                    struct Finish(Arc<Scheduler>);
                    impl Drop for Finish {
                        fn drop(&mut self) {
                            ME.with(|m| *m.borrow_mut() = None);
                            let mut s = self.0.lock();
                            s.done += 1;
                            self.0.pick(&mut s);
                        }
                    }
                    ME.with(|m| *m.borrow_mut() = Some((Arc::clone(&sched), me)));
                    {
                        let mut s = sched.lock();
                        s.waiting.insert(me);
                        if s.waiting.len() == s.threads {
                            sched.pick(&mut s);
                        }
                        sched.park(me, s);
                    }
                    let _finish = Finish(Arc::clone(&sched));
                    body();
                });
            }
        });
        core::mem::take(&mut sched.lock().trace)
    }

    /// Every schedule of `make()`'s threads, depth first; `check` after each. Returns how many.
    fn explore<'a>(
        mut make: impl FnMut() -> (Vec<Box<dyn FnOnce() + Send + 'a>>, Box<dyn FnOnce() + 'a>),
    ) -> usize {
        let mut script: Vec<usize> = Vec::new();
        let mut runs = 0;
        loop {
            let (bodies, check) = make();
            let trace = Self::run(script.clone(), bodies);
            check();
            runs += 1;
            // The deepest switch with an untried alternative after the one taken.
            let next = trace
                .iter()
                .enumerate()
                .rev()
                .find_map(|(i, (enabled, chosen))| {
                    enabled.iter().find(|&&c| c > *chosen).map(|&c| (i, c))
                });
            let Some((i, c)) = next else {
                return runs;
            };
            script = trace[..i].iter().map(|(_, chosen)| *chosen).collect();
            script.push(c);
        }
    }
}

/// A switch point, when the calling thread runs under a scheduler.
fn switch() {
    let me = ME.with(|m| m.borrow().clone());
    if let Some((sched, me)) = me {
        sched.switch(me);
    }
}

#[derive(Debug, thiserror::Error)]
enum FakeError {
    #[error("driver error {0}")]
    Code(u32),
    #[error(transparent)]
    Refused(#[from] Refusal),
}

impl BackendError for FakeError {
    fn kind(&self) -> ErrorKind {
        match self {
            Self::Code(_) => ErrorKind::Driver,
            Self::Refused(r) => r.kind(),
        }
    }
}

const INVALID_CONTEXT: u32 = 201;
const INVALID_HANDLE: u32 = 400;

/// A strict driver in the CUDA mould: per-thread context stacks, streams that die with their
/// context, stream calls that need their context current and alive, pools that reuse the last
/// freed block first.
#[derive(Default)]
struct Fake {
    state: Mutex<FakeState>,
}

#[derive(Default)]
struct FakeState {
    next: u64,
    contexts: BTreeSet<u64>,
    /// stream -> its context
    streams: BTreeMap<u64, u64>,
    pool_free_blocks: Vec<u64>,
    pool_live: BTreeSet<u64>,
    /// Stream calls in order: (call, stream).
    events: Vec<(&'static str, u64)>,
    // --- review knobs (all off by default) ---
    /// Reuse destroyed stream handle values (LIFO), and hand over after a destroy took effect.
    reuse_streams: bool,
    free_streams: Vec<u64>,
    /// Hand out managed memory (reusing freed addresses, LIFO), hand over after a free.
    managed: bool,
    managed_free: Vec<u64>,
    managed_live: BTreeSet<u64>,
    /// Pool frees of these pointers fail (the driver keeps the block).
    fail_pool_free: BTreeSet<u64>,
    /// The n-th pool free (1-based) fails.
    fail_pool_free_call: Option<usize>,
    pool_free_calls: usize,
    /// Switch at every push_current.
    switch_at_push: bool,
    /// These pool frees (1-based call numbers) fail.
    fail_pool_free_calls: BTreeSet<usize>,
    /// pool_destroy fails.
    fail_pool_destroy: bool,
    /// synchronize panics (a driver binding that panics mid-call).
    panic_in_synchronize: bool,
    /// stream_destroy of these streams fails, once each.
    fail_stream_destroy_once: BTreeSet<u64>,
    // --- review tracking (always on) ---
    destroyed_contexts: BTreeSet<u64>,
    /// Pushes of a context that was destroyed (a dangling CUcontext on a real driver).
    dead_pushes: u64,
    /// How many threads have each context pushed now.
    current_on: BTreeMap<u64, i64>,
    /// context_destroy while the context is current on some thread.
    destroyed_while_current: u64,
    live_pools: BTreeSet<u64>,
    /// pool_alloc on a pool that is not live (destroyed).
    alloc_from_dead_pool: u64,
    /// Pools made so far (handles 77, 78, ...).
    pools_made: u64,
    /// Each live pool block -> the stream it was allocated on.
    block_stream: BTreeMap<u64, u64>,
    /// Pool frees on the default stream of a block whose own stream was not waited for since
    /// work was queued on it (destroyed or not: a destroyed stream's work still completes
    /// later): on a real driver nothing orders the free after that (non-blocking) stream's work.
    freed_off_live_stream: u64,
    /// Streams waited for since work was last queued on them.
    synced: BTreeSet<u64>,
}

std::thread_local! {
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

const PRIMARY: u64 = 1;
const BLOCK: usize = 4096;

impl Fake {
    fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn current(&self, s: &FakeState) -> Result<u64, FakeError> {
        let top = STACK.with(|st| st.borrow().last().copied());
        match top {
            Some(c) if c == PRIMARY || s.contexts.contains(&c) => Ok(c),
            _ => Err(FakeError::Code(INVALID_CONTEXT)),
        }
    }

    /// A live stream of the current context (0: the default stream of any context).
    fn stream(&self, s: &FakeState, stream: u64) -> Result<(), FakeError> {
        let ctx = self.current(s)?;
        if stream == DEFAULT_STREAM || s.streams.get(&stream) == Some(&ctx) {
            Ok(())
        } else {
            Err(FakeError::Code(INVALID_HANDLE))
        }
    }
}

// SAFETY: the fake never hands out memory (`alloc_managed` fails): no allocation contract to
// keep; `device_facts` is honest about the fake device.
unsafe impl DriverApi for Fake {
    type Error = FakeError;

    fn device_count(&self) -> u32 {
        1
    }
    fn device_facts(&self, _: DeviceId) -> DeviceFacts {
        DeviceFacts {
            concurrent_managed_access: true,
            pageable_memory_access: false,
            pageable_uses_host_page_tables: false,
            host_registration: false,
        }
    }
    fn primary_context(&self, _: DeviceId) -> DriverContext {
        DriverContext::from_raw(PRIMARY)
    }
    fn push_current(&self, context: DriverContext) -> Result<(), FakeError> {
        let context = context.raw();
        if self.lock().switch_at_push {
            switch();
        }
        let mut s = self.lock();
        if s.destroyed_contexts.contains(&context) {
            s.dead_pushes += 1;
        }
        if context != PRIMARY && !s.contexts.contains(&context) {
            return Err(FakeError::Code(INVALID_CONTEXT));
        }
        STACK.with(|st| st.borrow_mut().push(context));
        *s.current_on.entry(context).or_default() += 1;
        Ok(())
    }
    fn pop_current(&self) -> Result<(), FakeError> {
        let popped = STACK.with(|st| st.borrow_mut().pop());
        if let Some(c) = popped {
            *self.lock().current_on.entry(c).or_default() -= 1;
        }
        popped.map(|_| ()).ok_or(FakeError::Code(INVALID_CONTEXT))
    }
    fn alloc_managed(&self, _: DeviceId, _: usize) -> Result<u64, FakeError> {
        let mut s = self.lock();
        if !s.managed {
            return Err(FakeError::Code(2));
        }
        let ptr = match s.managed_free.pop() {
            Some(p) => p,
            None => {
                s.next += 1;
                0x4000_0000 + s.next * 0x10_0000
            }
        };
        s.managed_live.insert(ptr);
        Ok(ptr)
    }
    unsafe fn free(&self, ptr: u64) -> Result<(), FakeError> {
        let mut s = self.lock();
        if !s.managed || !s.managed_live.remove(&ptr) {
            return Err(FakeError::Code(1));
        }
        s.managed_free.push(ptr);
        drop(s);
        // The caller hears back later: another thread's allocation can fall in here.
        switch();
        Ok(())
    }
    unsafe fn zero(&self, _: DeviceId, _: u64, _: usize) -> Result<(), FakeError> {
        Err(FakeError::Code(1))
    }
    fn advise(&self, _: u64, _: usize, _: Advice) -> Result<(), FakeError> {
        Err(FakeError::Code(1))
    }
    fn prefetch(&self, _: u64, _: usize, _: Location, _: DriverStream) -> Result<(), FakeError> {
        Err(FakeError::Code(1))
    }
    fn scrub_stream(&self, _: DeviceId) -> DriverStream {
        DriverStream::DEFAULT
    }
    fn stream_create(&self) -> Result<DriverStream, FakeError> {
        switch();
        let mut s = self.lock();
        let ctx = self.current(&s)?;
        let reused = if s.reuse_streams {
            s.free_streams.pop()
        } else {
            None
        };
        let stream = match reused {
            Some(r) => r,
            None => {
                s.next += 1;
                1000 + s.next
            }
        };
        s.streams.insert(stream, ctx);
        s.synced.remove(&stream);
        Ok(DriverStream::from_raw(stream))
    }
    fn stream_destroy(&self, stream: DriverStream) -> Result<(), FakeError> {
        let stream = stream.raw();
        switch();
        let mut s = self.lock();
        self.stream(&s, stream)?;
        if s.fail_stream_destroy_once.remove(&stream) {
            return Err(FakeError::Code(999));
        }
        s.streams.remove(&stream);
        s.events.push(("stream_destroy", stream));
        if s.reuse_streams {
            s.free_streams.push(stream);
            drop(s);
            switch();
        }
        Ok(())
    }
    fn synchronize(&self, stream: DriverStream) -> Result<(), FakeError> {
        let stream = stream.raw();
        switch();
        let mut s = self.lock();
        self.stream(&s, stream)?;
        if s.panic_in_synchronize {
            drop(s);
            panic!("the driver binding panicked mid-call");
        }
        s.events.push(("synchronize", stream));
        s.synced.insert(stream);
        Ok(())
    }
    fn context_create(&self, _: DeviceId) -> Result<DriverContext, FakeError> {
        switch();
        let mut s = self.lock();
        s.next += 1;
        let ctx = 100 + s.next;
        s.contexts.insert(ctx);
        Ok(DriverContext::from_raw(ctx))
    }
    fn context_destroy(&self, context: DriverContext) -> Result<(), FakeError> {
        let context = context.raw();
        switch();
        let mut s = self.lock();
        if !s.contexts.remove(&context) {
            return Err(FakeError::Code(INVALID_CONTEXT));
        }
        s.destroyed_contexts.insert(context);
        if s.current_on.get(&context).copied().unwrap_or(0) > 0 {
            s.destroyed_while_current += 1;
        }
        // Its streams die with it, as on the driver.
        s.streams.retain(|_, c| *c != context);
        Ok(())
    }
    fn pool_create(&self, _: DeviceId, _: u64, _: u64) -> Result<DriverPool, FakeError> {
        let mut s = self.lock();
        let pool = 77 + s.pools_made;
        s.pools_made += 1;
        s.live_pools.insert(pool);
        Ok(DriverPool::from_raw(pool))
    }
    fn pool_destroy(&self, pool: DriverPool) -> Result<(), FakeError> {
        let pool = pool.raw();
        let mut s = self.lock();
        if s.fail_pool_destroy {
            return Err(FakeError::Code(999));
        }
        s.live_pools.remove(&pool);
        Ok(())
    }
    fn pool_alloc(
        &self,
        pool: DriverPool,
        _: usize,
        stream: DriverStream,
    ) -> Result<u64, FakeError> {
        let (pool, stream) = (pool.raw(), stream.raw());
        switch();
        let mut s = self.lock();
        self.stream(&s, stream)?;
        if !s.live_pools.contains(&pool) {
            s.alloc_from_dead_pool += 1;
        }
        let ptr = match s.pool_free_blocks.pop() {
            Some(p) => p,
            None => {
                s.next += 1;
                0x10_0000 + s.next * BLOCK as u64
            }
        };
        s.pool_live.insert(ptr);
        s.block_stream.insert(ptr, stream);
        s.synced.remove(&stream);
        Ok(ptr)
    }
    /// Its blocks are given back at once when freed (their addresses kept for reuse): it
    /// holds the live ones.
    fn pool_reserved(&self, _: DriverPool) -> Result<u64, FakeError> {
        Ok(self.lock().pool_live.len() as u64 * BLOCK as u64)
    }
    fn pool_trim(&self, _: DriverPool, _: u64) -> Result<(), FakeError> {
        Ok(())
    }
    fn pool_free(&self, ptr: u64, stream: DriverStream) -> Result<(), FakeError> {
        let stream = stream.raw();
        switch();
        let mut s = self.lock();
        self.stream(&s, stream)?;
        s.pool_free_calls += 1;
        let call = s.pool_free_calls;
        if s.fail_pool_free.contains(&ptr)
            || Some(call) == s.fail_pool_free_call
            || s.fail_pool_free_calls.contains(&call)
        {
            return Err(FakeError::Code(999));
        }
        if !s.pool_live.remove(&ptr) {
            return Err(FakeError::Code(INVALID_HANDLE));
        }
        // As on the driver, a destroyed stream's queued work still runs: only a wait orders
        // what comes after it.
        if let Some(own) = s.block_stream.remove(&ptr)
            && stream == DEFAULT_STREAM
            && own != DEFAULT_STREAM
            && !s.synced.contains(&own)
        {
            s.freed_off_live_stream += 1;
        }
        s.pool_free_blocks.push(ptr);
        s.events.push(("pool_free", stream));
        s.synced.remove(&stream);
        // The caller hears back later: the window another thread's allocation can fall into.
        drop(s);
        switch();
        Ok(())
    }
}

type Body<'a> = Box<dyn FnOnce() + Send + 'a>;

/// A device pool of `tenant` on device 0 of `backend`.
fn pool_of(
    backend: &Arc<DriverBackend<Fake>>,
    tenant: &Arc<TenantLedger>,
) -> TenantDevicePool<Arc<DriverBackend<Fake>>> {
    TenantDevicePool::new(
        Arc::clone(backend),
        Arc::clone(tenant),
        DeviceId(0),
        &DevicePoolConfig::default(),
    )
    .expect("pool")
}

#[test]
fn a_tenant_context_under_every_interleaving_of_two_users() {
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(Fake::default()));
        let tenant = TenantKey::fresh(TenantId(1));
        let contexts = Arc::new(Mutex::new(Vec::new()));
        let bodies: Vec<Body<'_>> = (0..2)
            .map(|_| {
                let (backend, contexts) = (Arc::clone(&backend), Arc::clone(&contexts));
                Box::new(move || {
                    let stream = backend
                        .acquire_stream(tenant, IsolationLevel::ContextIsolated)
                        .expect("acquire");
                    backend.synchronize(&stream).expect("a usable stream");
                    contexts.lock().unwrap().push(stream.context());
                    backend.release_stream(stream).expect("release");
                }) as Body<'_>
            })
            .collect();
        let check = Box::new(move || {
            let stats = backend.stats();
            assert_eq!((stats.live_streams, stats.live_contexts), (0, 0));
            assert_eq!(stats.release_failures, 0);
            let driver = backend.driver().lock();
            assert!(driver.contexts.is_empty(), "contexts left in the driver");
            assert!(driver.streams.is_empty(), "streams left in the driver");
            let seen = contexts.lock().unwrap();
            assert_eq!(seen.len(), 2);
        });
        (bodies, check as Box<dyn FnOnce()>)
    });
    std::eprintln!("{runs} schedules");
    // Both users overlapping, and each before the other: more than the two serial orders.
    assert!(runs > 10, "{runs} schedules explored");
}

#[test]
fn overlapping_users_share_one_context_under_every_interleaving() {
    // Both streams are held at once, so both users must see the same context.
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(Fake::default()));
        let tenant = TenantKey::fresh(TenantId(1));
        let held = Arc::new(Mutex::new(Vec::new()));
        let bodies: Vec<Body<'_>> = (0..2)
            .map(|_| {
                let (backend, held) = (Arc::clone(&backend), Arc::clone(&held));
                Box::new(move || {
                    let stream = backend
                        .acquire_stream(tenant, IsolationLevel::ContextIsolated)
                        .expect("acquire");
                    held.lock().unwrap().push(stream);
                }) as Body<'_>
            })
            .collect();
        let check = Box::new(move || {
            let streams: Vec<Stream> = core::mem::take(&mut *held.lock().unwrap());
            assert_eq!(streams[0].context(), streams[1].context(), "one context");
            assert_eq!(
                backend.driver().lock().contexts.len(),
                1,
                "one in the driver"
            );
            for s in streams {
                backend.release_stream(s).expect("release");
            }
            assert!(backend.driver().lock().contexts.is_empty());
            assert_eq!(backend.stats().live_contexts, 0);
        });
        (bodies, check as Box<dyn FnOnce()>)
    });
    assert!(runs > 2, "{runs} schedules explored");
}

#[test]
fn a_pool_free_racing_an_allocation_keeps_the_ledger_exact() {
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(Fake::default()));
        let tenant = Arc::new(TenantLedger::new(
            TenantId(1),
            2 * BLOCK as u64,
            IsolationLevel::Shared,
        ));
        let pool = Arc::new(pool_of(&backend, &tenant));
        let stream = Stream::new(
            crate::DriverStream::DEFAULT,
            crate::DriverContext::from_raw(0),
            IsolationLevel::Shared,
            tenant.key(),
        );
        let first = pool.allocate(BLOCK, &stream).expect("first");
        let kept = Arc::new(Mutex::new(Vec::new()));
        let freeing: Body<'_> = {
            let pool = Arc::clone(&pool);
            let stream = Stream::new(
                crate::DriverStream::DEFAULT,
                crate::DriverContext::from_raw(0),
                IsolationLevel::Shared,
                tenant.key(),
            );
            Box::new(move || pool.free(first, &stream).expect("free"))
        };
        let allocating: Body<'_> = {
            let (pool, kept) = (Arc::clone(&pool), Arc::clone(&kept));
            let stream = Stream::new(
                crate::DriverStream::DEFAULT,
                crate::DriverContext::from_raw(0),
                IsolationLevel::Shared,
                tenant.key(),
            );
            Box::new(move || {
                if let Ok(a) = pool.allocate(BLOCK, &stream) {
                    kept.lock().unwrap().push(a);
                }
            })
        };
        let check = Box::new(move || {
            let live_in_driver = backend.driver().lock().pool_live.len() as u64;
            assert_eq!(
                tenant.stats().device_pool_bytes,
                live_in_driver * BLOCK as u64,
                "the ledger charges exactly what the driver holds"
            );
            assert_eq!(backend.stats().live_pool_allocations, live_in_driver);
            drop(kept);
            drop(pool);
            assert_eq!(tenant.stats().touched_bytes, 0);
        });
        (vec![freeing, allocating], check as Box<dyn FnOnce()>)
    });
    assert!(runs > 2, "{runs} schedules explored");
}

/// Releasing the shared stream destroys nothing but waits for the default stream: a shared
/// tenant's work there is done before its memory is scrubbed on the non-blocking zeroing stream.
#[test]
fn releasing_the_shared_stream_waits_for_it() {
    let backend = DriverBackend::new(Fake::default());
    let tenant = TenantLedger::new(TenantId(1), u64::MAX, IsolationLevel::Shared);
    let shared = backend
        .acquire_stream(tenant.key(), IsolationLevel::Shared)
        .expect("stream");
    assert_eq!(shared.raw(), DEFAULT_STREAM);
    core::mem::take(&mut backend.driver().lock().events);
    backend.release_stream(shared).expect("release");
    let events = core::mem::take(&mut backend.driver().lock().events);
    assert_eq!(events, [("synchronize", DEFAULT_STREAM)]);
}

#[test]
fn teardown_is_ordered_on_the_stream_that_used_the_memory() {
    let backend = Arc::new(DriverBackend::new(Fake::default()));
    let tenant = Arc::new(TenantLedger::new(
        TenantId(1),
        u64::MAX,
        IsolationLevel::ContextIsolated,
    ));
    let pool = pool_of(&backend, &tenant);
    let live = backend
        .acquire_stream(tenant.key(), IsolationLevel::ContextIsolated)
        .expect("stream");
    let gone = backend
        .acquire_stream(tenant.key(), IsolationLevel::ContextIsolated)
        .expect("stream");
    let _on_live = pool.allocate(BLOCK, &live).expect("block");
    let _on_gone = pool.allocate(BLOCK, &gone).expect("block");
    let gone_raw = gone.raw();
    backend.release_stream(gone).expect("release");
    drop(pool);
    let events = core::mem::take(&mut backend.driver().lock().events);
    assert_eq!(
        &events[..2],
        &[("synchronize", gone_raw), ("stream_destroy", gone_raw)],
        "a stream is waited for before it is destroyed"
    );
    let mut frees: Vec<u64> = events
        .iter()
        .filter(|(call, _)| *call == "pool_free")
        .map(|&(_, stream)| stream)
        .collect();
    frees.sort_unstable();
    assert_eq!(
        frees,
        [DEFAULT_STREAM, live.raw()],
        "each block freed on its own stream while it lives, else (its stream waited for and \
         gone) on the default stream"
    );
    assert_eq!(
        backend.driver().lock().freed_off_live_stream,
        0,
        "no block freed beside work still queued on its stream"
    );
    backend.release_stream(live).expect("release");
    assert_eq!(tenant.stats().touched_bytes, 0);
}

mod review;
