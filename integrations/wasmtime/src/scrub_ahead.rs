//! Scrubbing ahead: a thread per slot pool that zeroes the slots guests gave back while they are
//! free ([`SlotPool::scrub_ahead`], or a guarded pool's own), so the instantiation that takes
//! one next (or, for a guarded pool, the drop that gives one back) does no scrub of its own
//! ([`CreatorBuilder::scrub_ahead`](crate::CreatorBuilder::scrub_ahead)).
//!
//! The work moves, it does not vanish: the same bytes are zeroed, on a core that has time to
//! spare, and a host with no spare core pays it there instead. The thread keeps looking for a
//! short while after its last scrub (yielding its core to anything runnable), so a steady stream
//! of instantiations never has to wake it; after that it sleeps until a slot comes back dirty.
//! It lets a few slots gather before it scrubs them in a row ([`AheadPool::gathering`]), while
//! acquisitions take slots already scrubbed (`SlotTable::prefer_ready`): the pool's lock and
//! free list then cross between the two cores once per gathering rather than twice per
//! instantiation. A slot it has not reached yet is scrubbed by its acquisition: correctness
//! never waits for the thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tensor_wasm_mem_core::{DeviceId, SlotPool};

use crate::Backend;
use crate::TwmError;
use crate::guarded_region::GuardedPool;

/// How long the thread keeps looking after its last scrub before it sleeps: longer than the
/// gap between two instantiations of a busy host, short enough that an idle one sleeps.
const LINGER: Duration = Duration::from_micros(200);

/// Slots scrubbed between two looks at whether the creator is going.
const BATCH: usize = 16;

/// How long fewer slots than a gathering ([`AheadPool::gathering`]) wait before they are
/// scrubbed all the same.
const GATHER_WAIT: Duration = Duration::from_micros(50);

std::thread_local! {
    /// This thread is a scrub-ahead thread.
    static ON_A_SCRUBBER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A pool's scrub-ahead thread: stopped and joined when dropped (the creator's last handle goes).
pub(crate) struct Scrubber {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// A slot pool a [`Scrubber`] scrubs ahead: a managed one ([`SlotPool`]) or a guarded one.
pub(crate) trait AheadPool: Send + Sync + 'static {
    /// Its device (the thread's name).
    fn device(&self) -> DeviceId;
    /// Slots given back that the thread lets gather before it scrubs them, one after another,
    /// and takes at once (`SlotTable::ahead_at_once`: four, or a quarter of the pool's slots if
    /// fewer): acquisitions meanwhile take slots already scrubbed (`SlotTable::prefer_ready`),
    /// and the table's lock and free list cross between the two cores once per gathering
    /// rather than twice per instantiation; a small pool's acquisitions would run out of
    /// scrubbed slots while the thread waited for more.
    fn gathering(&self) -> usize;
    /// Free slots waiting for a scrub (a count a moment behind).
    fn dirty_free(&self) -> usize;
    /// Scrubs up to `max` of them: how many, or `Err` after a failure (counted in the pool's
    /// figures; the slot waits for its acquisition).
    fn scrub_ahead(&self, max: usize) -> Result<usize, ()>;
    /// The pool's device is fenced (a kernel fault): a held slot may have kept a recovery back.
    fn fenced(&self) -> bool;
    /// Has `signal` called when a slot comes back dirty, and from then on leaves slots'
    /// scrubs to the thread or their acquisitions.
    fn on_dirty_release(&self, signal: Arc<dyn Fn() + Send + Sync>);
    /// The thread ended (stopped, or unwound by a bug): no one scrubs ahead any more.
    fn stopped(&self) {}
}

impl<B: Backend> AheadPool for SlotPool<Arc<B>> {
    fn device(&self) -> DeviceId {
        SlotPool::device(self)
    }
    fn gathering(&self) -> usize {
        SlotPool::ahead_at_once(self)
    }
    fn dirty_free(&self) -> usize {
        SlotPool::dirty_free(self)
    }
    fn scrub_ahead(&self, max: usize) -> Result<usize, ()> {
        SlotPool::scrub_ahead(self, max).map_err(drop)
    }
    fn fenced(&self) -> bool {
        use tensor_wasm_mem_core::ManagedAllocator;
        self.allocator().device_fenced(SlotPool::device(self))
    }
    fn on_dirty_release(&self, signal: Arc<dyn Fn() + Send + Sync>) {
        SlotPool::on_dirty_release(self, signal);
    }
}

impl<B: Backend> AheadPool for GuardedPool<B> {
    fn device(&self) -> DeviceId {
        GuardedPool::device(self)
    }
    fn gathering(&self) -> usize {
        GuardedPool::ahead_at_once(self)
    }
    fn dirty_free(&self) -> usize {
        GuardedPool::dirty_free(self)
    }
    fn scrub_ahead(&self, max: usize) -> Result<usize, ()> {
        GuardedPool::scrub_ahead(self, max).map_err(drop)
    }
    /// Host pages, detached from the device before they came back: a fence holds nothing back.
    fn fenced(&self) -> bool {
        false
    }
    fn on_dirty_release(&self, signal: Arc<dyn Fn() + Send + Sync>) {
        GuardedPool::on_dirty_release(self, signal);
    }
    /// Its slots are scrubbed as they come back again, not left dirty for a thread that is
    /// gone; those already free and dirty are zeroed by their acquisitions (a managed pool's
    /// acquisitions scrub theirs anyway, and its slab is committed whether its slots are dirty
    /// or not).
    fn stopped(&self) {
        self.stop_deferring();
    }
}

impl Scrubber {
    /// Starts the thread for `pool` and has the pool wake it when a slot comes back dirty.
    /// `recover` is called when the thread put a slot back on a fenced device (a kernel fault
    /// came while it scrubbed): the automatic recovery that slot held back.
    /// [`TwmError::Thread`] if the thread cannot be started.
    pub(crate) fn start<P: AheadPool>(
        pool: &Arc<P>,
        recover: impl Fn() + Send + 'static,
    ) -> Result<Self, TwmError> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name(format!("twm-scrub-{}", pool.device().0))
            .spawn({
                let (pool, stop) = (Arc::clone(pool), Arc::clone(&stop));
                move || run(&*pool, &stop, pool.gathering(), recover)
            })
            .map_err(TwmError::Thread)?;
        let waker = thread.thread().clone();
        // A pool gets one signal; a creator starts one thread per pool it made.
        pool.on_dirty_release(Arc::new(move || waker.unpark()));
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

/// Scrubs while there is work, lingers, then sleeps until a dirty release or the stop.
fn run(pool: &impl AheadPool, stop: &AtomicBool, gather: usize, recover: impl Fn()) {
    /// Tells the pool when the thread ends, however it ends.
    struct Ends<'a, P: AheadPool>(&'a P);
    impl<P: AheadPool> Drop for Ends<'_, P> {
        fn drop(&mut self) {
            self.0.stopped();
        }
    }
    let _ends = Ends(pool);
    ON_A_SCRUBBER.set(true);
    let mut last_work = Instant::now();
    while !stop.load(Ordering::Acquire) {
        let waiting = pool.dirty_free();
        let gathered = waiting >= gather || (waiting > 0 && last_work.elapsed() >= GATHER_WAIT);
        let scrubbed = if gathered {
            pool.scrub_ahead(BATCH)
        } else {
            Ok(0)
        };
        // A slot was held here (scrubbed, or its scrub failed): if the device was fenced
        // meanwhile, the pool has let its slab go, and a recovery refused while the slot was
        // held may run now.
        if !matches!(scrubbed, Ok(0)) && pool.fenced() {
            recover();
        }
        match scrubbed {
            // Waiting slots it cannot take (the device fenced, the slab gone): their
            // acquisitions scrub them. Sleep until the next dirty release.
            Ok(0) if gathered && pool.dirty_free() > 0 => {
                std::thread::park();
                last_work = Instant::now();
            }
            // Gathering, or lingering for the next.
            Ok(0) if waiting > 0 || last_work.elapsed() < LINGER => std::thread::yield_now(),
            Ok(0) => {
                std::thread::park();
                last_work = Instant::now();
            }
            Ok(_) => last_work = Instant::now(),
            // Counted in the pool's figures; the slot went back dirty, and its acquisition
            // scrubs it (or fails as it would have). Retrying at once would only count more
            // failures: wait for the next slot to come back.
            Err(()) => std::thread::park(),
        }
    }
}

impl Drop for Scrubber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            if ON_A_SCRUBBER.get() || crate::lifecycle::telling_any_here() {
                // The creator's last handle went on a scrub-ahead thread (an embedder's
                // callback run by a recovery it tried), maybe this one, maybe while holding
                // what a sibling waits for; or in a launcher's callback told of a recovery,
                // whose frame below holds the list of recoveries told that the thread's own
                // recovery waits for: it stops at its next look, detached.
                return;
            }
            // It ends at its next look (a batch of scrubs at most). A panic there (a bug) was
            // reported by the panic hook already; the creator still goes.
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for Scrubber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scrubber")
            .field("running", &self.thread.is_some())
            .finish_non_exhaustive()
    }
}
