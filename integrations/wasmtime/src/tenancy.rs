//! Tenancy with one Engine: a per-Store [`TenantLimiter`] that charges a [`Tenant`] for what its
//! guests touch and hold, refuses what would pass a budget, and gives everything back when the
//! memories are really gone.
//!
//! A tenant has three budgets on its one ledger ([`TenantBudgets`]), all hard and all checked
//! before anything is allocated:
//!
//! - **touched** bytes (the cap): a memory's current size, charged at instantiation and on each
//!   growth ([`ChargeMode::Touched`], the default: managed memory is demand-paged, so capacity
//!   that is never touched costs no device memory), or its whole capacity at instantiation
//!   ([`ChargeMode::Capacity`], for backings where capacity is physical);
//! - **held** bytes: the capacity a memory occupies (its pool slot, or its whole allocation),
//!   and [`TABLE_ELEMENT_BYTES`] per table element;
//! - **memories**: linear memories alive at once, across all the tenant's Stores.
//!
//! Wasmtime calls the limiter's `memory_growing(0, minimum, maximum)` for every memory at
//! instantiation, *before* the creator allocates, then the creator's `new_memory` on the same
//! thread; `memory_growing(current, desired, ..)` on each `memory.grow`. The limiter charges the
//! touched bytes (the same rule for a new memory and a growth: `desired - current`) and hands
//! the Store's charge to the creator on the thread; the creator charges the held bytes and the
//! memory count (and the capacity in `Capacity` mode), and the memory keeps all of it, with the
//! Store's charge, until its backing is freed or back in the pool. Wasmtime drops a Store's data
//! (the limiter) *before* its memories: the charge outlives the limiter, so a tenant is never
//! below what it holds.
//!
//! - A memory past a budget refuses instantiation with [`TwmError::Denied`] naming the tenant,
//!   the budget, its limit and the request, when the module is instantiated through
//!   [`instantiate`]. A plain `Linker::instantiate` is refused too, with Wasmtime's generic
//!   message; [`TenantLimiter::last_denial`] then has the details.
//! - A growth past the touched budget is a failed `memory.grow`: `-1` to the guest, which keeps
//!   running. So is a growth past the memory's capacity (never charged).
//! - Under [`instantiate`] the limiter knows how many memories and tables the module defines
//!   (Wasmtime makes them all before the start function runs), so a start function's
//!   `memory.grow` on a zero-page memory is a growth: past the cap it returns `-1`, as the spec
//!   says, instead of refusing the instantiation.
//! - Tables: a table past [`TenantLimiter::DEFAULT_TABLE_ELEMENTS`] elements (or the tenant's
//!   held budget) refuses instantiation; a `table.grow` past them returns `-1`. Instances,
//!   tables and memories per Store default to Wasmtime's own limits
//!   ([`wasmtime::DEFAULT_INSTANCE_LIMIT`] and friends); [`instantiate`] refuses a module that
//!   would pass them with [`TwmError::Limit`].

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tensor_wasm_mem_core::{
    Denied, DeviceId, IsolationLevel, LedgerGroup, MemoryPlan, PlanLimits, Purpose, Reservation,
    Stream, TenantBudgets, TenantContext, TenantId, TenantKey,
};
use wasmtime::{AsContextMut, Instance, Linker, Module, ResourceLimiter, Store};

use crate::error::TwmError;

/// Host bytes charged to the held budget per table element: Wasmtime 48 stores a funcref
/// element as one pointer and an externref as a 32-bit GC reference; both are charged as a
/// pointer.
pub const TABLE_ELEMENT_BYTES: u64 = 8;

/// How a tenant is charged for a memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChargeMode {
    /// The initial size at instantiation, then each growth (what the guest can touch).
    #[default]
    Touched,
    /// The whole capacity at instantiation (for backings where capacity is physical).
    Capacity,
}

/// A tenant: its ledger ([`TenantContext`]), a name for errors and reports, memory counts, and
/// the devices it is bound to.
///
/// A tenant is bound to one device or a set of them (device 0 unless made with
/// [`with_devices`](Self::with_devices) or placed by a [`Placement`](crate::Placement)): its
/// memories, pool slots and guest stream are on its home device ([`device`](Self::device), the
/// first of the set), and its guests may prefetch to or advise any device of the set
/// ([`may_use`](Self::may_use)), and no other.
#[derive(Debug)]
pub struct Tenant {
    context: Arc<TenantContext>,
    name: String,
    memories_created: AtomicU64,
    devices: Vec<DeviceId>,
}

/// A snapshot of a tenant's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantStats {
    /// The tenant's id.
    pub id: TenantId,
    /// Its name.
    pub name: String,
    /// Its isolation level.
    pub isolation: IsolationLevel,
    /// Its cap (the touched budget) in bytes.
    pub cap: u64,
    /// Touched bytes charged now.
    pub live_bytes: u64,
    /// The most touched bytes ever charged at once.
    pub peak_bytes: u64,
    /// Its held budget in bytes.
    pub held_limit: u64,
    /// Bytes of capacity held now (memory slots or allocations, table elements, pool buffers).
    pub held_bytes: u64,
    /// The most bytes of capacity ever held at once.
    pub held_peak_bytes: u64,
    /// Its budget of live memories.
    pub memory_limit: u64,
    /// Memories alive now (counted until their backing is freed or back in the pool).
    pub live_memories: u64,
    /// Memories ever charged.
    pub memories_created: u64,
    /// Requests any budget refused.
    pub denials: u64,
    /// Of `denials`, those by the held budget.
    pub held_denials: u64,
    /// Of `denials`, those by the memories budget.
    pub memory_denials: u64,
    /// Of `live_bytes`, the bytes in the tenant's device memory pools.
    pub device_pool_bytes: u64,
    /// Its home device (where its memories, pool slots and stream are).
    pub device: DeviceId,
}

impl Tenant {
    /// A tenant with a byte cap at an isolation level, its other budgets at their defaults for
    /// that cap ([`TenantBudgets::for_cap`]).
    pub fn new(
        id: u64,
        name: impl Into<String>,
        cap_bytes: u64,
        isolation: IsolationLevel,
    ) -> Arc<Self> {
        Self::with_budgets(id, name, TenantBudgets::for_cap(cap_bytes), isolation)
    }

    /// A tenant with `budgets` at an isolation level, on device 0.
    pub fn with_budgets(
        id: u64,
        name: impl Into<String>,
        budgets: TenantBudgets,
        isolation: IsolationLevel,
    ) -> Arc<Self> {
        Arc::new(Self::make(
            id,
            name.into(),
            budgets,
            isolation,
            vec![DeviceId(0)],
            None,
        ))
    }

    /// A tenant with `budgets` at an isolation level, bound to `devices`: the first is its home
    /// (memories, pool slots, stream), all of them may be prefetched to and advised. An empty
    /// set, or a device named twice, is [`TwmError::Devices`].
    pub fn with_devices(
        id: u64,
        name: impl Into<String>,
        budgets: TenantBudgets,
        isolation: IsolationLevel,
        devices: &[DeviceId],
    ) -> Result<Arc<Self>, TwmError> {
        crate::placement::check_device_set(devices)?;
        Ok(Arc::new(Self::make(
            id,
            name.into(),
            budgets,
            isolation,
            devices.to_vec(),
            None,
        )))
    }

    pub(crate) fn make(
        id: u64,
        name: String,
        budgets: TenantBudgets,
        isolation: IsolationLevel,
        devices: Vec<DeviceId>,
        group: Option<Arc<LedgerGroup>>,
    ) -> Self {
        let context = match group {
            Some(group) => TenantContext::in_group(TenantId(id), budgets, isolation, group),
            None => TenantContext::with_budgets(TenantId(id), budgets, isolation),
        };
        Self {
            context: Arc::new(context),
            name,
            memories_created: AtomicU64::new(0),
            devices,
        }
    }

    /// Its home device: where its memories, pool slots and guest stream are.
    #[must_use]
    pub fn device(&self) -> DeviceId {
        self.devices[0]
    }

    /// Every device it is bound to (its home first).
    #[must_use]
    pub fn devices(&self) -> &[DeviceId] {
        &self.devices
    }

    /// Whether its guests may prefetch to or advise `device`.
    #[must_use]
    pub fn may_use(&self, device: DeviceId) -> bool {
        self.devices.contains(&device)
    }

    /// The ledger.
    #[must_use]
    pub fn context(&self) -> &Arc<TenantContext> {
        &self.context
    }

    /// The name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A snapshot of the figures.
    #[must_use]
    pub fn stats(&self) -> TenantStats {
        let ledger = self.context.stats();
        TenantStats {
            id: self.context.id(),
            name: self.name.clone(),
            isolation: self.context.isolation(),
            cap: ledger.cap,
            live_bytes: ledger.live_bytes,
            peak_bytes: ledger.peak_bytes,
            held_limit: ledger.held_limit,
            held_bytes: ledger.held_bytes,
            held_peak_bytes: ledger.held_peak_bytes,
            memory_limit: ledger.memory_limit,
            live_memories: ledger.live_memories,
            memories_created: self.memories_created.load(Ordering::Acquire),
            denials: ledger.denials,
            held_denials: ledger.held_denials,
            memory_denials: ledger.memory_denials,
            device_pool_bytes: ledger.device_pool_bytes,
            device: self.device(),
        }
    }

    pub(crate) fn denied(&self, denied: Denied) -> TwmError {
        TwmError::Denied {
            tenant_name: self.name.clone(),
            denied,
        }
    }

    /// Reserves `bytes` for `purpose`, or a [`TwmError::Denied`] naming this tenant.
    pub(crate) fn reserve_for(
        &self,
        bytes: u64,
        purpose: Purpose,
    ) -> Result<Reservation, TwmError> {
        self.context
            .try_reserve_for(bytes, purpose)
            .map_err(|d| self.denied(d))
    }

    /// Charges one new memory holding `held` bytes: the memory count and the held bytes, in
    /// that order; nothing if either refuses.
    pub(crate) fn charge_memory(&self, held: u64) -> Result<MemoryCharge, TwmError> {
        let count = self.reserve_for(1, Purpose::Memory)?;
        let held = self.reserve_for(held, Purpose::Held)?;
        self.memories_created.fetch_add(1, Ordering::AcqRel);
        Ok(MemoryCharge {
            _count: count,
            _held: held,
        })
    }
}

/// What one memory holds of its tenant's memory-count and held budgets.
#[derive(Debug)]
pub(crate) struct MemoryCharge {
    _count: Reservation,
    _held: Reservation,
}

/// What one Store has charged its tenant (touched bytes of its memories, its table elements),
/// shared by the Store's limiter and every memory made in it, so it goes back when the last of
/// them goes: the memories, which Wasmtime drops after the Store's data.
#[derive(Debug)]
pub(crate) struct StoreCharge {
    tenant: Arc<Tenant>,
    mode: ChargeMode,
    touched: Mutex<Reservation>,
    tables: Mutex<Reservation>,
    /// The creator's last refusal of a memory in this Store (held or memories budget), for
    /// [`instantiate`] to return typed.
    refusal: Mutex<Option<Denied>>,
    /// Streams of this Store's guest context still alive: a memory that goes before them (the
    /// Store's data outlived its memories, as with `Store::into_data`) waits for them first.
    streams: Mutex<Vec<StreamId>>,
}

/// What names a stream to its backend (a [`Stream`] is a handle that cannot be copied).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamId {
    raw: u64,
    context: u64,
    level: IsolationLevel,
    tenant: TenantKey,
    device: DeviceId,
}

impl StreamId {
    pub(crate) fn of(stream: &Stream) -> Self {
        Self {
            raw: stream.raw(),
            context: stream.context(),
            level: stream.level(),
            tenant: stream.tenant_key(),
            device: stream.device(),
        }
    }

    /// A handle to the same stream, for a wait (the backend refuses it if the stream is gone).
    pub(crate) fn handle(self) -> Stream {
        Stream::new(self.raw, self.context, self.level, self.tenant).on_device(self.device)
    }
}

impl StoreCharge {
    pub(crate) fn tenant(&self) -> &Arc<Tenant> {
        &self.tenant
    }

    pub(crate) fn mode(&self) -> ChargeMode {
        self.mode
    }

    fn touched(&self) -> std::sync::MutexGuard<'_, Reservation> {
        self.touched.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Reservation> {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives back `bytes` of touched charge (a creation the creator refused after the limiter
    /// charged it: Wasmtime reports no failure to the limiter then).
    pub(crate) fn refund_touched(&self, bytes: u64) {
        let mut touched = self.touched();
        let keep = touched.bytes().saturating_sub(bytes);
        touched.shrink_to(keep);
    }

    pub(crate) fn add_stream(&self, id: StreamId) {
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(id);
    }

    pub(crate) fn remove_stream(&self, id: StreamId) {
        let mut streams = self.streams.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = streams.iter().position(|s| *s == id) {
            streams.swap_remove(i);
        }
    }

    /// The Store's streams still alive.
    pub(crate) fn streams(&self) -> Vec<StreamId> {
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn record_refusal(&self, denied: Denied) {
        *self.refusal.lock().unwrap_or_else(PoisonError::into_inner) = Some(denied);
    }

    fn take_refusal(&self) -> Option<Denied> {
        self.refusal
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// A new memory the limiter has approved, for the creator Wasmtime calls next on this thread.
#[derive(Debug)]
pub(crate) struct Creation {
    /// The Store's charge, which the memory keeps alive.
    pub(crate) store: Arc<StoreCharge>,
    /// The size the limiter approved (the memory's minimum in bytes).
    minimum: usize,
    /// Touched bytes the limiter charged for it.
    pub(crate) touched: u64,
}

thread_local! {
    /// The handoff from `memory_growing(0, ..)` to `new_memory`: Wasmtime makes the two calls
    /// one after the other on the same thread, with nothing in between that can reach another
    /// Store's limiter.
    static CREATION: RefCell<Option<Creation>> = const { RefCell::new(None) };
}

fn announce(creation: Option<Creation>) {
    CREATION.with(|c| *c.borrow_mut() = creation);
}

/// The creation the limiter announced on this thread, if it is for a memory of `minimum` bytes
/// (any other announcement is stale and is dropped).
pub(crate) fn take_creation(minimum: usize) -> Option<Creation> {
    CREATION
        .with(|c| c.borrow_mut().take())
        .filter(|c| c.minimum == minimum)
}

/// Drops any stale announcement: a growth, not a creation, followed it.
pub(crate) fn forget_creation() {
    announce(None);
}

/// A per-Store Wasmtime `ResourceLimiter` charging one [`Tenant`].
pub struct TenantLimiter {
    charge: Arc<StoreCharge>,
    limits: PlanLimits,
    /// The last memory growth charged, until its outcome is known.
    pending_growth: u64,
    /// The last table growth charged, until its outcome is known.
    pending_table_growth: u64,
    instantiating: bool,
    /// During [`instantiate`]: the memories the module defines that Wasmtime has yet to create.
    /// A `memory_growing` from zero is a new memory only while this is above zero; after, it is
    /// a growth of a zero-page memory (a start function's `memory.grow`).
    new_memories: Option<u32>,
    /// The same for tables.
    new_tables: Option<u32>,
    /// Instances, tables and memories made by [`instantiate`] in this Store.
    made: [u64; 3],
    growths: u64,
    denied_growths: u64,
    denied_table_growths: u64,
    last_denial: Option<Denied>,
    max_table_elements: usize,
    max_instances: usize,
    max_tables: usize,
    max_memories: usize,
}

impl fmt::Debug for TenantLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantLimiter")
            .field("tenant", &self.charge.tenant.name)
            .field("mode", &self.charge.mode)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Figures of one Store's limiter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimiterStats {
    /// Touched bytes of this Store's memories charged to its tenant (in `Capacity` mode the
    /// capacity is charged by each memory instead, and is not in this figure).
    pub charged_bytes: u64,
    /// Held bytes of this Store's table elements charged to its tenant.
    pub table_bytes: u64,
    /// Memories this Store made through [`instantiate`].
    pub memories: u64,
    /// Growths the limiter allowed (a growth may still fail after, in the backend).
    pub growths: u64,
    /// Growths refused (`-1` to the guest): past the cap or past the memory's capacity.
    pub denied_growths: u64,
    /// Table growths refused (`-1` to the guest).
    pub denied_table_growths: u64,
}

const INSTANCES: usize = 0;
const TABLES: usize = 1;
const MEMORIES: usize = 2;

impl TenantLimiter {
    /// The default limit of elements in one table: a million (8 MiB of host memory).
    pub const DEFAULT_TABLE_ELEMENTS: usize = 1 << 20;

    /// A limiter charging `tenant` in `mode`, planning memories under `limits` (use the creator's:
    /// `creator.limits()`).
    pub fn new(tenant: Arc<Tenant>, mode: ChargeMode, limits: PlanLimits) -> Self {
        let zero = |purpose| {
            tenant
                .context
                .try_reserve_for(0, purpose)
                .unwrap_or_else(|_| unreachable!("a zero-byte reservation is always granted"))
        };
        let charge = Arc::new(StoreCharge {
            touched: Mutex::new(zero(Purpose::LinearMemory)),
            tables: Mutex::new(zero(Purpose::Held)),
            tenant,
            mode,
            refusal: Mutex::new(None),
            streams: Mutex::new(Vec::new()),
        });
        Self {
            charge,
            limits,
            pending_growth: 0,
            pending_table_growth: 0,
            instantiating: false,
            new_memories: None,
            new_tables: None,
            made: [0; 3],
            growths: 0,
            denied_growths: 0,
            denied_table_growths: 0,
            last_denial: None,
            max_table_elements: Self::DEFAULT_TABLE_ELEMENTS,
            max_instances: wasmtime::DEFAULT_INSTANCE_LIMIT,
            max_tables: wasmtime::DEFAULT_TABLE_LIMIT,
            max_memories: wasmtime::DEFAULT_MEMORY_LIMIT,
        }
    }

    /// Limits tables to `elements` each (default [`DEFAULT_TABLE_ELEMENTS`](Self::DEFAULT_TABLE_ELEMENTS)).
    #[must_use]
    pub fn with_max_table_elements(mut self, elements: usize) -> Self {
        self.max_table_elements = elements;
        self
    }

    /// Limits this Store to `instances` instances, `tables` tables and `memories` memories
    /// (defaults: Wasmtime's [`wasmtime::DEFAULT_INSTANCE_LIMIT`],
    /// [`wasmtime::DEFAULT_TABLE_LIMIT`], [`wasmtime::DEFAULT_MEMORY_LIMIT`]).
    #[must_use]
    pub fn with_store_limits(mut self, instances: usize, tables: usize, memories: usize) -> Self {
        self.max_instances = instances;
        self.max_tables = tables;
        self.max_memories = memories;
        self
    }

    /// The tenant.
    #[must_use]
    pub fn tenant(&self) -> &Arc<Tenant> {
        &self.charge.tenant
    }

    pub(crate) fn store_charge(&self) -> &Arc<StoreCharge> {
        &self.charge
    }

    /// The most recent refusal by a budget, if any.
    #[must_use]
    pub fn last_denial(&self) -> Option<Denied> {
        self.last_denial
    }

    /// This Store's figures.
    #[must_use]
    pub fn stats(&self) -> LimiterStats {
        LimiterStats {
            charged_bytes: self.charge.touched().bytes(),
            table_bytes: self.charge.tables().bytes(),
            memories: self.made[MEMORIES],
            growths: self.growths,
            denied_growths: self.denied_growths,
            denied_table_growths: self.denied_table_growths,
        }
    }

    /// Refuses a creation: an error naming the tenant during [`instantiate`], a plain `false`
    /// otherwise (a failed `memory.grow`, or Wasmtime's generic instantiation error).
    fn refuse(&self, creating: bool, error: TwmError) -> wasmtime::Result<bool> {
        if creating && self.instantiating {
            Err(wasmtime::Error::new(error))
        } else {
            Ok(false)
        }
    }

    fn deny(&mut self, creating: bool, denied: Denied) -> wasmtime::Result<bool> {
        self.last_denial = Some(denied);
        tracing::debug!(%denied, "twm: denied by a tenant budget");
        let error = self.charge.tenant.denied(denied);
        self.refuse(creating, error)
    }

    /// Whether a `*_growing(current, ..)` call announces a new object, given the count of new
    /// ones [`instantiate`] expects (`None` outside it: then a growth from zero is taken for a
    /// new object, which only changes how a refusal is reported).
    fn is_creation(pending: &mut Option<u32>, current: usize) -> bool {
        match pending {
            Some(left) if current == 0 && *left > 0 => {
                *left -= 1;
                true
            }
            Some(_) => false,
            None => current == 0,
        }
    }
}

impl ResourceLimiter for TenantLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // A new call means the previous growth's outcome is settled (a failure was reported
        // through `memory_grow_failed` before this call), and any announcement is stale.
        self.pending_growth = 0;
        forget_creation();
        let creating = Self::is_creation(&mut self.new_memories, current);
        let _span = tracing::debug_span!(
            "twm.tenant.memory",
            isolation = self.charge.tenant.context.isolation().name(),
            tenant = self.charge.tenant.name.as_str(),
            current,
            desired
        )
        .entered();
        // Page size 1: the plan is never rounded below what the creator can hand out, so
        // nothing the creator would serve is refused here.
        let plan = match MemoryPlan::from_bytes(current.min(desired), maximum, 1, &self.limits) {
            Ok(plan) => plan,
            Err(e) => return self.refuse(creating, TwmError::Plan(e)),
        };
        if desired as u64 > plan.capacity_bytes() {
            // Past the capacity the creator gives such a memory: it cannot succeed, so it is
            // refused before anything is charged (a new memory this large is a plan error).
            if creating {
                if let Err(e) = MemoryPlan::from_bytes(desired, maximum, 1, &self.limits) {
                    return self.refuse(creating, TwmError::Plan(e));
                }
            } else {
                self.denied_growths += 1;
                return Ok(false);
            }
        }
        // The same rule for a new memory and a growth: what becomes touchable. In `Capacity`
        // mode the creator charges the whole capacity to the memory instead.
        let extra = match self.charge.mode {
            ChargeMode::Touched => desired.saturating_sub(current) as u64,
            ChargeMode::Capacity => 0,
        };
        let granted = self.charge.touched().try_grow(extra);
        if let Err(denied) = granted {
            if !creating {
                self.denied_growths += 1;
            }
            return self.deny(creating, denied);
        }
        self.pending_growth = extra;
        if creating {
            self.made[MEMORIES] += 1;
        } else {
            self.growths += 1;
        }
        if current == 0 {
            // Maybe a new memory (certainly, under `instantiate`): the creator takes this if
            // Wasmtime calls it next; a growth's `grow_to` drops it.
            announce(Some(Creation {
                store: Arc::clone(&self.charge),
                minimum: desired,
                touched: extra,
            }));
        }
        Ok(true)
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        // Every failure reported here follows the `memory_growing` call that charged it: the
        // one path where Wasmtime 48 reports a failure without announcing the growth first
        // (past what a 1-byte-page memory type can represent) cannot be reached, because our
        // creators refuse custom page sizes (and `configure` turns the proposal off). So the
        // pending growth is refunded whatever the error says.
        forget_creation();
        if self.pending_growth > 0 {
            let refund = self.pending_growth;
            let mut touched = self.charge.touched();
            let keep = touched.bytes() - refund;
            touched.shrink_to(keep);
        }
        self.pending_growth = 0;
        Ok(())
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.pending_table_growth = 0;
        let creating = Self::is_creation(&mut self.new_tables, current);
        if desired > self.max_table_elements {
            if !creating {
                self.denied_table_growths += 1;
            }
            let error = TwmError::Limit {
                what: "elements in one table",
                requested: desired as u64,
                limit: self.max_table_elements as u64,
            };
            return self.refuse(creating, error);
        }
        let extra = (desired.saturating_sub(current) as u64).saturating_mul(TABLE_ELEMENT_BYTES);
        let granted = self.charge.tables().try_grow(extra);
        if let Err(denied) = granted {
            if !creating {
                self.denied_table_growths += 1;
            }
            return self.deny(creating, denied);
        }
        self.pending_table_growth = extra;
        if creating {
            self.made[TABLES] += 1;
        }
        Ok(true)
    }

    fn table_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        if self.pending_table_growth > 0 {
            let refund = self.pending_table_growth;
            let mut tables = self.charge.tables();
            let keep = tables.bytes() - refund;
            tables.shrink_to(keep);
        }
        self.pending_table_growth = 0;
        Ok(())
    }

    fn instances(&self) -> usize {
        self.max_instances
    }

    fn tables(&self) -> usize {
        self.max_tables
    }

    fn memories(&self) -> usize {
        self.max_memories
    }
}

/// Store data that holds a [`TenantLimiter`].
pub trait HasTenantLimiter: 'static {
    /// The limiter.
    fn tenant_limiter(&mut self) -> &mut TenantLimiter;
}

impl HasTenantLimiter for TenantLimiter {
    fn tenant_limiter(&mut self) -> &mut TenantLimiter {
        self
    }
}

/// A Store whose limiter charges the tenant of `data`.
pub fn new_store<T: HasTenantLimiter>(engine: &wasmtime::Engine, data: T) -> Store<T> {
    let mut store = Store::new(engine, data);
    store.limiter(|data| data.tenant_limiter());
    store
}

/// Instantiates `module` with the limiter told that memories and tables are being created, so
/// a memory or table past the tenant's budgets refuses instantiation with [`TwmError::Denied`],
/// and a module that would pass the Store's counts with [`TwmError::Limit`] (downcast the
/// returned error).
pub fn instantiate<T: HasTenantLimiter>(
    mut store: impl AsContextMut<Data = T>,
    linker: &Linker<T>,
    module: &Module,
) -> wasmtime::Result<Instance> {
    let required = module.resources_required();
    let mut context = store.as_context_mut();
    let limiter = context.data_mut().tenant_limiter();
    let wanted = [
        (
            INSTANCES,
            "instances in one Store",
            1,
            limiter.max_instances,
        ),
        (
            TABLES,
            "tables in one Store",
            u64::from(required.num_tables),
            limiter.max_tables,
        ),
        (
            MEMORIES,
            "memories in one Store",
            u64::from(required.num_memories),
            limiter.max_memories,
        ),
    ];
    for (index, what, more, limit) in wanted {
        let requested = limiter.made[index].saturating_add(more);
        if requested > limit as u64 {
            return Err(wasmtime::Error::new(TwmError::Limit {
                what,
                requested,
                limit: limit as u64,
            }));
        }
    }
    limiter.instantiating = true;
    limiter.new_memories = Some(required.num_memories);
    limiter.new_tables = Some(required.num_tables);
    let _ = limiter.charge.take_refusal();
    let result = linker.instantiate(&mut context, module);
    forget_creation();
    let limiter = context.data_mut().tenant_limiter();
    limiter.instantiating = false;
    limiter.new_memories = None;
    limiter.new_tables = None;
    let refusal = limiter.charge.take_refusal();
    match result {
        Ok(instance) => {
            limiter.made[INSTANCES] += 1;
            Ok(instance)
        }
        Err(error) => match refusal {
            // The creator refused a memory (held or memories budget): its message reached
            // Wasmtime as text only, so the typed denial is returned here.
            Some(denied) if error.downcast_ref::<TwmError>().is_none() => {
                limiter.last_denial = Some(denied);
                Err(wasmtime::Error::new(limiter.charge.tenant.denied(denied)))
            }
            _ => Err(error),
        },
    }
}
