//! One linear memory's life after the creator made it: its record (storage and charge under one
//! lock, shared by the registry, host calls and device-access scopes), its growth, and its end,
//! where the storage is released and its charge goes back with it, or both are kept together
//! when the backend refuses ([`KeptMemories`]).
//!
//! ```text
//!  TensorWasmLinearMemory ──owns──▶ Arc<MemoryRecord> ◀── registry (by base), scopes (Weak)
//!        grow_to                        │ held: RwLock<Option<Held { storage, charge }>>
//!          │ redeem the limiter's grant │ books: the Store's (its streams are waited for)
//!          │ charge what it misses      │
//!          ▼ storage.grow_to, pay       ▼ drop: wait for the Store's streams, then
//!                                         Held::release ─ Ok: charge dropped (given back)
//!                                                       └ refused: KeptMemories (retried)
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, Weak};

use tensor_wasm_mem_core::{Advice, BackendError, DeviceId, DeviceSlice, Location, Stream};
use wasmtime::LinearMemory;

use crate::Backend;
use crate::books::{self, MemoryCharge, StoreBooks};
use crate::error::TwmError;
use crate::kernels::KernelRegistry;
use crate::storage::Storage;

std::thread_local! {
    /// The creators (their [`KeptMemories`], by address) whose launchers this thread is telling
    /// of a recovery ([`KeptMemories::settle`]), innermost last.
    static TELLING: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Marks this thread as telling the launchers of one creator of a recovery while it lives (an
/// unwinding launcher included).
struct Telling;

impl Telling {
    fn start(kept: usize) -> Self {
        TELLING.with_borrow_mut(|t| t.push(kept));
        Self
    }
}

/// Kept memories taken off the list to be released again ([`KeptMemories::retry_kept`]): those
/// not tried yet and those the backend still refused go back to the list when it drops, the
/// retry ended with them, even should a backend panic mid-release (the memory being released
/// then is lost with its unwinding; the others keep their storage and charge together, kept).
struct Retry<'a, B: Backend> {
    kept: &'a KeptMemories<B>,
    left: std::collections::VecDeque<Held<B>>,
    still: Vec<Held<B>>,
}

impl<B: Backend> Drop for Retry<'_, B> {
    fn drop(&mut self) {
        let mut kept = self.kept.lock();
        kept.append(&mut self.still);
        // Those not tried yet (only while a release unwinds).
        kept.extend(self.left.drain(..));
        self.kept.count.store(kept.len() as u64, Ordering::Release);
        drop(kept);
        self.kept.retrying.store(false, Ordering::Release);
    }
}

/// This thread is telling some creator's launchers of a recovery (a launcher's callback runs
/// on it, under that creator's list of recoveries told).
pub(crate) fn telling_any_here() -> bool {
    TELLING.with_borrow(|t| !t.is_empty())
}

impl Drop for Telling {
    fn drop(&mut self) {
        TELLING.with_borrow_mut(|t| t.pop());
    }
}

/// A memory's storage and what pays for it, together for their whole life.
pub(crate) struct Held<B: Backend> {
    pub(crate) storage: Storage<B>,
    /// `None` for a memory no tenant pays for (a creator that allows untenanted memories).
    pub(crate) charge: Option<MemoryCharge>,
}

impl<B: Backend> Held<B> {
    /// Gives the storage back; its charge goes back with it (dropped after the release), or,
    /// if the backend refuses, stays with it.
    #[expect(
        clippy::result_large_err,
        reason = "a refused release hands the storage back by value, on a rare path"
    )]
    pub(crate) fn release(self) -> Result<(), Self> {
        let Self { storage, charge } = self;
        match storage.release() {
            Ok(()) => {
                drop(charge);
                Ok(())
            }
            Err(refused) => {
                tracing::warn!(error = %refused.error, "twm: the backend refused to release a memory: kept, with its charge");
                Err(Self {
                    storage: refused.resource,
                    charge,
                })
            }
        }
    }

    /// The tenant paying for it (`None`: no tenant pays) and the bytes it holds visible.
    fn holder(&self) -> (Option<Arc<crate::tenancy::Tenant>>, usize) {
        let tenant = self.charge.as_ref().map(|c| Arc::clone(c.tenant()));
        (tenant, self.len())
    }

    /// Bytes the storage holds visible (what a kept memory still holds for its tenant).
    fn len(&self) -> usize {
        self.storage.len()
    }
}

/// A memory device work may still use: never given back while that work may run.
pub(crate) struct Busy<B: Backend> {
    held: Held<B>,
    device: DeviceId,
    /// Its unfinished work was all in its device's primary context (not a context-isolated
    /// tenant's own): a fence of the device ends it for good.
    primary_only: bool,
}

/// Memories whose storage the backend refused to release, kept with their charges, released
/// again by [`retry`](Self::retry) (on the creator's next memory, or when the embedder asks)
/// and a last time when the creator goes: whatever the backend still refuses then is left to it
/// (a driver backend retries at its own drop) and its charge stays with the tenant for good
/// ([`Reservation::strand`](tensor_wasm_mem_core::Reservation::strand)).
pub(crate) struct KeptMemories<B: Backend> {
    /// The creator's kernels, told of each recovery.
    kernels: Option<Arc<KernelRegistry<B>>>,
    kept: Mutex<Vec<Held<B>>>,
    /// Memories device work may still use (a stream of their Store could not be released):
    /// never given back, nor scrubbed for another tenant, while the creator lives.
    busy: Mutex<Vec<Busy<B>>>,
    /// Busy now (read without the lock on every memory the creator makes).
    busy_count: AtomicU64,
    /// Kept now (read without the lock on every memory the creator makes).
    count: AtomicU64,
    released: AtomicU64,
    /// A retry is under way: another caller does not wait for it.
    retrying: std::sync::atomic::AtomicBool,
    /// Devices recovered after a kernel fault, and how long the last recovery took (ns).
    recoveries: AtomicU64,
    last_recovery_ns: AtomicU64,
    /// A fenced device recovers when its last user goes.
    automatic: bool,
    /// The backend's recoveries (all devices) when this creator last caught up with them, and
    /// each device's: a recovery by anyone (another creator on the backend included) is
    /// caught up with on this creator's next call.
    seen_recoveries: AtomicU64,
    seen_per_device: Mutex<Vec<u64>>,
}

impl<B: Backend> KeptMemories<B> {
    /// None kept; `automatic`: a fenced device recovers when its last user goes (the embedder
    /// asserted [`CreatorBuilder::recover_automatically`](crate::CreatorBuilder::recover_automatically)'s
    /// contract).
    pub(crate) fn new(automatic: bool, kernels: Option<Arc<KernelRegistry<B>>>) -> Self {
        Self {
            automatic,
            kernels,
            kept: Mutex::new(Vec::new()),
            busy: Mutex::new(Vec::new()),
            busy_count: AtomicU64::new(0),
            count: AtomicU64::new(0),
            released: AtomicU64::new(0),
            retrying: std::sync::atomic::AtomicBool::new(false),
            recoveries: AtomicU64::new(0),
            last_recovery_ns: AtomicU64::new(0),
            seen_recoveries: AtomicU64::new(0),
            seen_per_device: Mutex::new(Vec::new()),
        }
    }
}

impl<B: Backend> KeptMemories<B> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Held<B>>> {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn keep(&self, held: Held<B>) {
        let mut kept = self.lock();
        kept.push(held);
        self.count.store(kept.len() as u64, Ordering::Release);
    }

    /// Keeps a memory device work may still use, for good (while the creator lives), or until
    /// its device is fenced where that work was all in the lost primary context.
    fn keep_busy(&self, busy: Busy<B>) {
        let mut all = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        all.push(busy);
        self.busy_count.store(all.len() as u64, Ordering::Release);
    }

    /// Busy memories whose device is fenced and whose unfinished work was all in its lost
    /// primary context (it never runs again): kept, as any memory whose free the fence
    /// refuses, so the recovery is not kept waiting for them.
    fn settle_busy_on_fenced(&self) {
        if self.busy_count.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut busy = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        let (dead, alive): (Vec<_>, Vec<_>) = busy
            .drain(..)
            .partition(|b| b.primary_only && b.held.storage.allocator().device_fenced(b.device));
        *busy = alive;
        self.busy_count.store(busy.len() as u64, Ordering::Release);
        drop(busy);
        for b in dead {
            tracing::warn!("twm: a busy memory's work died with its fenced context: released");
            if let Err(held) = b.held.release() {
                self.keep(held);
            }
        }
    }

    /// The tenants (and bytes) of busy memories on `device`: they keep it from recovering.
    pub(crate) fn busy_on(
        &self,
        device: DeviceId,
    ) -> Vec<(Option<Arc<crate::tenancy::Tenant>>, usize)> {
        self.busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|b| b.device == device)
            .map(|b| b.held.holder())
            .collect()
    }

    /// Releases every kept memory again, without holding the list across the backend's calls
    /// (and not at all while another caller is at it); the ones the backend still refuses
    /// stay, and so do busy ones. Nothing but an atomic load when nothing is kept (what the
    /// creator calls on every memory it makes).
    #[inline]
    pub(crate) fn retry_kept(&self) {
        if self.count.load(Ordering::Acquire) != 0 {
            self.retry_kept_now();
        }
    }

    #[cold]
    #[inline(never)]
    fn retry_kept_now(&self) {
        if self.retrying.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut retry = Retry {
            kept: self,
            left: self.lock().drain(..).collect(),
            still: Vec::new(),
        };
        while let Some(held) = retry.left.pop_front() {
            match held.release() {
                Ok(()) => {
                    self.released.fetch_add(1, Ordering::AcqRel);
                }
                Err(held) => retry.still.push(held),
            }
        }
        // `retry` drops here: what is still kept goes back to the list.
    }

    /// Memories kept now (busy ones included), and the bytes they hold visible.
    pub(crate) fn figures(&self) -> (u64, u64) {
        let kept = self.lock();
        let busy = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        let all = kept.iter().chain(busy.iter().map(|b| &b.held));
        let bytes = all.map(|h| h.len() as u64).sum();
        ((kept.len() + busy.len()) as u64, bytes)
    }

    /// Kept memories a retry has released since the creator was made.
    pub(crate) fn released(&self) -> u64 {
        self.released.load(Ordering::Acquire)
    }

    /// Catches up with the recoveries of the backend's devices since this creator last looked,
    /// whoever made them (this creator, another creator on the same backend, the embedder
    /// through the backend): the launchers are told of each recovered device before any guest
    /// launches there again, and the kept memories are released again (those a reset destroyed
    /// free without the driver, and their charges go back). Then retries the kept memories as
    /// [`retry_kept`](Self::retry_kept) does. One atomic load when nothing was recovered
    /// (what the creator does on every memory it makes and every launch).
    pub(crate) fn settle(&self, backend: &B) {
        self.settle_busy_on_fenced();
        let total = backend.recoveries();
        // A launcher told of a recovery may call back into this creator (an instantiation, a
        // retry of the releases): on this thread, the recoveries are being told already, by
        // the frame below, which holds the list (and keeps other threads' launches waiting
        // until every launcher has heard; a launch on this thread meanwhile is refused,
        // `telling_here`).
        if self.seen_recoveries.load(Ordering::Acquire) != total && !self.telling_here() {
            let mut seen = self
                .seen_per_device
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let devices = backend.device_count() as usize;
            let len = devices.max(seen.len());
            seen.resize(len, 0);
            for (device, seen) in seen.iter_mut().enumerate().take(devices) {
                let device = DeviceId(u32::try_from(device).unwrap_or(u32::MAX));
                let now = backend.device_health(device).recoveries;
                if now > *seen {
                    if let Some(kernels) = &self.kernels {
                        // Before any guest launches there again: the launchers' modules there
                        // are gone.
                        let _telling = Telling::start(self.key());
                        kernels.device_recovered(backend, device);
                    }
                    // Only once every launcher has heard: a launcher that panicked leaves the
                    // recovery to be told again (forgetting is idempotent), not half told.
                    *seen = now;
                }
            }
            self.seen_recoveries.store(total, Ordering::Release);
        }
        self.retry_kept();
    }

    /// This creator's key among those a thread is telling.
    fn key(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    /// This thread is telling this creator's launchers of a recovery (a launcher called back
    /// into the creator): a launch now could reach a launcher not told yet.
    pub(crate) fn telling_here(&self) -> bool {
        TELLING.with_borrow(|t| t.contains(&self.key()))
    }

    /// Recovers a fenced `device` on `backend` (its primary context reset: see
    /// [`TensorWasmMemoryCreator::recover`](crate::TensorWasmMemoryCreator::recover)), then
    /// [`settle`](Self::settle)s: the launchers are told, the kept memories released again.
    /// `Ok(None)` for a device that is not fenced (recovered by another caller already: this
    /// creator catches up with that recovery all the same).
    ///
    /// # Safety
    ///
    /// As for [`TensorWasmMemoryCreator::recover`](crate::TensorWasmMemoryCreator::recover).
    pub(crate) unsafe fn recover(
        &self,
        backend: &B,
        device: DeviceId,
    ) -> Result<Option<tensor_wasm_mem_core::Recovery>, TwmError> {
        if !backend.device_fenced(device) {
            self.settle(backend);
            return Ok(None);
        }
        let started = std::time::Instant::now();
        // Memories refused while another recovery was resetting (not yet given up), and busy
        // ones whose work died with the context, are given up now: the reset need not wait.
        self.settle_busy_on_fenced();
        self.retry_kept();
        // SAFETY: the caller's contract is the recovery's.
        let recovery = unsafe { backend.recover_device(device) }.map_err(TwmError::backend)?;
        let took = || u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if recovery.is_some() {
            // Counted as soon as the reset is done (a launcher that panics as it is told,
            // below, does not undo it); its time then covers the releases after it too.
            self.recoveries.fetch_add(1, Ordering::AcqRel);
            self.last_recovery_ns.store(took(), Ordering::Release);
        }
        self.settle(backend);
        if let Some(r) = &recovery {
            let took = took();
            self.last_recovery_ns.store(took, Ordering::Release);
            tracing::info!(
                device = device.0,
                lost_allocations = r.allocations,
                took_us = took / 1000,
                "twm: device recovered after a kernel fault"
            );
        }
        Ok(recovery)
    }

    /// [`recover`](Self::recover) where a fenced device's last user just went: a recovery that
    /// must still wait (something of it in use) is not an error here; the last one tries again.
    pub(crate) fn recover_when_free(&self, backend: &B, device: DeviceId) {
        if !self.automatic || !backend.device_fenced(device) {
            return;
        }
        // SAFETY: the embedder asserted the recovery's contract when it asked for automatic
        // recovery (`CreatorBuilder::recover_automatically`).
        if let Err(e) = unsafe { self.recover(backend, device) } {
            tracing::debug!(error = %e, device = device.0, "twm: the device is not recovered yet");
        }
    }

    /// Devices recovered, and the last recovery's time in nanoseconds.
    pub(crate) fn recoveries(&self) -> (u64, u64) {
        (
            self.recoveries.load(Ordering::Acquire),
            self.last_recovery_ns.load(Ordering::Acquire),
        )
    }
}

impl<B: Backend> Drop for KeptMemories<B> {
    /// The last try; what the backend still refuses is abandoned to it (no further try) and
    /// its charge stays with its tenant for good.
    fn drop(&mut self) {
        /// Abandons what is left when it drops: after the last try, or while that try unwinds
        /// (a backend panicking mid-release), so that no kept memory, busy or not, is ever
        /// freed by its own drop with its charge given back.
        struct AbandonLeft<'a, B: Backend>(&'a KeptMemories<B>);
        impl<B: Backend> Drop for AbandonLeft<'_, B> {
            fn drop(&mut self) {
                self.0.abandon_left();
            }
        }
        let _left = AbandonLeft(self);
        self.retry_kept();
    }
}

impl<B: Backend> KeptMemories<B> {
    /// Abandons every memory still kept (busy ones included) to the backend, for good: no
    /// further try, and its charge stays with its tenant.
    fn abandon_left(&self) {
        let kept: Vec<Held<B>> = self.lock().drain(..).collect();
        let busy: Vec<Busy<B>> = self
            .busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
            .collect();
        for held in kept.into_iter().chain(busy.into_iter().map(|b| b.held)) {
            tracing::warn!(
                "twm: a memory the backend never released stays with it; its charge stays with its tenant"
            );
            let Held { storage, charge } = held;
            storage.abandon();
            if let Some(charge) = charge {
                charge.strand();
            }
        }
    }
}

/// One live memory as the registry, host calls and scopes see it.
pub(crate) struct MemoryRecord<B: Backend> {
    held: RwLock<Option<Held<B>>>,
    /// The storage's device (it never changes), read without the lock.
    device: DeviceId,
    /// The books of the Store that made it, if a limiter charged it: its growth grants, and
    /// the streams to wait for before the storage goes.
    books: Option<Arc<StoreBooks>>,
    kept: Arc<KeptMemories<B>>,
}

impl<B: Backend> MemoryRecord<B> {
    /// The tenant paying for it (`None`: no tenant pays) and the bytes it holds visible;
    /// `None` once its storage went.
    pub(crate) fn holder(&self) -> Option<(Option<Arc<crate::tenancy::Tenant>>, usize)> {
        self.read().as_ref().map(Held::holder)
    }

    pub(crate) fn new(
        held: Held<B>,
        device: DeviceId,
        books: Option<Arc<StoreBooks>>,
        kept: Arc<KeptMemories<B>>,
    ) -> Self {
        Self {
            held: RwLock::new(Some(held)),
            device,
            books,
            kept,
        }
    }

    pub(crate) fn device(&self) -> DeviceId {
        self.device
    }

    fn read(&self) -> RwLockReadGuard<'_, Option<Held<B>>> {
        self.held.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the storage (`Some` from creation until the record drops).
    pub(crate) fn with_storage<R>(
        &self,
        f: impl FnOnce(&Storage<B>) -> Result<R, TwmError>,
    ) -> Result<R, TwmError> {
        match self.read().as_ref() {
            Some(held) => f(&held.storage),
            None => Err(TwmError::NotOurMemory),
        }
    }
}

/// Tries of a wait for a guest stream's work before its Store's memories go back
/// ([`wait_for_work`]).
const WORK_WAITS: usize = 3;

/// Waits for the work queued on the stream `key` names before memory it may write goes back,
/// trying again after a refusal that may pass (a plain driver error), up to three tries; a lost
/// context (its work abandoned, never run) is answered at once. The last answer.
pub(crate) fn wait_for_work<B: Backend>(
    backend: &B,
    key: tensor_wasm_mem_core::StreamKey,
) -> Result<(), B::Error> {
    use tensor_wasm_mem_core::ErrorKind;
    let mut answer = backend.wait_for(key);
    for _ in 1..WORK_WAITS {
        match &answer {
            Err(e) if e.kind() != ErrorKind::ContextLost => answer = backend.wait_for(key),
            _ => break,
        }
    }
    answer
}

impl<B: Backend> MemoryRecord<B> {
    /// Waits for the Store's live streams (each as [`wait_for_work`] does); `false` if a wait
    /// failed or a stream of the Store could not be released (work queued there may still
    /// run).
    fn streams_quiet(&self, held: &Held<B>) -> bool {
        let Some(books) = &self.books else {
            return true;
        };
        let mut quiet = !books.is_unsettled();
        for id in books.streams() {
            match wait_for_work(&**held.storage.allocator(), id) {
                Ok(()) => {}
                // A context lost to a kernel fault runs nothing again: its work was abandoned.
                Err(e) if e.kind() == tensor_wasm_mem_core::ErrorKind::ContextLost => {}
                Err(e) => {
                    tracing::warn!(error = %e, "twm: waiting for a stream before freeing a memory failed");
                    quiet = false;
                }
            }
        }
        quiet
    }
}

impl<B: Backend> Drop for MemoryRecord<B> {
    /// Before the storage goes: waits for the Store's guest streams still alive (its data
    /// outlived its memories, as with `Store::into_data`), so no work queued on them lands after
    /// the scrub, in the next holder's memory (in Wasmtime's usual order they are already
    /// released and waited for). Then releases the storage, its charge going back with it, or
    /// keeps both when the backend refuses.
    fn drop(&mut self) {
        let Some(held) = self
            .held
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return;
        };
        // A fenced device runs none of the work of its lost primary context, and its free is
        // refused (the memory stays, given up to the recovery): a memory whose unfinished work
        // was all there is never kept busy. A context-isolated tenant's own context is not lost
        // with the device's: its work may still run.
        let primary_only = self.books.as_ref().is_none_or(|b| {
            b.tenant().ledger().isolation() != tensor_wasm_mem_core::IsolationLevel::ContextIsolated
        });
        let work_died = primary_only && held.storage.allocator().device_fenced(self.device);
        if !work_died && !self.streams_quiet(&held) {
            tracing::warn!("twm: work may still use a memory: kept, not given back");
            return self.kept.keep_busy(Busy {
                held,
                device: self.device,
                primary_only,
            });
        }
        let backend = self
            .kept
            .automatic
            .then(|| Arc::clone(held.storage.allocator()));
        if let Err(held) = held.release() {
            self.kept.keep(held);
        }
        // Its device fenced after a kernel fault: the last memory there to go recovers it
        // (a kept one, whose free the fence refused, or a pool slot, which went back).
        if let Some(backend) = backend {
            self.kept.recover_when_free(&backend, self.device);
        }
    }
}

/// One memory held by a device-access scope (see [`crate::DeviceAccess`]). Weak: a scope that
/// is forgotten (`mem::forget`) keeps no memory, slot or charge alive.
pub(crate) struct ScopedMemory<B: Backend>(Weak<MemoryRecord<B>>, DeviceId);

impl<B: Backend> ScopedMemory<B> {
    pub(crate) fn of(record: &Arc<MemoryRecord<B>>) -> Self {
        Self(Arc::downgrade(record), record.device)
    }

    fn with<R>(&self, f: impl FnOnce(&Storage<B>) -> Result<R, TwmError>) -> Result<R, TwmError> {
        // Alive while the scope holds the Store (the memory cannot go before).
        let record = self.0.upgrade().ok_or(TwmError::NotOurMemory)?;
        record.with_storage(f)
    }

    /// The books of the Store that made it (`None`: a creator bound to a tenant, no limiter).
    pub(crate) fn books(&self) -> Option<Arc<StoreBooks>> {
        self.0.upgrade().and_then(|r| r.books.clone())
    }

    /// A device slice of a range already checked against the visible size.
    pub(crate) fn slice(&self, range: &std::ops::Range<usize>) -> Result<DeviceSlice, TwmError> {
        self.with(|s| s.device_slice(range.start, range.len()))
    }

    pub(crate) fn prefetch(
        &self,
        range: &std::ops::Range<usize>,
        to: Location,
        stream: &Stream,
    ) -> Result<(), TwmError> {
        self.with(|s| s.prefetch(range.start, range.len(), to, stream))
    }

    pub(crate) fn advise(
        &self,
        range: &std::ops::Range<usize>,
        advice: Advice,
    ) -> Result<(), TwmError> {
        self.with(|s| s.advise(range.start, range.len(), advice))
    }

    /// The host address of visible byte `offset`, where the storage is host-accessible.
    pub(crate) fn host_ptr(&self, offset: usize) -> Option<*mut u8> {
        self.with(|s| {
            Ok(s.capabilities()
                .host_accessible
                .then(|| s.as_ptr().wrapping_add(offset)))
        })
        .ok()
        .flatten()
    }

    pub(crate) fn backend(&self) -> Result<Arc<B>, TwmError> {
        self.with(|s| Ok(Arc::clone(s.allocator())))
    }

    /// The device the memory is on.
    pub(crate) fn device(&self) -> DeviceId {
        self.1
    }
}

/// Unregisters a memory from its creator when it goes.
pub(crate) trait Registry<B: Backend>: Send + Sync {
    fn unregister(&self, base: usize);
}

/// One Wasm linear memory made by a
/// [`TensorWasmMemoryCreator`](crate::TensorWasmMemoryCreator): a fixed capacity, a growing
/// visible size, a base that never moves. Growth is decided here, once, over any storage:
/// within the capacity, paid (the Store's limiter's grant, or a charge of its own) before the
/// storage grows, given back if the storage cannot. Unregisters itself on drop; its storage and
/// charge go when the last user of its record is done.
pub struct TensorWasmLinearMemory<B: Backend> {
    registry: Arc<dyn Registry<B>>,
    record: Arc<MemoryRecord<B>>,
    base: usize,
    len: usize,
    capacity: usize,
}

impl<B: Backend> fmt::Debug for TensorWasmLinearMemory<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorWasmLinearMemory")
            .field("base", &(self.base as *const u8))
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> TensorWasmLinearMemory<B> {
    pub(crate) fn new(
        registry: Arc<dyn Registry<B>>,
        record: Arc<MemoryRecord<B>>,
        (base, len, capacity): (usize, usize, usize),
    ) -> Self {
        Self {
            registry,
            record,
            base,
            len,
            capacity,
        }
    }

    /// Visible bytes now.
    #[must_use]
    pub fn current_size(&self) -> usize {
        self.len
    }

    /// The fixed capacity.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// `true` when the memory is unified memory a device can use with no copy (managed memory,
    /// or guarded host memory with pageable memory access).
    #[must_use]
    pub fn is_uvm_backed(&self) -> bool {
        self.record
            .with_storage(|s| Ok(s.capabilities().is_uvm()))
            .unwrap_or(false)
    }

    /// Grows to `new_size`; a refusal is counted for the memory's tenant (the guest sees -1;
    /// a limiter's hook hears of it from Wasmtime's failure report).
    fn grow(&mut self, new_size: usize) -> Result<(), TwmError> {
        let grown = self.try_grow(new_size);
        if grown.is_err() {
            let held = self.record.read();
            if let Some(charge) = held.as_ref().and_then(|h| h.charge.as_ref()) {
                charge.tenant().count_refused_growth();
            }
        }
        grown
    }

    fn try_grow(&mut self, new_size: usize) -> Result<(), TwmError> {
        // The Store's limiter granted this growth just before, on this thread: redeemed first,
        // so a growth refused here gives its grant back (the bytes never became reachable)
        // instead of leaving it charged to the Store.
        let grant = self.record.books.as_ref().and_then(books::redeem_growth);
        if new_size > self.capacity {
            return Err(TwmError::CapacityExceeded {
                requested: new_size,
                capacity: self.capacity,
            });
        }
        let extra = new_size.saturating_sub(self.len) as u64;
        let mut guard = self
            .record
            .held
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let held = guard.as_mut().ok_or(TwmError::NotOurMemory)?;
        let growth = match &held.charge {
            Some(charge) => charge.growth(extra, grant)?,
            None => None,
        };
        // On failure `growth` drops here: nothing stays charged for bytes never reachable.
        held.storage.grow_to(new_size)?;
        if let Some(charge) = &mut held.charge {
            charge.pay_growth(growth);
        }
        self.len = self.len.max(new_size);
        Ok(())
    }
}

// SAFETY: `as_ptr` is the base of a live allocation (or pool slot, or guarded region) of at
// least `capacity` bytes, owned by this memory's record until it drops, and it never changes:
// growth only makes more of the storage reachable, up to `capacity`, zeroing newly visible bytes
// where the backend does not hand out zeroed memory. `byte_size` bytes from the base are always
// readable and writable from the host.
unsafe impl<B: Backend> LinearMemory for TensorWasmLinearMemory<B> {
    fn byte_size(&self) -> usize {
        self.len
    }

    fn byte_capacity(&self) -> usize {
        self.capacity
    }

    fn grow_to(&mut self, new_size: usize) -> wasmtime::Result<()> {
        self.grow(new_size).map_err(wasmtime::Error::new)
    }

    fn as_ptr(&self) -> *mut u8 {
        self.base as *mut u8
    }
}

impl<B: Backend> Drop for TensorWasmLinearMemory<B> {
    fn drop(&mut self) {
        self.registry.unregister(self.base);
        // The storage is released when the last `Arc` to the record drops: here, or at the end
        // of a host call that is using it right now; its charge goes back with it.
    }
}
