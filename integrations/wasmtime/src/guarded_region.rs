//! The device-visible guarded backing's storage: a [`GuardedRegion`] (host virtual memory with
//! `PROT_NONE` guard pages, its reachable pages attached to the backend for the device) and the
//! [`GuardedPool`] its slots come from.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tensor_wasm_mem_core::{
    Advice, Ahead, Allocation, DeviceId, DeviceSlice, Error as CoreError, HostAccess, HostMemory,
    Location, Operation, PoolConfig, PoolStats, RangeError, Refused, Returned, SlotId, SlotTable,
    Stream, check_range,
};

use crate::Backend;
use crate::config::{GUARDED_GUARD, GUARDED_RESERVATION};
use crate::error::TwmError;
use crate::host_mapping::{HostMapping, page_size};

/// Where a guarded region's address space comes from.
enum Home<B: Backend> {
    /// A reservation of its own, unmapped with it.
    Own(HostMapping),
    /// A slot of a guarded pool, given back (scrubbed) with it.
    Slot {
        pool: Arc<GuardedPool<B>>,
        slot: SlotId,
    },
}

/// One guarded memory: `PROT_NONE` host address space whose first `accessible` bytes (whole
/// pages, at least the visible size) are readable, writable and attached to the backend for
/// `device`, one attached range per growth.
pub(crate) struct GuardedRegion<B: Backend> {
    backend: Arc<B>,
    device: DeviceId,
    access: HostAccess,
    home: Home<B>,
    base: usize,
    page: usize,
    len: usize,
    /// Bytes from the base that are attached (and readable and writable): whole pages, at least
    /// `len`; everything past them is `PROT_NONE` up to the end of the reservation and guard.
    accessible: usize,
    /// Bytes from the base that are readable and writable: `accessible`, except while a pool
    /// slot is being handed out with the pages its last holder left open (see `open_in`).
    opened: usize,
    capacity: usize,
    /// The attached ranges, in address order, covering `base..base + accessible`.
    chunks: Vec<Allocation>,
    /// Advice or a prefetch reached the backend: hints are reset before the pages go.
    hinted: AtomicBool,
    /// A failure left the attachment or the page protection unknown (a refused detach, a
    /// failed `mprotect` close): no growth, no device calls, and a pool slot is withdrawn (never
    /// reused) when the region goes.
    broken: bool,
    /// Its visible pages are attached no more: a growth on a fenced device detached them to
    /// attach a larger range, and both that and attaching them again were refused. Advice and
    /// prefetch are refused as on a lost device; the next growth attaches them again; any hints
    /// they had stay pending for the slot's next holder.
    detached: bool,
    /// A hint reset failed at release (a refused call: a fenced device, say): a pool slot goes
    /// back with its hints pending, reset by its next acquisition before it is handed on; an own
    /// reservation's pages go with their mapping.
    hints_pending: bool,
    /// Released: every chunk detached and the home finished (mapping dropped, slot returned).
    released: bool,
    /// Given up with chunks the backend keeps: no more tries, the pages stay mapped.
    abandoned: bool,
    /// The bytes it holds: its pool slot's size, or its own reservation's.
    held: usize,
    /// Where its creator counts regions kept mapped for the backend.
    kept_mappings: KeptMappings,
}

impl<B: Backend> fmt::Debug for GuardedRegion<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardedRegion")
            .field("device", &self.device)
            .field("access", &self.access)
            .field("len", &self.len)
            .field("accessible", &self.accessible)
            .field("capacity", &self.capacity)
            .field("chunks", &self.chunks.len())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> GuardedRegion<B> {
    /// A region in a reservation of its own: `max(reserved, capacity) + guard` bytes of address
    /// space (what Wasmtime elides checks against), nothing open yet ([`open`](Self::open)).
    pub(crate) fn new(
        backend: Arc<B>,
        (device, access): (DeviceId, HostAccess),
        capacity: usize,
        reserved: usize,
        guard: usize,
        kept_mappings: KeptMappings,
    ) -> Result<Self, TwmError> {
        let span = reserved
            .max(capacity)
            .checked_add(guard)
            .ok_or(TwmError::Plan(
                tensor_wasm_mem_core::PlanError::TooLargeForHost { bytes: u64::MAX },
            ))?;
        let mapping = HostMapping::reserve(span)?;
        let base = mapping.base();
        // What the guest can ever touch; the rest of the reservation is address space only.
        let held = capacity.max(1).next_multiple_of(page_size());
        Ok(Self::at(
            backend,
            (device, access),
            (Home::Own(mapping), base),
            (capacity, held),
            0,
            kept_mappings,
        ))
    }

    /// A region at `base` of `home` holding `held` bytes, whose first `opened` bytes are already
    /// readable and writable (a pool slot keeps the pages its last holder opened, scrubbed, so
    /// that a memory of the same size costs no `mprotect`); nothing is attached until
    /// [`open`](Self::open).
    fn at(
        backend: Arc<B>,
        (device, access): (DeviceId, HostAccess),
        (home, base): (Home<B>, usize),
        (capacity, held): (usize, usize),
        opened: usize,
        kept_mappings: KeptMappings,
    ) -> Self {
        Self {
            backend,
            device,
            access,
            home,
            base,
            page: page_size(),
            len: 0,
            accessible: 0,
            opened,
            capacity,
            chunks: Vec::new(),
            hinted: AtomicBool::new(false),
            broken: false,
            detached: false,
            hints_pending: false,
            released: false,
            abandoned: false,
            held,
            kept_mappings,
        }
    }

    /// Makes the first `initial` bytes accessible and attached, and closes again whatever else
    /// the slot's last holder left open, before the memory is handed out. On failure the region
    /// stays its owner's to release (what was attached is detached then).
    pub(crate) fn open(&mut self, initial: usize) -> Result<(), TwmError> {
        self.grow_to(initial)?;
        self.close_past_accessible()
    }

    /// The bytes the region holds: its pool slot, or its own reservation.
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// How the device reaches the pages.
    pub(crate) fn access(&self) -> HostAccess {
        self.access
    }

    /// The backend the pages are attached to.
    pub(crate) fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The first byte.
    pub(crate) fn base(&self) -> usize {
        self.base
    }

    /// Visible bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A checked device slice of the visible bytes (the host address is the device address).
    pub(crate) fn device_slice(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<DeviceSlice, RangeError> {
        check_range(offset, len, self.len).map(|range| DeviceSlice {
            device_ptr: (self.base + range.start) as u64,
            len,
        })
    }

    pub(crate) fn advise(&self, offset: usize, len: usize, advice: Advice) -> Result<(), TwmError> {
        self.each_span(offset, len, Operation::Advise, |a, o, l| {
            self.backend.advise(a, o, l, advice)
        })
    }

    pub(crate) fn prefetch(
        &self,
        offset: usize,
        len: usize,
        to: Location,
        stream: &Stream,
    ) -> Result<(), TwmError> {
        self.each_span(offset, len, Operation::Prefetch, |a, o, l| {
            self.backend.prefetch(a, o, l, to, stream)
        })
    }

    /// Makes every open page past the accessible ones a guard again.
    fn close_past_accessible(&mut self) -> Result<(), TwmError> {
        if self.opened > self.accessible {
            let (mapping, at) = self.mapping();
            mapping.close(at + self.accessible, self.opened - self.accessible)?;
            self.opened = self.accessible;
        }
        Ok(())
    }

    /// The mapping the region lies in, and the region's offset in it.
    fn mapping(&self) -> (&HostMapping, usize) {
        match &self.home {
            Home::Own(m) => (m, 0),
            Home::Slot { pool, .. } => (&pool.mapping, self.base - pool.mapping.base()),
        }
    }

    pub(crate) fn grow_to(&mut self, new_len: usize) -> Result<(), TwmError> {
        if self.broken {
            return Err(TwmError::GuardedMemoryBroken);
        }
        if new_len > self.capacity {
            return Err(TwmError::CapacityExceeded {
                requested: new_len,
                capacity: self.capacity,
            });
        }
        let want = new_len.next_multiple_of(self.page);
        if want > self.accessible {
            if want > self.opened {
                let (mapping, at) = self.mapping();
                let opened = mapping.open(at + self.opened, want - self.opened);
                // A failed `mprotect` may have opened part of the range: count all of it as
                // open, so it is closed below and scrubbed when the slot goes back.
                self.opened = want;
                if let Err(e) = opened {
                    self.close_or_warn();
                    return Err(e);
                }
            }
            if let Err(e) = self.attach(want) {
                // The pages past the visible size are guards again (or the region is refused
                // and dropped).
                self.close_or_warn();
                return Err(TwmError::from_core(CoreError::backend(
                    Operation::AttachHost,
                    e,
                )));
            }
            self.accessible = want;
        }
        self.len = self.len.max(new_len);
        Ok(())
    }

    /// Closes what is open past the accessible pages after a failed growth; a failure to close
    /// is logged (the pages stay counted as open, and are scrubbed with the slot).
    fn close_or_warn(&mut self) {
        if let Err(e) = self.close_past_accessible() {
            tracing::warn!(error = %e, "twm: closing pages past a guarded memory's end failed");
            self.broken = true;
        }
    }

    /// Attaches the pages up to `want` (readable and writable now) to the backend. With
    /// registration, the new pages are a registration of their own (registered pages are
    /// pinned one range at a time); with pageable access the region keeps one chunk for all its
    /// pages, replaced by a larger one (the driver is asked nothing either way), so a guest's
    /// advice or prefetch is one driver call however the memory grew.
    fn attach(&mut self, want: usize) -> Result<(), B::Error> {
        let start = match self.access {
            HostAccess::Registered => self.accessible,
            HostAccess::Pageable => 0,
        };
        let attach = |from: usize, to: usize| {
            let ptr = std::ptr::NonNull::new((self.base + from) as *mut u8)
                .expect("a mapping's base is never null");
            // SAFETY: `ptr..ptr + (to - from)` lies inside our mapping, page-aligned, readable
            // and writable (opened by `grow_to`, or left open by the slot's last holder and
            // scrubbed), owned by this region, and stays mapped until the chunk is detached
            // (`release` detaches every chunk before the pages are dropped or unmapped, and a
            // region dropped with chunks the backend kept keeps its mapping).
            unsafe {
                self.backend
                    .attach_host(self.device, self.access, ptr, to - from)
            }
        };
        if self.access == HostAccess::Pageable
            && let Some(old) = self.chunks.pop()
        {
            // SAFETY: a chunk of ours with pageable access: the backend asks the driver
            // nothing, so device work on the range is unaffected (`HostMemory::attach_host`).
            if let Err(refused) = unsafe { self.backend.detach_host(old) } {
                // The range stays attached: this region cannot attach at its base again. The
                // chunk stays ours, detached again when the region is released.
                self.chunks.push(refused.resource);
                self.broken = true;
                return Err(refused.error);
            }
        }
        match attach(start, want) {
            Ok(chunk) => {
                self.chunks.push(chunk);
                self.detached = false;
                Ok(())
            }
            Err(e) => {
                if self.access == HostAccess::Pageable && self.accessible > 0 {
                    match attach(0, self.accessible) {
                        Ok(old) => self.chunks.push(old),
                        // The visible pages are attached no more (a fenced device refuses both):
                        // a known state, not a broken one. Advice and prefetch are refused
                        // until a growth attaches them again, and the hints they had cannot be
                        // reset through them: they go with a pool slot, pending.
                        Err(_) => {
                            self.detached = true;
                            if self.hinted.load(Ordering::Acquire) {
                                self.hints_pending = true;
                            }
                        }
                    }
                }
                Err(e)
            }
        }
    }

    /// Runs `f` on each attached chunk's part of visible `offset..offset + len` (checked), as
    /// `(chunk, offset in it, length)`.
    fn each_span(
        &self,
        offset: usize,
        len: usize,
        op: Operation,
        f: impl Fn(&Allocation, usize, usize) -> Result<(), B::Error>,
    ) -> Result<(), TwmError> {
        let range = check_range(offset, len, self.len).map_err(TwmError::GuestRange)?;
        if self.broken {
            return Err(TwmError::GuardedMemoryBroken);
        }
        if self.detached {
            return Err(TwmError::DeviceLost { op: op.name() });
        }
        self.hinted.store(true, Ordering::Release);
        let (start, end) = (self.base + range.start, self.base + range.end);
        for chunk in &self.chunks {
            let (c_start, c_end) = (
                chunk.as_ptr() as usize,
                chunk.as_ptr() as usize + chunk.len(),
            );
            let (s, e) = (start.max(c_start), end.min(c_end));
            if s < e {
                f(chunk, s - c_start, e - s)
                    .map_err(|e| TwmError::from_core(CoreError::backend(op, e)))?;
            }
        }
        Ok(())
    }

    /// Gives the pages back: hints reset (once, if any were given), every chunk detached, then
    /// the home finished (an own reservation unmapped when the region drops, a slot returned to
    /// its pool, scrubbed). A detach the backend refuses hands the region back with the chunks
    /// it still holds ([`Refused`]): release it again later. Device work on the pages must be
    /// over (the memory's record waits for its Store's streams first).
    #[expect(
        clippy::result_large_err,
        reason = "a refused release hands the storage back by value, on a rare path"
    )]
    pub(crate) fn release(mut self) -> Result<(), Refused<Self, TwmError>> {
        match self.let_go() {
            Ok(()) => Ok(()),
            Err(error) => Err(Refused {
                resource: self,
                error,
            }),
        }
    }

    /// The steps of [`release`](Self::release), each done once, however often it is retried.
    fn let_go(&mut self) -> Result<(), TwmError> {
        if self.released {
            return Ok(());
        }
        self.reset_hints();
        // Every chunk is offered, whatever the others answer: a refusal of one (a fenced
        // device's) must not keep the rest attached, where a recovery would wait for them for
        // ever. The refused ones stay, for the next try.
        let mut failed = None;
        for chunk in std::mem::take(&mut self.chunks) {
            // SAFETY: a chunk this region attached; no device work uses it (the caller's
            // guarantee, kept by the memory's record).
            if let Err(refused) = unsafe { self.backend.detach_host(chunk) } {
                self.chunks.push(refused.resource);
                failed.get_or_insert(refused.error);
            }
        }
        if let Some(error) = failed {
            return Err(TwmError::from_core(CoreError::backend(
                Operation::DetachHost,
                error,
            )));
        }
        self.released = true;
        if let Home::Slot { pool, slot } = &self.home {
            let hinted = self.hinted.load(Ordering::Acquire);
            let released = Released {
                reusable: !self.broken,
                hinted,
                // Every chunk the hints could have reached.
                hints_pending: if self.hints_pending {
                    self.accessible
                } else {
                    0
                },
            };
            pool.release(*slot, self.opened, released);
        }
        Ok(())
    }

    /// Resets the hints of every chunk once, if advice or a prefetch reached them; after a
    /// failure the hints stay pending, and a pool slot's next acquisition resets them.
    fn reset_hints(&mut self) {
        // Registered (pinned) pages take no advice and never migrate: nothing to reset, and a
        // refused call (a fenced device) must not leave the slot waiting for a reset that
        // would pin it again for nothing.
        if !self.hinted.load(Ordering::Acquire)
            || self.hints_pending
            || self.access == HostAccess::Registered
        {
            return;
        }
        for chunk in &self.chunks {
            if let Err(e) = self.backend.reset_hints(chunk, 0, chunk.len()) {
                tracing::warn!(error = %e, "twm: resetting a guarded region's hints failed: reset before its slot is reused");
                self.hints_pending = true;
            }
        }
    }
}

/// How a guarded region's pages came back to their pool (every chunk detached).
#[derive(Clone, Copy, Debug)]
struct Released {
    /// Their protection is known: the slot may go to the next tenant. If not, it is withdrawn.
    reusable: bool,
    /// Advice or a prefetch reached them.
    hinted: bool,
    /// Bytes from the slot's start whose hints a failed reset left (0: none): reset by the
    /// slot's next acquisition before it is handed on.
    hints_pending: usize,
}

impl<B: Backend> GuardedRegion<B> {
    /// Gives the region up without another try, after the backend refused to release it for
    /// good: its chunks stay with the backend, and so its pages stay mapped, never reused.
    pub(crate) fn abandon(mut self) {
        self.abandoned = true;
    }

    /// Keeps the pages the backend still holds mapped, never reused under a device mapping:
    /// an own reservation stays mapped, a slot is withdrawn with its pool's address space kept.
    fn keep_for_the_backend(&mut self) {
        self.kept_mappings.add();
        // No detach will come: the backend is told, so no record of them waits past a
        // recovery for a release that never comes.
        for chunk in self.chunks.drain(..) {
            self.backend.forget(chunk);
        }
        match &mut self.home {
            Home::Own(mapping) => mapping.keep_mapped(),
            Home::Slot { pool, slot } => pool.withdraw_held(*slot),
        }
    }
}

impl<B: Backend> Drop for GuardedRegion<B> {
    /// A region not released (a failed open): releases what it can; an abandoned one only
    /// keeps its pages for the backend.
    fn drop(&mut self) {
        if self.released {
            return;
        }
        if self.abandoned {
            return self.keep_for_the_backend();
        }
        if let Err(e) = self.let_go() {
            tracing::warn!(error = %e, "twm: a guarded region's pages stay mapped: the backend keeps them");
            self.keep_for_the_backend();
        }
    }
}

/// Guarded regions of one creator whose pages stayed mapped (or whose pool slot was withdrawn
/// with its pool's address space kept) because the backend still held them when they went for
/// good: non-zero is a driver fault to look at. A refused detach first keeps the memory, and its
/// charge, in its creator ([`CreatorStats::kept_memories`](crate::CreatorStats::kept_memories))
/// and is tried again; only what is still refused when the creator goes is counted here. (Slots
/// withdrawn for a failed scrub or a lost page protection are counted in
/// `PoolStats::scrub_failures`; a refused hint reset withdraws nothing: the slot's next
/// acquisition makes it.) Take it with
/// [`TensorWasmMemoryCreator::kept_mappings`](crate::TensorWasmMemoryCreator::kept_mappings):
/// it reads the same count after the creator has gone. Clones read the same count.
#[derive(Clone, Debug, Default)]
pub struct KeptMappings(Arc<AtomicU64>);

impl KeptMappings {
    /// Regions kept mapped so far.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    fn add(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

/// Bytes at the start of a guarded pool slot that are zeroed by writing rather than dropped when
/// the slot is given back (as Wasmtime's `linear_memory_keep_resident`): a small memory's pages
/// stay resident across tenants and cost neither a system call nor a page fault per reuse.
const KEEP_RESIDENT_BYTES: usize = 64 << 10;

/// Guarded slots in one reservation, each `reservation + guard` of address space (so Wasmtime's
/// guard-page Config holds in every slot), with guard space between them. A slot is scrubbed
/// when it is given back by dropping the pages its holder could touch (`MADV_DONTNEED` up to
/// its high-water mark, as Wasmtime's pooling allocator does): they read as zeros and hold no
/// memory until touched again. Its hints are reset and its chunks detached first (registered
/// pages unregistered: a pinned page would survive the drop for the device, keeping the old
/// tenant's bytes where the device reads). The dropped pages stay readable and writable while
/// the slot is free, and the next holder closes what its memory does not reach before the
/// memory is handed out.
pub(crate) struct GuardedPool<B: Backend> {
    backend: Arc<B>,
    device: DeviceId,
    access: HostAccess,
    mapping: HostMapping,
    /// Per slot: what its last holder left (see [`Left`]).
    slots: SlotTable<Left>,
    /// Called when a slot comes back dirty, once something scrubs ahead
    /// ([`on_dirty_release`](Self::on_dirty_release)): a slot's scrub then waits for a scrub
    /// ahead or its next acquisition, instead of running as it comes back.
    signal: std::sync::OnceLock<Arc<dyn Fn() + Send + Sync>>,
    /// Slots go back dirty, for the thread that scrubs ahead: set with the signal, cleared
    /// when that thread ends ([`stop_deferring`](Self::stop_deferring)).
    deferring: AtomicBool,
    /// A slot was withdrawn with chunks the backend would not detach: the pool's address space
    /// stays mapped when the pool goes.
    driver_held: AtomicBool,
    /// Where its creator counts regions kept mapped for the backend.
    kept_mappings: KeptMappings,
}

impl<B: Backend> fmt::Debug for GuardedPool<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardedPool")
            .field("device", &self.device)
            .field("access", &self.access)
            .field("classes", &self.slots.layout())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> GuardedPool<B> {
    /// Reserves the pool's address space: per class, `slots` slots of `max(slot_bytes,
    /// GUARDED_RESERVATION) + GUARDED_GUARD` bytes.
    pub(crate) fn new(
        backend: Arc<B>,
        device: DeviceId,
        access: HostAccess,
        config: &PoolConfig,
        kept_mappings: KeptMappings,
    ) -> Result<Self, TwmError> {
        let page = page_size();
        // Each slot spans its reservation (at least Wasmtime's) and its guard.
        let (classes, total) = config.layout(|slot_bytes| {
            usize::try_from(GUARDED_RESERVATION)
                .ok()?
                .max(slot_bytes)
                .checked_add(usize::try_from(GUARDED_GUARD).ok()?)?
                .checked_next_multiple_of(page)
        })?;
        let mapping = HostMapping::reserve(total)?;
        Ok(Self {
            backend,
            device,
            access,
            mapping,
            slots: SlotTable::new(classes, |_| Left::default()).waiting_when(|left| left.dirty > 0),
            signal: std::sync::OnceLock::new(),
            deferring: AtomicBool::new(false),
            driver_held: AtomicBool::new(false),
            kept_mappings,
        })
    }

    /// The slot size a memory of `capacity` bytes would hold (the smallest class that fits).
    pub(crate) fn slot_size_for(&self, capacity: usize) -> Option<usize> {
        self.slots.slot_size_for(capacity)
    }

    /// A region in a free slot of the smallest class that holds `capacity` and whose address
    /// space covers Wasmtime's `reserved + guard`.
    pub(crate) fn acquire(
        self: &Arc<Self>,
        capacity: usize,
        reserved: usize,
        guard: usize,
    ) -> Result<GuardedRegion<B>, TwmError> {
        let needed = reserved.max(capacity).saturating_add(guard);
        // The largest class that holds the memory must span what Wasmtime reserves and guards.
        let largest = self
            .slots
            .layout()
            .iter()
            .rfind(|c| c.slot_bytes >= capacity);
        if largest.is_some_and(|c| needed > c.stride) {
            return Err(TwmError::ReservationNotHonoured { reserved: needed });
        }
        let taken = self.slots.take(capacity, |c| c.stride >= needed)?;
        if taken.meta.dirty > 0 {
            // Given back while something scrubs ahead, and not reached yet: scrubbed here.
            // SAFETY: the slot was just taken: no one uses its pages, no device holds them
            // (its chunks were detached before it came back), and its first `opened` bytes
            // are readable and writable.
            if let Err(e) = unsafe { self.scrub(taken.offset(), taken.meta.dirty) } {
                // Its pages are in no known state: never handed to another tenant.
                self.slots.withdraw_taken(taken.slot);
                return Err(e);
            }
        }
        let scrubbed = taken.meta.dirty as u64;
        if taken.meta.hinted > 0 {
            // Its last holder's hint reset was refused: reset here, before anyone holds it.
            // SAFETY: as above; `hinted <= opened`.
            match unsafe { self.reset_left_hints(taken.offset(), taken.meta.hinted) } {
                Ok(()) => {}
                Err(HintsLeft::Pending(e)) => {
                    // Back with its hints still pending (scrubbed, if it was dirty): the next
                    // acquisition tries again.
                    let left = Left {
                        dirty: 0,
                        ..taken.meta
                    };
                    self.slots.refuse(taken.slot, left, scrubbed);
                    return Err(e);
                }
                Err(HintsLeft::Attached(e)) => {
                    // The range the reset was made through stays attached: never reused.
                    self.slots.scrubbed(Returned {
                        scrubbed,
                        hints_reset: false,
                    });
                    self.slots.withdraw_taken(taken.slot);
                    self.driver_held.store(true, Ordering::Release);
                    return Err(e);
                }
            }
        }
        if scrubbed > 0 || taken.meta.hinted > 0 {
            self.slots.scrubbed(Returned {
                scrubbed,
                hints_reset: taken.meta.hinted > 0,
            });
        }
        let base = self.mapping.base() + taken.offset();
        let home = Home::Slot {
            pool: Arc::clone(self),
            slot: taken.slot,
        };
        Ok(GuardedRegion::at(
            Arc::clone(&self.backend),
            (self.device, self.access),
            (home, base),
            (capacity, taken.layout.slot_bytes),
            taken.meta.opened,
            self.kept_mappings.clone(),
        ))
    }

    /// A slot comes back, every chunk detached, with its first `opened` bytes readable and
    /// writable (the high-water mark of what its holder could touch): their pages are dropped
    /// (they read as zeros and hold no memory), and left open for the next holder, whose
    /// `open_in` closes what it does not use (a memory of the same size then costs no
    /// `mprotect`, as in Wasmtime's pooling allocator). A free slot is reachable by no one. A
    /// slot that is not reusable (hints kept, protection unknown), or whose scrub failed, is
    /// withdrawn for good rather than handed to another tenant. While something scrubs ahead
    /// ([`on_dirty_release`](Self::on_dirty_release)), the slot goes back dirty instead, and is
    /// scrubbed by it or by its next acquisition, whichever comes first.
    fn release(&self, slot: SlotId, opened: usize, released: Released) {
        // While a thread scrubs ahead, the slot goes back dirty and the thread is told.
        let signal = self
            .signal
            .get()
            .filter(|_| self.deferring.load(Ordering::Acquire));
        let scrubbed = if !released.reusable {
            None
        } else if signal.is_some() {
            Some(0)
        } else {
            // SAFETY: the slot's holder is gone and its chunks detached: no one uses its
            // pages, no device holds them pinned, and its first `opened` bytes are readable
            // and writable (a failed `mprotect` would have made it not reusable).
            unsafe { self.scrub(self.offset_of(slot), opened) }
                .ok()
                .map(|()| opened)
        };
        let Some(scrubbed) = scrubbed else {
            // Withdrawn for good: never handed to another tenant.
            self.slots.withdraw(slot);
            return;
        };
        let left = Left {
            opened,
            dirty: opened - scrubbed,
            hinted: released.hints_pending,
        };
        let returned = Returned {
            scrubbed: scrubbed as u64,
            hints_reset: released.hinted && released.hints_pending == 0,
        };
        self.slots.give_back(slot, left, returned);
        if let Some(signal) = signal
            && opened > 0
        {
            signal();
        }
    }

    /// Has `signal` called each time a slot comes back dirty (on the releasing thread, right
    /// after the slot is free: it must be quick, and must not use the pool), and from then on
    /// leaves a slot's scrub to [`scrub_ahead`](Self::scrub_ahead) or its next acquisition.
    /// One signal per pool: `false` (and `signal` dropped) if the pool has one.
    pub(crate) fn on_dirty_release(&self, signal: Arc<dyn Fn() + Send + Sync>) -> bool {
        let set = self.signal.set(signal).is_ok();
        if set {
            self.deferring.store(true, Ordering::Release);
        }
        // Something scrubs ahead: acquisitions take scrubbed slots first.
        self.slots.prefer_ready();
        set
    }

    /// The thread that scrubbed ahead ended (its creator went, or a bug unwound it): slots are
    /// scrubbed as they come back again, as without it. Dirty ones already free are zeroed by
    /// their acquisitions.
    pub(crate) fn stop_deferring(&self) {
        self.deferring.store(false, Ordering::Release);
    }

    /// Scrubs up to `max` free slots given back dirty, a few at a time
    /// ([`SlotTable::ahead_at_once`], however deep in a free list they lie), as their
    /// acquisitions would: the number scrubbed. Each is off its free list while it is scrubbed, so no one can be handed
    /// one half zeroed. A slot whose scrub failed goes back still dirty, last in its free list
    /// (counted in [`PoolStats::scrub_failures`]): its acquisition tries again, and withdraws
    /// it if that fails too; the rest of its gathering is scrubbed all the same, and the
    /// (first) error is returned.
    pub(crate) fn scrub_ahead(&self, max: usize) -> Result<usize, TwmError> {
        let mut done = 0;
        while done < max {
            // Put back however the scrubs go (a panic included: still dirty, as taken).
            let mut gathering = self.slots.gather(max - done);
            if gathering.is_empty() {
                break;
            }
            // A failed scrub does not stop the others of its gathering: a slot that keeps
            // failing must not keep the rest dirty (and resident).
            let mut failed = None;
            for (taken, outcome) in gathering.slots() {
                // A failure (or a panic) after the bytes kept resident were written.
                let written = taken.meta.dirty.min(KEEP_RESIDENT_BYTES) as u64;
                *outcome = Some((taken.meta, Ahead::Failed { scrubbed: written }));
                // SAFETY: the slot was just taken off its free list: no one uses its pages, no
                // device holds them (detached before it came back), and its first `opened`
                // bytes are readable and writable.
                match unsafe { self.scrub(taken.offset(), taken.meta.dirty) } {
                    Ok(()) => {
                        let left = Left {
                            dirty: 0,
                            ..taken.meta
                        };
                        let returned = Returned {
                            scrubbed: taken.meta.dirty as u64,
                            hints_reset: false,
                        };
                        *outcome = Some((left, Ahead::Scrubbed(returned)));
                        done += 1;
                    }
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
            }
            drop(gathering); // back on their free lists
            if let Some(e) = failed {
                return Err(e);
            }
        }
        Ok(done)
    }

    /// The most slots one [`scrub_ahead`](Self::scrub_ahead) gathering takes at once.
    pub(crate) fn ahead_at_once(&self) -> usize {
        self.slots.ahead_at_once()
    }

    /// Free slots given back dirty, not scrubbed yet (a count a moment behind).
    pub(crate) fn dirty_free(&self) -> usize {
        self.slots.waiting()
    }

    /// The pool's device.
    pub(crate) fn device(&self) -> DeviceId {
        self.device
    }

    /// Resets the hints a holder left on the first `hinted` bytes of the free slot at `offset`
    /// (its own reset was refused as it went: a fenced device, say), through a range attached
    /// for the call and detached after it.
    ///
    /// # Safety
    ///
    /// The slot was just taken off its free list: no one uses its pages and no device holds
    /// them; its first `hinted` bytes are readable and writable (whole pages).
    unsafe fn reset_left_hints(&self, offset: usize, hinted: usize) -> Result<(), HintsLeft> {
        let backend_error = |op, e| TwmError::from_core(CoreError::backend(op, e));
        let Some(ptr) = std::ptr::NonNull::new((self.mapping.base() + offset) as *mut u8) else {
            // A mapping is never at address 0.
            return Err(HintsLeft::Pending(TwmError::GuardedMemoryBroken));
        };
        // SAFETY: the caller's guarantee: the range is the slot's, mapped readable and writable,
        // page aligned, and stays mapped until it is detached below (the pool owns it).
        let chunk = unsafe {
            self.backend
                .attach_host(self.device, self.access, ptr, hinted)
        }
        .map_err(|e| HintsLeft::Pending(backend_error(Operation::AttachHost, e)))?;
        let reset = self.backend.reset_hints(&chunk, 0, hinted);
        // SAFETY: attached just above; no device work uses it (none was given the range).
        if let Err(refused) = unsafe { self.backend.detach_host(chunk) } {
            self.backend.forget(refused.resource);
            self.kept_mappings.add();
            return Err(HintsLeft::Attached(backend_error(
                Operation::DetachHost,
                refused.error,
            )));
        }
        reset.map_err(|e| HintsLeft::Pending(backend_error(Operation::ResetHints, e)))
    }

    /// A slot leaves with chunks the backend still holds: withdrawn (never returned), and the
    /// pool's address space stays mapped when the pool goes.
    fn withdraw_held(&self, slot: SlotId) {
        self.slots.withdraw(slot);
        self.driver_held.store(true, Ordering::Release);
    }

    /// Where `slot` starts, from the start of the pool's mapping.
    fn offset_of(&self, slot: SlotId) -> usize {
        let c = &self.slots.layout()[slot.class];
        c.offset + c.stride * slot.index as usize
    }

    /// Zeroes a free slot's first `opened` bytes: the first [`KEEP_RESIDENT_BYTES`] by writing
    /// zeros (they stay resident, and the next holder touches them without a page fault), the
    /// rest by dropping the pages.
    ///
    /// # Safety
    ///
    /// No one uses the slot's pages, and no device holds them pinned.
    unsafe fn scrub(&self, offset: usize, opened: usize) -> Result<(), TwmError> {
        let kept = opened.min(KEEP_RESIDENT_BYTES);
        // SAFETY: the slot's first `opened` bytes are readable and writable (its holder's
        // accessible pages) and used by no one (the caller's guarantee).
        unsafe { ((self.mapping.base() + offset) as *mut u8).write_bytes(0, kept) };
        // SAFETY: as above.
        unsafe { self.mapping.discard(offset + kept, opened - kept) }
    }

    /// The pool's figures.
    pub(crate) fn stats(&self) -> PoolStats {
        self.slots.stats()
    }
}

impl<B: Backend> Drop for GuardedPool<B> {
    fn drop(&mut self) {
        if *self.driver_held.get_mut() {
            self.mapping.keep_mapped();
        }
    }
}

/// Why a slot's pending hints were not reset ([`GuardedPool::reset_left_hints`]).
enum HintsLeft {
    /// They are still pending, nothing attached: the slot may wait for another try.
    Pending(TwmError),
    /// The range attached for the reset could not be detached: the slot is never reused.
    Attached(TwmError),
}

/// What a guarded slot's last holder left: the bytes from its start left readable and writable
/// (`opened`), of those the bytes not zeroed yet (`dirty`: all of them while the slot waits for
/// a scrub ahead, none once scrubbed), and the bytes whose hints its reset could not take back
/// (`hinted`: 0 unless a reset was refused as it went; at most `opened`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Left {
    opened: usize,
    dirty: usize,
    hinted: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{GUARDED_GUARD, GUARDED_RESERVATION};
    use std::sync::atomic::AtomicUsize;
    use tensor_wasm_mem_core::SizeClass;
    use tensor_wasm_mem_mock::{MockBackend, MockConfig};

    const PAGE: usize = 64 << 10;

    /// A guarded pool of `slots` slots of two Wasm pages on a simulated device with pageable
    /// memory access.
    fn pool(slots: usize) -> Arc<GuardedPool<MockBackend>> {
        let backend = Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
            pageable_memory_access: true,
            ..MockConfig::default()
        }));
        let config = PoolConfig::new(DeviceId(0), [SizeClass::new(2 * PAGE, slots)]);
        let pool = GuardedPool::new(
            backend,
            DeviceId(0),
            HostAccess::Pageable,
            &config,
            KeptMappings::default(),
        );
        Arc::new(pool.expect("a guarded pool"))
    }

    /// A memory of `pages` Wasm pages from `pool`, its first byte of each page written.
    fn dirtied(pool: &Arc<GuardedPool<MockBackend>>, pages: usize) -> GuardedRegion<MockBackend> {
        let reserved = GUARDED_RESERVATION as usize;
        let guard = GUARDED_GUARD as usize;
        let mut region = pool.acquire(2 * PAGE, reserved, guard).expect("a slot");
        region.open(pages * PAGE).expect("opened");
        for page in 0..pages {
            // SAFETY: inside the region's open pages, which this test alone uses.
            unsafe { ((region.base() + page * PAGE) as *mut u8).write(0xa5) };
        }
        region
    }

    /// Every page of `region` reads zero at the bytes `dirtied` wrote.
    fn reads_zero(region: &GuardedRegion<MockBackend>, pages: usize) -> bool {
        // SAFETY: inside the region's open pages.
        (0..pages).all(|page| unsafe { ((region.base() + page * PAGE) as *const u8).read() } == 0)
    }

    /// Once something scrubs ahead, a slot goes back dirty (the signal called), and the
    /// acquisition that takes it before any scrub ahead zeroes it itself.
    #[test]
    fn a_dirty_slot_taken_before_its_scrub_ahead_is_zeroed_by_its_acquisition() {
        let pool = pool(1);
        let signals = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&signals);
        assert!(pool.on_dirty_release(Arc::new(move || {
            counted.fetch_add(1, Ordering::Relaxed);
        })));
        assert!(
            !pool.on_dirty_release(Arc::new(|| {})),
            "one signal per pool"
        );
        dirtied(&pool, 2).release().expect("released");
        assert_eq!(signals.load(Ordering::Relaxed), 1);
        assert_eq!(pool.dirty_free(), 1);
        assert_eq!(
            pool.stats().bytes_scrubbed,
            0,
            "not scrubbed as it came back"
        );
        let mut again = pool
            .acquire(
                2 * PAGE,
                GUARDED_RESERVATION as usize,
                GUARDED_GUARD as usize,
            )
            .expect("the slot");
        again.open(2 * PAGE).expect("opened");
        assert!(reads_zero(&again, 2));
        assert_eq!(pool.dirty_free(), 0);
        let s = pool.stats();
        assert_eq!((s.bytes_scrubbed, s.scrubbed_ahead), (2 * PAGE as u64, 0));
        again.release().expect("released");
    }

    /// Slots given back dirty are scrubbed ahead a few at a time and reach their next holders
    /// zeroed, with no scrub of their acquisitions' own.
    #[test]
    fn slots_scrubbed_ahead_reach_their_next_holders_zeroed() {
        let pool = pool(6);
        pool.on_dirty_release(Arc::new(|| {}));
        let held: Vec<_> = (0..5).map(|_| dirtied(&pool, 2)).collect();
        for region in held {
            region.release().expect("released");
        }
        assert_eq!(pool.dirty_free(), 5);
        assert_eq!(pool.scrub_ahead(usize::MAX).expect("scrubbed"), 5);
        assert_eq!(pool.dirty_free(), 0);
        let s = pool.stats();
        assert_eq!((s.scrubbed_ahead, s.bytes_scrubbed), (5, 10 * PAGE as u64));
        let again: Vec<_> = (0..6)
            .map(|_| {
                let reserved = GUARDED_RESERVATION as usize;
                let mut region = pool
                    .acquire(2 * PAGE, reserved, GUARDED_GUARD as usize)
                    .expect("a slot");
                region.open(2 * PAGE).expect("opened");
                region
            })
            .collect();
        assert!(again.iter().all(|region| reads_zero(region, 2)));
        assert_eq!(
            pool.stats().bytes_scrubbed,
            10 * PAGE as u64,
            "no acquisition scrubbed"
        );
        for region in again {
            region.release().expect("released");
        }
        assert_eq!(pool.stats().free(), 6);
    }

    /// However many slots come back dirty at once, a scrub ahead reaches every one of them
    /// (however deep in the free list): none keeps a gone tenant's pages resident.
    #[test]
    fn a_burst_of_releases_is_scrubbed_ahead_in_full() {
        let pool = pool(80);
        pool.on_dirty_release(Arc::new(|| {}));
        let held: Vec<_> = (0..80).map(|_| dirtied(&pool, 1)).collect();
        for region in held {
            region.release().expect("released");
        }
        assert_eq!(pool.dirty_free(), 80);
        assert_eq!(pool.scrub_ahead(usize::MAX).expect("scrubbed"), 80);
        let s = pool.stats();
        assert_eq!((pool.dirty_free(), s.scrubbed_ahead), (0, 80));
    }

    /// Once the thread that scrubbed ahead is gone, slots are scrubbed as they come back
    /// again: none waits for a scrub that will not come.
    #[test]
    fn when_the_scrub_ahead_stops_slots_are_scrubbed_as_they_come_back() {
        let pool = pool(2);
        pool.on_dirty_release(Arc::new(|| {}));
        dirtied(&pool, 1).release().expect("released");
        assert_eq!(pool.dirty_free(), 1);
        pool.stop_deferring();
        dirtied(&pool, 1).release().expect("released");
        assert_eq!(
            pool.dirty_free(),
            1,
            "the second was scrubbed as it came back"
        );
    }

    /// Without anything scrubbing ahead, a slot is scrubbed as it comes back, as before.
    #[test]
    fn without_a_scrub_ahead_a_slot_is_scrubbed_as_it_comes_back() {
        let pool = pool(1);
        dirtied(&pool, 1).release().expect("released");
        assert_eq!(pool.dirty_free(), 0);
        assert_eq!(pool.stats().bytes_scrubbed, PAGE as u64);
        assert_eq!(pool.scrub_ahead(usize::MAX).expect("nothing to do"), 0);
    }
}
