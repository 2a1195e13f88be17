//! The tenant's books: what a memory and a Store pay for, as values that live with what they pay
//! for, and the one handoff from a Store's limiter to the creator and the memories.
//!
//! - A [`MemoryCharge`] is computed once, before a memory's storage is acquired (touched bytes,
//!   held bytes, one memory), moves into the memory's record, grows with the memory, and goes
//!   back only when the storage is really gone: a refused free keeps it (the creator keeps the
//!   storage and its charge together and releases both later).
//! - [`StoreBooks`] is one Store's account: its tables' elements, the growth grants of memories
//!   our creator did not make (`Memory::new`, a pooling allocator), and the one grant its
//!   limiter has just made and not yet handed over.
//! - The handoff: Wasmtime calls the limiter's `memory_growing`, then (on the same thread, with
//!   nothing in between) the creator's `new_memory` or the memory's `grow_to`. The grant waits in
//!   the Store's books under a ticket; the thread holds only a weak reference to the books and
//!   the ticket (no charge, nothing kept alive), which a consumer of the same Store redeems. A
//!   creation is announced only inside an [`EntryScope`] of its own Store (opened by
//!   [`instantiate`](crate::instantiate), closed on every exit), so no memory is ever charged
//!   to, or placed by, a tenant other than its own Store's. A grant nobody redeems is settled in
//!   the Store's books at the Store's next limiter call or scope exit: it paid for a memory we
//!   did not make, which lives until the Store goes.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use tensor_wasm_mem_core::{Denied, Purpose, Reservation, StreamKey};

use crate::error::TwmError;
use crate::shares::{PoolShares, SlotShare};
use crate::tenancy::{ChargeMode, Tenant};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is complete before anything that can panic.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What one linear memory pays its tenant, computed before its storage is acquired: the bytes
/// the guest can touch (its current size, or its capacity in [`ChargeMode::Capacity`]), the
/// bytes it holds (its allocation or pool slot), and one memory. Dropped (given back) only when
/// the memory's storage is gone.
#[derive(Debug)]
pub(crate) struct MemoryCharge {
    tenant: Arc<Tenant>,
    mode: ChargeMode,
    touched: Reservation,
    held: Reservation,
    _count: Reservation,
    /// The pool slot counted against the tenant's share, for a pooled memory.
    _share: Option<SlotShare>,
}

impl MemoryCharge {
    /// Charges `tenant` for a memory of `capacity` bytes, `initial` visible, holding `held`
    /// bytes: the touched bytes (`granted` already, by the Store's limiter, or charged here),
    /// the memory count, then the held bytes. Nothing stays charged if any budget refuses.
    pub(crate) fn new(
        tenant: &Arc<Tenant>,
        mode: ChargeMode,
        granted: Option<Reservation>,
        (initial, capacity, held): (u64, u64, u64),
    ) -> Result<Self, TwmError> {
        let owed = match mode {
            ChargeMode::Touched => initial,
            ChargeMode::Capacity => capacity,
        };
        let mut touched =
            granted.unwrap_or_else(|| tenant.ledger().empty_reservation(Purpose::LinearMemory));
        let missing = owed.saturating_sub(touched.bytes());
        if missing > 0 {
            touched
                .absorb(tenant.reserve_for(missing, Purpose::LinearMemory)?)
                .ok();
        }
        let count = tenant.reserve_for(1, Purpose::Memory)?;
        let held = tenant.reserve_for(held, Purpose::Held)?;
        tenant.count_memory();
        Ok(Self {
            tenant: Arc::clone(tenant),
            mode,
            touched,
            held,
            _count: count,
            _share: None,
        })
    }

    /// Counts the pool slot of `slot_bytes` this memory holds against its tenant's share of
    /// `shares`, or refuses ([`TwmError::PoolShare`]) and charges nothing more.
    pub(crate) fn take_share(
        &mut self,
        shares: &Arc<PoolShares>,
        slot_bytes: u64,
    ) -> Result<(), TwmError> {
        self._share = Some(shares.take(&self.tenant, slot_bytes)?);
        Ok(())
    }

    /// Charges the held budget up to `bytes` (what the memory's storage really holds), or
    /// refuses and charges nothing more.
    pub(crate) fn hold_at_least(&mut self, bytes: u64) -> Result<(), TwmError> {
        let more = bytes.saturating_sub(self.held.bytes());
        self.held
            .try_grow(more)
            .map_err(|denied| self.tenant.denied(denied))
    }

    /// The tenant paying.
    pub(crate) fn tenant(&self) -> &Arc<Tenant> {
        &self.tenant
    }

    /// What a growth by `extra` bytes owes beyond a limiter's `grant`: nothing in
    /// [`ChargeMode::Capacity`] (the capacity is paid), else what the grant does not cover,
    /// charged now. The result joins the memory with [`pay_growth`](Self::pay_growth) once the
    /// storage has grown, or goes back by being dropped.
    pub(crate) fn growth(
        &self,
        extra: u64,
        grant: Option<Reservation>,
    ) -> Result<Option<Reservation>, TwmError> {
        if self.mode == ChargeMode::Capacity {
            // The capacity is paid up front; a grant (there is none in this mode) goes back.
            return Ok(None);
        }
        let mut grant = grant.unwrap_or_else(|| {
            self.tenant
                .ledger()
                .empty_reservation(Purpose::LinearMemory)
        });
        let missing = extra.saturating_sub(grant.bytes());
        if missing > 0 {
            grant
                .absorb(self.tenant.reserve_for(missing, Purpose::LinearMemory)?)
                .ok();
        }
        Ok(Some(grant))
    }

    /// Leaves the whole charge with the tenant for good: the backend never gave the memory's
    /// storage back, and nothing is left to carry the charge.
    pub(crate) fn strand(self) {
        self.touched.strand();
        self.held.strand();
        self._count.strand();
    }

    /// Adds a growth's charge to the memory's touched bytes.
    pub(crate) fn pay_growth(&mut self, growth: Option<Reservation>) {
        if let Some(growth) = growth {
            // Same tenant and purpose by construction; a mismatch would be given back.
            let _ = self.touched.absorb(growth);
        }
    }
}

/// A grant the limiter made and nobody has redeemed yet.
#[derive(Debug)]
struct OpenGrant {
    ticket: u64,
    grant: Reservation,
}

/// One Store's account with its tenant, shared by its limiter, its guest context and every
/// memory our creator made for it (which Wasmtime drops after the Store's data).
#[derive(Debug)]
pub(crate) struct StoreBooks {
    tenant: Arc<Tenant>,
    mode: ChargeMode,
    /// The elements of this Store's tables (touched and held bytes).
    tables: Mutex<Reservation>,
    /// Growth grants of memories our creator did not make, kept until the Store goes.
    settled: Mutex<Reservation>,
    /// The limiter's latest grant, until the creator or a memory redeems it.
    open: Mutex<Option<OpenGrant>>,
    tickets: AtomicU64,
    /// The creator's last refusal of a memory in this Store, for `instantiate` to return typed.
    refusal: Mutex<Option<TwmError>>,
    /// Streams of this Store's guest context still alive: a memory that goes before them (the
    /// Store's data outlived its memories, as with `Store::into_data`) waits for them first.
    streams: Mutex<Vec<StreamKey>>,
    /// A stream of this Store could not be released (its wait or its destroy was refused):
    /// work queued on it may still run, so no memory of the Store is given back.
    unsettled: std::sync::atomic::AtomicBool,
    /// A grant was settled here: the Store has a memory our creator did not make (`Memory::new`,
    /// an imported one), which only the limiter's grants pay for, in either charge mode.
    bypassed: std::sync::atomic::AtomicBool,
}

impl StoreBooks {
    pub(crate) fn new(tenant: Arc<Tenant>, mode: ChargeMode) -> Arc<Self> {
        let context = tenant.ledger();
        Arc::new(Self {
            tables: Mutex::new(context.empty_reservation(Purpose::Table)),
            settled: Mutex::new(context.empty_reservation(Purpose::LinearMemory)),
            open: Mutex::new(None),
            tickets: AtomicU64::new(0),
            refusal: Mutex::new(None),
            streams: Mutex::new(Vec::new()),
            unsettled: std::sync::atomic::AtomicBool::new(false),
            bypassed: std::sync::atomic::AtomicBool::new(false),
            tenant,
            mode,
        })
    }

    pub(crate) fn tenant(&self) -> &Arc<Tenant> {
        &self.tenant
    }

    pub(crate) fn mode(&self) -> ChargeMode {
        self.mode
    }

    /// Touched bytes granted to this Store's memories through its limiter and not yet joined
    /// to a memory of ours (memories we did not make, a grant on its way).
    pub(crate) fn settled_bytes(&self) -> u64 {
        let open = lock(&self.open).as_ref().map_or(0, |g| g.grant.bytes());
        lock(&self.settled).bytes() + open
    }

    /// Bytes of this Store's table elements.
    pub(crate) fn table_bytes(&self) -> u64 {
        lock(&self.tables).bytes()
    }

    /// Charges `extra` bytes of table elements, for good (until the Store goes: a table never
    /// shrinks, and a growth Wasmtime fails after the limiter said yes is not reported back).
    pub(crate) fn charge_tables(&self, extra: u64) -> Result<(), Denied> {
        lock(&self.tables).try_grow(extra)
    }

    /// Charges `bytes` touched bytes for a memory growing (or, `creation`, a memory being made
    /// inside an [`EntryScope`] of this Store) to `minimum` bytes, and announces the grant on
    /// this thread. A grant still open from before is settled first.
    pub(crate) fn grant(
        self: &Arc<Self>,
        bytes: u64,
        creation: bool,
        minimum: usize,
    ) -> Result<(), Denied> {
        self.settle();
        let grant = self
            .tenant
            .ledger()
            .try_reserve_for(bytes, Purpose::LinearMemory)?;
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        *lock(&self.open) = Some(OpenGrant { ticket, grant });
        let creation = creation && handoff::in_scope(self);
        handoff::announce(handoff::Announcement {
            books: Arc::downgrade(self),
            ticket,
            minimum,
            creation,
        });
        Ok(())
    }

    /// Moves a grant nobody redeemed into the Store's account: it paid for a memory our creator
    /// did not make, which lives until the Store goes.
    pub(crate) fn settle(&self) {
        let open = lock(&self.open).take();
        if let Some(open) = open {
            // Same tenant and purpose by construction.
            let _ = lock(&self.settled).absorb(open.grant);
            self.bypassed.store(true, Ordering::Release);
        }
        handoff::forget_for(self);
    }

    /// Whether the Store has a memory our creator did not make (a grant nobody redeemed was
    /// settled): in [`ChargeMode::Capacity`] its growths are paid by the limiter's grants, as
    /// our memories' are by their capacity.
    pub(crate) fn has_bypass_memory(&self) -> bool {
        self.bypassed.load(Ordering::Acquire)
    }

    fn redeem(&self, ticket: u64) -> Option<Reservation> {
        let mut open = lock(&self.open);
        match open.take() {
            Some(grant) if grant.ticket == ticket => Some(grant.grant),
            other => {
                *open = other;
                None
            }
        }
    }

    pub(crate) fn record_refusal(&self, refused: TwmError) {
        *lock(&self.refusal) = Some(refused);
    }

    pub(crate) fn take_refusal(&self) -> Option<TwmError> {
        lock(&self.refusal).take()
    }

    pub(crate) fn add_stream(&self, id: StreamKey) {
        lock(&self.streams).push(id);
    }

    pub(crate) fn remove_stream(&self, id: StreamKey) {
        let mut streams = lock(&self.streams);
        if let Some(i) = streams.iter().position(|s| *s == id) {
            streams.swap_remove(i);
        }
    }

    /// The Store's streams still alive.
    pub(crate) fn streams(&self) -> Vec<StreamKey> {
        lock(&self.streams).clone()
    }

    /// A stream of the Store could not be released, or a wait for it failed: its work may
    /// still run.
    pub(crate) fn mark_unsettled(&self) {
        self.unsettled.store(true, Ordering::Release);
    }

    /// Whether a stream of the Store could not be released.
    pub(crate) fn is_unsettled(&self) -> bool {
        self.unsettled.load(Ordering::Acquire)
    }
}

/// The creation the Store's limiter announced on this thread, for a memory of `minimum` bytes:
/// its books and its touched grant. `None` outside an [`EntryScope`] of that Store, for a
/// Store that is gone, or for any other announcement (which stays for its own consumer).
pub(crate) fn redeem_creation(minimum: usize) -> Option<(Arc<StoreBooks>, Reservation)> {
    let announced = handoff::take_if(|a| a.creation && a.minimum == minimum)?;
    let books = announced.books.upgrade()?;
    let grant = books.redeem(announced.ticket)?;
    Some((books, grant))
}

/// The growth `books`'s limiter granted on this thread just before, if any.
pub(crate) fn redeem_growth(books: &Arc<StoreBooks>) -> Option<Reservation> {
    let announced = handoff::take_if(|a| std::ptr::eq(a.books.as_ptr(), Arc::as_ptr(books)))?;
    books.redeem(announced.ticket)
}

/// An entry point's scope for one Store (opened by [`instantiate`](crate::instantiate)): only
/// inside it are the Store's new memories announced to the creator. Closed when dropped, on
/// every exit (success, error, unwinding): the thread's announcement of the Store is cleared
/// and a grant nobody redeemed is settled.
#[derive(Debug)]
pub(crate) struct EntryScope {
    books: Arc<StoreBooks>,
}

impl EntryScope {
    pub(crate) fn enter(books: &Arc<StoreBooks>) -> Self {
        handoff::push_scope(books);
        Self {
            books: Arc::clone(books),
        }
    }
}

impl Drop for EntryScope {
    fn drop(&mut self) {
        handoff::pop_scope(&self.books);
        self.books.settle();
    }
}

/// The thread's side of the handoff: weak references and tickets only, never a charge.
mod handoff {
    use super::{Arc, RefCell, StoreBooks, Weak};

    #[derive(Debug)]
    pub(super) struct Announcement {
        pub(super) books: Weak<StoreBooks>,
        pub(super) ticket: u64,
        pub(super) minimum: usize,
        pub(super) creation: bool,
    }

    #[derive(Debug, Default)]
    struct Handoff {
        announcement: Option<Announcement>,
        /// The Stores whose entry scopes are open on this thread, innermost last.
        scopes: Vec<*const StoreBooks>,
    }

    thread_local! {
        static HANDOFF: RefCell<Handoff> = RefCell::new(Handoff::default());
    }

    fn with<R>(f: impl FnOnce(&mut Handoff) -> R) -> Option<R> {
        // `try_with`: during thread teardown there is nothing to hand off.
        HANDOFF.try_with(|h| f(&mut h.borrow_mut())).ok()
    }

    pub(super) fn announce(announcement: Announcement) {
        with(|h| h.announcement = Some(announcement));
    }

    pub(super) fn take_if(accept: impl FnOnce(&Announcement) -> bool) -> Option<Announcement> {
        with(|h| {
            if h.announcement.as_ref().is_some_and(accept) {
                h.announcement.take()
            } else {
                None
            }
        })
        .flatten()
    }

    /// Clears the thread's announcement if it is `books`'s.
    pub(super) fn forget_for(books: &StoreBooks) {
        with(|h| {
            if h.announcement
                .as_ref()
                .is_some_and(|a| std::ptr::eq(a.books.as_ptr(), books))
            {
                h.announcement = None;
            }
        });
    }

    pub(super) fn in_scope(books: &Arc<StoreBooks>) -> bool {
        with(|h| h.scopes.last() == Some(&Arc::as_ptr(books))).unwrap_or(false)
    }

    pub(super) fn push_scope(books: &Arc<StoreBooks>) {
        with(|h| h.scopes.push(Arc::as_ptr(books)));
    }

    pub(super) fn pop_scope(books: &Arc<StoreBooks>) {
        with(|h| {
            if let Some(i) = h.scopes.iter().rposition(|s| *s == Arc::as_ptr(books)) {
                h.scopes.remove(i);
            }
        });
    }
}
