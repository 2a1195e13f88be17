//! Tenancy with one Engine: a per-Store [`TenantLimiter`] that charges a [`Tenant`] for what its
//! guests can touch, refuses what would pass its cap, and gives everything back when the Store
//! drops.
//!
//! Wasmtime calls the limiter's `memory_growing(0, minimum, maximum)` for every memory at
//! instantiation, *before* the creator allocates, and `memory_growing(current, desired, ..)` on
//! each `memory.grow`. The limiter charges the initial size there, then each growth
//! ([`ChargeMode::Touched`], the default: managed memory is demand-paged, so capacity that is
//! never touched costs no device memory), or the whole capacity at instantiation
//! ([`ChargeMode::Capacity`], for backings where capacity is physical).
//!
//! - An initial size past the cap refuses instantiation with [`TwmError::Denied`] naming the
//!   tenant, its cap and the request, when the module is instantiated through [`instantiate`]
//!   (which tells the limiter that memories are being created). A plain `Linker::instantiate`
//!   is refused too, with Wasmtime's generic message; [`TenantLimiter::last_denial`] then has the
//!   details.
//! - A growth past the cap is a failed `memory.grow`: `-1` to the guest, which keeps running.
//! - Wasmtime announces a new memory as a growth from size zero. Under [`instantiate`] the
//!   limiter knows how many memories the module defines (Wasmtime makes them all before the
//!   start function runs), so a start function's `memory.grow` on a zero-page memory is a
//!   growth: past the cap it returns `-1`, as the spec says, instead of refusing the
//!   instantiation. After instantiation (and under a plain `Linker::instantiate`) a growth from
//!   zero is taken for a new memory: charged the same bytes in `Touched` mode, its whole capacity
//!   again in `Capacity` mode (an over-charge, never an under-charge), and counted as one more
//!   memory in the figures.
//! - A memory's bytes stay charged until its Store drops (Wasmtime keeps memories as long as the
//!   Store), even if instantiation fails after the memory was made: the charge is never lower than
//!   what is held.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tensor_wasm_mem_core::{
    Denied, IsolationLevel, MemoryPlan, PlanLimits, Reservation, TenantContext, TenantId,
};
use wasmtime::{AsContextMut, Instance, Linker, Module, ResourceLimiter, Store};

use crate::error::TwmError;

/// How a tenant is charged for a memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChargeMode {
    /// The initial size at instantiation, then each growth (what the guest can touch).
    #[default]
    Touched,
    /// The whole capacity at instantiation (for backings where capacity is physical).
    Capacity,
}

/// A tenant: its ledger ([`TenantContext`]), a name for errors and reports, and memory counts.
#[derive(Debug)]
pub struct Tenant {
    context: Arc<TenantContext>,
    name: String,
    live_memories: AtomicU64,
    memories_created: AtomicU64,
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
    /// Its cap in bytes.
    pub cap: u64,
    /// Bytes charged now.
    pub live_bytes: u64,
    /// The most bytes ever charged at once.
    pub peak_bytes: u64,
    /// Memories charged now.
    pub live_memories: u64,
    /// Memories ever charged.
    pub memories_created: u64,
    /// Requests the cap refused.
    pub denials: u64,
    /// Of `live_bytes`, the bytes in the tenant's device memory pools.
    pub device_pool_bytes: u64,
}

impl Tenant {
    /// A tenant with a byte cap at an isolation level.
    pub fn new(
        id: u64,
        name: impl Into<String>,
        cap_bytes: u64,
        isolation: IsolationLevel,
    ) -> Arc<Self> {
        Arc::new(Self {
            context: Arc::new(TenantContext::new(TenantId(id), cap_bytes, isolation)),
            name: name.into(),
            live_memories: AtomicU64::new(0),
            memories_created: AtomicU64::new(0),
        })
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
            live_memories: self.live_memories.load(Ordering::Acquire),
            memories_created: self.memories_created.load(Ordering::Acquire),
            denials: ledger.denials,
            device_pool_bytes: ledger.device_pool_bytes,
        }
    }

    pub(crate) fn denied(&self, denied: Denied) -> TwmError {
        TwmError::Denied {
            tenant_name: self.name.clone(),
            denied,
        }
    }

    /// Reserves `bytes`, or a [`TwmError::Denied`] naming this tenant.
    pub(crate) fn reserve(&self, bytes: u64) -> Result<Reservation, TwmError> {
        self.context.try_reserve(bytes).map_err(|d| self.denied(d))
    }

    fn memory_created(&self) {
        self.live_memories.fetch_add(1, Ordering::AcqRel);
        self.memories_created.fetch_add(1, Ordering::AcqRel);
    }
}

/// A per-Store Wasmtime `ResourceLimiter` charging one [`Tenant`].
pub struct TenantLimiter {
    tenant: Arc<Tenant>,
    mode: ChargeMode,
    limits: PlanLimits,
    charge: Reservation,
    /// The last growth charged, until its outcome is known.
    pending_growth: u64,
    instantiating: bool,
    /// During [`instantiate`]: the memories the module defines that Wasmtime has yet to create.
    /// A `memory_growing` from zero is a new memory only while this is above zero; after, it is
    /// a growth of a zero-page memory (a start function's `memory.grow`).
    new_memories: Option<u32>,
    memories: u64,
    growths: u64,
    denied_growths: u64,
    last_denial: Option<Denied>,
    max_table_elements: usize,
    max_instances: usize,
    max_memories: usize,
}

impl fmt::Debug for TenantLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantLimiter")
            .field("tenant", &self.tenant.name)
            .field("mode", &self.mode)
            .field("charged", &self.charge.bytes())
            .field("memories", &self.memories)
            .finish_non_exhaustive()
    }
}

/// Figures of one Store's limiter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimiterStats {
    /// Bytes this Store holds charged to its tenant.
    pub charged_bytes: u64,
    /// Memories this Store charged.
    pub memories: u64,
    /// Growths the limiter allowed (a growth past the capacity may still fail after).
    pub growths: u64,
    /// Growths the cap refused (`-1` to the guest).
    pub denied_growths: u64,
}

impl TenantLimiter {
    /// A limiter charging `tenant` in `mode`, planning memories under `limits` (use the creator's:
    /// `creator.limits()`).
    pub fn new(tenant: Arc<Tenant>, mode: ChargeMode, limits: PlanLimits) -> Self {
        let charge = tenant
            .context
            .try_reserve(0)
            .unwrap_or_else(|_| unreachable!("a zero-byte reservation is always granted"));
        Self {
            tenant,
            mode,
            limits,
            charge,
            pending_growth: 0,
            instantiating: false,
            new_memories: None,
            memories: 0,
            growths: 0,
            denied_growths: 0,
            last_denial: None,
            max_table_elements: 10_000_000,
            max_instances: 10_000,
            max_memories: 10_000,
        }
    }

    /// Limits table growth to `elements` per table (default ten million).
    #[must_use]
    pub fn with_max_table_elements(mut self, elements: usize) -> Self {
        self.max_table_elements = elements;
        self
    }

    /// The tenant.
    #[must_use]
    pub fn tenant(&self) -> &Arc<Tenant> {
        &self.tenant
    }

    /// The most recent refusal by the cap, if any.
    #[must_use]
    pub fn last_denial(&self) -> Option<Denied> {
        self.last_denial
    }

    /// This Store's figures.
    #[must_use]
    pub fn stats(&self) -> LimiterStats {
        LimiterStats {
            charged_bytes: self.charge.bytes(),
            memories: self.memories,
            growths: self.growths,
            denied_growths: self.denied_growths,
        }
    }

    /// Refuses a creation: an error naming the tenant during [`instantiate`], a plain `false`
    /// otherwise (a failed `memory.grow`, or Wasmtime's generic instantiation error).
    fn refuse(&mut self, error: TwmError) -> wasmtime::Result<bool> {
        if self.instantiating {
            Err(wasmtime::Error::new(error))
        } else {
            Ok(false)
        }
    }

    fn create_memory(&mut self, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let _span = tracing::debug_span!(
            "twm.tenant.memory",
            isolation = self.tenant.context.isolation().name(),
            tenant = self.tenant.name.as_str(),
            desired
        )
        .entered();
        // Page size 1: the charge is never rounded below what the creator can hand out.
        let plan = match MemoryPlan::from_bytes(desired, maximum, 1, &self.limits) {
            Ok(plan) => plan,
            Err(e) => return self.refuse(TwmError::Plan(e)),
        };
        let bytes = match self.mode {
            ChargeMode::Touched => plan.initial_bytes(),
            ChargeMode::Capacity => plan.capacity_bytes(),
        };
        if let Err(denied) = self.charge.try_grow(bytes) {
            self.last_denial = Some(denied);
            tracing::debug!(%denied, "twm: memory denied by the tenant cap");
            let error = self.tenant.denied(denied);
            return self.refuse(error);
        }
        self.pending_growth = bytes;
        self.memories += 1;
        self.tenant.memory_created();
        Ok(true)
    }

    fn grow_memory(&mut self, current: usize, desired: usize) -> wasmtime::Result<bool> {
        if desired as u64 > self.limits.per_memory_limit() {
            // The creator's capacity never exceeds the limit: this growth would fail anyway.
            return Ok(false);
        }
        let extra = match self.mode {
            ChargeMode::Touched => desired.saturating_sub(current) as u64,
            ChargeMode::Capacity => 0,
        };
        match self.charge.try_grow(extra) {
            Ok(()) => {
                self.pending_growth = extra;
                self.growths += 1;
                Ok(true)
            }
            Err(denied) => {
                self.last_denial = Some(denied);
                self.denied_growths += 1;
                Ok(false)
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
        // A new call means the previous growth's outcome is settled (a failure was reported
        // through `memory_grow_failed` before this call).
        self.pending_growth = 0;
        // Wasmtime announces a new memory as a growth from zero. Under `instantiate` the limiter
        // knows how many the module defines (they are all made before its start function runs);
        // elsewhere a growth from zero is taken for a new memory.
        let creating = match &mut self.new_memories {
            Some(left) if current == 0 && *left > 0 => {
                *left -= 1;
                true
            }
            Some(_) => false,
            None => current == 0,
        };
        if creating {
            self.create_memory(desired, maximum)
        } else {
            self.grow_memory(current, desired)
        }
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        // Every failure reported here follows the `memory_growing` call that charged it: the
        // one path where Wasmtime 48 reports a failure without announcing the growth first
        // (past what a 1-byte-page memory type can represent) cannot be reached, because our
        // creators refuse custom page sizes (and `configure` turns the proposal off). So the
        // pending growth is refunded whatever the error says.
        if self.pending_growth > 0 {
            let refund = self.pending_growth;
            self.charge.shrink_to(self.charge.bytes() - refund);
        }
        self.pending_growth = 0;
        Ok(())
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= self.max_table_elements)
    }

    fn instances(&self) -> usize {
        self.max_instances
    }

    fn memories(&self) -> usize {
        self.max_memories
    }
}

impl Drop for TenantLimiter {
    fn drop(&mut self) {
        // The Store (and every memory in it) is going away: its charge goes back with
        // `self.charge`, and its memories stop counting.
        self.tenant
            .live_memories
            .fetch_sub(self.memories, Ordering::AcqRel);
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

/// Instantiates `module` with the limiter told that memories are being created, so a memory past
/// the tenant's cap refuses instantiation with [`TwmError::Denied`] (downcast the returned error).
pub fn instantiate<T: HasTenantLimiter>(
    mut store: impl AsContextMut<Data = T>,
    linker: &Linker<T>,
    module: &Module,
) -> wasmtime::Result<Instance> {
    let defined = module.resources_required().num_memories;
    let mut context = store.as_context_mut();
    let limiter = context.data_mut().tenant_limiter();
    limiter.instantiating = true;
    limiter.new_memories = Some(defined);
    let result = linker.instantiate(&mut context, module);
    let limiter = context.data_mut().tenant_limiter();
    limiter.instantiating = false;
    limiter.new_memories = None;
    result
}
