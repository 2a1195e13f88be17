//! Tenants and their ledgers: hard budgets, reserved atomically, given back on drop.
//!
//! A tenant has three budgets, all hard and all checked before anything is allocated:
//!
//! - [`Budget::Touched`] (the *cap*): bytes its guests can read and write (linear memory up to
//!   its current size, device pool buffers);
//! - [`Budget::Held`]: capacity its objects occupy whether touched or not (a memory's whole
//!   allocation or pool slot, table elements, device pool buffers);
//! - [`Budget::Memories`]: linear memories alive at once, across all its Stores.
//!
//! [`TenantBudgets::for_cap`] gives the defaults that follow from a cap.
//!
//! ```
//! use std::sync::Arc;
//! use tensor_wasm_mem_core::{IsolationLevel, TenantLedger, TenantId};
//!
//! let tenant = Arc::new(TenantLedger::new(TenantId(1), 1 << 20, IsolationLevel::default()));
//! let a = tenant.try_reserve(768 << 10).unwrap();
//! assert!(tenant.try_reserve(512 << 10).is_err()); // would pass the 1 MiB cap: denied
//! drop(a);
//! assert_eq!(tenant.stats().touched_bytes, 0);
//! assert_eq!(tenant.stats().denials, 1);
//! ```

use alloc::sync::Arc;
use core::fmt;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::error::ErrorKind;
use crate::isolation::IsolationLevel;
use crate::plan::DEFAULT_MAX_BYTES;

/// Identifies a tenant to people: the embedder's number, used in messages, spans and metrics.
///
/// Two tenants may share an id by accident; backends never key anything on it alone but on a
/// [`TenantKey`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TenantId(pub u64);

/// Identifies one tenant object in a backend's tables: its [`TenantId`] and a serial number
/// unique in the process, minted by [`TenantKey::fresh`] (each [`TenantLedger`] mints its own).
///
/// Two tenants made with the same id get different keys, so they never share an isolated context,
/// a stream or a pool, and cannot release each other's: identity cannot collide by accident.
///
/// ```
/// use tensor_wasm_mem_core::{IsolationLevel, TenantLedger, TenantId};
///
/// let a = TenantLedger::new(TenantId(7), 1 << 20, IsolationLevel::ContextIsolated);
/// let b = TenantLedger::new(TenantId(7), 1 << 20, IsolationLevel::ContextIsolated);
/// assert_eq!(a.key().id(), b.key().id());
/// assert_ne!(a.key(), b.key());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TenantKey {
    id: TenantId,
    serial: u64,
}

/// The next serial [`TenantKey::fresh`] hands out.
static NEXT_TENANT_SERIAL: AtomicU64 = AtomicU64::new(1);

impl TenantKey {
    /// A key no other call of this function has returned in this process.
    #[must_use]
    pub fn fresh(id: TenantId) -> Self {
        // Relaxed: only uniqueness matters, which the atomic read-modify-write gives.
        let serial = NEXT_TENANT_SERIAL.fetch_add(1, Ordering::Relaxed);
        Self { id, serial }
    }

    /// The embedder's id.
    #[must_use]
    pub const fn id(self) -> TenantId {
        self.id
    }

    /// The process-unique serial number.
    #[must_use]
    pub const fn serial(self) -> u64 {
        self.serial
    }
}

impl fmt::Display for TenantKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (#{})", self.id, self.serial)
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tenant {}", self.0)
    }
}

/// One of a tenant's budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Budget {
    /// Bytes its guests can touch (the cap).
    Touched,
    /// Bytes of capacity its objects occupy.
    Held,
    /// Linear memories alive at once.
    Memories,
}

impl Budget {
    /// The name used in messages, spans and metrics: `touched`, `held` or `memories`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Touched => "touched",
            Self::Held => "held",
            Self::Memories => "memories",
        }
    }

    /// What the budget counts: `bytes` or `memories`.
    #[must_use]
    pub const fn unit(self) -> &'static str {
        match self {
            Self::Touched | Self::Held => "bytes",
            Self::Memories => "memories",
        }
    }
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tenant's limits, one per [`Budget`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantBudgets {
    /// Bytes its guests can touch (the cap).
    pub touched_bytes: u64,
    /// Bytes of capacity its objects may occupy.
    pub held_bytes: u64,
    /// Linear memories it may have alive at once.
    pub memories: u64,
}

impl TenantBudgets {
    /// The default held budget is this many times the cap ...
    pub const HELD_PER_TOUCHED: u64 = 4;
    /// Room in the default held budget beside a memory, for its tables: 32 MiB, two million
    /// table elements at the Wasmtime integration's 16 bytes each (two tables at its default
    /// element limit). A program with one default-size memory and a table must fit in the
    /// defaults.
    pub const TABLE_ROOM_BYTES: u64 = 32 << 20;
    /// ... and never less than one memory of the default size plus
    /// [`TABLE_ROOM_BYTES`](Self::TABLE_ROOM_BYTES).
    pub const MIN_HELD_BYTES: u64 = DEFAULT_MAX_BYTES + Self::TABLE_ROOM_BYTES;
    /// The default number of live memories.
    pub const DEFAULT_MEMORIES: u64 = 1024;

    /// The defaults for a cap of `touched_bytes`: a held budget of
    /// [`HELD_PER_TOUCHED`](Self::HELD_PER_TOUCHED) times the cap, at least
    /// [`MIN_HELD_BYTES`](Self::MIN_HELD_BYTES), and
    /// [`DEFAULT_MEMORIES`](Self::DEFAULT_MEMORIES) live memories.
    #[must_use]
    pub const fn for_cap(touched_bytes: u64) -> Self {
        Self::for_cap_and_limit(touched_bytes, DEFAULT_MAX_BYTES)
    }

    /// The defaults for a cap of `touched_bytes` where no memory may be larger than
    /// `memory_bytes` (a creator's per-memory limit, `PlanLimits::per_memory_limit`): a held
    /// budget of [`HELD_PER_TOUCHED`](Self::HELD_PER_TOUCHED) times the cap, at least one such
    /// memory plus [`TABLE_ROOM_BYTES`](Self::TABLE_ROOM_BYTES), and
    /// [`DEFAULT_MEMORIES`](Self::DEFAULT_MEMORIES) live memories. [`for_cap`](Self::for_cap)
    /// is this for the default limit (256 MiB); with a smaller limit the floor is smaller,
    /// so a small tenant does not get a large memory's room for nothing.
    ///
    /// ```
    /// use tensor_wasm_mem_core::TenantBudgets;
    ///
    /// // A 1 MiB cap where memories are at most 1 MiB: 1 MiB + 32 MiB of tables, not 288 MiB.
    /// let budgets = TenantBudgets::for_cap_and_limit(1 << 20, 1 << 20);
    /// assert_eq!(budgets.held_bytes, (1 << 20) + TenantBudgets::TABLE_ROOM_BYTES);
    /// // Four times the cap where that is more.
    /// assert_eq!(TenantBudgets::for_cap_and_limit(64 << 20, 1 << 20).held_bytes, 256 << 20);
    /// ```
    #[must_use]
    pub const fn for_cap_and_limit(touched_bytes: u64, memory_bytes: u64) -> Self {
        Self {
            touched_bytes,
            held_bytes: touched_bytes.saturating_mul(Self::HELD_PER_TOUCHED),
            memories: Self::DEFAULT_MEMORIES,
        }
        .with_room_for_memory(memory_bytes)
    }

    /// These budgets with a held budget of at least one memory of `memory_bytes` plus
    /// [`TABLE_ROOM_BYTES`](Self::TABLE_ROOM_BYTES): for defaults where the embedder's memories
    /// are larger than the default size (a per-memory limit above 256 MiB, or a pool whose
    /// slots are). Never lowers a budget.
    ///
    /// ```
    /// use tensor_wasm_mem_core::TenantBudgets;
    ///
    /// let budgets = TenantBudgets::for_cap(4 << 20).with_room_for_memory(1 << 30);
    /// assert_eq!(budgets.held_bytes, (1 << 30) + TenantBudgets::TABLE_ROOM_BYTES);
    /// assert_eq!(budgets.touched_bytes, 4 << 20); // the cap is the cap
    /// ```
    #[must_use]
    pub const fn with_room_for_memory(mut self, memory_bytes: u64) -> Self {
        let floor = memory_bytes.saturating_add(Self::TABLE_ROOM_BYTES);
        if self.held_bytes < floor {
            self.held_bytes = floor;
        }
        self
    }

    /// No limit on anything.
    #[must_use]
    pub const fn unlimited() -> Self {
        Self {
            touched_bytes: u64::MAX,
            held_bytes: u64::MAX,
            memories: u64::MAX,
        }
    }

    /// The limit of `budget`.
    #[must_use]
    pub const fn limit(&self, budget: Budget) -> u64 {
        match budget {
            Budget::Touched => self.touched_bytes,
            Budget::Held => self.held_bytes,
            Budget::Memories => self.memories,
        }
    }
}

/// A tenant's budget said no: granting the request would have taken it past the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{tenant} denied {requested} {unit} by its {budget} budget: {live} of its limit of {cap} {unit} \
     are already reserved",
    unit = .budget.unit()
)]
pub struct Denied {
    /// The tenant.
    pub tenant: TenantId,
    /// The budget that refused.
    pub budget: Budget,
    /// Its limit (bytes, or memories for [`Budget::Memories`]).
    pub cap: u64,
    /// What it held when the request was refused.
    pub live: u64,
    /// What was requested.
    pub requested: u64,
}

impl Denied {
    /// Always [`ErrorKind::CapExceeded`].
    #[must_use]
    pub const fn kind(&self) -> ErrorKind {
        ErrorKind::CapExceeded
    }
}

/// What a reservation pays for, and so which budgets it counts against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Purpose {
    /// Wasm linear memory the guest can touch: the touched budget.
    #[default]
    LinearMemory,
    /// Device-only buffers from the tenant's device memory pools: the touched and the held
    /// budgets (a pool buffer is both usable and occupied).
    DevicePool,
    /// Capacity occupied (a memory's allocation or slot): the held budget.
    Held,
    /// Live linear memories, counted one each: the memories budget.
    Memory,
    /// Table elements: real host memory a guest can fill, so the touched and the held budgets
    /// (a tenant with a cap of 0 has no table elements).
    Table,
}

impl Purpose {
    const fn charges(self, budget: Budget) -> bool {
        matches!(
            (self, budget),
            (
                Self::LinearMemory | Self::DevicePool | Self::Table,
                Budget::Touched
            ) | (Self::DevicePool | Self::Held | Self::Table, Budget::Held)
                | (Self::Memory, Budget::Memories)
        )
    }
}

/// One budget's counters.
#[derive(Debug)]
struct Meter {
    limit: u64,
    live: AtomicU64,
    peak: AtomicU64,
    denials: AtomicU64,
}

impl Meter {
    const fn new(limit: u64) -> Self {
        Self {
            limit,
            live: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            denials: AtomicU64::new(0),
        }
    }

    /// Adds `amount` if that keeps the total within `limit` (and within what a `u64` counts):
    /// the total it had before; else the total it has, and nothing is added. The peak is
    /// raised apart ([`raise_peak`](Self::raise_peak)), once the whole charge went through.
    fn add(&self, amount: u64, limit: u64) -> Result<u64, u64> {
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |live| {
                live.checked_add(amount).filter(|&total| total <= limit)
            })
    }

    /// Records `total` as a peak if it is one (a read first: below the peak, as most charges
    /// are, no read-modify-write).
    fn raise_peak(&self, total: u64) {
        if total > self.peak.load(Ordering::Acquire) {
            self.peak.fetch_max(total, Ordering::AcqRel);
        }
    }

    fn uncharge(&self, amount: u64) {
        let before = self.live.fetch_sub(amount, Ordering::AcqRel);
        debug_assert!(before >= amount, "ledger underflow");
    }

    fn live(&self) -> u64 {
        self.live.load(Ordering::Acquire)
    }

    fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }
}

/// A snapshot of a tenant's ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerStats {
    /// The touched budget (the cap) in bytes.
    pub touched_limit: u64,
    /// Touched bytes reserved now.
    pub touched_bytes: u64,
    /// The most touched bytes ever reserved at once.
    pub touched_peak_bytes: u64,
    /// Reservations alive now.
    pub live_reservations: u64,
    /// Reservations (and growths) ever granted.
    pub granted: u64,
    /// Requests ever denied.
    pub denials: u64,
    /// Of `touched_bytes`, the bytes held in device memory pools.
    pub device_pool_bytes: u64,
    /// The held budget in bytes.
    pub held_limit: u64,
    /// Bytes of capacity held now.
    pub held_bytes: u64,
    /// The most bytes of capacity ever held at once.
    pub held_peak_bytes: u64,
    /// The memories budget.
    pub memories_limit: u64,
    /// Memories charged now.
    pub live_memories: u64,
    /// The most memories ever charged at once.
    pub peak_memories: u64,
    /// Of `denials`, those by the touched budget (the cap).
    pub touched_denials: u64,
    /// Of `denials`, those by the held budget.
    pub held_denials: u64,
    /// Of `denials`, those by the memories budget.
    pub memory_denials: u64,
    /// Of `touched_bytes` and `held_bytes`, the bytes in table elements.
    pub table_bytes: u64,
    /// Of `held_bytes`, the bytes charged for good ([`Reservation::strand`]): what a backend
    /// never gave back after its owner was gone (their touched bytes stay in `touched_bytes`
    /// too), until the tenant itself goes.
    pub stranded_bytes: u64,
}

/// Running totals of many tenants' ledgers: the members (tenants made with
/// [`TenantLedger::in_group`] on it and not yet dropped), their committed caps (each member's
/// touched budget, from its creation until the ledger itself drops, whoever holds it last), and
/// the touched and held bytes they have charged now, kept as they charge and uncharge (one
/// atomic add each), so a group's figures cost one load however many tenants it has. What
/// placement reads per device without visiting its tenants. (Totals are kept modulo 2^64: exact
/// unless the true sum passes `u64::MAX`, as an unlimited budget's cap does.)
#[derive(Debug, Default)]
pub struct LedgerGroup {
    touched: AtomicU64,
    held: AtomicU64,
    committed: AtomicU64,
    members: AtomicU64,
}

impl LedgerGroup {
    /// The caps (touched budgets) of the members alive now.
    pub fn committed_bytes(&self) -> u64 {
        self.committed.load(Ordering::Acquire)
    }

    /// Members alive now.
    pub fn members(&self) -> u64 {
        self.members.load(Ordering::Acquire)
    }

    /// Touched bytes charged to the group's tenants now.
    pub fn touched_bytes(&self) -> u64 {
        self.touched.load(Ordering::Acquire)
    }

    /// Held bytes charged to the group's tenants now.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// The totals `purpose` counts in, with their budgets, in one order.
    fn totals_for(&self, purpose: Purpose) -> impl Iterator<Item = (Budget, &AtomicU64)> {
        [Budget::Touched, Budget::Held]
            .into_iter()
            .filter(move |&budget| purpose.charges(budget))
            .filter_map(|budget| self.total(budget).map(|total| (budget, total)))
    }

    fn total(&self, budget: Budget) -> Option<&AtomicU64> {
        match budget {
            Budget::Touched => Some(&self.touched),
            Budget::Held => Some(&self.held),
            Budget::Memories => None,
        }
    }
}

/// The former name of [`TenantLedger`] (it is the tenant's books, not a CUDA context).
#[deprecated(
    since = "0.1.0",
    note = "renamed TenantLedger: the tenant's books, not a CUDA context"
)]
pub type TenantContext = TenantLedger;

/// A tenant: an identity, hard budgets ([`TenantBudgets`]), an isolation level, and the ledger
/// that enforces them.
///
/// Reserving is lock-free and atomic: under any contention no budget's live total ever exceeds
/// its limit. A reservation that counts against two budgets ([`Purpose::DevicePool`]) takes the
/// first, then the second, and gives the first back if the second refuses.
#[derive(Debug)]
pub struct TenantLedger {
    key: TenantKey,
    isolation: IsolationLevel,
    touched: Meter,
    held: Meter,
    memories: Meter,
    live_reservations: AtomicU64,
    granted: AtomicU64,
    denials: AtomicU64,
    device_pool: AtomicU64,
    tables: AtomicU64,
    stranded: AtomicU64,
    group: Option<Arc<LedgerGroup>>,
}

impl TenantLedger {
    /// A tenant with a cap of `cap_bytes` (`u64::MAX` for none) at `isolation`, the other
    /// budgets at their defaults for that cap ([`TenantBudgets::for_cap`]), and a fresh
    /// [`TenantKey`].
    #[must_use]
    pub fn new(id: TenantId, cap_bytes: u64, isolation: IsolationLevel) -> Self {
        Self::with_budgets(id, TenantBudgets::for_cap(cap_bytes), isolation)
    }

    /// A tenant with `budgets` at `isolation`, with a fresh [`TenantKey`].
    #[must_use]
    pub fn with_budgets(id: TenantId, budgets: TenantBudgets, isolation: IsolationLevel) -> Self {
        Self {
            key: TenantKey::fresh(id),
            isolation,
            touched: Meter::new(budgets.touched_bytes),
            held: Meter::new(budgets.held_bytes),
            memories: Meter::new(budgets.memories),
            live_reservations: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            denials: AtomicU64::new(0),
            device_pool: AtomicU64::new(0),
            tables: AtomicU64::new(0),
            stranded: AtomicU64::new(0),
            group: None,
        }
    }

    /// A tenant as [`with_budgets`](Self::with_budgets) makes it, a member of `group` until it
    /// drops: its cap counts in the group's committed bytes and its charges in the group's
    /// totals.
    #[must_use]
    pub fn in_group(
        id: TenantId,
        budgets: TenantBudgets,
        isolation: IsolationLevel,
        group: Arc<LedgerGroup>,
    ) -> Self {
        let mut context = Self::with_budgets(id, budgets, isolation);
        group
            .committed
            .fetch_add(budgets.touched_bytes, Ordering::AcqRel);
        group.members.fetch_add(1, Ordering::AcqRel);
        context.group = Some(group);
        context
    }

    /// The group this tenant is a member of, if any.
    #[must_use]
    pub fn group(&self) -> Option<&Arc<LedgerGroup>> {
        self.group.as_ref()
    }

    /// The tenant's id.
    #[must_use]
    pub const fn id(&self) -> TenantId {
        self.key.id
    }

    /// The tenant's identity in backends' tables (streams, contexts, pools).
    #[must_use]
    pub const fn key(&self) -> TenantKey {
        self.key
    }

    /// The cap (the touched budget) in bytes.
    #[must_use]
    pub const fn cap(&self) -> u64 {
        self.touched.limit
    }

    /// The budgets.
    #[must_use]
    pub const fn budgets(&self) -> TenantBudgets {
        TenantBudgets {
            touched_bytes: self.touched.limit,
            held_bytes: self.held.limit,
            memories: self.memories.limit,
        }
    }

    /// The isolation level.
    #[must_use]
    pub const fn isolation(&self) -> IsolationLevel {
        self.isolation
    }

    /// Touched bytes reserved now.
    #[must_use]
    pub fn touched_bytes(&self) -> u64 {
        self.touched.live()
    }

    /// What `budget` has charged now.
    #[must_use]
    pub fn live(&self, budget: Budget) -> u64 {
        self.meter(budget).live()
    }

    /// A snapshot of the ledger (each figure read atomically; the set is not one instant).
    #[must_use]
    pub fn stats(&self) -> LedgerStats {
        LedgerStats {
            touched_limit: self.touched.limit,
            touched_bytes: self.touched.live(),
            touched_peak_bytes: self.touched.peak(),
            live_reservations: self.live_reservations.load(Ordering::Acquire),
            granted: self.granted.load(Ordering::Relaxed),
            denials: self.denials.load(Ordering::Relaxed),
            device_pool_bytes: self.device_pool.load(Ordering::Acquire),
            held_limit: self.held.limit,
            held_bytes: self.held.live(),
            held_peak_bytes: self.held.peak(),
            memories_limit: self.memories.limit,
            live_memories: self.memories.live(),
            peak_memories: self.memories.peak(),
            touched_denials: self.touched.denials.load(Ordering::Relaxed),
            held_denials: self.held.denials.load(Ordering::Relaxed),
            memory_denials: self.memories.denials.load(Ordering::Relaxed),
            table_bytes: self.tables.load(Ordering::Acquire),
            stranded_bytes: self.stranded.load(Ordering::Acquire),
        }
    }

    const fn meter(&self, budget: Budget) -> &Meter {
        match budget {
            Budget::Touched => &self.touched,
            Budget::Held => &self.held,
            Budget::Memories => &self.memories,
        }
    }

    /// Adds `amount` to every budget `purpose` counts against, if each stays within its limit;
    /// else nothing is charged and the first budget that refused is named.
    fn charge(&self, amount: u64, purpose: Purpose) -> Result<(), Denied> {
        self.add(amount, purpose, true)?;
        self.granted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Charges `amount` for `purpose` whatever its budgets say: for bytes the tenant holds
    /// already, which no refusal can undo. Past a budget, every charge that checks it is
    /// denied until enough is given back. Only a total no meter can count (past `u64::MAX`,
    /// in the tenant's budgets or its group's totals) is refused, and then nothing is charged:
    /// no figure a driver reports can wrap the books.
    fn force_charge(&self, amount: u64, purpose: Purpose) -> Result<(), Denied> {
        self.add(amount, purpose, false)
    }

    /// Adds `amount` to every budget `purpose` counts against (within their limits if
    /// `within_limits`, else whatever they say), then to the group's totals; all or nothing.
    /// A total is never taken past `u64::MAX`: that refuses the charge whatever the limits.
    /// A normal charge's refusal counts as a denial, in the budget's figures and the tenant's;
    /// a forced one's never (a driver's uncountable figure is no tenant's denial).
    fn add(&self, amount: u64, purpose: Purpose, within_limits: bool) -> Result<(), Denied> {
        const ORDER: [Budget; 3] = [Budget::Touched, Budget::Held, Budget::Memories];
        let charged = |budget: &&Budget| purpose.charges(**budget);
        let undo = |upto: usize| {
            for &taken in ORDER[..upto].iter().filter(charged) {
                self.meter(taken).uncharge(amount);
            }
        };
        let mut totals = [0u64; 3];
        for (i, &budget) in ORDER.iter().enumerate() {
            if !purpose.charges(budget) {
                continue;
            }
            let meter = self.meter(budget);
            let limit = if within_limits { meter.limit } else { u64::MAX };
            match meter.add(amount, limit) {
                // `before + amount` was checked in `add`.
                Ok(before) => totals[i] = before + amount,
                Err(live) => {
                    undo(i);
                    // A driver's uncountable figure (forced) is no tenant's denial.
                    if within_limits {
                        meter.denials.fetch_add(1, Ordering::Relaxed);
                        self.denials.fetch_add(1, Ordering::Relaxed);
                    }
                    return Err(self.refusal(budget, live, amount));
                }
            }
        }
        if let Err(budget) = self.group_checked_add(amount, purpose) {
            undo(ORDER.len());
            let live = self.meter(budget).live();
            return Err(self.refusal(budget, live, amount));
        }
        for (&budget, &total) in ORDER.iter().zip(&totals) {
            // Zero for a budget not charged (or a charge of nothing): no peak to raise.
            if total > 0 {
                self.meter(budget).raise_peak(total);
            }
        }
        // Each figure is a part of the touched budget's total, which just counted `amount`.
        if let Some(figure) = self.figure(purpose) {
            figure.fetch_add(amount, Ordering::AcqRel);
        }
        Ok(())
    }

    /// `budget` (at `live`) refused `amount`.
    fn refusal(&self, budget: Budget, live: u64, amount: u64) -> Denied {
        Denied {
            tenant: self.key.id,
            budget,
            cap: self.meter(budget).limit,
            live,
            requested: amount,
        }
    }

    /// Adds `amount` to the group's totals of the budgets `purpose` charges, unless one would
    /// pass `u64::MAX` (then nothing is added, and that budget comes back).
    fn group_checked_add(&self, amount: u64, purpose: Purpose) -> Result<(), Budget> {
        let Some(group) = &self.group else {
            return Ok(());
        };
        let totals = || group.totals_for(purpose);
        for (i, (budget, sum)) in totals().enumerate() {
            if sum
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                    t.checked_add(amount)
                })
                .is_err()
            {
                for (_, sum) in totals().take(i) {
                    sum.fetch_sub(amount, Ordering::AcqRel);
                }
                return Err(budget);
            }
        }
        Ok(())
    }

    /// Takes `amount` back from the group's totals of the budgets `purpose` charges.
    fn group_sub(&self, amount: u64, purpose: Purpose) {
        if let Some(group) = &self.group {
            for (_, total) in group.totals_for(purpose) {
                total.fetch_sub(amount, Ordering::AcqRel);
            }
        }
    }

    /// The figure that reports `purpose` apart, if any.
    fn figure(&self, purpose: Purpose) -> Option<&AtomicU64> {
        match purpose {
            Purpose::DevicePool => Some(&self.device_pool),
            Purpose::Table => Some(&self.tables),
            Purpose::LinearMemory | Purpose::Held | Purpose::Memory => None,
        }
    }

    fn uncharge(&self, amount: u64, purpose: Purpose) {
        if let Some(figure) = self.figure(purpose) {
            figure.fetch_sub(amount, Ordering::AcqRel);
        }
        self.group_sub(amount, purpose);
        for budget in [Budget::Touched, Budget::Held, Budget::Memories] {
            if purpose.charges(budget) {
                self.meter(budget).uncharge(amount);
            }
        }
    }

    /// An empty reservation for `purpose`, to grow later ([`Reservation::try_grow`],
    /// [`Reservation::absorb`]): charges nothing, so it is never refused.
    pub fn empty_reservation(self: &Arc<Self>, purpose: Purpose) -> Reservation {
        self.live_reservations.fetch_add(1, Ordering::AcqRel);
        Reservation {
            tenant: Arc::clone(self),
            bytes: 0,
            purpose,
        }
    }

    /// Every budget's live total is within its limit (only a charge made past the limits,
    /// [`Reservation::grow_past_limits`], can take one over).
    #[must_use]
    pub fn within_limits(&self) -> bool {
        [Budget::Touched, Budget::Held, Budget::Memories]
            .iter()
            .all(|&b| self.meter(b).live() <= self.meter(b).limit)
    }

    /// Reserves `bytes` of linear memory against the cap, or says no. The bytes come back when
    /// the [`Reservation`] drops.
    pub fn try_reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, Denied> {
        self.try_reserve_for(bytes, Purpose::LinearMemory)
    }

    /// Reserves `bytes` for `purpose` against the budgets it counts against (for
    /// [`Purpose::Memory`], `bytes` is a number of memories).
    pub fn try_reserve_for(
        self: &Arc<Self>,
        bytes: u64,
        purpose: Purpose,
    ) -> Result<Reservation, Denied> {
        self.charge(bytes, purpose)?;
        self.live_reservations.fetch_add(1, Ordering::AcqRel);
        Ok(Reservation {
            tenant: Arc::clone(self),
            bytes,
            purpose,
        })
    }
}

impl Drop for TenantLedger {
    /// Leaves the group: the cap is no longer committed there, and what the tenant still has
    /// charged (only stranded bytes can be: every other reservation keeps the tenant alive)
    /// leaves the group's totals with it, so a group's totals are always the sum over its
    /// members.
    fn drop(&mut self) {
        if let Some(group) = &self.group {
            group
                .committed
                .fetch_sub(self.touched.limit, Ordering::AcqRel);
            group.members.fetch_sub(1, Ordering::AcqRel);
            group
                .touched
                .fetch_sub(self.touched.live(), Ordering::AcqRel);
            group.held.fetch_sub(self.held.live(), Ordering::AcqRel);
        }
    }
}

/// Bytes reserved against a tenant's cap; given back on drop.
#[derive(Debug)]
#[must_use = "dropping a reservation gives its bytes back at once"]
pub struct Reservation {
    tenant: Arc<TenantLedger>,
    bytes: u64,
    purpose: Purpose,
}

impl Reservation {
    /// Leaves the bytes charged to the tenant for good, without keeping the tenant alive: for a
    /// resource its backend never gave back after its owner was gone (nothing is left to carry
    /// the charge, and the tenant must never read as holding less than the backend does). Held
    /// bytes count in [`LedgerStats::stranded_bytes`]; everything stranded leaves the tenant's
    /// group's totals when the tenant itself goes.
    pub fn strand(mut self) {
        if self.purpose.charges(Budget::Held) {
            self.tenant.stranded.fetch_add(self.bytes, Ordering::AcqRel);
        }
        self.bytes = 0;
    }

    /// Moves `other`'s charge into this reservation (nothing is charged or given back): for a
    /// grant made apart (a growth the limiter approved) joining what it pays for. A reservation
    /// of another tenant or purpose is handed back untouched.
    pub fn absorb(&mut self, mut other: Self) -> Result<(), Self> {
        if !Arc::ptr_eq(&self.tenant, &other.tenant) || self.purpose != other.purpose {
            return Err(other);
        }
        // Both amounts are charged in the same meters, so their sum fits the limit and a u64.
        self.bytes += other.bytes;
        other.bytes = 0;
        Ok(())
    }

    /// Moves up to `bytes` of this reservation's charge into a new one of the same tenant and
    /// purpose (nothing is charged or given back): for a charge that passes from one thing to
    /// another that pays for the same bytes (a block a pool kept, handed out again).
    pub fn split(&mut self, bytes: u64) -> Self {
        let moved = bytes.min(self.bytes);
        self.bytes -= moved;
        self.tenant.live_reservations.fetch_add(1, Ordering::AcqRel);
        Self {
            tenant: Arc::clone(&self.tenant),
            bytes: moved,
            purpose: self.purpose,
        }
    }

    /// Bytes held.
    #[must_use]
    pub const fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What it pays for.
    #[must_use]
    pub const fn purpose(&self) -> Purpose {
        self.purpose
    }

    /// The tenant charged.
    #[must_use]
    pub fn tenant(&self) -> &Arc<TenantLedger> {
        &self.tenant
    }

    /// Reserves `additional` more bytes into this reservation, or says no (and holds what it
    /// held).
    pub fn try_grow(&mut self, additional: u64) -> Result<(), Denied> {
        self.tenant.charge(additional, self.purpose)?;
        self.bytes += additional;
        Ok(())
    }

    /// Charges `additional` more bytes into this reservation whatever the tenant's budgets say:
    /// for what the tenant holds already and no refusal can undo (a driver's rounding of a
    /// block it mapped). Past a budget the tenant is denied everything that checks it until
    /// enough is given back; its figures read above the limit meanwhile, as what it holds is.
    ///
    /// # Errors
    ///
    /// [`Denied`] only where a total would pass what the ledger counts (`u64::MAX`: figures
    /// no memory could back, a driver's error); then nothing is charged.
    pub fn grow_past_limits(&mut self, additional: u64) -> Result<(), Denied> {
        self.tenant.force_charge(additional, self.purpose)?;
        self.bytes += additional;
        Ok(())
    }

    /// Gives back all but `bytes` (no-op if it holds `bytes` or fewer).
    pub fn shrink_to(&mut self, bytes: u64) {
        if bytes < self.bytes {
            self.tenant.uncharge(self.bytes - bytes, self.purpose);
            self.bytes = bytes;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.tenant.uncharge(self.bytes, self.purpose);
        self.tenant.live_reservations.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use alloc::vec::Vec;

    fn tenant(cap: u64) -> Arc<TenantLedger> {
        Arc::new(TenantLedger::new(
            TenantId(7),
            cap,
            IsolationLevel::StreamIsolated,
        ))
    }

    #[test]
    fn a_group_sums_its_tenants_as_they_charge() {
        let group = Arc::new(LedgerGroup::default());
        let budgets = TenantBudgets::for_cap(100);
        let a = Arc::new(TenantLedger::in_group(
            TenantId(1),
            budgets,
            IsolationLevel::default(),
            Arc::clone(&group),
        ));
        let b = Arc::new(TenantLedger::in_group(
            TenantId(2),
            budgets,
            IsolationLevel::default(),
            Arc::clone(&group),
        ));
        let outside = tenant(100);
        let mut ta = a.try_reserve(60).unwrap();
        let hb = b.try_reserve_for(500, Purpose::Held).unwrap();
        let pool = b.try_reserve_for(30, Purpose::DevicePool).unwrap();
        let _count = a.try_reserve_for(1, Purpose::Memory).unwrap();
        let _other = outside.try_reserve(50).unwrap();
        assert_eq!((group.touched_bytes(), group.held_bytes()), (90, 530));
        assert!(a.try_reserve(41).is_err(), "a refusal counts nowhere");
        ta.try_grow(10).unwrap();
        assert_eq!(group.touched_bytes(), 100);
        ta.shrink_to(20);
        assert_eq!(group.touched_bytes(), 50);
        drop((ta, hb, pool));
        assert_eq!((group.touched_bytes(), group.held_bytes()), (0, 0));
    }

    /// A charge past the limits counts what the tenant holds, however far past; only a total
    /// no meter can count (its own or its group's, past `u64::MAX`) is refused, and then
    /// nothing is charged anywhere: the books never wrap.
    #[test]
    fn a_charge_past_the_limits_never_wraps_the_books() {
        let group = Arc::new(LedgerGroup::default());
        let members = [1, 2].map(|id| {
            Arc::new(TenantLedger::in_group(
                TenantId(id),
                TenantBudgets::for_cap(100),
                IsolationLevel::default(),
                Arc::clone(&group),
            ))
        });
        let mut first = members[0].empty_reservation(Purpose::DevicePool);
        first.grow_past_limits(u64::MAX - 10).unwrap();
        assert_eq!(first.bytes(), u64::MAX - 10);
        assert!(!members[0].within_limits());
        let mut more = members[0].empty_reservation(Purpose::DevicePool);
        let before = members[0].stats();
        let err = more.grow_past_limits(11).unwrap_err();
        assert_eq!(
            (err.budget, err.live, err.requested),
            (Budget::Touched, u64::MAX - 10, 11)
        );
        assert_eq!(more.bytes(), 0);
        let after = members[0].stats();
        assert_eq!(
            (
                after.touched_bytes,
                after.held_bytes,
                after.device_pool_bytes
            ),
            (
                before.touched_bytes,
                before.held_bytes,
                before.device_pool_bytes
            ),
            "nothing charged"
        );
        more.grow_past_limits(10).unwrap();
        // The other member's books could count it, the group's totals could not: refused,
        // forced or not, with nothing charged, no peak left behind, no denial counted (the
        // driver's error, not the tenant's).
        let mut second = members[1].empty_reservation(Purpose::DevicePool);
        assert!(second.grow_past_limits(1).is_err());
        assert!(members[1].try_reserve(1).is_err());
        assert_eq!(second.bytes(), 0);
        let other = members[1].stats();
        assert_eq!(
            (
                other.touched_bytes,
                other.touched_peak_bytes,
                other.held_peak_bytes
            ),
            (0, 0, 0),
            "rolled back"
        );
        assert_eq!(
            (
                other.denials,
                other.touched_denials,
                members[0].stats().denials
            ),
            (0, 0, 0)
        );
        assert_eq!(group.touched_bytes(), u64::MAX);
        drop((first, more, second));
        assert_eq!((group.touched_bytes(), group.held_bytes()), (0, 0));
        assert_eq!(members[0].stats().touched_bytes, 0);
        assert!(members[0].within_limits());
    }

    /// A later budget that cannot count a charge past the limits takes back what the earlier
    /// ones took, and no peak stays behind.
    #[test]
    fn a_charge_one_budget_cannot_count_is_taken_back_from_the_others() {
        let t = tenant(100);
        let mut held = t.empty_reservation(Purpose::Held);
        held.grow_past_limits(u64::MAX).unwrap();
        let mut pool = t.empty_reservation(Purpose::DevicePool);
        let err = pool.grow_past_limits(1).unwrap_err();
        assert_eq!(err.budget, Budget::Held);
        let stats = t.stats();
        assert_eq!(
            (
                stats.touched_bytes,
                stats.touched_peak_bytes,
                stats.device_pool_bytes
            ),
            (0, 0, 0),
            "the touched budget's share rolled back"
        );
        drop((held, pool));
        assert_eq!(t.stats().held_bytes, 0);
    }

    #[test]
    fn reserve_release_and_figures() {
        let t = tenant(100);
        let a = t.try_reserve(60).unwrap();
        let b = t.try_reserve(40).unwrap();
        let err = t.try_reserve(1).unwrap_err();
        assert_eq!(
            err,
            Denied {
                tenant: TenantId(7),
                budget: Budget::Touched,
                cap: 100,
                live: 100,
                requested: 1
            }
        );
        assert_eq!(err.kind(), ErrorKind::CapExceeded);
        assert!(err.to_string().contains("tenant 7"));
        let s = t.stats();
        assert_eq!(
            (
                s.touched_bytes,
                s.touched_peak_bytes,
                s.live_reservations,
                s.granted,
                s.denials
            ),
            (100, 100, 2, 2, 1)
        );
        drop(a);
        assert_eq!(t.touched_bytes(), 40);
        drop(b);
        let s = t.stats();
        assert_eq!(
            (s.touched_bytes, s.touched_peak_bytes, s.live_reservations),
            (0, 100, 0)
        );
    }

    #[test]
    fn overflowing_requests_are_denied_not_wrapped() {
        let t = tenant(u64::MAX);
        let _a = t.try_reserve(u64::MAX - 1).unwrap();
        assert!(t.try_reserve(2).is_err());
        assert!(t.try_reserve(u64::MAX).is_err());
        assert_eq!(t.touched_bytes(), u64::MAX - 1);
        let stats = t.stats();
        assert_eq!(
            (stats.denials, stats.touched_denials),
            (2, 2),
            "each counted"
        );
    }

    #[test]
    fn grow_and_shrink() {
        let t = tenant(10);
        let mut r = t.try_reserve(4).unwrap();
        r.try_grow(6).unwrap();
        assert_eq!(r.bytes(), 10);
        assert!(r.try_grow(1).is_err());
        assert_eq!(r.bytes(), 10, "a denied growth keeps what was held");
        r.shrink_to(3);
        assert_eq!(t.touched_bytes(), 3);
        r.shrink_to(5);
        assert_eq!(r.bytes(), 3, "shrink_to never grows");
        drop(r);
        assert_eq!(t.stats().touched_bytes, 0);
        assert_eq!(t.stats().live_reservations, 0);
    }

    #[test]
    fn purposes_share_one_cap_and_are_reported_apart() {
        let t = tenant(100);
        let memory = t.try_reserve(60).unwrap();
        let mut pool = t.try_reserve_for(30, Purpose::DevicePool).unwrap();
        assert_eq!(pool.purpose(), Purpose::DevicePool);
        assert!(
            t.try_reserve_for(11, Purpose::DevicePool).is_err(),
            "one cap for both"
        );
        pool.try_grow(10).unwrap();
        let s = t.stats();
        assert_eq!((s.touched_bytes, s.device_pool_bytes), (100, 40));
        pool.shrink_to(5);
        assert_eq!(t.stats().device_pool_bytes, 5);
        drop(pool);
        drop(memory);
        let s = t.stats();
        assert_eq!((s.touched_bytes, s.device_pool_bytes), (0, 0));
    }

    #[test]
    fn each_budget_is_hard_and_named_when_it_refuses() {
        let budgets = TenantBudgets {
            touched_bytes: 100,
            held_bytes: 1000,
            memories: 2,
        };
        let t = Arc::new(TenantLedger::with_budgets(
            TenantId(3),
            budgets,
            IsolationLevel::Shared,
        ));
        assert_eq!(t.budgets(), budgets);
        let held = t.try_reserve_for(901, Purpose::Held).unwrap();
        assert_eq!(t.touched_bytes(), 0, "held capacity is not touched");
        let denied = t.try_reserve_for(101, Purpose::Held).unwrap_err();
        assert_eq!(
            (denied.budget, denied.cap, denied.live, denied.requested),
            (Budget::Held, 1000, 901, 101)
        );
        assert!(denied.to_string().contains("held budget"), "{denied}");
        // A pool buffer counts against both: refused by the held budget, nothing is charged.
        let denied = t.try_reserve_for(101, Purpose::DevicePool).unwrap_err();
        assert_eq!(denied.budget, Budget::Touched, "the first budget to refuse");
        let denied = t.try_reserve_for(100, Purpose::DevicePool).unwrap_err();
        assert_eq!(denied.budget, Budget::Held);
        assert_eq!((t.live(Budget::Touched), t.live(Budget::Held)), (0, 901));
        let pool = t.try_reserve_for(50, Purpose::DevicePool).unwrap();
        assert_eq!((t.live(Budget::Touched), t.live(Budget::Held)), (50, 951));
        let a = t.try_reserve_for(1, Purpose::Memory).unwrap();
        let b = t.try_reserve_for(1, Purpose::Memory).unwrap();
        let denied = t.try_reserve_for(1, Purpose::Memory).unwrap_err();
        assert_eq!((denied.budget, denied.cap), (Budget::Memories, 2));
        assert!(denied.to_string().contains("1 memories"), "{denied}");
        let s = t.stats();
        assert_eq!(
            (
                s.held_bytes,
                s.live_memories,
                s.held_denials,
                s.memory_denials,
                s.denials
            ),
            (951, 2, 2, 1, 4)
        );
        drop((held, pool, a, b));
        let s = t.stats();
        assert_eq!((s.touched_bytes, s.held_bytes, s.live_memories), (0, 0, 0));
        assert_eq!((s.held_peak_bytes, s.peak_memories), (951, 2));
    }

    #[test]
    fn default_budgets_follow_the_cap() {
        let zero = TenantBudgets::for_cap(0);
        assert_eq!(zero.held_bytes, TenantBudgets::MIN_HELD_BYTES);
        assert_eq!(TenantBudgets::for_cap(1 << 30).held_bytes, 4 << 30);
        assert_eq!(TenantBudgets::for_cap(u64::MAX).held_bytes, u64::MAX);
        assert_eq!(zero.memories, TenantBudgets::DEFAULT_MEMORIES);
        // One default-size memory and a table fit at any cap.
        assert!(zero.held_bytes > DEFAULT_MAX_BYTES);
        let big = TenantBudgets::for_cap(1 << 20).with_room_for_memory(4 << 30);
        assert_eq!(big.held_bytes, (4 << 30) + TenantBudgets::TABLE_ROOM_BYTES);
        assert_eq!(
            TenantBudgets::for_cap(8 << 30).with_room_for_memory(1 << 20),
            TenantBudgets::for_cap(8 << 30),
            "never lowers a budget"
        );
        assert_eq!(
            TenantBudgets::unlimited().with_room_for_memory(u64::MAX),
            TenantBudgets::unlimited()
        );
    }

    #[test]
    fn zero_cap_denies_everything_but_zero() {
        let t = tenant(0);
        assert!(t.try_reserve(1).is_err());
        let r = t.try_reserve(0).unwrap();
        assert_eq!(r.bytes(), 0);
    }

    /// At least two threads and 100,000 reserve/release operations: the live total never passes
    /// the cap, and returns to zero.
    #[test]
    fn contention_never_overcommits() {
        const THREADS: usize = 4;
        const OPS: usize = 50_000; // per thread: 200,000 reserve/release operations in all
        const CAP: u64 = 300;
        let t = tenant(CAP);
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                let t = Arc::clone(&t);
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    let mut granted = 0u64;
                    for op in 0..OPS {
                        let bytes = ((op * 31 + i * 17) % 97 + 1) as u64;
                        if let Ok(r) = t.try_reserve(bytes) {
                            granted += 1;
                            held.push(r);
                        }
                        assert!(t.touched_bytes() <= CAP, "over-committed");
                        if held.len() > 3 || op % 5 == 0 {
                            held.clear();
                        }
                    }
                    granted
                })
            })
            .collect();
        let granted: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        let s = t.stats();
        assert_eq!(s.touched_bytes, 0);
        assert_eq!(s.live_reservations, 0);
        assert!(s.touched_peak_bytes <= CAP);
        assert_eq!(s.granted, granted);
        assert_eq!(s.granted + s.denials, (THREADS * OPS) as u64);
        assert!(s.denials > 0, "the test must actually hit the cap");
        assert!(s.granted > 0);
    }
}

#[cfg(test)]
mod model {
    //! The ledger against a plain model: random sequences of reserve, grow, shrink and release.
    use super::*;
    use alloc::vec::Vec;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Reserve(u64, bool),
        Grow(usize, u64),
        Shrink(usize, u64),
        Release(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..400, any::<bool>()).prop_map(|(b, pool)| Op::Reserve(b, pool)),
            (any::<usize>(), 0u64..200).prop_map(|(i, b)| Op::Grow(i, b)),
            (any::<usize>(), 0u64..400).prop_map(|(i, b)| Op::Shrink(i, b)),
            any::<usize>().prop_map(Op::Release),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn ledger_matches_the_model(cap in 0u64..1000, ops in proptest::collection::vec(op(), 1..60)) {
            let t = Arc::new(TenantLedger::new(TenantId(1), cap, IsolationLevel::Shared));
            // The model: the bytes and purpose of each live reservation, and the counters.
            let mut held: Vec<(Reservation, u64, bool)> = Vec::new();
            let (mut peak, mut denials, mut granted) = (0u64, 0u64, 0u64);
            for op in ops {
                let live: u64 = held.iter().map(|h| h.1).sum();
                match op {
                    Op::Reserve(bytes, pool) => {
                        let purpose = if pool { Purpose::DevicePool } else { Purpose::LinearMemory };
                        let fits = live + bytes <= cap;
                        match t.try_reserve_for(bytes, purpose) {
                            Ok(r) => {
                                prop_assert!(fits);
                                held.push((r, bytes, pool));
                                granted += 1;
                            }
                            Err(d) => {
                                prop_assert!(!fits);
                                prop_assert_eq!(d.live, live);
                                denials += 1;
                            }
                        }
                    }
                    Op::Grow(i, bytes) if !held.is_empty() => {
                        let i = i % held.len();
                        let fits = live + bytes <= cap;
                        prop_assert_eq!(held[i].0.try_grow(bytes).is_ok(), fits);
                        if fits {
                            held[i].1 += bytes;
                            granted += 1;
                        } else {
                            denials += 1;
                        }
                    }
                    Op::Shrink(i, bytes) if !held.is_empty() => {
                        let i = i % held.len();
                        held[i].0.shrink_to(bytes);
                        held[i].1 = held[i].1.min(bytes);
                    }
                    Op::Release(i) if !held.is_empty() => {
                        let i = i % held.len();
                        drop(held.swap_remove(i));
                    }
                    _ => {}
                }
                let live: u64 = held.iter().map(|h| h.1).sum();
                peak = peak.max(live);
                let s = t.stats();
                prop_assert_eq!(s.touched_bytes, live);
                prop_assert!(s.touched_bytes <= cap);
                prop_assert_eq!(s.touched_peak_bytes, peak);
                prop_assert_eq!(s.live_reservations, held.len() as u64);
                prop_assert_eq!(s.denials, denials);
                prop_assert_eq!(s.granted, granted);
                let pool: u64 = held.iter().filter(|h| h.2).map(|h| h.1).sum();
                prop_assert_eq!(s.device_pool_bytes, pool);
            }
            drop(held);
            prop_assert_eq!(t.stats().touched_bytes, 0);
        }
    }
}
