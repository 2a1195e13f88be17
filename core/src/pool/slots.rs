//! [`SlotTable`]: the bookkeeping every slot pool shares, whatever its slots are made of (a
//! managed slab, guarded host address space): the size classes as [`PoolConfig::layout`]
//! placed them, a free list per class (the most recently freed slot reused first), what each
//! slot's next scrub needs to know, and one set of figures ([`PoolStats`]).
//!
//! A pool decides *how* a slot is scrubbed (when it is handed out, or when it comes back) and
//! tells the table what happened; the table decides nothing about memory.
//!
//! [`PoolConfig::layout`]: super::PoolConfig::layout

use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::config::{ClassLayout, ClassStats, PoolError, PoolStats};

/// One slot: its class and its index in the class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotId {
    /// The class, in the table's order (smallest slot first).
    pub class: usize,
    /// The slot's index in its class.
    pub index: u32,
}

/// A slot taken off its free list, with what the pool recorded for it when it came back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Taken<M> {
    /// Which slot.
    pub slot: SlotId,
    /// Its class's layout (size, offset, stride).
    pub layout: ClassLayout,
    /// What the pool recorded when it was last given back (or at the start).
    pub meta: M,
}

impl<M> Taken<M> {
    /// The slot's start, from the start of the pool.
    #[must_use]
    pub fn offset(&self) -> usize {
        self.layout.offset + self.layout.stride * self.slot.index as usize
    }
}

/// The most slots one [`SlotTable::take_dirty`] hands out to be scrubbed ahead: a scrubbing
/// thread takes the table's lock once to take them and once to put them back, rather than
/// twice per slot.
pub const AHEAD_MAX: usize = 4;

/// How a slot taken to be scrubbed ahead ([`SlotTable::take_dirty`]) goes back
/// ([`SlotTable::ahead_done`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ahead {
    /// Scrubbed: what was done.
    Scrubbed(Returned),
    /// The scrub failed after zeroing `scrubbed` bytes.
    Failed {
        /// Bytes zeroed before the failure.
        scrubbed: u64,
    },
    /// Nothing was done (the pool could not scrub it after all).
    Untouched,
}

/// How a slot came back to its pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Returned {
    /// Bytes the pool zeroed as the slot came back (0 for a pool that scrubs on handing out).
    pub scrubbed: u64,
    /// Its hints were reset as it came back.
    pub hints_reset: bool,
}

#[derive(Debug)]
struct Counters {
    acquisitions: u64,
    releases: u64,
    bytes_scrubbed: u64,
    scrub_failures: u64,
    hint_resets: u64,
    exhaustions: u64,
    scrubbed_ahead: u64,
}

impl Counters {
    /// Counts a scrub that was done.
    fn scrubbed(&mut self, returned: Returned) {
        self.bytes_scrubbed += returned.scrubbed;
        self.hint_resets += u64::from(returned.hints_reset);
    }
}

/// A class's free slots are kept on two lists, by whether the table's `waits` accepts their
/// record: those ready to be handed out as they are, and those that wait for a scrub ahead. A
/// slot's place in the order they were freed in is its stamp (`freed`), so that a table that
/// does not prefer ready slots still hands out the most recently freed of both lists; one that
/// does ([`SlotTable::prefer_ready`]) and a scrub ahead each pop the top of their own list,
/// and neither searches the other's slots nor reads their records.
#[derive(Debug)]
struct Class<M> {
    /// Free slots whose record does not wait; the last is handed out first.
    ready: Vec<u32>,
    /// Free slots whose record waits for a scrub ahead (their sum is `TableState::waiting`);
    /// the last is the most recently freed.
    waiting: Vec<u32>,
    /// Free slots taken off `waiting` to be scrubbed ahead ([`SlotTable::take_dirty`]), back
    /// soon.
    ahead: u32,
    /// Slots of this class withdrawn for good (their sum is `TableState::withdrawn`).
    withdrawn: usize,
    /// Per slot: what its next scrub needs to know.
    meta: Vec<M>,
    /// Per slot: when it was last freed, in the class's order: larger is more recent. A slot
    /// put on top of its list is stamped `newest + 1`, one put last `oldest - 1`, so each
    /// list is in stamp order and the two tops say which was freed last.
    freed: Vec<i64>,
    /// The largest and smallest stamps given.
    newest: i64,
    oldest: i64,
}

impl<M> Class<M> {
    /// Free slots, ready or waiting (not those being scrubbed ahead).
    fn free_len(&self) -> usize {
        self.ready.len() + self.waiting.len()
    }

    /// Puts `index` on `waits`' list: on top (the most recently freed), or `last`.
    fn push(&mut self, index: u32, waits: bool, last: bool) {
        let list = if waits {
            &mut self.waiting
        } else {
            &mut self.ready
        };
        if last {
            self.oldest -= 1;
            self.freed[index as usize] = self.oldest;
            list.insert(0, index);
        } else {
            self.newest += 1;
            self.freed[index as usize] = self.newest;
            list.push(index);
        }
    }

    /// Takes the top of the ready list if `prefer_ready` and it has one, or else the most
    /// recently freed of the two tops; `Some(true)` if it was a waiting one.
    fn pop(&mut self, prefer_ready: bool) -> Option<(u32, bool)> {
        let from_waiting = match (self.ready.last(), self.waiting.last()) {
            (None, None) => return None,
            (Some(_), None) => false,
            (None, Some(_)) => true,
            (Some(_), Some(_)) if prefer_ready => false,
            (Some(&r), Some(&w)) => self.freed[w as usize] > self.freed[r as usize],
        };
        let list = if from_waiting {
            &mut self.waiting
        } else {
            &mut self.ready
        };
        list.pop().map(|index| (index, from_waiting))
    }
}

#[derive(Debug)]
struct TableState<M> {
    classes: Vec<Class<M>>,
    counters: Counters,
    /// Slots withdrawn for good (off the free lists, held by no one).
    withdrawn: usize,
    /// Free slots whose record the table's `waits` accepts (waiting for a scrub ahead).
    waiting: usize,
}

impl<M> TableState<M> {
    /// No slot is held: every slot is free or withdrawn.
    fn idle(&self, layout: &[ClassLayout]) -> bool {
        let free: usize = self.classes.iter().map(Class::free_len).sum();
        let slots: usize = layout.iter().map(|c| c.slots as usize).sum();
        free + self.withdrawn == slots
    }
}

/// Sorts every class's free slots afresh onto the list `waits` says (each list keeps the order
/// they were freed in), counts the waiting ones, and publishes the count.
fn recount<M>(state: &mut TableState<M>, waits: fn(&M) -> bool, published: &AtomicUsize) {
    for c in &mut state.classes {
        let mut free: Vec<u32> = c.ready.drain(..).chain(c.waiting.drain(..)).collect();
        free.sort_unstable_by_key(|&i| c.freed[i as usize]);
        for index in free {
            if waits(&c.meta[index as usize]) {
                c.waiting.push(index);
            } else {
                c.ready.push(index);
            }
        }
    }
    state.waiting = state.classes.iter().map(|c| c.waiting.len()).sum();
    published.store(state.waiting, Ordering::Relaxed);
}

/// Every slot of `layout` free, with `initial(class)` recorded, on the ready list (the table's
/// `recount` sorts them onto their lists): slot 0 on top, the first handed out.
fn fresh_classes<M: Copy>(
    layout: &[ClassLayout],
    initial: &impl Fn(&ClassLayout) -> M,
) -> Vec<Class<M>> {
    layout
        .iter()
        .map(|c| Class {
            ready: (0..c.slots).rev().collect(),
            waiting: Vec::with_capacity(c.slots as usize),
            ahead: 0,
            withdrawn: 0,
            meta: alloc::vec![initial(c); c.slots as usize],
            // Slot 0 the most recently freed, slot `slots - 1` the least.
            freed: (0..i64::from(c.slots)).map(|i| -i).collect(),
            newest: 0,
            oldest: 1 - i64::from(c.slots),
        })
        .collect()
}

/// Free lists, per-slot records and figures of a slot pool: the bookkeeping every slot pool
/// shares, whatever its slots are made of (a managed slab, guarded host address space): the
/// size classes as [`PoolConfig::layout`](super::PoolConfig::layout) placed them, a free list
/// per class (the most recently freed slot reused first), what each slot's next scrub needs to
/// know, and one set of figures ([`PoolStats`]). A pool decides *how* a slot is scrubbed (when
/// it is handed out, or when it comes back) and tells the table what happened; the table
/// decides nothing about memory.
#[derive(Debug)]
pub struct SlotTable<M> {
    layout: Vec<ClassLayout>,
    state: spin::Mutex<TableState<M>>,
    /// Which free slots wait for a scrub ahead ([`waiting_when`](Self::waiting_when)).
    waits: fn(&M) -> bool,
    /// An acquisition takes a ready slot before a waiting one, however recently the waiting
    /// one was freed ([`prefer_ready`](Self::prefer_ready)): set once, when something scrubs
    /// ahead.
    prefer_ready: core::sync::atomic::AtomicBool,
    /// `TableState::waiting`, stored under the lock at each change, for readers without it;
    /// alone on its cache line (a scrubbing thread polls it while acquisitions write beside).
    waiting: super::CacheLine<AtomicUsize>,
    /// What acquisitions scrubbed ([`scrubbed`](Self::scrubbed)): bytes, and hint resets.
    /// Counted without the lock (an acquisition takes it once, to take its slot), and added
    /// to the counters under the lock in [`stats`](Self::stats).
    scrubbed_on_take: (AtomicU64, AtomicU64),
}

impl<M: Copy> SlotTable<M> {
    /// A table over `layout` (smallest slot first, as [`PoolConfig::layout`] returns it), every
    /// slot free with `initial(class)` recorded.
    ///
    /// [`PoolConfig::layout`]: super::PoolConfig::layout
    pub fn new(layout: Vec<ClassLayout>, initial: impl Fn(&ClassLayout) -> M) -> Self {
        let classes = fresh_classes(&layout, &initial);
        let mut table = Self {
            layout,
            waits: |_| false,
            prefer_ready: core::sync::atomic::AtomicBool::new(false),
            waiting: super::CacheLine(AtomicUsize::new(0)),
            scrubbed_on_take: (AtomicU64::new(0), AtomicU64::new(0)),
            state: spin::Mutex::new(TableState {
                classes,
                counters: Counters {
                    acquisitions: 0,
                    releases: 0,
                    bytes_scrubbed: 0,
                    scrub_failures: 0,
                    hint_resets: 0,
                    exhaustions: 0,
                    scrubbed_ahead: 0,
                },
                withdrawn: 0,
                waiting: 0,
            }),
        };
        recount(table.state.get_mut(), table.waits, &table.waiting.0);
        table
    }

    /// Counts the free slots whose record `waits` accepts ([`waiting`](Self::waiting)), and has
    /// [`take_dirty`](Self::take_dirty) take them: the slots a pool scrubs ahead. None by
    /// default.
    #[must_use]
    pub fn waiting_when(mut self, waits: fn(&M) -> bool) -> Self {
        self.waits = waits;
        recount(self.state.get_mut(), waits, &self.waiting.0);
        self
    }

    /// From now on, an acquisition takes the most recently freed slot of its class that does
    /// not wait for a scrub, and one that waits only if none is ready: for a pool that scrubs
    /// ahead, so that slots given back gather for the scrubbing thread (which then takes the
    /// table's lock once to take a gathering and once to put it back, not once between every
    /// two acquisitions) while acquisitions take slots already scrubbed. Without it, an
    /// acquisition takes the most recently freed slot, ready or not.
    pub fn prefer_ready(&self) {
        self.prefer_ready.store(true, Ordering::Relaxed);
    }

    /// Free slots that wait for a scrub ahead, as last counted under the lock (a reader
    /// without it may see the count a moment behind; it never drifts).
    pub fn waiting(&self) -> usize {
        self.waiting.0.load(Ordering::Relaxed)
    }

    /// Puts `slot` on its class's free list with `meta` recorded: on top (the next handed out),
    /// or `last`; counted among the slots that wait if it does.
    fn free(&self, state: &mut TableState<M>, slot: SlotId, meta: M, last: bool) {
        let waits = (self.waits)(&meta);
        let class = &mut state.classes[slot.class];
        class.meta[slot.index as usize] = meta;
        class.push(slot.index, waits, last);
        if waits {
            self.count(state, true);
        }
    }

    /// Counts a slot in (`came`) or out of the free slots that wait, and publishes the count.
    fn count(&self, state: &mut TableState<M>, came: bool) {
        if came {
            state.waiting += 1;
        } else {
            state.waiting -= 1;
        }
        self.waiting.0.store(state.waiting, Ordering::Relaxed);
    }

    /// Runs `f` under the table's lock if no slot is held (every slot free or withdrawn), so
    /// that no slot is taken while it runs: what a pool swaps its memory under. `None` (and `f`
    /// not run) while a slot is held.
    pub fn if_idle<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        let state = self.state.lock();
        state.idle(&self.layout).then(f)
    }

    /// Makes every slot free again with `initial(class)` recorded (withdrawn ones included),
    /// and runs `f`, under the table's lock, if no slot is held: what a pool does when it
    /// carves its slots from new memory. The figures are kept. `None` (nothing changed) while
    /// a slot is held.
    pub fn renew<R>(
        &self,
        initial: impl Fn(&ClassLayout) -> M,
        f: impl FnOnce() -> R,
    ) -> Option<R> {
        let mut state = self.state.lock();
        if !state.idle(&self.layout) {
            return None;
        }
        state.classes = fresh_classes(&self.layout, &initial);
        state.withdrawn = 0;
        recount(&mut state, self.waits, &self.waiting.0);
        Some(f())
    }

    /// A slot taken and not handed out after all (nothing done to it): it goes back as it
    /// was, its acquisition undone.
    pub fn untake(&self, slot: SlotId, meta: M) {
        let mut state = self.state.lock();
        self.free(&mut state, slot, meta, false);
        state.counters.acquisitions -= 1;
    }

    /// The classes, smallest slot first.
    pub fn layout(&self) -> &[ClassLayout] {
        &self.layout
    }

    /// The size of the smallest slot class that can hold `capacity` bytes, if any.
    pub fn slot_size_for(&self, capacity: usize) -> Option<usize> {
        self.layout
            .iter()
            .map(|c| c.slot_bytes)
            .find(|&s| s >= capacity)
    }

    /// Takes the most recently freed slot of the smallest class that holds `capacity` bytes
    /// and that `fits` accepts (a pool's own condition, such as the address space a slot
    /// spans), counting an acquisition; [`PoolError::TooLarge`] if no class holds it,
    /// [`PoolError::Exhausted`] (counted) if every such slot is taken. Once
    /// [`prefer_ready`](Self::prefer_ready) is set, the most recently freed one that does not
    /// wait for a scrub ahead comes first.
    pub fn take(
        &self,
        capacity: usize,
        fits: impl Fn(&ClassLayout) -> bool,
    ) -> Result<Taken<M>, PoolError> {
        let largest = self.layout.last().map_or(0, |c| c.slot_bytes);
        if capacity > largest {
            return Err(PoolError::TooLarge {
                requested: capacity as u64,
                largest: largest as u64,
            });
        }
        let prefer_ready = self.prefer_ready.load(Ordering::Relaxed);
        loop {
            let mut state = self.state.lock();
            let found = self
                .layout
                .iter()
                .enumerate()
                .filter(|(_, c)| c.slot_bytes >= capacity && fits(c))
                .find_map(|(class, layout)| {
                    let c = &mut state.classes[class];
                    let (index, waited) = c.pop(prefer_ready)?;
                    let meta = c.meta[index as usize];
                    Some((
                        Taken {
                            slot: SlotId { class, index },
                            layout: *layout,
                            meta,
                        },
                        waited,
                    ))
                });
            if let Some((taken, waited)) = found {
                state.counters.acquisitions += 1;
                if waited {
                    self.count(&mut state, false);
                }
                return Ok(taken);
            }
            // A fitting slot being scrubbed ahead is free, and back within a few scrubs (one
            // gathering, `ahead_at_once`): wait for
            // it rather than call the pool exhausted.
            let ahead = self
                .layout
                .iter()
                .zip(&state.classes)
                .any(|(c, class)| class.ahead > 0 && c.slot_bytes >= capacity && fits(c));
            if !ahead {
                state.counters.exhaustions += 1;
                return Err(PoolError::Exhausted {
                    requested: capacity as u64,
                });
            }
            drop(state);
            // Off the lock while the scrub runs: the scrubber needs it to put the slot back.
            for _ in 0..64 {
                core::hint::spin_loop();
            }
        }
    }

    /// A slot taken whose scrub failed (part way: `scrubbed` bytes were zeroed): it is not
    /// handed out but goes back last in its class's free list (so a slot that keeps failing
    /// does not stand in front of the others) with `meta` for the next try, its acquisition
    /// undone and a scrub failure counted.
    pub fn refuse(&self, slot: SlotId, meta: M, scrubbed: u64) {
        let mut state = self.state.lock();
        self.free(&mut state, slot, meta, true);
        state.counters.acquisitions -= 1;
        state.counters.scrub_failures += 1;
        state.counters.bytes_scrubbed += scrubbed;
    }

    /// Counts a scrub done as a slot was handed out (the slot's record is not touched: a held
    /// slot's is written when it goes back free, and read only while it is free).
    pub fn scrubbed(&self, returned: Returned) {
        let (bytes, resets) = &self.scrubbed_on_take;
        bytes.fetch_add(returned.scrubbed, Ordering::Relaxed);
        if returned.hints_reset {
            resets.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A slot comes back, free, with `meta` for its next scrub, counting a release.
    pub fn give_back(&self, slot: SlotId, meta: M, returned: Returned) {
        let mut state = self.state.lock();
        self.free(&mut state, slot, meta, false);
        state.counters.releases += 1;
        state.counters.scrubbed(returned);
    }

    /// Takes, to scrub them ahead of their next acquisitions, up to `max` free slots that wait
    /// ([`waiting_when`](Self::waiting_when)), at most [`ahead_at_once`](Self::ahead_at_once)
    /// (and a quarter of a class's slots from one class), nearest the top of their class's
    /// free list (the most recently freed), smallest class first, in one hold of the table's
    /// lock: `f` is given each. However deep a waiting slot lies it is found (the waiting ones
    /// are a list of their own: nothing is searched). They are held
    /// by the caller until they go back ([`ahead_done`](Self::ahead_done)): no acquisition is
    /// counted, and no one else can take them meanwhile (an acquisition that finds no other
    /// fitting slot waits for them). The number taken.
    pub fn take_dirty(&self, max: usize, mut f: impl FnMut(Taken<M>)) -> usize {
        let max = max.min(self.ahead_at_once());
        let mut state = self.state.lock();
        let mut taken = 0;
        for (class, layout) in self.layout.iter().enumerate() {
            if taken == max {
                break;
            }
            // None of this class waits, or a quarter of the class at most,
            // so that its acquisitions do not all wait for one gathering.
            let class_cap = (layout.slots as usize / 4).max(1);
            let wanted = (max - taken)
                .min(state.classes[class].waiting.len())
                .min(class_cap);
            for _ in 0..wanted {
                let c = &mut state.classes[class];
                let Some(index) = c.waiting.pop() else { break };
                c.ahead += 1;
                let meta = c.meta[index as usize];
                self.count(&mut state, false);
                f(Taken {
                    slot: SlotId { class, index },
                    layout: *layout,
                    meta,
                });
                taken += 1;
            }
        }
        taken
    }

    /// A gathering of up to `max` waiting slots, taken as [`take_dirty`](Self::take_dirty)
    /// takes them: held by the [`Gathering`] until it goes, then put back in one hold of the
    /// lock, each as its outcome says. Empty if none waits.
    pub fn gather(&self, max: usize) -> Gathering<'_, M> {
        let mut slots = [None; AHEAD_MAX];
        let mut count = 0;
        self.take_dirty(max, |taken| {
            debug_assert!(
                count < AHEAD_MAX,
                "take_dirty takes at most AHEAD_MAX slots"
            );
            slots[count] = Some((taken, None));
            count += 1;
        });
        Gathering { table: self, slots }
    }

    /// The most slots one [`take_dirty`](Self::take_dirty) takes: [`AHEAD_MAX`], or a quarter
    /// of the table's slots if fewer (at least one), so that an acquisition that finds every
    /// other slot held waits for a few scrubs at most, and a pool of two or three for one.
    pub fn ahead_at_once(&self) -> usize {
        let slots: usize = self.layout.iter().map(|c| c.slots as usize).sum();
        (slots / 4).clamp(1, AHEAD_MAX)
    }

    /// Slots taken by [`take_dirty`](Self::take_dirty) go back free, in one hold of the
    /// table's lock, each with its `meta` as its `ahead` says: scrubbed (on top of its class's
    /// free list, the next handed out, counted as a slot scrubbed ahead), failed part way (last
    /// in it, a scrub failure counted), or untouched (on top, as it was, nothing counted).
    pub fn ahead_done(&self, done: impl IntoIterator<Item = (SlotId, M, Ahead)>) {
        let mut done = done.into_iter().peekable();
        if done.peek().is_none() {
            return;
        }
        let mut state = self.state.lock();
        for (slot, meta, ahead) in done {
            state.classes[slot.class].ahead -= 1;
            self.free(
                &mut state,
                slot,
                meta,
                matches!(ahead, Ahead::Failed { .. }),
            );
            let c = &mut state.counters;
            match ahead {
                Ahead::Scrubbed(returned) => {
                    c.scrubbed_ahead += 1;
                    c.scrubbed(returned);
                }
                Ahead::Failed { scrubbed } => {
                    c.scrub_failures += 1;
                    c.bytes_scrubbed += scrubbed;
                }
                Ahead::Untouched => {}
            }
        }
    }

    /// `slot` came back but cannot be handed out again (its scrub failed, or what it holds is
    /// unknown): it stays off the free lists for good, counting a release and a scrub failure,
    /// and counted withdrawn (neither free nor in use).
    pub fn withdraw(&self, slot: SlotId) {
        let mut state = self.state.lock();
        state.counters.releases += 1;
        state.counters.scrub_failures += 1;
        state.withdrawn += 1;
        state.classes[slot.class].withdrawn += 1;
    }

    /// `slot`, just taken, had a scrub that failed, leaving its pages in no known state: it is
    /// not handed out, nor put back, but withdrawn for good, its acquisition undone and a scrub
    /// failure counted.
    pub fn withdraw_taken(&self, slot: SlotId) {
        let mut state = self.state.lock();
        state.counters.acquisitions -= 1;
        state.counters.scrub_failures += 1;
        state.withdrawn += 1;
        state.classes[slot.class].withdrawn += 1;
    }

    /// Slots withdrawn for good since the slots were last carved afresh
    /// ([`renew`](Self::renew)).
    pub fn withdrawn(&self) -> usize {
        self.state.lock().withdrawn
    }

    /// The figures.
    pub fn stats(&self) -> PoolStats {
        let state = self.state.lock();
        let c = &state.counters;
        PoolStats {
            classes: self
                .layout
                .iter()
                .zip(&state.classes)
                .map(|(layout, class)| ClassStats {
                    slot_bytes: layout.slot_bytes,
                    slots: layout.slots as usize,
                    // A slot being scrubbed ahead is free: it is back within a gathering.
                    in_use: layout.slots as usize
                        - class.free_len()
                        - class.ahead as usize
                        - class.withdrawn,
                    free: class.free_len() + class.ahead as usize,
                    withdrawn: class.withdrawn,
                })
                .collect(),
            acquisitions: c.acquisitions,
            releases: c.releases,
            bytes_scrubbed: c.bytes_scrubbed + self.scrubbed_on_take.0.load(Ordering::Relaxed),
            scrub_failures: c.scrub_failures,
            hint_resets: c.hint_resets + self.scrubbed_on_take.1.load(Ordering::Relaxed),
            exhaustions: c.exhaustions,
            scrubbed_ahead: c.scrubbed_ahead,
            slab_given_up: false,
        }
    }
}

/// Free slots taken together to be scrubbed ahead ([`SlotTable::gather`]): held (no one else can
/// take them; the figures count them free) until the gathering goes, when they go back in one
/// hold of the table's lock, each as its outcome says ([`SlotTable::ahead_done`]). A slot with
/// no outcome (not reached, or whose scrub never returned: the scrubber set none) goes back as
/// it was taken, untouched; so a panic mid-gathering loses no slot.
#[derive(Debug)]
pub struct Gathering<'a, M: Copy> {
    table: &'a SlotTable<M>,
    #[allow(clippy::type_complexity)]
    slots: [Option<(Taken<M>, Option<(M, Ahead)>)>; AHEAD_MAX],
}

impl<M: Copy> Gathering<'_, M> {
    /// No slot was taken.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }

    /// Each slot taken, with how it goes back: `None` (as taken, untouched) until the caller
    /// sets the record it goes back with and the outcome.
    pub fn slots(&mut self) -> impl Iterator<Item = (&Taken<M>, &mut Option<(M, Ahead)>)> {
        self.slots
            .iter_mut()
            .flatten()
            .map(|(taken, outcome)| (&*taken, outcome))
    }
}

impl<M: Copy> Drop for Gathering<'_, M> {
    fn drop(&mut self) {
        let back = self
            .slots
            .iter_mut()
            .filter_map(Option::take)
            .map(|(taken, outcome)| {
                let (meta, ahead) = outcome.unwrap_or((taken.meta, Ahead::Untouched));
                (taken.slot, meta, ahead)
            });
        self.table.ahead_done(back);
    }
}
