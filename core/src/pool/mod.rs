//! The slot pool: one slab from a [`ManagedAllocator`], carved into slots by size class, slots
//! reused, and every reused slot scrubbed before its next holder sees it.
//!
//! Scrubbing is exact: a holder can only have touched its visible window, and the window never
//! shrinks, so its largest size (the *high-water mark*) is recorded when the slot comes back and
//! exactly `0..high_water` is zeroed (through [`ManagedAllocator::zero`]) when the slot is next
//! handed out. A slab whose allocator does not hand out zeroed memory starts with every slot
//! dirty to its full size, so the first holder sees zeros too.
//!
//! ```
//! use std::sync::Arc;
//! # use tensor_wasm_mem_core::doc_support::HeapAllocator;
//! use tensor_wasm_mem_core::{DeviceId, PoolConfig, SizeClass, SlotPool};
//!
//! let config = PoolConfig::new(DeviceId(0), [SizeClass::new(1 << 20, 4)]);
//! let pool = SlotPool::shared(HeapAllocator::default(), config).unwrap();
//! let mut memory = pool.acquire(1 << 20, 65536).unwrap(); // capacity 1 MiB, 64 KiB visible
//! memory.write(0, &[0xff; 16]).unwrap();
//! drop(memory); // back to the pool
//! let memory = pool.acquire(1 << 20, 65536).unwrap(); // the same slot, scrubbed
//! let mut bytes = [1u8; 16];
//! memory.read(0, &mut bytes).unwrap();
//! assert_eq!(bytes, [0; 16]);
//! assert_eq!(pool.stats().bytes_scrubbed, 65536);
//! ```

use alloc::sync::Arc;
use core::fmt;

use alloc::boxed::Box;
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

use crate::allocator::{Allocation, ManagedAllocator};
use crate::buffer::UnifiedBuffer;
use crate::error::{Error, ErrorType, Operation};

mod config;
mod slots;

pub use config::{
    ClassLayout, ClassStats, MAX_POOL_SLOTS, PoolConfig, PoolError, PoolStats, SLOT_ALIGN,
    SizeClass,
};
pub use slots::{AHEAD_MAX, Ahead, Gathering, Returned, SlotId, SlotTable, Taken};

/// What a managed slot's next scrub must do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Dirt {
    /// Bytes from its start that may be non-zero.
    dirty: usize,
    /// Bytes from its start that may carry advice (0: none).
    hinted: usize,
    /// Device work may have touched it (a device pointer was resolved, or it was prefetched to
    /// a device): its pages may be on the device, and it is zeroed there. Otherwise only the
    /// host touched it, and it is zeroed on the host, where its pages are: no page crosses the
    /// link for a scrub.
    device: bool,
    /// A slot of a new slab from an allocator that does not hand out zeroed memory, never
    /// handed out: zeroed in full by its acquisition, never ahead (a slot scrubbed ahead that
    /// no one takes would have its pages committed for nothing).
    fresh: bool,
}

impl Dirt {
    /// A free slot with this record waits for a scrub ahead: a holder left it dirty or hinted.
    fn waits(&self) -> bool {
        !self.fresh && *self != Dirt::default()
    }
}

/// A value alone on its cache line: one a thread polls while others write the lines beside it.
#[derive(Debug, Default)]
#[repr(align(64))]
struct CacheLine<T>(T);

/// Resets advice and residency over a range of the slab: [`Advisor::reset_hints`] of the
/// allocator, recorded by the first holder that hints (the pool itself needs no `Advisor`).
///
/// [`Advisor::reset_hints`]: crate::Advisor::reset_hints
pub(crate) type ResetHints<A> =
    fn(&A, &Allocation, usize, usize) -> Result<(), <A as ErrorType>::Error>;

/// A pool of equally sized slots per size class, carved from one slab. Slots are scrubbed as
/// they are handed out (the zeroing is the backend's, and may be asynchronous work ordered on
/// its scrub stream): a slot comes back by recording its high-water mark only.
///
/// After a kernel fault fences the pool's device, the pool hands out nothing there
/// ([`PoolError::DeviceFenced`]) and gives its slab up as soon as no slot is held (the free is
/// refused in the lost context, and the slab forgotten: a recovery's reset destroys it), so the
/// pool never keeps the device from being recovered; once the device is recovered, the next
/// acquisition carves the slots from a new slab.
pub struct SlotPool<A: ManagedAllocator> {
    allocator: A,
    device: crate::device::DeviceId,
    /// Bytes of a slab.
    slab_bytes: usize,
    /// The slab every slot lies in (a `Box`ed handle), null once given up. Swapped only under
    /// the slot table's lock while no slot is held ([`SlotTable::if_idle`],
    /// [`SlotTable::renew`]), so a held slot's slab is live and unchanged while it is held.
    slab: AtomicPtr<Allocation>,
    /// Serialises giving the slab up, making a new one, and [`with_slab`](Self::with_slab).
    renewing: spin::Mutex<()>,
    slots: SlotTable<Dirt>,
    /// Set by the first slot holder that advises or prefetches (see [`PoolSlot::hinted`]).
    reset_hints: spin::Mutex<Option<ResetHints<A>>>,
    /// Slots held for a moment to be scrubbed ahead: a recovery's request to let the slab go
    /// waits for them ([`IdleHolder`] below). Alone on its line: the acquisition path never
    /// touches it.
    ///
    /// [`IdleHolder`]: crate::allocator::IdleHolder
    scrubbing: CacheLine<AtomicUsize>,
    /// Called as a slot that needs a scrub comes back ([`on_dirty_release`](Self::on_dirty_release)).
    signal: spin::Once<Arc<dyn Fn() + Send + Sync>>,
    /// The pool owns the boxed slab behind `slab` (so it is `Send` and `Sync` as that is).
    _slab: core::marker::PhantomData<Box<Allocation>>,
}

impl<A: ManagedAllocator> fmt::Debug for SlotPool<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotPool")
            .field("device", &self.device)
            .field("slab_bytes", &self.slab_bytes)
            .field("has_slab", &!self.slab.load(Ordering::Acquire).is_null())
            .field("classes", &self.slots.layout())
            .finish_non_exhaustive()
    }
}

impl<A: ManagedAllocator> SlotPool<A> {
    /// Takes one slab from `allocator` and carves it as `config` says.
    pub fn new(allocator: A, config: PoolConfig) -> Result<Self, Error<A::Error>> {
        let (layout, total) = config.layout(Some)?;
        let slab = allocator
            .allocate(config.device, total)
            .map_err(|e| Error::backend(Operation::Allocate, e))?;
        let slots = SlotTable::new(layout, Self::fresh(&allocator)).waiting_when(Dirt::waits);
        Ok(Self {
            allocator,
            device: config.device,
            slab_bytes: total,
            slab: AtomicPtr::new(Box::into_raw(Box::new(slab))),
            renewing: spin::Mutex::new(()),
            slots,
            reset_hints: spin::Mutex::new(None),
            scrubbing: CacheLine(AtomicUsize::new(0)),
            signal: spin::Once::new(),
            _slab: core::marker::PhantomData,
        })
    }

    /// [`new`](Self::new), shared, and registered with its allocator
    /// ([`ManagedAllocator::watch_idle`]): when the pool's device is fenced and no slot is
    /// held, a recovery of that device (by whoever recovers it) has the pool give its slab up
    /// first, so an idle pool never keeps its device fenced until its own next call. The way to
    /// make a pool that lives as long as its users (a pool made with `new` gives its slab up on
    /// its own calls only).
    pub fn shared(allocator: A, config: PoolConfig) -> Result<Arc<Self>, Error<A::Error>>
    where
        A: Send + Sync + 'static,
    {
        let pool = Arc::new(Self::new(allocator, config)?);
        let weak: alloc::sync::Weak<Self> = Arc::downgrade(&pool);
        pool.allocator.watch_idle(weak);
        Ok(pool)
    }

    /// What a slot of a new slab needs: nothing where the allocator hands out zeroed memory,
    /// else a scrub of its full size, so its first holder sees zeros too.
    fn fresh(allocator: &A) -> impl Fn(&ClassLayout) -> Dirt {
        let zeroed = allocator.capabilities().comes_zeroed;
        move |c| Dirt {
            dirty: if zeroed { 0 } else { c.slot_bytes },
            hinted: 0,
            device: false,
            fresh: !zeroed,
        }
    }

    /// The allocator the slab came from.
    pub fn allocator(&self) -> &A {
        &self.allocator
    }

    /// The device the slots are on.
    pub fn device(&self) -> crate::device::DeviceId {
        self.device
    }

    /// Runs `f` on the slab every slot lies in (for inspection), while it cannot be given up or
    /// replaced; `None` while the pool has none (given up on a fenced device, not made again
    /// yet). `f` must not use the pool itself (acquiring or releasing a slot there may wait for
    /// this call to end).
    ///
    /// `f` runs under the pool's lock that a recovery of its device takes too (to have the
    /// pool give its slab up): `f` must not recover the device, nor drop what recovers it.
    pub fn with_slab<R>(&self, f: impl FnOnce(&Allocation) -> R) -> Option<R> {
        let _renewing = self.renewing.lock();
        let slab = self.slab.load(Ordering::Acquire);
        // SAFETY: non-null, the slab is the live box this pool owns; it is only replaced or
        // given up under `renewing`, held here while `f` runs.
        (!slab.is_null()).then(|| f(unsafe { &*slab }))
    }

    /// The slab of a slot that is held.
    ///
    /// # Safety
    ///
    /// A slot of this pool must be held (taken from the table, not given back) by the caller
    /// for as long as the reference is used: the slab is swapped only while no slot is held.
    unsafe fn held_slab(&self) -> &Allocation {
        let slab = self.slab.load(Ordering::Acquire);
        debug_assert!(!slab.is_null(), "a held slot's slab is never given up");
        // SAFETY: by the caller's contract a slot is held, so the slab was installed before it
        // was taken and is not swapped until every slot is back: a live box of this pool.
        unsafe { &*slab }
    }

    /// Gives the slab up if the pool's device is fenced (a kernel fault in its primary context)
    /// and no slot is held: its free is refused in the lost context, and the slab forgotten
    /// ([`ManagedAllocator::forget`]), so a recovery's reset destroys it and nothing of the pool
    /// keeps the device from being recovered. `true` if it was given up now. The next
    /// acquisition after the recovery makes a new slab.
    pub fn give_up_if_fenced(&self) -> bool {
        if !self.allocator.device_fenced(self.device) {
            return false;
        }
        let _renewing = self.renewing.lock();
        // Again under the lock: a recovery and a renewal may have come since the first look.
        if !self.allocator.device_fenced(self.device) {
            return false;
        }
        let taken = self
            .slots
            .if_idle(|| self.slab.swap(core::ptr::null_mut(), Ordering::AcqRel));
        match taken {
            Some(slab) if !slab.is_null() => {
                // SAFETY: the box this pool installed, swapped out (no slot is held, and none
                // can be taken on a null slab): owned here alone.
                let slab = unsafe { Box::from_raw(slab) };
                self.let_slab_go(*slab);
                true
            }
            _ => false,
        }
    }

    /// Frees a slab no slot holds; a refused free leaves it to the backend, forgotten (a driver
    /// backend frees it when it drops, unless a recovery's reset destroyed it first): no tenant
    /// pays for a pool's slab. A slab with a withdrawn slot is never freed here but forgotten at
    /// once: a slot is withdrawn when its holder gave it up because device work may still
    /// write it (`UnifiedBuffer::abandon`: a stream whose wait the driver refused), and freeing
    /// the slab would let the driver hand those addresses to another allocation, another
    /// tenant's, under that work. So a pooled memory abandoned busy is left to the driver as an
    /// unpooled one is.
    fn let_slab_go(&self, slab: Allocation) {
        if self.slots.withdrawn() > 0 {
            self.allocator.forget(slab);
            return;
        }
        // SAFETY: the slab came from `self.allocator`, no slot of it is held (the caller
        // swapped it out under the table's lock while none was), and none was given up under
        // work that may still run (no slot is withdrawn): nothing uses it afterwards.
        if let Err(refused) = unsafe { self.allocator.free(slab) } {
            self.allocator.forget(refused.resource);
        }
    }

    /// Makes a new slab where the pool gave its slab up (its device was fenced, and is not
    /// any more), and carves every slot from it, fresh.
    fn renew(&self) -> Result<(), Error<A::Error>> {
        let _renewing = self.renewing.lock();
        if !self.slab.load(Ordering::Acquire).is_null() {
            return Ok(());
        }
        let slab = self
            .allocator
            .allocate(self.device, self.slab_bytes)
            .map_err(|e| Error::backend(Operation::Allocate, e))?;
        let slab = Box::into_raw(Box::new(slab));
        let fresh = Self::fresh(&self.allocator);
        let install = || self.slab.store(slab, Ordering::Release);
        // A slot is held only for a moment here (an acquisition that found no slab puts it back
        // untouched, a scrub ahead its slot): wait it out.
        while self.slots.renew(&fresh, install).is_none() {
            core::hint::spin_loop();
        }
        Ok(())
    }

    /// A snapshot of the pool's figures.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            slab_given_up: self.slab.load(Ordering::Acquire).is_null(),
            ..self.slots.stats()
        }
    }

    /// The size of the smallest slot class that can hold `capacity` bytes (what a memory of that
    /// capacity occupies when the class has a free slot), or `None` if none can.
    #[must_use]
    pub fn slot_size_for(&self, capacity: usize) -> Option<usize> {
        self.slots.slot_size_for(capacity)
    }

    /// Hands out a slot that can hold `capacity` bytes (the smallest free one that fits), as a
    /// [`UnifiedBuffer`] whose first `visible` bytes are visible, all zero.
    pub fn acquire(
        self: &Arc<Self>,
        capacity: usize,
        visible: usize,
    ) -> Result<UnifiedBuffer<A>, Error<A::Error>> {
        if visible > capacity {
            return Err(PoolError::VisibleAboveCapacity {
                visible: visible as u64,
                capacity: capacity as u64,
            }
            .into());
        }
        if self.allocator.device_fenced(self.device) {
            self.give_up_if_fenced();
            return Err(PoolError::DeviceFenced {
                device: self.device,
            }
            .into());
        }
        if self.slab.load(Ordering::Acquire).is_null() {
            self.renew()?;
        }
        let taken = self.slots.take(capacity, |_| true)?;
        let (slot, offset, dirt) = (taken.slot, taken.offset(), taken.meta);
        if self.slab.load(Ordering::Acquire).is_null() {
            // Given up between the check and the take (the device was fenced meanwhile): the
            // slot goes back untouched.
            self.slots.untake(slot, dirt);
            return Err(PoolError::DeviceFenced {
                device: self.device,
            }
            .into());
        }
        if dirt != Dirt::default()
            && let Err(e) = self.prepare(slot, offset, dirt)
        {
            // The slot went back: a scrub refused on a device fenced meanwhile lets the slab
            // go if that was the last slot held.
            self.give_up_if_fenced();
            return Err(e);
        }
        let slot = PoolSlot {
            pool: Arc::clone(self),
            id: slot,
            slot_bytes: taken.layout.slot_bytes,
            offset,
            high_water: visible,
            hinted: AtomicBool::new(false),
            device: AtomicBool::new(false),
            withdrawn: false,
        };
        Ok(UnifiedBuffer::from_slot(slot, capacity, visible))
    }

    /// Scrubs a slot just taken: zeroes its dirty bytes, then resets its hints (after the
    /// zeroing, which may itself move pages). A failure hands nothing out: the slot goes back
    /// free, still dirty (a failed zeroing) or still hinted, and is scrubbed again next time;
    /// so does a backend that panics mid-scrub (a bug): the pool neither loses the slot nor
    /// waits for it for ever.
    fn prepare(&self, slot: SlotId, offset: usize, dirt: Dirt) -> Result<(), Error<A::Error>> {
        let unwinding = TakenHeld {
            pool: self,
            slot,
            dirt,
        };
        let scrubbed = self.scrub(offset, dirt);
        core::mem::forget(unwinding);
        match scrubbed {
            Ok(returned) => {
                self.slots.scrubbed(returned);
                Ok(())
            }
            Err((left, scrubbed, e)) => {
                self.slots.refuse(slot, left, scrubbed);
                Err(e)
            }
        }
    }

    /// Zeroes a held slot's dirty bytes, then resets its hints: what was done, or what is left
    /// to do with the bytes zeroed before the failure.
    fn scrub(&self, offset: usize, dirt: Dirt) -> Result<Returned, (Dirt, u64, Error<A::Error>)> {
        self.zero(offset, dirt).map_err(|e| (dirt, 0, e))?;
        let scrubbed = dirt.dirty as u64;
        if let Err(e) = self.reset(offset, dirt.hinted) {
            return Err((Dirt { dirty: 0, ..dirt }, scrubbed, e));
        }
        Ok(Returned {
            scrubbed,
            hints_reset: dirt.hinted > 0,
        })
    }

    /// Scrubs up to `max` free slots that wait for it (zeroes what their last holders could
    /// have written and resets their hints, as an acquisition would), so that the acquisitions
    /// that take them do no scrub of their own: the work moves off the acquisition's path, to
    /// a thread with time to spare (the Wasmtime integration's `CreatorBuilder::scrub_ahead`
    /// runs one). The number of slots scrubbed; 0 when none waits (or the pool's device is
    /// fenced: an acquisition there is refused anyway).
    ///
    /// The slots are taken off their free lists a few at a time ([`SlotTable::ahead_at_once`],
    /// in one hold of the pool's lock; however deep in a free list they lie), so no one can be
    /// handed one half zeroed; once all of them are scrubbed
    /// they go back on top (in one hold of the lock), the next handed out. A failed scrub puts
    /// its slot back still dirty (counted in [`PoolStats::scrub_failures`]; the acquisition
    /// that takes it scrubs it, or fails as it would have), the rest of its gathering scrubbed
    /// all the same, and returns the (first) error: a caller in a loop should back off rather than retry
    /// at once.
    pub fn scrub_ahead(&self, max: usize) -> Result<usize, Error<A::Error>> {
        let mut done = 0;
        while done < max {
            // Counted before the fence is looked at: a recovery that asks the pool to let its
            // slab go either sees this scrub and waits for it, or comes after and is seen here.
            let counted = Scrubbing::new(self);
            if self.allocator.device_fenced(self.device)
                || self.slab.load(Ordering::Acquire).is_null()
            {
                break;
            }
            // A few slots at once: the table's lock is taken once to take them and once to put
            // them back (when `gathering` goes, before `counted`), not twice per slot.
            let mut gathering = self.slots.gather(max - done);
            if gathering.is_empty() {
                break;
            }
            // A failed scrub does not stop the others of its gathering (a slot that keeps
            // failing must not keep the rest dirty); a fenced device does.
            let mut failed = None;
            for (taken, outcome) in gathering.slots() {
                if self.allocator.device_fenced(self.device) {
                    // Put back as it was: scrubbed by its acquisition, or let go with the slab.
                    *outcome = Some((taken.meta, Ahead::Untouched));
                    continue;
                }
                // Failed, should the backend panic in it; the ones not started go back
                // untouched.
                *outcome = Some((taken.meta, Ahead::Failed { scrubbed: 0 }));
                match self.scrub_taken(taken) {
                    Ok(Some(returned)) => {
                        *outcome = Some((Dirt::default(), Ahead::Scrubbed(returned)));
                        done += 1;
                    }
                    Ok(None) => *outcome = Some((taken.meta, Ahead::Untouched)),
                    Err((left, scrubbed, e)) => {
                        *outcome = Some((left, Ahead::Failed { scrubbed }));
                        failed.get_or_insert(e);
                    }
                }
            }
            drop(gathering); // back on their free lists
            drop(counted);
            // The slots are back: on a device fenced meanwhile, one may have been the last held.
            self.give_up_if_fenced();
            if let Some(e) = failed {
                return Err(e);
            }
        }
        Ok(done)
    }

    /// Scrubs a slot [`scrub_ahead`](Self::scrub_ahead) took: what was done, or `None` if the
    /// slab went meanwhile (the slot untouched), or what is left to do after a failure.
    #[allow(clippy::type_complexity)]
    fn scrub_taken(
        &self,
        taken: &Taken<Dirt>,
    ) -> Result<Option<Returned>, (Dirt, u64, Error<A::Error>)> {
        if self.slab.load(Ordering::Acquire).is_null() {
            return Ok(None);
        }
        self.scrub(taken.offset(), taken.meta).map(Some)
    }

    /// Some free slot waits for a scrub, as far as the pool can tell without its lock (a
    /// hint: [`scrub_ahead`](Self::scrub_ahead) finds out for sure).
    #[must_use]
    pub fn has_dirty_free(&self) -> bool {
        self.slots.waiting() > 0
    }

    /// Has `signal` called each time a slot that needs a scrub comes back (on the releasing
    /// thread, right after the slot is free: it must be quick, and must not use the pool), so
    /// a thread that scrubs ahead can sleep while there is nothing to scrub. One signal per
    /// pool: `false` (and `signal` dropped) if the pool has one.
    pub fn on_dirty_release(&self, signal: Arc<dyn Fn() + Send + Sync>) -> bool {
        let mut set = false;
        self.signal.call_once(|| {
            set = true;
            signal
        });
        // Something scrubs ahead: acquisitions take scrubbed slots first.
        self.slots.prefer_ready();
        set
    }

    /// The most slots one [`scrub_ahead`](Self::scrub_ahead) gathering takes at once
    /// ([`SlotTable::ahead_at_once`]).
    #[must_use]
    pub fn ahead_at_once(&self) -> usize {
        self.slots.ahead_at_once()
    }

    /// Free slots that wait for a scrub ahead (a count a moment behind, never drifting).
    pub fn dirty_free(&self) -> usize {
        self.slots.waiting()
    }

    /// Zeroes the first `dirt.dirty` bytes of the slot at `offset` where its pages are: on
    /// the device (the allocator's zeroing, a device memset) if device work may have touched it,
    /// from the host ([`ManagedAllocator::zero_on_host`]) if only the host did. No page crosses
    /// the link for a scrub.
    fn zero(&self, offset: usize, dirt: Dirt) -> Result<(), Error<A::Error>> {
        let dirty = dirt.dirty;
        if dirty == 0 {
            return Ok(());
        }
        // SAFETY: the slot at `offset` was just taken by the caller, and is held.
        let slab = unsafe { self.held_slab() };
        let zeroed = if dirt.device {
            // SAFETY: the slab is live (owned by `self`), and the slot `offset..offset + dirty`
            // was just taken off the free list, so no holder can access it.
            unsafe { self.allocator.zero(slab, offset, dirty) }
        } else {
            // SAFETY: as above, and no device work touched the slot since its last scrub
            // (`dirt.device` is false), so none uses it.
            unsafe { self.allocator.zero_on_host(slab, offset, dirty) }
        };
        zeroed.map_err(|e| Error::backend(Operation::Zero, e))
    }

    /// Resets the hints of the first `hinted` bytes of the slot at `offset`.
    fn reset(&self, offset: usize, hinted: usize) -> Result<(), Error<A::Error>> {
        if hinted == 0 {
            return Ok(());
        }
        // A slot is only marked hinted after `reset_hints` is recorded.
        let reset = *self.reset_hints.lock();
        match reset {
            // SAFETY: the slot at `offset` was just taken by the caller, and is held.
            Some(reset) => reset(&self.allocator, unsafe { self.held_slab() }, offset, hinted)
                .map_err(|e| Error::backend(Operation::ResetHints, e)),
            None => Ok(()),
        }
    }

    /// A slot comes back dirty to its high-water mark (and hinted to it, if its holder
    /// hinted); a reset that failed before keeps its own extent.
    fn release(
        &self,
        slot: SlotId,
        slot_bytes: usize,
        high_water: usize,
        (hinted, device): (bool, bool),
    ) {
        let high_water = high_water.min(slot_bytes);
        let dirt = Dirt {
            dirty: high_water,
            hinted: if hinted { high_water } else { 0 },
            device,
            fresh: false,
        };
        self.slots.give_back(slot, dirt, Returned::default());
        if dirt.waits()
            && let Some(signal) = self.signal.get()
        {
            signal();
        }
    }
}

impl<A: ManagedAllocator + Send + Sync> crate::allocator::IdleHolder for SlotPool<A> {
    /// Lets the slab go if the device is fenced and no slot is held; a slot held only for a
    /// moment to be scrubbed ahead (a call refused at once on the fenced device, or a host
    /// memset) is waited for first, so the recovery that asks now finds the pool idle rather
    /// than being refused for a slot that is back a moment later. (An acquisition's own scrub
    /// is not waited for: the acquisition fails on the fenced device, and the creation it was
    /// for tries the recovery again as it is refused.)
    fn let_go_if_fenced(&self) {
        if !self.allocator.device_fenced(self.device) {
            return;
        }
        while self.scrubbing.0.load(Ordering::SeqCst) > 0 {
            core::hint::spin_loop();
        }
        self.give_up_if_fenced();
    }
}

impl<A: ManagedAllocator> Drop for SlotPool<A> {
    fn drop(&mut self) {
        let slab = *self.slab.get_mut();
        if !slab.is_null() {
            // SAFETY: the box this pool installed; every slot holds an `Arc` to the pool, so
            // none is alive when the pool drops, and nothing uses the slab afterwards.
            let slab = unsafe { Box::from_raw(slab) };
            self.let_slab_go(*slab);
        }
    }
}

/// A scrub ahead in progress ([`SlotPool::scrub_ahead`]): counted while it lives, so a recovery
/// waits for it. Its slots are held by a [`Gathering`] made after it, which goes first and puts
/// them back (a slot whose scrub never finished, the backend having panicked mid-scrub, goes back
/// dirty with a failed scrub counted; those not reached yet untouched), so no acquisition or
/// recovery waits for them for ever.
struct Scrubbing<'a, A: ManagedAllocator>(&'a SlotPool<A>);

impl<'a, A: ManagedAllocator> Scrubbing<'a, A> {
    fn new(pool: &'a SlotPool<A>) -> Self {
        pool.scrubbing.0.fetch_add(1, Ordering::SeqCst);
        Self(pool)
    }
}

impl<A: ManagedAllocator> Drop for Scrubbing<'_, A> {
    fn drop(&mut self) {
        self.0.scrubbing.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A slot an acquisition took and is scrubbing: dropped only if the scrub unwinds (it is
/// forgotten once the scrub returns), it puts the slot back as it was taken, dirty, with a
/// failed scrub counted.
struct TakenHeld<'a, A: ManagedAllocator> {
    pool: &'a SlotPool<A>,
    slot: SlotId,
    dirt: Dirt,
}

impl<A: ManagedAllocator> Drop for TakenHeld<'_, A> {
    fn drop(&mut self) {
        self.pool.slots.refuse(self.slot, self.dirt, 0);
    }
}

/// One slot on loan from a [`SlotPool`]; goes back (dirty to its high-water mark) on drop.
pub(crate) struct PoolSlot<A: ManagedAllocator> {
    pool: Arc<SlotPool<A>>,
    id: SlotId,
    slot_bytes: usize,
    offset: usize,
    high_water: usize,
    /// The holder advised (some of) the slot: its hints are reset before reuse.
    hinted: AtomicBool,
    /// Device work may have touched the slot: it is zeroed on the device.
    device: AtomicBool,
    /// Given up: it leaves the pool for good instead of going back.
    withdrawn: bool,
}

impl<A: ManagedAllocator> PoolSlot<A> {
    /// Withdraws the slot from its pool for good (it is never handed out again) when it goes.
    pub(crate) fn withdraw(&mut self) {
        self.withdrawn = true;
    }

    pub(crate) fn pool(&self) -> &Arc<SlotPool<A>> {
        &self.pool
    }

    /// The slab the slot lies in.
    pub(crate) fn slab(&self) -> &Allocation {
        // SAFETY: this slot is held for as long as `self` lives (it goes back in `drop`).
        unsafe { self.pool.held_slab() }
    }

    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Records, before the holder advises or prefetches, that the slot's hints must be reset
    /// before its next holder gets it, and how (`reset` is `A`'s [`Advisor::reset_hints`]).
    ///
    /// [`Advisor::reset_hints`]: crate::Advisor::reset_hints
    pub(crate) fn hinted(&self, reset: ResetHints<A>) {
        if !self.hinted.load(Ordering::Acquire) {
            *self.pool.reset_hints.lock() = Some(reset);
            self.hinted.store(true, Ordering::Release);
        }
    }

    /// Records that device work may touch the slot (a device pointer into it was handed out, or
    /// it is prefetched to a device): its scrub runs on the device, where its pages may be.
    pub(crate) fn device_touched(&self) {
        self.device.store(true, Ordering::Release);
    }

    /// Records that the holder may have touched `0..bytes`.
    pub(crate) fn touch(&mut self, bytes: usize) {
        self.high_water = self.high_water.max(bytes);
    }
}

impl<A: ManagedAllocator> fmt::Debug for PoolSlot<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolSlot")
            .field("slot", &self.id)
            .field("offset", &self.offset)
            .field("high_water", &self.high_water)
            .finish()
    }
}

impl<A: ManagedAllocator> Drop for PoolSlot<A> {
    fn drop(&mut self) {
        if self.withdrawn {
            self.pool.slots.withdraw(self.id);
        } else {
            let touched = (*self.hinted.get_mut(), *self.device.get_mut());
            self.pool
                .release(self.id, self.slot_bytes, self.high_water, touched);
        }
        // The last slot back on a fenced device lets the slab go, for the recovery.
        self.pool.give_up_if_fenced();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doc_support::HeapAllocator;
    use crate::mocks::{MockBackend, MockError};
    use crate::{
        Advice, Capabilities, IsolationLevel, Location, Stream, TenantId, TenantKey, TenantLedger,
    };
    use crate::{DeviceId, ErrorKind};
    use alloc::vec::Vec;
    use rstest::rstest;

    const PAGE: usize = SLOT_ALIGN;
    static HEAP: HeapAllocator = HeapAllocator::new();

    fn heap_pool(classes: &[SizeClass]) -> Arc<SlotPool<HeapAllocator>> {
        Arc::new(
            SlotPool::new(
                HeapAllocator::new(),
                PoolConfig::new(DeviceId(0), classes.iter().copied()),
            )
            .unwrap(),
        )
    }

    /// A mockall backend whose allocations are real heap memory.
    fn mock_backend(comes_zeroed: bool) -> MockBackend {
        let mut mock = MockBackend::new();
        mock.expect_capabilities().returning(move || Capabilities {
            host_accessible: true,
            comes_zeroed,
            ..Capabilities::NONE
        });
        mock.expect_allocate()
            .returning(|device, bytes| HEAP.allocate(device, bytes).map_err(|e| MockError(e.kind)));
        mock.expect_free().returning(|a| {
            // SAFETY: every allocation of this mock came from `HEAP`.
            unsafe { HEAP.free(a) }.map_err(|r| r.map_error(|e| MockError(e.kind)))
        });
        mock
    }

    #[test]
    fn reuse_never_exhausts() {
        let pool = heap_pool(&[SizeClass::new(PAGE, 3), SizeClass::new(4 * PAGE, 2)]);
        let stats = pool.stats();
        let slots: usize = stats.classes.iter().map(|c| c.slots).sum();
        for round in 0..10 * slots {
            let held: Vec<_> = (0..slots)
                .map(|i| {
                    pool.acquire(if i < 3 { PAGE } else { 4 * PAGE }, 0)
                        .unwrap()
                })
                .collect();
            assert_eq!(pool.stats().in_use(), slots, "round {round}");
            drop(held);
            assert_eq!(pool.stats().free(), slots);
        }
        let s = pool.stats();
        assert_eq!(s.acquisitions, (10 * slots * slots) as u64);
        assert_eq!(s.releases, s.acquisitions);
        assert_eq!(s.exhaustions, 0);
    }

    #[test]
    fn smallest_fitting_class_first_then_larger_then_exhausted() {
        let pool = heap_pool(&[SizeClass::new(4 * PAGE, 1), SizeClass::new(PAGE, 1)]);
        let a = pool.acquire(100, 0).unwrap();
        assert_eq!(a.slot_bytes(), Some(PAGE));
        let b = pool.acquire(100, 0).unwrap();
        assert_eq!(
            b.slot_bytes(),
            Some(4 * PAGE),
            "falls back to a larger class"
        );
        let err = pool.acquire(100, 0).unwrap_err();
        assert!(matches!(
            err,
            Error::Pool(PoolError::Exhausted { requested: 100 })
        ));
        assert_eq!(err.kind(), ErrorKind::PoolExhausted);
        assert_eq!(pool.stats().exhaustions, 1);
        let err = pool.acquire(4 * PAGE + 1, 0).unwrap_err();
        assert!(matches!(err, Error::Pool(PoolError::TooLarge { .. })));
        let err = pool.acquire(PAGE, PAGE + 1).unwrap_err();
        assert!(matches!(
            err,
            Error::Pool(PoolError::VisibleAboveCapacity { .. })
        ));
        drop((a, b));
        assert_eq!(pool.stats().free(), 2);
    }

    #[test]
    fn slots_do_not_overlap() {
        let pool = heap_pool(&[SizeClass::new(PAGE, 4), SizeClass::new(2 * PAGE, 2)]);
        let held: Vec<_> = (0..6)
            .map(|i| {
                pool.acquire(if i < 4 { PAGE } else { 2 * PAGE }, 0)
                    .unwrap()
            })
            .collect();
        let mut ranges: Vec<_> = held
            .iter()
            .map(|b| {
                let start = b.as_ptr() as usize;
                start..start + b.slot_bytes().unwrap()
            })
            .collect();
        ranges.sort_by_key(|r| r.start);
        for w in ranges.windows(2) {
            assert!(w[0].end <= w[1].start);
        }
        let (slab, len) = pool.with_slab(|s| (s.as_ptr() as usize, s.len())).unwrap();
        assert!(
            ranges
                .iter()
                .all(|r| r.start >= slab && r.end <= slab + len)
        );
        assert!(ranges.iter().all(|r| (r.start - slab).is_multiple_of(PAGE)));
    }

    #[test]
    fn reused_slot_reads_zero() {
        let pool = heap_pool(&[SizeClass::new(2 * PAGE, 1)]);
        let mut a = pool.acquire(2 * PAGE, PAGE).unwrap();
        a.grow_to(2 * PAGE).unwrap();
        a.write(0, &[0xff; 2 * PAGE]).unwrap();
        drop(a);
        let b = pool.acquire(2 * PAGE, 2 * PAGE).unwrap();
        let mut out = alloc::vec![1u8; 2 * PAGE];
        b.read(0, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 0));
        assert_eq!(pool.stats().bytes_scrubbed, 2 * PAGE as u64);
    }

    /// The scrub zeroes exactly the previous holder's high-water mark, through the allocator.
    #[test]
    fn scrubs_exactly_the_high_water_mark() {
        let mut mock = mock_backend(true);
        // Slot 0 of the only class starts at offset 0. The holder grew to 3 pages; that, and
        // nothing more, is zeroed, once, when the slot is handed out again.
        mock.expect_zero()
            .withf(|_, offset, len| *offset == 0 && *len == 3 * PAGE)
            .times(1)
            .returning(|a, offset, len| {
                // SAFETY: the allocation is a live `HEAP` allocation held by the pool.
                unsafe { HEAP.zero(a, offset, len) }.map_err(|e| MockError(e.kind))
            });
        let config = PoolConfig::new(DeviceId(0), [SizeClass::new(8 * PAGE, 1)]);
        let pool = Arc::new(SlotPool::new(mock, config).unwrap());
        let mut first = pool.acquire(8 * PAGE, PAGE).unwrap();
        first.grow_to(3 * PAGE).unwrap();
        first.grow_to(2 * PAGE).unwrap(); // never shrinks the mark
        drop(first);
        let second = pool.acquire(8 * PAGE, 0).unwrap();
        drop(second); // touched nothing: the next scrub would be empty
        let third = pool.acquire(8 * PAGE, PAGE).unwrap();
        assert_eq!(pool.stats().bytes_scrubbed, 3 * PAGE as u64);
        drop(third);
    }

    /// A holder that advises or prefetches leaves its hints to be reset, over its high-water
    /// mark, after the zeroing and before the next holder; a holder that hinted nothing costs
    /// no reset.
    #[test]
    fn hints_are_reset_after_the_scrub_and_only_for_a_slot_that_was_hinted() {
        let mut mock = mock_backend(true);
        let mut seq = mockall::Sequence::new();
        mock.expect_advise().times(1).returning(|_, _, _, _| Ok(()));
        mock.expect_prefetch()
            .times(1)
            .returning(|_, _, _, _, _| Ok(()));
        // Slot 1 of the class (at 8 pages), touched to 2 pages: zeroed, then reset.
        mock.expect_zero()
            .withf(|_, offset, len| *offset == 8 * PAGE && *len == 2 * PAGE)
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Ok(()));
        mock.expect_reset_hints()
            .withf(|_, offset, len| *offset == 8 * PAGE && *len == 2 * PAGE)
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Ok(()));
        // Slot 0, touched but never hinted: zeroed only.
        mock.expect_zero()
            .withf(|_, offset, len| *offset == 0 && *len == PAGE)
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Ok(()));
        let config = PoolConfig::new(DeviceId(0), [SizeClass::new(8 * PAGE, 2)]);
        let pool = Arc::new(SlotPool::new(mock, config).unwrap());
        let plain = pool.acquire(8 * PAGE, PAGE).unwrap(); // slot 0
        let mut hinted = pool.acquire(8 * PAGE, PAGE).unwrap(); // slot 1
        hinted.grow_to(2 * PAGE).unwrap();
        hinted.advise(0, PAGE, Advice::SetReadMostly).unwrap();
        let stream = Stream::new(
            crate::DriverStream::from_raw(1),
            crate::DriverContext::from_raw(0),
            IsolationLevel::Shared,
            TenantKey::fresh(TenantId(1)),
        );
        hinted
            .prefetch(PAGE, PAGE, Location::Device(DeviceId(0)), &stream)
            .unwrap();
        drop(hinted);
        let next = pool.acquire(8 * PAGE, 0).unwrap(); // slot 1 again
        drop(plain);
        let last = pool.acquire(8 * PAGE, 0).unwrap(); // slot 0 again
        let s = pool.stats();
        assert_eq!((s.hint_resets, s.bytes_scrubbed), (1, 3 * PAGE as u64));
        drop((next, last));
    }

    /// A reset that fails hands nothing out; the next try resets again without zeroing again.
    #[test]
    fn failed_hint_reset_hands_out_nothing_and_is_retried() {
        let mut mock = mock_backend(true);
        let mut seq = mockall::Sequence::new();
        mock.expect_advise().returning(|_, _, _, _| Ok(()));
        mock.expect_zero()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Ok(()));
        mock.expect_reset_hints()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Err(MockError(ErrorKind::Driver)));
        mock.expect_reset_hints()
            .withf(|_, offset, len| *offset == 0 && *len == PAGE)
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Ok(()));
        let config = PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 1)]);
        let pool = Arc::new(SlotPool::new(mock, config).unwrap());
        let first = pool.acquire(PAGE, PAGE).unwrap();
        first
            .advise(0, PAGE, Advice::SetPreferredLocation(Location::Host))
            .unwrap();
        drop(first);
        let err = pool.acquire(PAGE, PAGE).unwrap_err();
        assert!(matches!(
            err,
            Error::Backend {
                op: Operation::ResetHints,
                ..
            }
        ));
        let s = pool.stats();
        assert_eq!((s.in_use(), s.free(), s.scrub_failures), (0, 1, 1));
        let again = pool.acquire(PAGE, 0).unwrap();
        let s = pool.stats();
        assert_eq!((s.hint_resets, s.bytes_scrubbed), (1, PAGE as u64));
        drop(again);
    }

    #[test]
    fn slab_that_is_not_zeroed_is_scrubbed_in_full_before_first_use() {
        let mut mock = mock_backend(false);
        let mut seq = mockall::Sequence::new();
        for offset in [0, PAGE] {
            mock.expect_zero()
                .withf(move |_, o, len| *o == offset && *len == PAGE)
                .times(1)
                .in_sequence(&mut seq)
                .returning(|_, _, _| Ok(()));
        }
        let config = PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 2)]);
        let pool = Arc::new(SlotPool::new(mock, config).unwrap());
        let a = pool.acquire(PAGE, 0).unwrap();
        let b = pool.acquire(PAGE, 0).unwrap();
        drop((a, b)); // neither holder made anything visible: nothing more to scrub
        let c = pool.acquire(PAGE, 0).unwrap();
        assert_eq!(pool.stats().bytes_scrubbed, 2 * PAGE as u64);
        drop(c);
    }

    /// A slot whose scrub fails goes to the back of the free list: the next acquisition tries
    /// another slot of the class instead of failing on the same one again.
    #[test]
    fn a_slot_that_fails_its_scrub_does_not_block_its_class() {
        let mut mock = mock_backend(true);
        // Slot 1 (at one page) is released dirty first, then slot 0: slot 0 is on top.
        mock.expect_zero()
            .withf(|_, offset, _| *offset == 0)
            .returning(|_, _, _| Err(MockError(ErrorKind::Driver)));
        mock.expect_zero()
            .withf(|_, offset, _| *offset == PAGE)
            .times(1)
            .returning(|_, _, _| Ok(()));
        let config = PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 2)]);
        let pool = Arc::new(SlotPool::new(mock, config).unwrap());
        let zero = pool.acquire(PAGE, PAGE).unwrap();
        let one = pool.acquire(PAGE, PAGE).unwrap();
        drop(one);
        drop(zero);
        assert!(pool.acquire(PAGE, PAGE).is_err(), "slot 0's scrub fails");
        let next = pool.acquire(PAGE, PAGE).expect("slot 1, not slot 0 again");
        let s = pool.stats();
        assert_eq!((s.scrub_failures, s.bytes_scrubbed), (1, PAGE as u64));
        drop(next);
    }

    /// A slot scrubbed ahead is zero when it is handed out, and its acquisition zeroes
    /// nothing: the scrub is counted once, where it ran.
    #[test]
    fn a_slot_scrubbed_ahead_is_handed_out_zeroed_without_a_second_scrub() {
        let pool = heap_pool(&[SizeClass::new(PAGE, 2)]);
        let signals = Arc::new(core::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&signals);
        assert!(pool.on_dirty_release(Arc::new(move || {
            counted.fetch_add(1, Ordering::Relaxed);
        })));
        assert!(
            !pool.on_dirty_release(Arc::new(|| {})),
            "one signal per pool"
        );
        drop(pool.acquire(PAGE, 0).unwrap());
        assert_eq!(
            signals.load(Ordering::Relaxed),
            0,
            "nothing visible, nothing dirty"
        );
        assert!(!pool.has_dirty_free());
        assert_eq!(pool.scrub_ahead(8).unwrap(), 0);
        let mut first = pool.acquire(PAGE, PAGE).unwrap();
        first.write(100, &[0xa5; 64]).unwrap();
        drop(first);
        assert_eq!(signals.load(Ordering::Relaxed), 1);
        assert!(pool.has_dirty_free());
        assert_eq!(pool.scrub_ahead(8).unwrap(), 1);
        assert!(!pool.has_dirty_free());
        assert_eq!(pool.scrub_ahead(8).unwrap(), 0, "scrubbed once");
        let s = pool.stats();
        assert_eq!((s.scrubbed_ahead, s.bytes_scrubbed), (1, PAGE as u64));
        assert_eq!((s.acquisitions, s.releases, s.free()), (2, 2, 2));
        let second = pool.acquire(PAGE, PAGE).unwrap();
        let mut bytes = [1u8; 64];
        second.read(100, &mut bytes).unwrap();
        assert_eq!(bytes, [0; 64]);
        assert_eq!(
            pool.stats().bytes_scrubbed,
            PAGE as u64,
            "no scrub at hand-out"
        );
        drop(second);
    }

    /// With a scrub ahead, an acquisition passes over a slot given back dirty for one that is
    /// ready, and takes (and scrubs) a dirty one only when no ready one is near the top;
    /// without, it takes the most recently freed, as always.
    #[test]
    fn with_a_scrub_ahead_acquisitions_take_ready_slots_first() {
        for scrubs_ahead in [false, true] {
            let pool = heap_pool(&[SizeClass::new(PAGE, 2)]);
            if scrubs_ahead {
                assert!(pool.on_dirty_release(Arc::new(|| {})));
            }
            let mut first = pool.acquire(PAGE, PAGE).unwrap();
            first.write(0, &[7; 8]).unwrap();
            drop(first);
            assert_eq!(pool.dirty_free(), 1);
            let second = pool.acquire(PAGE, PAGE).unwrap();
            let (scrubbed, waiting) = (pool.stats().bytes_scrubbed, pool.dirty_free());
            if scrubs_ahead {
                assert_eq!((scrubbed, waiting), (0, 1), "the ready slot below it");
            } else {
                assert_eq!(
                    (scrubbed, waiting),
                    (PAGE as u64, 0),
                    "the dirty one on top"
                );
            }
            if scrubs_ahead {
                // Only the dirty one is left: taken, and scrubbed at hand-out.
                let third = pool.acquire(PAGE, PAGE).unwrap();
                let mut bytes = [1u8; 8];
                third.read(0, &mut bytes).unwrap();
                assert_eq!(bytes, [0; 8]);
                assert_eq!(pool.stats().bytes_scrubbed, PAGE as u64);
                drop(third);
            }
            drop(second);
        }
    }

    /// A pool of one page-sized slot whose first zeroing fails and whose second (of the slot's
    /// page) succeeds.
    fn pool_whose_first_zeroing_fails() -> Arc<SlotPool<MockBackend>> {
        let mut mock = mock_backend(true);
        let mut seq = mockall::Sequence::new();
        mock.expect_zero()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Err(MockError(ErrorKind::Driver)));
        mock.expect_zero()
            .withf(|_, offset, len| *offset == 0 && *len == PAGE)
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Ok(()));
        let config = PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 1)]);
        Arc::new(SlotPool::new(mock, config).unwrap())
    }

    /// A scrub that fails in the middle of a gathering does not stop it: the others of the
    /// gathering are scrubbed, the failed one goes back still dirty (counted as a failure),
    /// and the error is returned, ending the scrub ahead there (the slots of the next
    /// gathering are left waiting).
    #[test]
    fn a_failure_in_a_gathering_scrubs_the_rest_of_it() {
        let mut mock = mock_backend(true);
        let mut seq = mockall::Sequence::new();
        for fails in [false, true, false, false] {
            mock.expect_zero()
                .times(1)
                .in_sequence(&mut seq)
                .returning(move |_, _, _| {
                    if fails {
                        Err(MockError(ErrorKind::Driver))
                    } else {
                        Ok(())
                    }
                });
        }
        let config = PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 16)]);
        let pool = Arc::new(SlotPool::new(mock, config).unwrap());
        assert_eq!(pool.ahead_at_once(), 4);
        let held: Vec<_> = (0..6).map(|_| pool.acquire(PAGE, PAGE).unwrap()).collect();
        drop(held);
        assert_eq!(pool.dirty_free(), 6);
        assert!(pool.scrub_ahead(usize::MAX).is_err());
        let s = pool.stats();
        assert_eq!((s.scrubbed_ahead, s.scrub_failures), (3, 1));
        assert_eq!(
            (s.free(), pool.dirty_free()),
            (16, 3),
            "the failed one and two more wait"
        );
    }

    /// A table of `slots` page-sized slots whose records say whether a slot waits for a scrub.
    fn dirt_table(slots: u32) -> SlotTable<bool> {
        SlotTable::new(
            alloc::vec![ClassLayout {
                slot_bytes: PAGE,
                slots,
                offset: 0,
                stride: PAGE,
            }],
            |_| false,
        )
        .waiting_when(|dirty: &bool| *dirty)
    }

    /// A scrub ahead takes the slots waiting a few at a time (a quarter of the table's slots,
    /// at most [`AHEAD_MAX`]) from the top of a free list down, however deep they lie, passing
    /// over the ones that do not wait, and puts them back in one go: scrubbed ones on top,
    /// failed ones last.
    #[test]
    fn slots_are_scrubbed_ahead_a_few_at_a_time() {
        assert_eq!(
            [1, 2, 3, 4, 7, 8, 16, 64].map(|n| dirt_table(n).ahead_at_once()),
            [1, 1, 1, 1, 1, 2, 4, 4]
        );
        let table = dirt_table(16);
        let held: Vec<_> = (0..16)
            .map(|_| table.take(PAGE, |_| true).unwrap())
            .collect();
        // Back in this order, the dirty ones 0, 2, 3, 5, 6 and 7: the clean 8 to 15 on top.
        for (i, taken) in held.iter().enumerate() {
            let dirty = i < 8 && i != 1 && i != 4;
            table.give_back(taken.slot, dirty, Returned::default());
        }
        assert_eq!(table.waiting(), 6);
        let mut took = Vec::new();
        assert_eq!(table.take_dirty(3, |t| took.push(t.slot.index)), 3);
        assert_eq!(took, [7, 6, 5], "the next handed out first, however deep");
        assert_eq!(table.waiting(), 3);
        assert_eq!(
            table.take_dirty(usize::MAX, |t| took.push(t.slot.index)),
            3,
            "only those that wait"
        );
        assert_eq!(took, [7, 6, 5, 3, 2, 0]);
        assert_eq!(table.take_dirty(usize::MAX, |_| ()), 0, "none left");
        assert_eq!(table.stats().free(), 16, "a slot scrubbed ahead is free");
        table.ahead_done(took.iter().map(|&index| {
            let slot = SlotId { class: 0, index };
            let ahead = if index == 0 {
                Ahead::Failed { scrubbed: 0 }
            } else {
                Ahead::Scrubbed(Returned {
                    scrubbed: PAGE as u64,
                    hints_reset: false,
                })
            };
            (slot, index == 0, ahead)
        }));
        let s = table.stats();
        assert_eq!((s.scrubbed_ahead, s.scrub_failures, s.free()), (5, 1, 16));
        assert_eq!(s.bytes_scrubbed, 5 * PAGE as u64);
        assert_eq!(table.waiting(), 1, "the failed one waits still");
        // Scrubbed ones on top (the last put back first); the failed one last.
        let next = table.take(PAGE, |_| true).unwrap();
        assert_eq!((next.slot.index, next.meta), (2, false));
        let mut rest = Vec::new();
        while let Ok(t) = table.take(PAGE, |_| true) {
            rest.push(t.slot.index);
        }
        assert_eq!(rest.last(), Some(&0));
        // A table of four takes one at a time.
        let small = dirt_table(4);
        let held: Vec<_> = (0..4)
            .map(|_| small.take(PAGE, |_| true).unwrap())
            .collect();
        for taken in &held {
            small.give_back(taken.slot, true, Returned::default());
        }
        assert_eq!(small.take_dirty(usize::MAX, |_| ()), 1);
    }

    /// An acquisition takes the most recently freed slot, ready or waiting; once the table
    /// prefers ready slots, a ready one however deep it lies (the waiting ones are a list of
    /// their own, so nothing is searched), and a waiting one only when none is ready.
    #[test]
    fn a_ready_slot_is_found_at_any_depth_once_preferred() {
        let table = dirt_table(32);
        let held: Vec<_> = (0..32)
            .map(|_| table.take(PAGE, |_| true).unwrap())
            .collect();
        // Slot 0 back clean first, the other 31 dirty on top of it.
        for taken in &held {
            table.give_back(taken.slot, taken.slot.index != 0, Returned::default());
        }
        assert_eq!(table.waiting(), 31);
        let last = table.take(PAGE, |_| true).unwrap();
        assert_eq!(
            (last.slot.index, last.meta),
            (31, true),
            "the last freed, dirty"
        );
        table.give_back(last.slot, true, Returned::default());
        table.prefer_ready();
        let ready = table.take(PAGE, |_| true).unwrap();
        assert_eq!((ready.slot.index, ready.meta), (0, false), "31 deep");
        assert_eq!(table.waiting(), 31);
        let next = table.take(PAGE, |_| true).unwrap();
        assert_eq!(
            (next.slot.index, next.meta),
            (31, true),
            "none ready: the last freed"
        );
        assert_eq!(table.waiting(), 30);
    }

    /// A gathering passes over a class where nothing waits without searching it, and takes a
    /// quarter of a class's slots at most, so that the class's acquisitions do not all wait
    /// for one gathering.
    #[test]
    fn a_gathering_takes_a_quarter_of_a_class_at_most() {
        let table = SlotTable::new(
            alloc::vec![
                ClassLayout {
                    slot_bytes: PAGE,
                    slots: 12,
                    offset: 0,
                    stride: PAGE,
                },
                ClassLayout {
                    slot_bytes: 2 * PAGE,
                    slots: 4,
                    offset: 12 * PAGE,
                    stride: 2 * PAGE,
                },
            ],
            |_| false,
        )
        .waiting_when(|dirty: &bool| *dirty);
        assert_eq!(table.ahead_at_once(), 4);
        // Three dirty slots of the larger class, none of the smaller.
        let held: Vec<_> = (0..3)
            .map(|_| table.take(2 * PAGE, |_| true).unwrap())
            .collect();
        for taken in &held {
            assert_eq!(taken.slot.class, 1);
            table.give_back(taken.slot, true, Returned::default());
        }
        let mut took = Vec::new();
        assert_eq!(table.take_dirty(usize::MAX, |t| took.push(t.slot)), 1);
        assert_eq!(took[0].class, 1, "a quarter of four");
        assert_eq!(table.waiting(), 2);
    }

    /// A withdrawn slot is neither free nor in use: it is counted apart, in its class, and
    /// acquisitions less releases still say how many are handed out.
    #[test]
    fn withdrawn_slots_are_neither_free_nor_in_use() {
        let table = dirt_table(4);
        let a = table.take(PAGE, |_| true).unwrap();
        let b = table.take(PAGE, |_| true).unwrap();
        table.withdraw(a.slot);
        table.withdraw_taken(b.slot);
        let s = table.stats();
        assert_eq!((s.in_use(), s.free(), s.withdrawn()), (0, 2, 2));
        assert_eq!((s.acquisitions, s.releases, s.scrub_failures), (1, 1, 2));
        let c = table.take(PAGE, |_| true).unwrap();
        assert_eq!(table.stats().in_use(), 1);
        table.give_back(c.slot, false, Returned::default());
        assert!(
            table.if_idle(|| ()).is_some(),
            "no slot held: two free, two withdrawn"
        );
    }

    /// Five dirty slots of a pool of sixteen are scrubbed ahead in two gatherings (four, then
    /// one), every one of them counted and zeroed.
    #[test]
    fn a_scrub_ahead_of_more_slots_than_one_gathering_scrubs_them_all() {
        let pool = heap_pool(&[SizeClass::new(PAGE, 16)]);
        let mut held = Vec::new();
        for _ in 0..5 {
            let mut slot = pool.acquire(PAGE, PAGE).unwrap();
            slot.write(8, &[0x5a; 8]).unwrap();
            held.push(slot);
        }
        drop(held);
        assert_eq!(pool.dirty_free(), 5);
        assert_eq!(pool.scrub_ahead(usize::MAX).unwrap(), 5);
        assert_eq!(pool.dirty_free(), 0);
        let s = pool.stats();
        assert_eq!((s.scrubbed_ahead, s.bytes_scrubbed), (5, 5 * PAGE as u64));
        let before = s.bytes_scrubbed;
        let all: Vec<_> = (0..16).map(|_| pool.acquire(PAGE, PAGE).unwrap()).collect();
        for slot in &all {
            let mut bytes = [1u8; 8];
            slot.read(8, &mut bytes).unwrap();
            assert_eq!(bytes, [0; 8]);
        }
        assert_eq!(
            pool.stats().bytes_scrubbed,
            before,
            "no acquisition scrubbed"
        );
    }

    /// A scrub ahead that fails puts its slot back still dirty, last in its class, with the
    /// failure counted: the acquisition that takes it scrubs it itself.
    #[test]
    fn a_failed_scrub_ahead_leaves_the_slot_to_its_acquisition() {
        let pool = pool_whose_first_zeroing_fails();
        drop(pool.acquire(PAGE, PAGE).unwrap());
        let err = pool.scrub_ahead(4).unwrap_err();
        assert!(matches!(
            err,
            Error::Backend {
                op: Operation::Zero,
                ..
            }
        ));
        let s = pool.stats();
        assert_eq!((s.scrub_failures, s.scrubbed_ahead, s.free()), (1, 0, 1));
        assert!(pool.has_dirty_free(), "still waiting for its scrub");
        drop(pool.acquire(PAGE, PAGE).unwrap());
        let s = pool.stats();
        assert_eq!((s.bytes_scrubbed, s.acquisitions), (PAGE as u64, 2));
    }

    /// Threads take, write and give back slots while another scrubs ahead without pause:
    /// every holder finds its slot zeroed, whoever scrubbed it, and finds one free.
    #[test]
    fn scrubbing_ahead_beside_acquisitions_never_hands_out_a_dirty_slot() {
        // As many slots as holders: a slot being scrubbed ahead is free, never an exhaustion.
        let pool = heap_pool(&[SizeClass::new(PAGE, 3)]);
        let stop = Arc::new(AtomicBool::new(false));
        std::thread::scope(|scope| {
            let scrubber = {
                let (pool, stop) = (Arc::clone(&pool), Arc::clone(&stop));
                scope.spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        pool.scrub_ahead(usize::MAX).unwrap();
                        core::hint::spin_loop();
                    }
                })
            };
            let holders: Vec<_> = (0..3u8)
                .map(|t| {
                    let pool = Arc::clone(&pool);
                    scope.spawn(move || {
                        for round in 0..300u32 {
                            let mut slot = pool.acquire(PAGE, PAGE).unwrap();
                            let mut bytes = [1u8; 256];
                            slot.read(PAGE - 256, &mut bytes).unwrap();
                            assert_eq!(bytes, [0; 256], "thread {t} round {round}");
                            slot.write(PAGE - 256, &[t + 1; 256]).unwrap();
                        }
                    })
                })
                .collect();
            for holder in holders {
                holder.join().unwrap();
            }
            stop.store(true, Ordering::Release);
            scrubber.join().unwrap();
        });
        let s = pool.stats();
        assert_eq!((s.acquisitions, s.releases, s.free()), (900, 900, 3));
        assert_eq!(s.exhaustions, 0);
        assert!(s.scrubbed_ahead <= 900, "{s:?}");
        assert_eq!(s.scrub_failures, 0);
    }

    /// Heap memory that counts where it is zeroed, can hold a zeroing until told to go, and
    /// has a fence the test sets: what the scrub-ahead cases need to see.
    #[derive(Default)]
    struct Watched {
        heap: HeapAllocator,
        not_zeroed: bool,
        fenced: AtomicBool,
        device_zeroes: core::sync::atomic::AtomicUsize,
        host_zeroes: core::sync::atomic::AtomicUsize,
        /// While set, a zeroing meets the test at the first barrier and waits at the second.
        hold: Option<(std::sync::Barrier, std::sync::Barrier)>,
        /// While set, a zeroing panics (a backend's bug).
        panics: AtomicBool,
    }

    impl ErrorType for Watched {
        type Error = <HeapAllocator as ErrorType>::Error;
    }

    // SAFETY: every call is `HeapAllocator`'s, which upholds the contract.
    unsafe impl ManagedAllocator for Watched {
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                comes_zeroed: !self.not_zeroed,
                ..self.heap.capabilities()
            }
        }
        fn device_count(&self) -> u32 {
            1
        }
        fn device_fenced(&self, _: DeviceId) -> bool {
            self.fenced.load(Ordering::SeqCst)
        }
        fn allocate(&self, device: DeviceId, bytes: usize) -> Result<Allocation, Self::Error> {
            self.heap.allocate(device, bytes)
        }
        unsafe fn free(
            &self,
            allocation: Allocation,
        ) -> Result<(), crate::Refused<Allocation, Self::Error>> {
            // SAFETY: the caller's contract, which is the heap's.
            unsafe { self.heap.free(allocation) }
        }
        unsafe fn zero(&self, a: &Allocation, at: usize, len: usize) -> Result<(), Self::Error> {
            // SAFETY: the caller's contract, which is the heap's.
            unsafe { self.zeroing(&self.device_zeroes, a, at, len) }
        }
        unsafe fn zero_on_host(
            &self,
            a: &Allocation,
            at: usize,
            len: usize,
        ) -> Result<(), Self::Error> {
            // SAFETY: the caller's contract, which is the heap's.
            unsafe { self.zeroing(&self.host_zeroes, a, at, len) }
        }
    }

    impl Watched {
        /// A zeroing, held if the test holds them, counted in `count`.
        ///
        /// # Safety
        ///
        /// [`ManagedAllocator::zero`]'s contract.
        unsafe fn zeroing(
            &self,
            count: &core::sync::atomic::AtomicUsize,
            a: &Allocation,
            at: usize,
            len: usize,
        ) -> Result<(), <HeapAllocator as ErrorType>::Error> {
            if let Some((entered, go)) = &self.hold {
                entered.wait();
                go.wait();
            }
            assert!(!self.panics.load(Ordering::SeqCst), "a backend's bug");
            count.fetch_add(1, Ordering::SeqCst);
            // SAFETY: the caller's contract, which is the heap's.
            unsafe { self.heap.zero(a, at, len) }
        }
    }

    impl crate::Advisor for Watched {
        fn advise(&self, a: &Allocation, o: usize, l: usize, v: Advice) -> Result<(), Self::Error> {
            self.heap.advise(a, o, l, v)
        }
        fn prefetch(
            &self,
            a: &Allocation,
            o: usize,
            l: usize,
            at: Location,
            s: &Stream,
        ) -> Result<(), Self::Error> {
            self.heap.prefetch(a, o, l, at, s)
        }
        fn reset_hints(&self, a: &Allocation, o: usize, l: usize) -> Result<(), Self::Error> {
            self.heap.reset_hints(a, o, l)
        }
    }

    fn watched_pool(watched: Watched, slots: usize) -> Arc<SlotPool<Watched>> {
        let config = PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, slots)]);
        SlotPool::shared(watched, config).unwrap()
    }

    fn zeroes(pool: &SlotPool<Watched>) -> (usize, usize) {
        let w = pool.allocator();
        (
            w.host_zeroes.load(Ordering::SeqCst),
            w.device_zeroes.load(Ordering::SeqCst),
        )
    }

    /// A slab that does not come zeroed starts with every slot dirty in full, but none waits
    /// for a scrub ahead: a slot no one takes keeps no pages committed; its acquisition zeroes
    /// it in full, on the host.
    #[test]
    fn fresh_slots_are_left_to_their_acquisition() {
        let pool = watched_pool(
            Watched {
                not_zeroed: true,
                ..Watched::default()
            },
            2,
        );
        assert!(!pool.has_dirty_free());
        assert_eq!(pool.scrub_ahead(usize::MAX).unwrap(), 0);
        assert_eq!(zeroes(&pool), (0, 0));
        let held = pool.acquire(PAGE, 0).unwrap();
        assert_eq!(zeroes(&pool), (1, 0));
        assert_eq!(pool.stats().bytes_scrubbed, PAGE as u64, "in full");
        drop(held); // nothing visible: clean
        assert!(!pool.has_dirty_free());
        let mut held = pool.acquire(PAGE, PAGE).unwrap();
        held.write(0, &[1; 8]).unwrap();
        drop(held);
        assert!(pool.has_dirty_free(), "a holder's dirt waits");
        assert_eq!(pool.scrub_ahead(usize::MAX).unwrap(), 1);
        assert_eq!(pool.stats().scrubbed_ahead, 1);
    }

    /// A scrub ahead whose backend panics mid-scrub puts its slot back dirty and leaves no
    /// count behind: an acquisition is not kept waiting for it, nor a recovery.
    #[test]
    fn a_panic_in_a_scrub_ahead_loses_no_slot() {
        let pool = watched_pool(
            Watched {
                panics: AtomicBool::new(true),
                ..Watched::default()
            },
            1,
        );
        drop(pool.acquire(PAGE, PAGE).unwrap());
        let unwound =
            std::panic::catch_unwind(core::panic::AssertUnwindSafe(|| pool.scrub_ahead(1)));
        assert!(unwound.is_err());
        let s = pool.stats();
        assert_eq!((s.free(), s.in_use(), s.scrub_failures), (1, 0, 1));
        assert!(pool.has_dirty_free(), "still waiting");
        lost_nothing_to_a_panic(&pool);
    }

    /// A waiting slot is scrubbed ahead however deep in its free list it lies (eighty dirty
    /// slots, every one reached).
    #[test]
    fn a_scrub_ahead_reaches_slots_deep_in_a_free_list() {
        let pool = heap_pool(&[SizeClass::new(PAGE, 80)]);
        let held: Vec<_> = (0..80).map(|_| pool.acquire(PAGE, PAGE).unwrap()).collect();
        drop(held);
        assert_eq!(pool.dirty_free(), 80);
        assert_eq!(pool.scrub_ahead(usize::MAX).unwrap(), 80);
        assert_eq!((pool.dirty_free(), pool.stats().scrubbed_ahead), (0, 80));
    }

    /// A backend that panics in the first scrub of a gathering of four: that one slot counts
    /// as a failed scrub, the three not reached go back untouched, all four free and dirty.
    #[test]
    fn a_panic_in_a_gathering_counts_one_failure() {
        let pool = watched_pool(
            Watched {
                panics: AtomicBool::new(true),
                ..Watched::default()
            },
            16,
        );
        let held: Vec<_> = (0..4).map(|_| pool.acquire(PAGE, PAGE).unwrap()).collect();
        drop(held);
        assert_eq!(pool.dirty_free(), 4);
        let unwound = std::panic::catch_unwind(core::panic::AssertUnwindSafe(|| {
            pool.scrub_ahead(usize::MAX)
        }));
        assert!(unwound.is_err());
        let s = pool.stats();
        assert_eq!((s.free(), s.scrub_failures, s.scrubbed_ahead), (16, 1, 0));
        assert_eq!(pool.dirty_free(), 4, "all four still wait");
        pool.allocator().panics.store(false, Ordering::SeqCst);
        assert_eq!(pool.scrub_ahead(usize::MAX).unwrap(), 4);
    }

    /// After a backend's panic mid-scrub (the panics stopped): the slot is handed out again,
    /// zeroed by its acquisition, and on a fenced device the pool lets its slab go (no slot is
    /// held, and no scrub counted as running).
    fn lost_nothing_to_a_panic(pool: &Arc<SlotPool<Watched>>) {
        use crate::allocator::IdleHolder;
        pool.allocator().panics.store(false, Ordering::SeqCst);
        let again = pool
            .acquire(PAGE, PAGE)
            .expect("the slot, scrubbed by its acquisition");
        let mut bytes = [1u8; 8];
        again.read(0, &mut bytes).unwrap();
        assert_eq!(bytes, [0; 8]);
        drop(again);
        pool.allocator().fenced.store(true, Ordering::SeqCst);
        pool.let_go_if_fenced();
        assert!(pool.stats().slab_given_up);
    }

    /// An acquisition whose backend panics mid-scrub puts its slot back dirty, counted as a
    /// failed scrub: the slot is not lost, the next acquisition scrubs it, and a fenced device
    /// lets the slab go (no slot is left held for ever).
    #[test]
    fn a_panic_in_an_acquisitions_scrub_loses_no_slot() {
        let pool = watched_pool(Watched::default(), 1);
        let mut first = pool.acquire(PAGE, PAGE).unwrap();
        first.write(0, &[0xa5; 8]).unwrap();
        drop(first);
        pool.allocator().panics.store(true, Ordering::SeqCst);
        let unwound =
            std::panic::catch_unwind(core::panic::AssertUnwindSafe(|| pool.acquire(PAGE, PAGE)));
        assert!(unwound.is_err());
        let s = pool.stats();
        assert_eq!(
            (s.free(), s.in_use(), s.scrub_failures, s.acquisitions),
            (1, 0, 1, 1)
        );
        lost_nothing_to_a_panic(&pool);
    }

    /// A slot device work touched, and whose holder advised it, is scrubbed ahead as its
    /// acquisition would: zeroed on the device, its hints reset.
    #[test]
    fn a_device_touched_hinted_slot_is_scrubbed_ahead_on_the_device() {
        let pool = watched_pool(Watched::default(), 1);
        let slot = pool.acquire(PAGE, PAGE).unwrap();
        slot.advise(0, PAGE, Advice::SetReadMostly).unwrap();
        slot.device_slice(0, PAGE).unwrap();
        drop(slot);
        assert_eq!(pool.scrub_ahead(1).unwrap(), 1);
        assert_eq!(zeroes(&pool), (0, 1), "on the device");
        let s = pool.stats();
        assert_eq!(
            (s.hint_resets, s.scrubbed_ahead, s.bytes_scrubbed),
            (1, 1, PAGE as u64)
        );
        drop(pool.acquire(PAGE, PAGE).unwrap());
        assert_eq!(zeroes(&pool), (0, 1), "nothing at hand-out");
        assert_eq!(pool.stats().hint_resets, 1);
    }

    /// A one-slot pool whose slot, dirty, is being scrubbed ahead on another thread (its
    /// zeroing held) while `during` starts a thread, and for 50 ms more (time for a call that
    /// should wait but does not to end); then the scrub goes on. The pool, that thread, and
    /// whether it had ended before the scrub went on (it should have waited for it).
    fn while_a_scrub_ahead_is_held<T>(
        during: impl FnOnce(&Arc<SlotPool<Watched>>) -> std::thread::JoinHandle<T>,
    ) -> (Arc<SlotPool<Watched>>, std::thread::JoinHandle<T>, bool) {
        let pool = watched_pool(
            Watched {
                hold: Some((std::sync::Barrier::new(2), std::sync::Barrier::new(2))),
                ..Watched::default()
            },
            1,
        );
        drop(pool.acquire(PAGE, PAGE).unwrap());
        let scrubber = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || pool.scrub_ahead(1))
        };
        let (entered, go) = pool.allocator().hold.as_ref().unwrap();
        entered.wait(); // the slot is off its free list, being zeroed
        let during = during(&pool);
        std::thread::sleep(core::time::Duration::from_millis(50));
        let ended = during.is_finished();
        go.wait();
        assert_eq!(scrubber.join().unwrap().unwrap(), 1);
        (pool, during, ended)
    }

    /// An acquisition that finds its class's only free slot being scrubbed ahead waits for it
    /// (one scrub) rather than calling the pool exhausted.
    #[test]
    fn an_acquisition_waits_for_the_slot_being_scrubbed_ahead() {
        let (pool, acquirer, ended) = while_a_scrub_ahead_is_held(|pool| {
            assert_eq!(
                pool.stats().free(),
                1,
                "a slot scrubbed ahead counts as free"
            );
            let pool = Arc::clone(pool);
            std::thread::spawn(move || pool.acquire(PAGE, PAGE).map(drop))
        });
        acquirer.join().unwrap().expect("the slot, once scrubbed");
        assert!(!ended, "the acquisition waited for the scrub");
        let s = pool.stats();
        assert_eq!((s.exhaustions, s.acquisitions), (0, 2));
        assert_eq!(zeroes(&pool), (1, 0));
    }

    /// A recovery that asks the pool to let its slab go while a slot is being scrubbed ahead
    /// (the device fenced meanwhile) waits for that slot rather than finding the pool busy and
    /// leaving the device fenced: the slab is given up once the scrub is back.
    #[test]
    fn letting_go_on_a_fenced_device_waits_for_a_scrub_ahead() {
        use crate::allocator::IdleHolder;
        let (pool, recovery, ended) = while_a_scrub_ahead_is_held(|pool| {
            pool.allocator().fenced.store(true, Ordering::SeqCst);
            let pool = Arc::clone(pool);
            std::thread::spawn(move || pool.let_go_if_fenced())
        });
        recovery.join().unwrap();
        assert!(
            !ended,
            "the recovery's request returned while the slot was held"
        );
        assert!(pool.stats().slab_given_up, "{:?}", pool.stats());
    }

    #[test]
    fn failed_scrub_hands_out_nothing_and_charges_nothing() {
        let pool = pool_whose_first_zeroing_fails();
        drop(pool.acquire(PAGE, PAGE).unwrap()); // dirty to one page
        let tenant = Arc::new(TenantLedger::new(
            TenantId(3),
            PAGE as u64,
            IsolationLevel::Shared,
        ));
        let attempt = tenant
            .try_reserve(PAGE as u64)
            .map_err(Error::from)
            .and_then(|r| pool.acquire(PAGE, PAGE).map(|b| (r, b)));
        let err = attempt.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Driver);
        assert!(matches!(
            err,
            Error::Backend {
                op: Operation::Zero,
                ..
            }
        ));
        assert_eq!(tenant.stats().touched_bytes, 0, "no ledger charge left");
        let s = pool.stats();
        assert_eq!(
            (s.in_use(), s.free(), s.scrub_failures),
            (0, 1, 1),
            "no leaked slot"
        );
        // The slot is still dirty and is scrubbed on the next try.
        let b = pool.acquire(PAGE, 0).unwrap();
        assert_eq!(pool.stats().bytes_scrubbed, PAGE as u64);
        drop(b);
    }

    #[test]
    fn failing_allocator_builds_no_pool() {
        let mut mock = MockBackend::new();
        mock.expect_allocate()
            .times(1)
            .returning(|_, _| Err(MockError(ErrorKind::OutOfMemory)));
        mock.expect_free().never();
        let err = SlotPool::new(
            mock,
            PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 1)]),
        )
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfMemory);
        assert!(matches!(
            err,
            Error::Backend {
                op: Operation::Allocate,
                ..
            }
        ));
    }

    #[test]
    fn pool_frees_its_slab_once() {
        let mut mock = MockBackend::new();
        mock.expect_capabilities().return_const(Capabilities {
            host_accessible: true,
            comes_zeroed: true,
            ..Capabilities::NONE
        });
        mock.expect_allocate()
            .times(1)
            .returning(|d, b| HEAP.allocate(d, b).map_err(|e| MockError(e.kind)));
        mock.expect_free().times(1).returning(|a| {
            // SAFETY: the allocation came from `HEAP`.
            unsafe { HEAP.free(a) }.map_err(|r| r.map_error(|e| MockError(e.kind)))
        });
        let pool = Arc::new(
            SlotPool::new(
                mock,
                PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 2)]),
            )
            .unwrap(),
        );
        let slot = pool.acquire(PAGE, 0).unwrap();
        drop(pool); // the slot keeps the pool alive
        drop(slot); // now the slab is freed, once
    }

    #[rstest]
    #[case::no_classes(&[])]
    #[case::zero_slots(&[SizeClass::new(PAGE, 0)])]
    #[case::zero_bytes(&[SizeClass::new(0, 1)])]
    #[case::same_after_rounding(&[SizeClass::new(1, 1), SizeClass::new(PAGE, 1)])]
    #[case::overflow(&[SizeClass::new(usize::MAX, 1)])]
    #[case::total_overflow(&[SizeClass::new(PAGE, usize::MAX / PAGE)])]
    fn invalid_configs(#[case] classes: &[SizeClass]) {
        let heap = HeapAllocator::new();
        let err = SlotPool::new(&heap, PoolConfig::new(DeviceId(0), classes.iter().copied()))
            .unwrap_err();
        assert!(matches!(err, Error::Pool(_)), "{err:?}");
        assert_eq!(heap.live(), 0);
    }

    #[test]
    fn concurrent_acquire_release() {
        let pool = heap_pool(&[SizeClass::new(PAGE, 4)]);
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let pool = Arc::clone(&pool);
                std::thread::spawn(move || {
                    let mut ok = 0;
                    for i in 0..2_000 {
                        if let Ok(mut b) = pool.acquire(PAGE, 64) {
                            let mut probe = [0u8; 64];
                            b.read(0, &mut probe).unwrap();
                            assert_eq!(probe, [0; 64], "a slot must come back scrubbed");
                            b.write(0, &[(t * 31 + i) as u8 | 1; 64]).unwrap();
                            ok += 1;
                        }
                    }
                    ok
                })
            })
            .collect();
        let ok: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        let s = pool.stats();
        assert_eq!(s.acquisitions, ok);
        assert_eq!(s.releases, ok);
        assert_eq!(s.free(), 4);
    }
}

#[cfg(test)]
mod model {
    //! The slot pool against a plain model: random sequences of acquire, grow, write, release
    //! and scrubs ahead.
    use super::*;
    use crate::doc_support::HeapAllocator;
    use crate::{DeviceId, ErrorKind};
    use alloc::vec::Vec;
    use hashbrown::HashMap;
    use proptest::prelude::*;

    const PAGE: usize = SLOT_ALIGN;

    #[derive(Clone, Debug)]
    enum Op {
        /// Acquire a slot of `pages` capacity with `visible` pages visible.
        Acquire(usize, usize),
        /// Grow holder `i` to `pages`.
        Grow(usize, usize),
        /// Fill holder `i`'s window with a byte.
        Write(usize, u8),
        /// Release holder `i`.
        Release(usize),
        /// Scrub every free slot that waits for it, ahead of its acquisition.
        ScrubAhead,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..=4, 0usize..=4).prop_map(|(c, v)| Op::Acquire(c, v)),
            (any::<usize>(), 0usize..=4).prop_map(|(i, p)| Op::Grow(i, p)),
            (any::<usize>(), 1u8..=255).prop_map(|(i, b)| Op::Write(i, b)),
            any::<usize>().prop_map(Op::Release),
            Just(Op::ScrubAhead),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn pool_matches_the_model(ops in proptest::collection::vec(op(), 1..40)) {
            // Classes: 2 slots of 1 page, 2 slots of 4 pages.
            let pool = Arc::new(
                SlotPool::new(
                    HeapAllocator::new(),
                    PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 2), SizeClass::new(4 * PAGE, 2)]),
                )
                .unwrap(),
            );
            // The model: per holder, (capacity, visible bytes); free slots per class.
            let mut holders: Vec<(UnifiedBuffer<HeapAllocator>, usize, usize)> = Vec::new();
            let mut scrubbed = 0u64;
            // Per slot base address: bytes its last holder made visible (what must be scrubbed).
            let mut dirty: HashMap<usize, usize> = HashMap::new();
            for op in ops {
                match op {
                    Op::Acquire(cap_pages, visible_pages) => {
                        let (capacity, visible) = (cap_pages * PAGE, visible_pages.min(cap_pages) * PAGE);
                        let small_free = 2 - holders.iter().filter(|h| h.0.slot_bytes() == Some(PAGE)).count();
                        let large_free = 2 - holders.iter().filter(|h| h.0.slot_bytes() == Some(4 * PAGE)).count();
                        let fits = (capacity <= PAGE && small_free > 0) || large_free > 0;
                        match pool.acquire(capacity, visible) {
                            Ok(buf) => {
                                prop_assert!(fits, "acquired with no fitting slot free");
                                let base = buf.as_ptr() as usize;
                                scrubbed += dirty.remove(&base).unwrap_or(0) as u64;
                                let mut bytes = alloc::vec![1u8; visible];
                                buf.read(0, &mut bytes).unwrap();
                                prop_assert!(bytes.iter().all(|&b| b == 0), "a slot must come zeroed");
                                holders.push((buf, capacity, visible));
                            }
                            Err(e) => {
                                prop_assert!(!fits, "refused with a fitting slot free: {:?}", e);
                                prop_assert_eq!(e.kind(), ErrorKind::PoolExhausted);
                            }
                        }
                    }
                    Op::Grow(i, pages) if !holders.is_empty() => {
                        let i = i % holders.len();
                        let (buf, capacity, visible) = &mut holders[i];
                        let target = pages * PAGE;
                        let ok = buf.grow_to(target).is_ok();
                        prop_assert_eq!(ok, target <= *capacity);
                        if ok {
                            *visible = (*visible).max(target);
                        }
                        prop_assert_eq!(buf.len(), *visible);
                    }
                    Op::Write(i, byte) if !holders.is_empty() => {
                        let i = i % holders.len();
                        let (buf, _, visible) = &mut holders[i];
                        let data = alloc::vec![byte; *visible];
                        buf.write(0, &data).unwrap();
                    }
                    Op::Release(i) if !holders.is_empty() => {
                        let i = i % holders.len();
                        let (buf, _, visible) = holders.swap_remove(i);
                        dirty.insert(buf.as_ptr() as usize, visible);
                    }
                    Op::ScrubAhead => {
                        let waiting = dirty.values().filter(|&&d| d > 0).count();
                        prop_assert_eq!(pool.scrub_ahead(usize::MAX).unwrap(), waiting);
                        scrubbed += dirty.drain().map(|(_, d)| d as u64).sum::<u64>();
                    }
                    _ => {}
                }
                let s = pool.stats();
                prop_assert_eq!(s.in_use(), holders.len());
                prop_assert_eq!(s.bytes_scrubbed, scrubbed, "scrubbing is exactly the high-water marks");
                prop_assert_eq!(pool.has_dirty_free(), dirty.values().any(|&d| d > 0), "the count of slots waiting is exact");
            }
        }
    }
}
