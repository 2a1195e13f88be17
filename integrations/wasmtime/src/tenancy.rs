//! Tenancy with one Engine: a per-Store [`TenantLimiter`] that charges a [`Tenant`] for what its
//! guests touch and hold, refuses what would pass a budget, and gives everything back when what
//! it paid for is really gone.
//!
//! A tenant has three budgets on its one ledger ([`TenantBudgets`]), all hard and all checked
//! before anything is allocated:
//!
//! - **touched** bytes (the cap): a memory's current size, charged at instantiation and on each
//!   growth ([`ChargeMode::Touched`], the default: managed memory is demand-paged, so capacity
//!   that is never touched costs no device memory), or its whole capacity at instantiation
//!   ([`ChargeMode::Capacity`], for backings where capacity is physical); and
//!   [`TABLE_ELEMENT_BYTES`] per table element (real host memory a guest fills);
//! - **held** bytes: the capacity a memory occupies (its pool slot, or its whole allocation),
//!   and the table elements again;
//! - **memories**: linear memories alive at once, across all the tenant's Stores.
//!
//! The lifecycle (`docs/ARCHITECTURE.md` draws it): Wasmtime calls the limiter's
//! `memory_growing(current, desired, maximum)` before a memory is made (`current == 0`) and
//! before each `memory.grow`, then, on the same thread, the creator's `new_memory` or the
//! memory's `grow_to`. The limiter checks the plan and grants the touched bytes as a value that
//! waits in the Store's books; the creator (inside [`instantiate`] only) or the memory redeems
//! it. The creator adds the memory count and the held bytes to the grant and the memory keeps
//! that one charge until its storage is really gone (a refused free keeps it: see
//! [`TensorWasmMemoryCreator::retry_releases`](crate::TensorWasmMemoryCreator::retry_releases)).
//! Table elements are charged to the Store's books when granted and go back when the Store's
//! data drops.
//!
//! - A memory past a budget refuses instantiation with [`TwmError::Denied`] naming the tenant,
//!   the budget, its limit and the request. Memories of a tenant's Store are made through
//!   [`instantiate`] (or [`instantiate_pre`]) only: the creator refuses a memory no tenant
//!   pays for ([`TwmError::NoTenant`]), which is what a plain `Linker::instantiate` asks for.
//! - [`instantiate`] refuses a tenant's Store whose limiter is not installed
//!   ([`TwmError::NoLimiter`]): make Stores with [`new_store`].
//! - A growth past the touched budget is a failed `memory.grow`: `-1` to the guest, which keeps
//!   running. So is a growth past the memory's capacity (never charged).
//! - Under [`instantiate`] the limiter knows how many memories and tables the module defines
//!   (Wasmtime makes them all before the start function runs), so a start function's
//!   `memory.grow` on a zero-page memory is a growth: past the cap it returns `-1`, as the spec
//!   says, instead of refusing the instantiation.
//! - Tables: a table past [`TenantLimiter::DEFAULT_TABLE_ELEMENTS`] elements, its declared
//!   maximum, or the tenant's touched or held budget refuses instantiation; a `table.grow` past
//!   them returns `-1`. Every grant is final once made: a failure Wasmtime reports after (or
//!   without) a grant refunds nothing (a growth past the declared maximum is refused before
//!   anything is charged). Instances, tables and memories per Store default to Wasmtime's own
//!   limits ([`wasmtime::DEFAULT_INSTANCE_LIMIT`] and friends); [`instantiate`] refuses a module
//!   that would pass them with [`TwmError::Limit`].

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tensor_wasm_mem_core::{
    Denied, DeviceId, IsolationLevel, LedgerGroup, MemoryPlan, PlanLimits, Purpose, Reservation,
    TenantBudgets, TenantId, TenantLedger,
};
use wasmtime::{
    AsContextMut, Instance, InstancePre, Linker, Module, ResourceLimiter, ResourcesRequired, Store,
    StoreContextMut,
};

use crate::books::{EntryScope, StoreBooks};
use crate::error::TwmError;

/// Host bytes charged per table element (to the touched and the held budget): Wasmtime 48
/// stores a funcref element as one pointer (an externref as a 32-bit GC reference), in storage
/// that grows by doubling, so a table grown one element at a time holds up to twice its
/// elements: each is charged as two pointers.
pub const TABLE_ELEMENT_BYTES: u64 = 16;

/// How a tenant is charged for a memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChargeMode {
    /// The initial size at instantiation, then each growth (what the guest can touch).
    #[default]
    Touched,
    /// The whole capacity at instantiation (for backings where capacity is physical).
    Capacity,
}

/// A tenant: its ledger ([`TenantLedger`]), a name for errors and reports, memory counts, and
/// the devices it is bound to.
///
/// A tenant is bound to one device or a set of them (device 0 unless made with
/// [`with_devices`](Self::with_devices) or placed by a [`Placement`](crate::Placement)): its
/// memories, pool slots and guest stream are on its home device ([`device`](Self::device), the
/// first of the set), and its guests may prefetch to or advise any device of the set
/// ([`may_use`](Self::may_use)), and no other.
#[derive(Debug)]
pub struct Tenant {
    context: Arc<TenantLedger>,
    name: String,
    memories_created: AtomicU64,
    refused_growths: AtomicU64,
    devices: Vec<DeviceId>,
    kernels: Arc<crate::kernels::KernelCounters>,
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
    /// Its touched budget (its cap) in bytes.
    pub touched_limit: u64,
    /// Touched bytes charged now.
    pub touched_bytes: u64,
    /// The most touched bytes ever charged at once.
    pub touched_peak_bytes: u64,
    /// Its held budget in bytes.
    pub held_limit: u64,
    /// Bytes of capacity held now (memory slots or allocations, table elements, pool buffers).
    pub held_bytes: u64,
    /// The most bytes of capacity ever held at once.
    pub held_peak_bytes: u64,
    /// Its budget of live memories.
    pub memories_limit: u64,
    /// Memories alive now (counted until their backing is freed or back in the pool).
    pub live_memories: u64,
    /// Memories ever charged.
    pub memories_created: u64,
    /// Requests any budget refused.
    pub denials: u64,
    /// Of `denials`, those by the touched budget (the cap).
    pub touched_denials: u64,
    /// Of `denials`, those by the held budget.
    pub held_denials: u64,
    /// Of `denials`, those by the memories budget.
    pub memory_denials: u64,
    /// Memory growths its guests were refused (`memory.grow` answered `-1`): a budget's
    /// denial (also in `denials`), a growth past the memory's capacity, or one the backend
    /// failed after the budgets granted it. Each also reaches a limiter's
    /// [`on_refused_growth`](TenantLimiter::on_refused_growth) hook.
    pub refused_growths: u64,
    /// Of `touched_bytes`, the bytes in the tenant's device memory pools.
    pub device_pool_bytes: u64,
    /// Of `touched_bytes` and `held_bytes`, the bytes in table elements.
    pub table_bytes: u64,
    /// Bytes charged for good: what a backend never gave back after its owner was gone
    /// ([`Reservation::strand`]).
    pub stranded_bytes: u64,
    /// Its home device (where its memories, pool slots and stream are).
    pub device: DeviceId,
    /// Kernels its guests launched that ran ([`kernels`](crate::kernels)).
    pub launches: u64,
    /// Launches refused before anything was queued (a bad argument, an unknown kernel, too
    /// many in flight, its device state lost before the launch: a neighbour's fault).
    pub refused_launches: u64,
    /// Launches whose kernel failed on the device, once launched.
    pub kernel_failures: u64,
    /// Host calls that found the tenant's device state lost to a kernel fault (each trapped its
    /// guest with [`TwmError::DeviceLost`](crate::TwmError::DeviceLost)): the tenant that faulted
    /// and its neighbours in the lost context alike.
    pub device_lost: u64,
    /// Faults attributed to this tenant: its launches whose own wait was the first to see a
    /// sticky fault (the device not fenced before the launch; for a context-isolated tenant,
    /// whose context is its own, any launch that lost it). A fault surfaces at whichever wait
    /// comes first, so this names the suspect, not a proof; its neighbours' `device_lost`
    /// counts the cost to them.
    pub kernel_faults: u64,
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
            Some(group) => TenantLedger::in_group(TenantId(id), budgets, isolation, group),
            None => TenantLedger::with_budgets(TenantId(id), budgets, isolation),
        };
        Self {
            context: Arc::new(context),
            name,
            memories_created: AtomicU64::new(0),
            refused_growths: AtomicU64::new(0),
            devices,
            kernels: Arc::default(),
        }
    }

    /// Its launch figures (shared by its Stores' guest contexts).
    pub(crate) fn kernel_counters(&self) -> &Arc<crate::kernels::KernelCounters> {
        &self.kernels
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

    /// The tenant's books: its budgets, reservations and figures.
    #[must_use]
    pub fn ledger(&self) -> &Arc<TenantLedger> {
        &self.context
    }

    /// The former name of [`ledger`](Self::ledger).
    #[deprecated(
        since = "0.1.0",
        note = "renamed ledger(): the tenant's books, not a CUDA context"
    )]
    #[must_use]
    pub fn context(&self) -> &Arc<TenantLedger> {
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
            touched_limit: ledger.touched_limit,
            touched_bytes: ledger.touched_bytes,
            touched_peak_bytes: ledger.touched_peak_bytes,
            held_limit: ledger.held_limit,
            held_bytes: ledger.held_bytes,
            held_peak_bytes: ledger.held_peak_bytes,
            memories_limit: ledger.memories_limit,
            live_memories: ledger.live_memories,
            memories_created: self.memories_created.load(Ordering::Acquire),
            denials: ledger.denials,
            touched_denials: ledger.touched_denials,
            refused_growths: self.refused_growths.load(Ordering::Acquire),
            held_denials: ledger.held_denials,
            memory_denials: ledger.memory_denials,
            device_pool_bytes: ledger.device_pool_bytes,
            table_bytes: ledger.table_bytes,
            stranded_bytes: ledger.stranded_bytes,
            device: self.device(),
            launches: self.kernels.launches.load(Ordering::Acquire),
            refused_launches: self.kernels.refused.load(Ordering::Acquire),
            kernel_failures: self.kernels.failures.load(Ordering::Acquire),
            device_lost: self.kernels.device_lost.load(Ordering::Acquire),
            kernel_faults: self.kernels.faults.load(Ordering::Acquire),
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

    /// Counts a memory growth refused to one of its guests.
    pub(crate) fn count_refused_growth(&self) {
        self.refused_growths.fetch_add(1, Ordering::AcqRel);
    }

    /// Counts a memory charged to this tenant.
    pub(crate) fn count_memory(&self) {
        self.memories_created.fetch_add(1, Ordering::AcqRel);
    }
}

/// What the limiter knows of the instantiation under way, if any.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Creating {
    instantiating: bool,
    /// During [`instantiate`]: the memories the module defines that Wasmtime has yet to create.
    /// A `memory_growing` from zero is a new memory only while this is above zero; after, it is
    /// a growth of a zero-page memory (a start function's `memory.grow`).
    new_memories: Option<u32>,
    /// The same for tables.
    new_tables: Option<u32>,
}

/// What one Store has made through [`instantiate`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct StoreCounts {
    instances: u64,
    tables: u64,
    memories: u64,
}

/// A memory growth the limiter refused (`memory.grow` answered `-1` to the guest), as the
/// hook of [`TenantLimiter::on_refused_growth`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusedGrowth {
    /// The memory's size before, in bytes (0 where Wasmtime refused the size before asking:
    /// not known then).
    pub current: usize,
    /// The size the guest asked for (`usize::MAX` where Wasmtime refused it before asking the
    /// limiter: a size the memory's type cannot represent).
    pub desired: usize,
    /// The budget that refused it; `None` for a growth past the memory's capacity (its declared
    /// maximum, or the plan's), or one that failed after a grant.
    pub denial: Option<Denied>,
    /// The budgets granted it and the memory failed it after (the backend could not grow it;
    /// its grant went back): a failure rather than a denial.
    pub failed: bool,
}

/// The host's hook on refused growths.
type GrowthHook = Arc<dyn Fn(&RefusedGrowth) + Send + Sync>;

/// A per-Store Wasmtime `ResourceLimiter` charging one [`Tenant`].
pub struct TenantLimiter {
    books: Arc<StoreBooks>,
    limits: PlanLimits,
    /// Set while the limiter is installed in a live Store by [`install_limiter`] (or
    /// [`new_store`]); cleared when that Store goes or gives its data back with
    /// `Store::into_data`.
    installed: Arc<AtomicBool>,
    creating: Creating,
    made: StoreCounts,
    growths: u64,
    /// The last growth granted (current and desired bytes), for a failure reported after it.
    last_granted: Option<(usize, usize)>,
    denied_growths: u64,
    denied_table_growths: u64,
    failed_growths: u64,
    last_denial: Option<Denied>,
    max_table_elements: usize,
    max_instances: usize,
    max_tables: usize,
    max_memories: usize,
    on_refused_growth: Option<GrowthHook>,
}

impl fmt::Debug for TenantLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantLimiter")
            .field("tenant", &self.books.tenant().name)
            .field("mode", &self.books.mode())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Figures of one Store's limiter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimiterStats {
    /// Touched bytes granted through this limiter that no memory of ours holds: growths of
    /// memories our creator did not make (`Memory::new`), kept until the Store goes. The
    /// touched bytes of our memories are in the tenant's figures (each memory holds its own).
    pub charged_bytes: u64,
    /// Bytes of this Store's table elements charged to its tenant.
    pub table_bytes: u64,
    /// Memories this Store made through [`instantiate`].
    pub memories: u64,
    /// Growths the limiter allowed (a growth may still fail after, in the backend).
    pub growths: u64,
    /// Growths refused (`-1` to the guest): past the cap or past the memory's capacity.
    pub denied_growths: u64,
    /// Table growths refused (`-1` to the guest).
    pub denied_table_growths: u64,
    /// Growths Wasmtime reported failed after (or without) a grant: none of them refunds
    /// anything (a memory of ours gives a failed growth's grant back itself).
    pub failed_growths: u64,
}

impl TenantLimiter {
    /// The default limit of elements in one table: a million (8 MiB of host memory).
    pub const DEFAULT_TABLE_ELEMENTS: usize = 1 << 20;

    /// A limiter charging `tenant` in `mode`, planning memories under `limits` (use the creator's:
    /// `creator.limits()`).
    pub fn new(tenant: Arc<Tenant>, mode: ChargeMode, limits: PlanLimits) -> Self {
        Self {
            books: StoreBooks::new(tenant, mode),
            limits,
            installed: Arc::new(AtomicBool::new(false)),
            creating: Creating::default(),
            made: StoreCounts::default(),
            growths: 0,
            last_granted: None,
            denied_growths: 0,
            denied_table_growths: 0,
            failed_growths: 0,
            last_denial: None,
            max_table_elements: Self::DEFAULT_TABLE_ELEMENTS,
            max_instances: wasmtime::DEFAULT_INSTANCE_LIMIT,
            max_tables: wasmtime::DEFAULT_TABLE_LIMIT,
            max_memories: wasmtime::DEFAULT_MEMORY_LIMIT,
            on_refused_growth: None,
        }
    }

    /// Calls `hook` on every memory growth of this Store refused to its guest (the guest sees
    /// `-1`, the host nothing else): a budget's denial (the limiter's, or the memory's own on a
    /// creator bound to a tenant), a growth past the memory's capacity or past what its type can
    /// represent, or one the backend failed after the budgets granted it
    /// ([`RefusedGrowth::failed`]). Outside [`instantiate`], a refused `Memory::new` is
    /// reported as a growth from 0 (the limiter cannot tell the two apart). The hook runs
    /// inside the guest's `memory.grow`: keep it short (count, log, flag).
    #[must_use]
    pub fn on_refused_growth(
        mut self,
        hook: impl Fn(&RefusedGrowth) + Send + Sync + 'static,
    ) -> Self {
        self.on_refused_growth = Some(Arc::new(hook));
        self
    }

    fn growth_refused(&mut self, current: usize, desired: usize, denial: Option<Denied>) {
        self.denied_growths += 1;
        self.report_refused(RefusedGrowth {
            current,
            desired,
            denial,
            failed: false,
        });
    }

    /// Counts a refused growth for the tenant and tells the host's hook.
    fn report_refused(&self, refused: RefusedGrowth) {
        self.books.tenant().count_refused_growth();
        self.tell_hook(&refused);
    }

    fn tell_hook(&self, refused: &RefusedGrowth) {
        if let Some(hook) = &self.on_refused_growth {
            hook(refused);
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
        self.books.tenant()
    }

    pub(crate) fn books(&self) -> &Arc<StoreBooks> {
        &self.books
    }

    /// Whether this limiter is installed in a live Store by [`new_store`] or
    /// [`install_limiter`]. (A limiter the embedder installs with its own `Store::limiter` call
    /// does not count: nothing would tell it when that Store goes.)
    #[must_use]
    pub fn is_installed(&self) -> bool {
        self.installed.load(Ordering::Acquire)
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
            charged_bytes: self.books.settled_bytes(),
            table_bytes: self.books.table_bytes(),
            memories: self.made.memories,
            growths: self.growths,
            denied_growths: self.denied_growths,
            denied_table_growths: self.denied_table_growths,
            failed_growths: self.failed_growths,
        }
    }

    /// Refuses a creation: an error naming the tenant during [`instantiate`], a plain `false`
    /// otherwise (a failed `memory.grow`, or Wasmtime's generic instantiation error).
    fn refuse(&self, creating: bool, error: TwmError) -> wasmtime::Result<bool> {
        if creating && self.creating.instantiating {
            Err(wasmtime::Error::new(error))
        } else {
            Ok(false)
        }
    }

    fn deny(&mut self, creating: bool, denied: Denied) -> wasmtime::Result<bool> {
        self.last_denial = Some(denied);
        tracing::debug!(%denied, "twm: denied by a tenant budget");
        let error = self.books.tenant().denied(denied);
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

    /// Checks a memory growing from `current` to `desired` bytes against the plan the creator
    /// would make: `Err` carries the limiter's answer (a refused growth is never charged).
    fn check_memory(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
        creating: bool,
        maybe_growth: bool,
    ) -> Result<(), wasmtime::Result<bool>> {
        // Page size 1: the plan is never rounded below what the creator can hand out, so
        // nothing the creator would serve is refused here.
        let plan = MemoryPlan::from_bytes(current.min(desired), maximum, 1, &self.limits)
            .map_err(|e| self.refuse(creating, TwmError::Plan(e)))?;
        if desired as u64 <= plan.capacity_bytes() {
            return Ok(());
        }
        // Past the capacity the creator gives such a memory (and so past its declared
        // maximum): it cannot succeed, so it is refused before anything is charged (a new
        // memory this large is a plan error).
        if creating {
            let planned = MemoryPlan::from_bytes(desired, maximum, 1, &self.limits);
            if planned.is_err() && maybe_growth {
                self.growth_refused(current, desired, None);
            }
            planned.map_err(|e| self.refuse(creating, TwmError::Plan(e)))?;
            return Ok(());
        }
        self.growth_refused(current, desired, None);
        Err(Ok(false))
    }

    /// Checks a table growing from `current` to `desired` elements: what it would charge, or
    /// the limiter's answer.
    fn check_table(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
        creating: bool,
    ) -> Result<u64, wasmtime::Result<bool>> {
        let limit = maximum.map_or(self.max_table_elements, |m| m.min(self.max_table_elements));
        let extra = (desired.saturating_sub(current) as u64).checked_mul(TABLE_ELEMENT_BYTES);
        match extra {
            Some(extra) if desired <= limit => Ok(extra),
            _ => {
                if !creating {
                    self.denied_table_growths += 1;
                }
                let error = TwmError::Limit {
                    what: "elements in one table",
                    requested: desired as u64,
                    limit: limit as u64,
                };
                Err(self.refuse(creating, error))
            }
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
        // A new call: a grant nobody redeemed paid for a memory we did not make.
        self.books.settle();
        self.last_granted = None;
        // Outside `instantiate` a growth from zero pages cannot be told from a new memory
        // (`Memory::new`): announced to the creator as one, and reported to the host as a
        // growth from 0 (a guest's `memory.grow` of an empty memory is one).
        let outside = self.creating.new_memories.is_none();
        let creating = Self::is_creation(&mut self.creating.new_memories, current);
        let maybe_growth = !creating || outside;
        let _span = tracing::debug_span!(
            "twm.tenant.memory",
            isolation = self.books.tenant().context.isolation().name(),
            tenant = self.books.tenant().name.as_str(),
            current,
            desired
        )
        .entered();
        if let Err(answer) = self.check_memory(current, desired, maximum, creating, maybe_growth) {
            return answer;
        }
        // The same rule for a new memory and a growth: what becomes touchable. In `Capacity`
        // mode the creator charges a memory of ours its whole capacity, this grant included
        // (a growth of it is paid already); a memory it did not make (`Memory::new`) is paid by
        // the grants alone, so a new memory's grant is made in either mode, and a growth's once
        // the Store has such a memory (the growth of one of ours gives its grant back).
        let bytes = match self.books.mode() {
            ChargeMode::Capacity if !creating && !self.books.has_bypass_memory() => 0,
            ChargeMode::Touched | ChargeMode::Capacity => desired.saturating_sub(current) as u64,
        };
        // Announced to the creator as a new memory only when it is one of the module's (a
        // growth of a zero-page memory, ours or not, is redeemed by no creator).
        if let Err(denied) = self.books.grant(bytes, creating, desired) {
            if maybe_growth {
                self.growth_refused(current, desired, Some(denied));
            }
            return self.deny(creating, denied);
        }
        if creating {
            self.made.memories += 1;
        } else {
            self.growths += 1;
        }
        if maybe_growth {
            self.last_granted = Some((current, desired));
        }
        Ok(true)
    }

    /// Answers no grant: a memory of ours gave a failed growth's grant back itself, and a grant
    /// for a memory we did not make stays charged until the Store goes (so a failure reported
    /// without a growth before it, which Wasmtime does for what a memory type cannot represent,
    /// can never give back a growth that was granted).
    ///
    /// The host hears of it: a failure of a memory of ours (its error is a [`TwmError`]) is the
    /// growth this limiter just granted (the memory counted it for its tenant: a denial by the
    /// tenant's budget there, as on a creator bound to a tenant, or a backend failure); any
    /// other is a growth Wasmtime refused before asking (a size the memory type cannot
    /// represent), counted here.
    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.failed_growths += 1;
        self.books.settle();
        match (error.downcast_ref::<TwmError>(), self.last_granted.take()) {
            // The memory of ours failed the growth just granted, and counted it.
            (Some(ours), Some((current, desired))) => self.tell_hook(&RefusedGrowth {
                current,
                desired,
                denial: match ours {
                    TwmError::Denied { denied, .. } => Some(*denied),
                    _ => None,
                },
                // A budget's denial and a growth past the memory's capacity are refusals; the
                // rest is the backend failing.
                failed: !matches!(
                    ours,
                    TwmError::Denied { .. } | TwmError::CapacityExceeded { .. }
                ),
            }),
            // Counted by the memory; no growth of this limiter's to name.
            (Some(_), None) => {}
            // Wasmtime refused it itself: after the grant and before the memory saw it (past
            // what the memory can hold without moving), or before asking (a size the memory
            // type cannot represent, not known here).
            (None, granted) => {
                let (current, desired) = granted.unwrap_or((0, usize::MAX));
                self.report_refused(RefusedGrowth {
                    current,
                    desired,
                    denial: None,
                    failed: false,
                });
            }
        }
        Ok(())
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.books.settle();
        let creating = Self::is_creation(&mut self.creating.new_tables, current);
        let extra = match self.check_table(current, desired, maximum, creating) {
            Ok(extra) => extra,
            Err(answer) => return answer,
        };
        if let Err(denied) = self.books.charge_tables(extra) {
            if !creating {
                self.denied_table_growths += 1;
            }
            return self.deny(creating, denied);
        }
        if creating {
            self.made.tables += 1;
        }
        Ok(true)
    }

    /// Answers no grant: a growth past the declared maximum was refused before anything was
    /// charged, and Wasmtime 48 reports an overflowing `old + delta` here without a
    /// `table_growing` first (reachable from a guest with 64-bit tables).
    fn table_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        self.failed_growths += 1;
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

/// Marks its limiter uninstalled when the Store that holds it (in its limiter closure) goes.
struct Installed(Arc<AtomicBool>);

impl Drop for Installed {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// A Store whose limiter charges the tenant of `data`. The limiter knows it is installed while
/// the Store lives: [`instantiate`] refuses a tenant's Store without it (one made with
/// `Store::new`, or holding data taken back from another Store with `Store::into_data`).
pub fn new_store<T: HasTenantLimiter>(engine: &wasmtime::Engine, data: T) -> Store<T> {
    let mut store = Store::new(engine, data);
    install_limiter(&mut store);
    store
}

/// Installs the tenant limiter of `store`'s data in `store` (what [`new_store`] does, for a
/// Store made otherwise): until the Store goes, or gives its data back, the limiter knows it is
/// installed and [`instantiate`] accepts the Store.
pub fn install_limiter<T: HasTenantLimiter>(store: &mut Store<T>) {
    // No deadline and unlimited fuel until a call asks for a limit (see `deadline`).
    crate::deadline::unlimited(&mut *store);
    let flag = Arc::clone(&store.data_mut().tenant_limiter().installed);
    flag.store(true, Ordering::Release);
    let installed = Installed(flag);
    store.limiter(move |data| {
        let _ = &installed;
        data.tenant_limiter()
    });
}

/// Instantiates `module` with the limiter told that memories and tables are being created, so
/// a memory or table past the tenant's budgets refuses instantiation with [`TwmError::Denied`],
/// and a module that would pass the Store's counts with [`TwmError::Limit`] (downcast the
/// returned error). A Store whose limiter is not installed is [`TwmError::NoLimiter`].
pub fn instantiate<T: HasTenantLimiter>(
    store: impl AsContextMut<Data = T>,
    linker: &Linker<T>,
    module: &Module,
) -> wasmtime::Result<Instance> {
    instantiate_with(store, module, |context| linker.instantiate(context, module))
}

/// [`instantiate`] from an `InstancePre` (what `Linker::instantiate_pre` makes): the same
/// checks and charges, without resolving the imports again.
pub fn instantiate_pre<T: HasTenantLimiter>(
    store: impl AsContextMut<Data = T>,
    pre: &InstancePre<T>,
) -> wasmtime::Result<Instance> {
    instantiate_with(store, pre.module(), |context| pre.instantiate(context))
}

fn instantiate_with<T: HasTenantLimiter>(
    mut store: impl AsContextMut<Data = T>,
    module: &Module,
    make: impl FnOnce(&mut StoreContextMut<'_, T>) -> wasmtime::Result<Instance>,
) -> wasmtime::Result<Instance> {
    let required = module.resources_required();
    let mut context = store.as_context_mut();
    let limiter = context.data_mut().tenant_limiter();
    limiter.check_instantiation(&required)?;
    let (outer, scope) = limiter.begin_instantiation(&required);
    let result = make(&mut context);
    drop(scope);
    context
        .data_mut()
        .tenant_limiter()
        .end_instantiation(outer, result)
}

impl TenantLimiter {
    /// Refuses what [`instantiate`] cannot do in this Store: no limiter installed, or counts
    /// past the Store's limits.
    fn check_instantiation(&self, required: &ResourcesRequired) -> Result<(), TwmError> {
        if !self.is_installed() {
            return Err(TwmError::NoLimiter {
                tenant_name: self.tenant().name().to_string(),
            });
        }
        let wanted = [
            (
                "instances in one Store",
                self.made.instances,
                1,
                self.max_instances,
            ),
            (
                "tables in one Store",
                self.made.tables,
                u64::from(required.num_tables),
                self.max_tables,
            ),
            (
                "memories in one Store",
                self.made.memories,
                u64::from(required.num_memories),
                self.max_memories,
            ),
        ];
        for (what, made, more, limit) in wanted {
            let requested = made.saturating_add(more);
            if requested > limit as u64 {
                return Err(TwmError::Limit {
                    what,
                    requested,
                    limit: limit as u64,
                });
            }
        }
        Ok(())
    }

    /// Tells the limiter what the module makes, and opens the Store's entry scope (closed when
    /// the returned guard drops, on every exit). Returns what an enclosing instantiation (one
    /// in a start function's host call) had told it, for `end_instantiation` to restore.
    fn begin_instantiation(&mut self, required: &ResourcesRequired) -> (Creating, EntryScope) {
        let outer = self.creating;
        self.creating = Creating {
            instantiating: true,
            new_memories: Some(required.num_memories),
            new_tables: Some(required.num_tables),
        };
        let _ = self.books.take_refusal();
        (outer, EntryScope::enter(&self.books))
    }

    fn end_instantiation(
        &mut self,
        outer: Creating,
        result: wasmtime::Result<Instance>,
    ) -> wasmtime::Result<Instance> {
        self.creating = outer;
        let refusal = self.books.take_refusal();
        match result {
            Ok(instance) => {
                self.made.instances += 1;
                Ok(instance)
            }
            Err(error) => match refusal {
                // The creator refused a memory (a budget, an exhausted pool, the driver): its
                // message reached Wasmtime as text only, so the typed error is returned here.
                Some(refused) if error.downcast_ref::<TwmError>().is_none() => {
                    if let TwmError::Denied { denied, .. } = &refused {
                        self.last_denial = Some(*denied);
                    }
                    Err(wasmtime::Error::new(refused))
                }
                _ => Err(error),
            },
        }
    }
}
