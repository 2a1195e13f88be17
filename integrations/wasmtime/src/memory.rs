//! [`TensorWasmMemoryCreator`]: Wasm linear memory on a backend's managed memory (or a guarded
//! backing), fresh or from a slot pool, with guest-pointer resolution.
//!
//! Making a memory is one straight line ([`TensorWasmMemoryCreator::create`]): check what the
//! engine asks, plan the memory, find who pays (the Store's limiter's grant, a tenant bound to
//! the creator, or nobody where allowed), charge it, acquire the storage, register. What
//! follows (growth, release) is in the `lifecycle` module.

use hashbrown::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tensor_wasm_mem_core::{
    Advice, Capabilities, DeviceId, DeviceSlice, Location, MemoryPlan, MemoryType as PlanType,
    PlanLimits, PoolConfig, PoolStats, Reservation, SLOT_ALIGN, SlotPool, Stream, TenantBudgets,
    UnifiedBuffer, check_range,
};
use wasmtime::{AsContext, Config, Engine, LinearMemory, Memory, MemoryCreator, MemoryType};

use crate::Backend;
use crate::backing::Backing;
use crate::books::{self, MemoryCharge, StoreBooks};
use crate::config::configure;
use crate::deadline::Interruption;
use crate::error::TwmError;
use crate::guarded_region::{GuardedPool, GuardedRegion, KeptMappings};
use crate::kernels::KernelRegistry;
use crate::lifecycle::{
    Held, KeptMemories, MemoryRecord, Registry, ScopedMemory, TensorWasmLinearMemory,
};
use crate::shares::PoolShares;
use crate::storage::{CreatorPool, Storage};
use crate::tenancy::{ChargeMode, Tenant};

/// Where a Wasmtime memory is, read from its Store: the key of the registry.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MemoryView {
    base: usize,
    size: usize,
}

impl MemoryView {
    /// Where `memory` lies in `store`; a memory of another Store is [`TwmError::ForeignMemory`].
    pub(crate) fn of(store: impl AsContext, memory: &Memory) -> Result<Self, TwmError> {
        // Wasmtime 48 has no public way to ask whether a `Memory` belongs to a Store: its
        // accessors assert it (a panic, "object used with the wrong store"). That assertion
        // runs before anything is read or changed, so catching it loses nothing; it turns an
        // embedder's mistake into a typed error (the panic message still reaches the panic hook).
        let store = store.as_context();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Self {
            base: memory.data_ptr(&store) as usize,
            size: memory.data_size(&store),
        }))
        .map_err(|_| TwmError::ForeignMemory)
    }
}

/// A checked device range of a guest's memory, as [`TensorWasmMemoryCreator::resolve`] returns
/// it: borrowed from the Store for `'s`, so it cannot outlive the Store (and the memory) it came
/// from, nor be held across a call into the guest. The raw values a kernel launch needs are
/// [`device_ptr`](Self::device_ptr) and [`len`](Self::len).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestSlice<'s> {
    slice: DeviceSlice,
    _store: PhantomData<&'s ()>,
}

impl GuestSlice<'_> {
    pub(crate) const fn new(slice: DeviceSlice) -> Self {
        Self {
            slice,
            _store: PhantomData,
        }
    }

    /// The device address of the first byte.
    #[must_use]
    pub const fn device_ptr(&self) -> u64 {
        self.slice.device_ptr
    }

    /// The length in bytes.
    #[must_use]
    pub const fn len(&self) -> usize {
        self.slice.len
    }

    /// `true` for an empty range.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.slice.len == 0
    }
}

struct CreatorInner<B: Backend> {
    /// The pools' scrub-ahead threads ([`CreatorBuilder::scrub_ahead`]): first, so that they
    /// are stopped and joined before anything else of the creator goes (fields drop in order).
    _scrubbers: Vec<crate::scrub_ahead::Scrubber>,
    backend: Arc<B>,
    /// The devices served, the default (for memories of no tenant) first.
    devices: Vec<DeviceId>,
    limits: PlanLimits,
    /// What memories are made of.
    backing: Backing,
    /// A pool per served device, in the same order (empty: fresh allocations).
    pools: Vec<CreatorPool<B>>,
    tenant: Option<(Arc<Tenant>, ChargeMode)>,
    /// Memories no tenant pays for are made (else refused with `NoTenant`).
    untenanted: bool,
    /// What the engines this creator configures compile in to stop guest code.
    interruption: Interruption,
    /// Each tenant's count of pool slots, and the most it may hold (pooled creators).
    shares: Option<Arc<PoolShares>>,
    /// The kernels its guests may launch.
    kernels: Option<Arc<KernelRegistry<B>>>,
    /// Live memories by base address, and the count of those made and gone.
    registry: Mutex<Live<B>>,
    /// Memories whose storage the backend refused to release, with their charges.
    kept: Arc<KeptMemories<B>>,
    /// Guarded regions kept mapped for good because the backend never let go of them.
    kept_mappings: KeptMappings,
    refused: AtomicU64,
    /// Memories refused at their tenant's slot share.
    share_denials: AtomicU64,
    /// The tenant a creator is bound to holds slots outside the shares (it has no one to share
    /// its pool with), unless the embedder set a share; other tenants' Stores it serves have
    /// theirs.
    bound_exempt: bool,
    /// The most one memory can hold: the per-memory limit, or a pool's largest slot.
    largest_memory: u64,
    /// The typed errors of refusals no Store's books took (a bound creator's, a Store without a
    /// limiter), the last per thread, for [`TensorWasmMemoryCreator::typed_error`].
    refusals: Mutex<Vec<(std::thread::ThreadId, TwmError)>>,
}

/// The most threads whose last untaken refusal a creator keeps (the oldest goes first).
const KEPT_REFUSALS: usize = 64;

/// A creator's live memories, and its counts of memories made and gone (kept under the same
/// lock as the map: one lock per memory made, one per memory gone).
struct Live<B: Backend> {
    memories: HashMap<usize, Arc<MemoryRecord<B>>>,
    created: u64,
    dropped: u64,
}

impl<B: Backend> CreatorInner<B> {
    fn registry(&self) -> std::sync::MutexGuard<'_, Live<B>> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<B: Backend> Registry<B> for CreatorInner<B> {
    fn unregister(&self, base: usize) {
        let mut live = self.registry();
        live.memories.remove(&base);
        live.dropped += 1;
    }
}

/// A tenant whose live memories keep a fenced device from being recovered
/// ([`TensorWasmMemoryCreator::recovery_blockers`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecoveryBlocker {
    /// The tenant paying for the memories (`None`: memories no tenant pays for).
    pub tenant: Option<tensor_wasm_mem_core::TenantId>,
    /// Its name.
    pub name: Option<String>,
    /// Its live memories on the device (each in a Store still alive).
    pub memories: u64,
    /// Bytes they hold visible.
    pub bytes: u64,
}

/// Figures of a creator (and its pool, if it has one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CreatorStats {
    /// What its memories are made of.
    pub backing: Backing,
    /// Memories alive now.
    pub live_memories: u64,
    /// Memories ever created (allocations, or slots taken).
    pub created: u64,
    /// Memories dropped (frees, or slots given back).
    pub dropped: u64,
    /// Memories refused (plan, cap, guard, pool or backend).
    pub refused: u64,
    /// Of those, memories refused at their tenant's share of the pool
    /// ([`TwmError::PoolShare`], [`CreatorBuilder::slots_per_tenant`]).
    pub share_denials: u64,
    /// Memories gone whose storage the backend refused to release: kept, with their charges
    /// (their tenants stay charged), and released again on the creator's next memory, by
    /// [`TensorWasmMemoryCreator::retry_releases`], and when the creator goes. Also counted
    /// here, and never released while the creator lives: memories device work may still use
    /// (a stream of their Store whose wait the driver refused; a stream destroyed after a
    /// failed wait proves nothing, its work may still run), unless a fence of their device ends
    /// that work (docs/SAFETY.md section 6b). Their charges stay with their tenants meanwhile.
    pub kept_memories: u64,
    /// Bytes those kept memories hold visible.
    pub kept_bytes: u64,
    /// Kept memories a later try released (their charges went back then).
    pub kept_released: u64,
    /// Devices recovered after a kernel fault ([`TensorWasmMemoryCreator::recover`]).
    pub recoveries: u64,
    /// How long the last recovery took, in microseconds (the context reset and the releases
    /// after it; 0 before the first).
    pub last_recovery_us: u64,
    /// The default device's pool's figures, when memories come from pools.
    pub pool: Option<PoolStats>,
    /// Each served device's figures, in the order served.
    pub devices: Vec<CreatorDeviceStats>,
}

/// A creator's figures on one device it serves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CreatorDeviceStats {
    /// The device.
    pub device: DeviceId,
    /// Memories alive on it now.
    pub live_memories: u64,
    /// Its pool's figures, when memories come from pools.
    pub pool: Option<PoolStats>,
    /// Its fault record: fenced now (a kernel fault in its primary context, not recovered
    /// yet), faults and recoveries so far.
    pub health: tensor_wasm_mem_core::DeviceHealth,
}

/// Builds a [`TensorWasmMemoryCreator`].
pub struct CreatorBuilder<B: Backend> {
    backend: Arc<B>,
    backing: Option<Backing>,
    devices: Vec<DeviceId>,
    limits: PlanLimits,
    pool: Option<PoolConfig>,
    tenant: Option<(Arc<Tenant>, ChargeMode)>,
    untenanted: bool,
    interruption: Interruption,
    slots_per_tenant: Option<usize>,
    kernels: Option<Arc<KernelRegistry<B>>>,
    /// A fenced device recovers when its last user goes.
    automatic_recovery: bool,
    /// Each managed pool gets a thread that scrubs its free slots ahead of acquisition.
    scrub_ahead: bool,
}

#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
impl CreatorBuilder<tensor_wasm_mem_mock::MockBackend> {
    /// [`recover_automatically`](Self::recover_automatically) on the mock backend, where it is
    /// safe: the simulated machine is the backend's own, so a reset of its primary context
    /// destroys nothing anyone else made, and a stale handle there is a typed error, never
    /// undefined behaviour.
    #[must_use]
    pub fn recover_simulated_automatically(self) -> Self {
        // SAFETY: the simulated machine is this backend's alone (above).
        unsafe { self.recover_automatically() }
    }
}

impl<B: Backend> fmt::Debug for CreatorBuilder<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CreatorBuilder")
            .field("backing", &self.backing)
            .field("devices", &self.devices)
            .field("limits", &self.limits)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> CreatorBuilder<B> {
    /// Serve `device` only (default device 0).
    #[must_use]
    pub fn device(mut self, device: DeviceId) -> Self {
        self.devices = vec![device];
        self
    }

    /// Serve every device of `devices`: a memory is made on its tenant's home device
    /// ([`Tenant::device`]), which must be one of them ([`TwmError::DeviceNotServed`]
    /// otherwise); a memory of no tenant (a Store without a limiter) on the first. With a pool,
    /// each device gets its own. An empty set, or one naming a device twice, is refused by
    /// [`build`](Self::build).
    #[must_use]
    pub fn devices(mut self, devices: &[DeviceId]) -> Self {
        self.devices = devices.to_vec();
        self
    }

    /// Serve every device of the backend (see [`devices`](Self::devices)).
    #[must_use]
    pub fn all_devices(self) -> Self {
        let all: Vec<DeviceId> = (0..self.backend.device_count()).map(DeviceId).collect();
        self.devices(&all)
    }

    /// Make memories of `backing` (see [`Backing`]) instead of what [`Backing::detect`] picks
    /// from the devices. A guarded backing a served device cannot serve is refused by
    /// [`build`](Self::build) ([`TwmError::BackingUnavailable`]).
    #[must_use]
    pub fn backing(mut self, backing: Backing) -> Self {
        self.backing = Some(backing);
        self
    }

    /// Plan memories under `limits` (default: [`PlanLimits::default`], 256 MiB per memory).
    #[must_use]
    pub fn limits(mut self, limits: PlanLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Take memories from slot pools carved as `config` says, one per served device (its slab
    /// on that device: `config.device` is replaced), instead of a fresh allocation each.
    ///
    /// Two defaults fit the plan and the tenants to the pool: a memory gets at most the largest
    /// slot, whether it declares no maximum (every clang C guest: the plan's default maximum,
    /// 256 MiB, would fit no slot) or a larger one (clamped, as the per-memory limit clamps it:
    /// growth past the slot is refused in the guest), as
    /// [`limits`](TensorWasmMemoryCreator::limits) shows; and one tenant may hold at most half of
    /// each size class's slots ([`slots_per_tenant`](Self::slots_per_tenant)).
    #[must_use]
    pub fn pool(mut self, config: PoolConfig) -> Self {
        self.pool = Some(config);
        self
    }

    /// Give each slot pool a thread that zeroes the slots guests gave back while they are free
    /// ([`SlotPool::scrub_ahead`] for a managed pool; a guarded pool's slots, which it
    /// otherwise scrubs as they come back, are then given back dirty and scrubbed by the same
    /// thread), so the instantiation that takes a slot, or the drop that gives it back, does no
    /// scrub of its own: with 64 KiB touched, about 0.55 us less per pooled instantiation on
    /// this project's bench machine (2.14 to 1.58 us managed, 2.23 to 1.65 us guarded,
    /// docs/BENCHMARKS.md). The same bytes are zeroed, on another core, and handing them over
    /// costs: the process spent about 1.5x the CPU per instantiation there. Worth it where
    /// instantiation latency matters and a core has time to spare; not where every core is
    /// busy (in about one run of three there the thread shared the instantiating thread's
    /// core and saved nothing). The thread lets a few slots gather (four,
    /// a quarter of the pool's at most, or fewer for 50 us) and scrubs them in a row (taken
    /// and put back in one hold of the pool's lock each) while acquisitions take slots already
    /// scrubbed, keeps looking for about 200 us after its last scrub (yielding its core between
    /// looks), then sleeps until a slot comes back dirty; it is stopped and joined when
    /// the creator goes. A slot it has not reached yet is scrubbed by its acquisition.
    ///
    /// Only with [`pool`](Self::pool). Off by default: a library starts no thread unasked. [`build`](Self::build) fails with [`TwmError::Thread`] if a
    /// thread cannot be started.
    #[must_use]
    pub fn scrub_ahead(mut self) -> Self {
        self.scrub_ahead = true;
        self
    }

    /// Bind the creator to one tenant (for an Engine per tenant): every memory is charged to it
    /// here, in the creator, as `mode` says.
    #[must_use]
    pub fn tenant(mut self, tenant: Arc<Tenant>, mode: ChargeMode) -> Self {
        self.tenant = Some((tenant, mode));
        self
    }

    /// Make memories no tenant pays for: those of a Store without a tenant limiter
    /// ([`new_store`](crate::new_store)), on a creator bound to no tenant. By default they are
    /// refused ([`TwmError::NoTenant`]), so a tenant's Store that lost its limiter (made with
    /// `Store::new`, or refilled with `Store::into_data`) cannot hold memory its tenant does not
    /// pay for. Untenanted memories go to the first served device and count in no budget.
    #[must_use]
    pub fn allow_untenanted(mut self) -> Self {
        self.untenanted = true;
        self
    }

    /// Compile deadlines and/or fuel into the engines this creator configures
    /// ([`install`](TensorWasmMemoryCreator::install), [`engine`](TensorWasmMemoryCreator::engine)):
    /// see [`deadline`](crate::deadline). Default [`Interruption::NONE`]: each costs a check in
    /// every guest loop.
    #[must_use]
    pub fn interruption(mut self, interruption: Interruption) -> Self {
        self.interruption = interruption;
        self
    }

    /// The preset for C guests (clang with wasi-libc declares no maximum) on a pool of `slots`
    /// slots of `slot_bytes` each: every memory plans a slot's capacity (the per-memory limit
    /// and the default maximum are `slot_bytes`), and one tenant holds at most half the slots.
    /// A size the plan cannot take (0, or past 4 GiB) is [`TwmError::Plan`].
    pub fn c_guests_on_pool(self, slots: usize, slot_bytes: usize) -> Result<Self, TwmError> {
        let bytes = slot_bytes as u64;
        let limits = PlanLimits::new(bytes)
            .and_then(|l| l.with_default_maximum(bytes))
            .map_err(TwmError::Plan)?;
        Ok(self.limits(limits).pool(PoolConfig::new(
            DeviceId(0),
            [tensor_wasm_mem_core::SizeClass::new(slot_bytes, slots)],
        )))
    }

    /// The most slots of each size class of a pool one tenant may hold at once (default: half
    /// of the class's slots, at least one; no limit on a creator bound to one tenant,
    /// [`tenant`](Self::tenant), unless set here), so that one tenant cannot take every slot of
    /// a pool tenants share, nor every slot of its largest class (where every memory that
    /// declares no maximum goes). A tenant at its share of every class that could hold a memory
    /// is refused before the pool is asked; the slot the pool chose is counted in its own class
    /// (a memory may spill into a larger class where the tenant has room), and one of a class
    /// where the tenant is at its share is given back at once.
    /// A memory past it is refused with [`TwmError::PoolShare`]. Ignored without a pool.
    #[must_use]
    pub fn slots_per_tenant(mut self, slots: usize) -> Self {
        self.slots_per_tenant = Some(slots);
        self
    }

    /// The kernels guests of this creator may launch through `twm.kernel` and `twm.launch`
    /// (see [`kernels`](crate::kernels)); none by default.
    #[must_use]
    pub fn kernels(mut self, registry: KernelRegistry<B>) -> Self {
        self.kernels = Some(Arc::new(registry));
        self
    }

    /// A device fenced after a kernel fault recovers on its own when its last user goes (its
    /// last memory, or its last guest stream), and on [`retry_releases`]; without this, only
    /// [`recover`] recovers one (docs/SAFETY.md section 6b).
    ///
    /// # Safety
    ///
    /// A recovery resets the device's primary context, which destroys everything made in it,
    /// not only what this layer made: nothing else in the process may use what it made there
    /// afterwards (an embedder's modules, functions, events and streams loaded through cudarc
    /// (`interop::cudarc`) or another binding, a [`KernelLauncher`](crate::kernels::KernelLauncher)'s
    /// cached modules, another backend's allocations on the device), or it must make them again
    /// (the simulated launcher does).
    ///
    /// [`retry_releases`]: TensorWasmMemoryCreator::retry_releases
    /// [`recover`]: TensorWasmMemoryCreator::recover
    #[must_use]
    pub unsafe fn recover_automatically(mut self) -> Self {
        self.automatic_recovery = true;
        self
    }

    /// The tenants' shares of the pool, if it has one.
    fn shares(&self) -> Option<Arc<PoolShares>> {
        self.pool.as_ref().map(|config| {
            PoolShares::new(
                config.classes.iter().map(|c| (laid_out(c), c.slots)),
                self.slots_per_tenant,
            )
        })
    }

    /// Builds the creator (allocating the pools' slabs, if any). A device the backend does not
    /// have is [`TwmError::UnknownDevice`].
    ///
    /// (On the mock backend, [`recover_automatically`](Self::recover_automatically) has a safe
    /// form: [`recover_simulated_automatically`](Self::recover_simulated_automatically).)
    pub fn build(self) -> Result<TensorWasmMemoryCreator<B>, TwmError> {
        crate::placement::check_device_set(&self.devices)?;
        let count = self.backend.device_count();
        if let Some(&device) = self.devices.iter().find(|d| d.0 >= count) {
            return Err(TwmError::UnknownDevice { device, count });
        }
        let backing = match self.backing {
            Some(backing) => backing,
            None => Backing::detect(&*self.backend, &self.devices),
        };
        backing.check(&*self.backend, &self.devices)?;
        let shares = self.shares();
        let bound_exempt = self.tenant.is_some() && self.slots_per_tenant.is_none();
        let limits = match &self.pool {
            Some(config) => fit_plan_to_pool(config, self.limits),
            None => self.limits,
        };
        let largest_slot = self.pool.as_ref().map_or(0, largest_slot);
        let largest_memory = largest_slot.max(limits.per_memory_limit());
        let mut pools = Vec::new();
        let kept_mappings = KeptMappings::default();
        if let Some(config) = self.pool {
            for &device in &self.devices {
                let config = PoolConfig {
                    device,
                    ..config.clone()
                };
                let backend = Arc::clone(&self.backend);
                pools.push(match backing {
                    Backing::Managed => CreatorPool::Managed(
                        SlotPool::shared(backend, config).map_err(TwmError::from_core)?,
                    ),
                    Backing::Guarded(access) => CreatorPool::Guarded(Arc::new(GuardedPool::new(
                        backend,
                        device,
                        access,
                        &config,
                        kept_mappings.clone(),
                    )?)),
                });
            }
        }
        let kept = Arc::new(KeptMemories::new(
            self.automatic_recovery,
            self.kernels.clone(),
        ));
        let scrubbers = if self.scrub_ahead {
            start_scrubbers(&pools, &self.backend, &kept)?
        } else {
            Vec::new()
        };
        Ok(TensorWasmMemoryCreator {
            inner: Arc::new(CreatorInner {
                _scrubbers: scrubbers,
                backing,
                backend: self.backend,
                devices: self.devices,
                limits,
                pools,
                tenant: self.tenant,
                untenanted: self.untenanted,
                interruption: self.interruption,
                shares,
                kernels: self.kernels.clone(),
                registry: Mutex::new(Live {
                    memories: HashMap::new(),
                    created: 0,
                    dropped: 0,
                }),
                kept,
                kept_mappings,
                refused: AtomicU64::new(0),
                share_denials: AtomicU64::new(0),
                bound_exempt,
                largest_memory,
                refusals: Mutex::new(Vec::new()),
            }),
        })
    }
}

/// A Wasmtime `MemoryCreator` that puts every linear memory in a backend's managed memory.
///
/// Cheap to clone (shared state). Install it with [`install`](Self::install) or make an engine
/// with [`engine`](Self::engine); both apply the safe Config from [`configure`].
///
/// Every memory is paid for by a tenant: a Store made by [`new_store`](crate::new_store) whose
/// modules are instantiated by [`instantiate`](crate::instantiate), or the tenant the creator is
/// bound to ([`CreatorBuilder::tenant`]); memories nobody pays for are refused
/// ([`TwmError::NoTenant`]) unless the creator allows them
/// ([`CreatorBuilder::allow_untenanted`]).
///
/// ```
/// use std::sync::Arc;
/// use tensor_wasm_mem_wasmtime::mock::MockBackend;
/// use tensor_wasm_mem_wasmtime::core::IsolationLevel;
/// use tensor_wasm_mem_wasmtime::{
///     ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, instantiate, new_store,
/// };
///
/// let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).build()?;
/// let engine = creator.engine()?;
/// let module = wasmtime::Module::new(&engine, r#"(module (memory (export "memory") 1 4))"#)?;
/// let tenant = Tenant::new(1, "t1", 1 << 20, IsolationLevel::StreamIsolated);
/// let mut store = new_store(&engine, TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()));
/// let instance = instantiate(&mut store, &wasmtime::Linker::new(&engine), &module)?;
/// let memory = instance.get_memory(&mut store, "memory").unwrap();
/// let slice = creator.resolve(&store, &memory, 16, 64)?; // a checked device pointer
/// assert_eq!(slice.len(), 64);
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
pub struct TensorWasmMemoryCreator<B: Backend> {
    inner: Arc<CreatorInner<B>>,
}

impl<B: Backend> Clone for TensorWasmMemoryCreator<B> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<B: Backend> fmt::Debug for TensorWasmMemoryCreator<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorWasmMemoryCreator")
            .field("backing", &self.inner.backing)
            .field("devices", &self.inner.devices)
            .field("limits", &self.inner.limits)
            .field("pooled", &!self.inner.pools.is_empty())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> TensorWasmMemoryCreator<B> {
    /// Starts building a creator on `backend`.
    pub fn builder(backend: Arc<B>) -> CreatorBuilder<B> {
        CreatorBuilder {
            backend,
            backing: None,
            devices: vec![DeviceId(0)],
            limits: PlanLimits::default(),
            pool: None,
            tenant: None,
            untenanted: false,
            interruption: Interruption::NONE,
            slots_per_tenant: None,
            kernels: None,
            automatic_recovery: false,
            scrub_ahead: false,
        }
    }

    /// The backend.
    #[must_use]
    pub fn backend(&self) -> &Arc<B> {
        &self.inner.backend
    }

    /// What the creator's memories offer: the backend's capabilities as its [`Backing`] shapes
    /// them (a guarded backing has guard pages, which [`install`](Self::install) turns into
    /// Wasmtime's guard-page Config).
    #[must_use]
    pub fn capabilities(&self) -> Capabilities {
        self.inner
            .backing
            .capabilities(self.inner.backend.capabilities())
    }

    /// What the creator's memories are made of (chosen at [`build`](CreatorBuilder::build)).
    #[must_use]
    pub fn backing(&self) -> Backing {
        self.inner.backing
    }

    /// The plan limits in force.
    #[must_use]
    pub fn limits(&self) -> PlanLimits {
        self.inner.limits
    }

    /// A tenant's default budgets for a cap of `touched_bytes`, sized to this creator's
    /// memories ([`TenantBudgets::for_cap_and_limit`]): a held budget of four times the cap, at
    /// least one of its largest memories (the per-memory limit, or a pool's largest slot) and
    /// room for tables, so a tenant made with them ([`Tenant::with_budgets`]) can always hold
    /// one memory, and a small tenant of a creator of small memories holds no more than that.
    /// (`Tenant::new` uses [`TenantBudgets::for_cap`], which holds one memory of the plan's
    /// default size, 256 MiB, whatever the creator's limit.)
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tensor_wasm_mem_wasmtime::prelude::*;
    ///
    /// let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
    ///     .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(1 << 30, 1)]))
    ///     .build()?;
    /// let budgets = creator.budgets_for_cap(8 << 20);
    /// assert!(budgets.held_bytes >= 1 << 30, "a 1 GiB slot fits the held budget");
    /// let tenant = Tenant::with_budgets(1, "alice", budgets, IsolationLevel::StreamIsolated);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn budgets_for_cap(&self, touched_bytes: u64) -> TenantBudgets {
        TenantBudgets::for_cap_and_limit(touched_bytes, self.inner.largest_memory)
    }

    /// The default device's managed slot pool, if memories come from managed pools (the
    /// figures of any pool, guarded ones too, are in [`stats`](Self::stats)).
    #[must_use]
    pub fn pool(&self) -> Option<&Arc<SlotPool<Arc<B>>>> {
        self.pool_on(self.device())
    }

    /// The managed slot pool of `device`, if memories come from managed pools and the creator
    /// serves it.
    #[must_use]
    pub fn pool_on(&self, device: DeviceId) -> Option<&Arc<SlotPool<Arc<B>>>> {
        let i = self.inner.devices.iter().position(|d| *d == device)?;
        match self.inner.pools.get(i)? {
            CreatorPool::Managed(pool) => Some(pool),
            CreatorPool::Guarded(_) => None,
        }
    }

    /// Makes `config` safe for this backend ([`configure`]) and installs this creator in it.
    pub fn install<'c>(&self, config: &'c mut Config) -> &'c mut Config {
        self.inner.interruption.configure(config);
        configure(config, &self.capabilities()).with_host_memory(Arc::new(self.clone()))
    }

    /// What the engines this creator configures compile in to stop guest code.
    #[must_use]
    pub fn interruption(&self) -> Interruption {
        self.inner.interruption
    }

    /// The kernels its guests may launch, if any.
    #[must_use]
    pub fn kernels(&self) -> Option<Arc<KernelRegistry<B>>> {
        self.inner.kernels.clone()
    }

    /// The most slots of the pool's largest class one tenant may hold at once (`None` without
    /// a pool; see [`CreatorBuilder::slots_per_tenant`]: each class has its own, and the tenant
    /// a creator is bound to holds slots outside the shares unless one was set).
    #[must_use]
    pub fn slots_per_tenant(&self) -> Option<usize> {
        self.inner.shares.as_ref().map(|s| s.limit())
    }

    /// An engine with the safe Config and this creator installed.
    pub fn engine(&self) -> wasmtime::Result<Engine> {
        let mut config = Config::new();
        self.install(&mut config);
        Engine::new(&config)
    }

    /// The count of this creator's guarded regions kept mapped for good because the backend
    /// never let go of them ([`KeptMappings`]), readable after the creator has gone (regions kept
    /// at the creator's own drop are counted then).
    #[must_use]
    pub fn kept_mappings(&self) -> KeptMappings {
        self.inner.kept_mappings.clone()
    }

    /// A snapshot of the creator's figures.
    #[must_use]
    pub fn stats(&self) -> CreatorStats {
        // The totals and the counts per device from one look at the registry (they agree).
        let (created, dropped, per_device) = {
            let live = self.inner.registry();
            (live.created, live.dropped, self.live_per_device(&live))
        };
        let (kept_memories, kept_bytes) = self.inner.kept.figures();
        let (recoveries, last_recovery_ns) = self.inner.kept.recoveries();
        CreatorStats {
            backing: self.inner.backing,
            live_memories: created - dropped.min(created),
            created,
            dropped,
            refused: self.inner.refused.load(Ordering::Acquire),
            share_denials: self.inner.share_denials.load(Ordering::Acquire),
            kept_memories,
            kept_bytes,
            kept_released: self.inner.kept.released(),
            recoveries,
            last_recovery_us: last_recovery_ns / 1000,
            pool: self.inner.pools.first().map(CreatorPool::stats),
            devices: self.device_stats(per_device),
        }
    }

    /// The live memories on each served device, in the served order.
    fn live_per_device(&self, registry: &Live<B>) -> Vec<u64> {
        let mut live = vec![0u64; self.inner.devices.len()];
        for record in registry.memories.values() {
            if let Some(i) = self
                .inner
                .devices
                .iter()
                .position(|d| *d == record.device())
            {
                live[i] += 1;
            }
        }
        live
    }

    /// Each served device's figures, with `live` its live memories (in the served order).
    fn device_stats(&self, live: Vec<u64>) -> Vec<CreatorDeviceStats> {
        self.inner
            .devices
            .iter()
            .zip(live)
            .enumerate()
            .map(|(i, (&device, live_memories))| CreatorDeviceStats {
                device,
                live_memories,
                pool: self.inner.pools.get(i).map(CreatorPool::stats),
                health: self.backend().device_health(device),
            })
            .collect()
    }

    /// The default device: where memories of no tenant are made (the first served).
    #[must_use]
    pub fn device(&self) -> DeviceId {
        self.inner.devices[0]
    }

    /// Every device this creator serves, the default first.
    #[must_use]
    pub fn devices(&self) -> &[DeviceId] {
        &self.inner.devices
    }

    /// Releases again every memory whose storage the backend refused to release (their
    /// charges go back as they are released), and returns how many memories are still kept:
    /// those the backend still refuses, and those device work may still use (a stream of their
    /// Store could not be released), which are never given back while the creator lives. The
    /// creator also tries on each memory it makes, and a last time when it goes.
    pub fn retry_releases(&self) -> u64 {
        self.settle();
        for &device in &self.inner.devices {
            self.recover_when_free(device);
        }
        self.inner.kept.figures().0
    }

    /// Recovers `device` after a kernel fault in its primary context fenced it: resets that
    /// context once nothing of this layer there is in use (every Store with a memory, a stream
    /// or a device pool on it gone), then releases the memories kept since the fault, whose
    /// charges go back. `Ok(None)` for a device that is not fenced (this creator still catches
    /// up with a recovery another creator on the backend made: its launchers hear of it, its
    /// kept memories are released). With
    /// [`CreatorBuilder::recover_automatically`] a device recovers on its own when its last user
    /// goes (its last memory, or its last guest stream); this is for an embedder who wants to
    /// know, or to try at a time of its choosing.
    ///
    /// While something is still in use the answer is a [`TwmError::Backend`] of kind
    /// [`ErrorKind::ContextLost`](tensor_wasm_mem_core::ErrorKind::ContextLost) that says how
    /// much (an embedder that keeps a Store keeps the device fenced: its guests trap on their
    /// next `twm` call with [`TwmError::DeviceLost`], and its scopes are refused). A managed
    /// slot pool's slab lives in the primary context: on a fenced device the pool hands out no
    /// slot and lets its slab go once no slot is held, and carves its slots from a new slab
    /// after the recovery (docs/SAFETY.md section 6b).
    ///
    /// # Safety
    ///
    /// A recovery resets the device's primary context, which destroys everything made in it,
    /// not only what this layer made: nothing else in the process may use what it made there
    /// afterwards (an embedder's modules, functions, events and streams loaded through cudarc
    /// (`interop::cudarc`) or another binding, a [`KernelLauncher`](crate::kernels::KernelLauncher)'s
    /// cached modules, another backend's allocations on the device), or it must make them again
    /// (the simulated launcher does).
    pub unsafe fn recover(
        &self,
        device: DeviceId,
    ) -> Result<Option<tensor_wasm_mem_core::Recovery>, TwmError> {
        self.give_up_fenced_slabs();
        // SAFETY: the caller's contract is the recovery's.
        unsafe { self.inner.kept.recover(self.backend(), device) }
    }

    /// Starts device work of the layer's own on `device` (a guest's kernel launch, an open
    /// device-access scope): no recovery resets the device's primary context until
    /// [`end_device_work`](Self::end_device_work). Refused, typed
    /// ([`ErrorKind::ContextLost`](tensor_wasm_mem_core::ErrorKind::ContextLost)), on a
    /// fenced device.
    pub(crate) fn begin_device_work(&self, device: DeviceId) -> Result<(), TwmError> {
        self.backend()
            .begin_device_work(device)
            .map_err(TwmError::backend)
    }

    /// Ends device work [`begin_device_work`](Self::begin_device_work) started; on a fenced
    /// device the automatic recovery that work held back runs now.
    pub(crate) fn end_device_work(&self, device: DeviceId) {
        let backend = self.backend();
        backend.end_device_work(device);
        if backend.device_fenced(device) {
            self.recover_when_free(device);
        }
    }

    /// [`recover`](Self::recover) where a guest's last stream on `device` went: not yet is not
    /// an error here.
    pub(crate) fn recover_when_free(&self, device: DeviceId) {
        self.give_up_fenced_slabs();
        self.inner.kept.recover_when_free(self.backend(), device);
    }

    /// Who keeps a fenced `device` from being recovered: per tenant, the live memories on it
    /// (each in a Store the embedder still holds; a memory no tenant pays for is listed under
    /// `tenant: None`), and memories gone whose Store's work may still run (a stream the driver
    /// would not release: kept busy while that work may run, which a fence ends only for work
    /// in the device's primary context). A recovery waits for every one of them to go: an embedder that wants the
    /// device back drops those Stores (their guests trap on their next `twm` call anyway).
    /// Empty when no memory of this creator lives there. Guest streams (a Store with no memory
    /// on the device) and other creators' memories are not listed; `recover`'s refusal counts
    /// everything of the backend still in use.
    #[must_use]
    pub fn recovery_blockers(&self, device: DeviceId) -> Vec<RecoveryBlocker> {
        let records: Vec<_> = self
            .inner
            .registry()
            .memories
            .values()
            .filter(|r| r.device() == device)
            .cloned()
            .collect();
        let mut blockers: Vec<RecoveryBlocker> = Vec::new();
        let holders = records
            .iter()
            .filter_map(|r| r.holder())
            .chain(self.inner.kept.busy_on(device));
        for (tenant, bytes) in holders {
            let id = tenant.as_ref().map(|t| t.ledger().id());
            match blockers.iter_mut().find(|b| b.tenant == id) {
                Some(b) => {
                    b.memories += 1;
                    b.bytes += bytes as u64;
                }
                None => blockers.push(RecoveryBlocker {
                    tenant: id,
                    name: tenant.map(|t| t.name().to_string()),
                    memories: 1,
                    bytes: bytes as u64,
                }),
            }
        }
        blockers
    }

    /// Each managed slot pool on a fenced device lets its slab go if no slot is held (its last
    /// slot's return does it too), so a pool never keeps its device from recovering (one atomic
    /// load per pool while no device is fenced).
    fn give_up_fenced_slabs(&self) {
        for pool in &self.inner.pools {
            if let CreatorPool::Managed(pool) = pool {
                pool.give_up_if_fenced();
            }
        }
    }

    /// Claims `device`'s fault number `faults` (its [`DeviceHealth::faults`] after the fault)
    /// for a tenant's launch: `true` for the first claim of it on the backend (whichever
    /// creator's launch claims it), so one fault is attributed to at most one launch.
    ///
    /// [`DeviceHealth::faults`]: tensor_wasm_mem_core::DeviceHealth::faults
    pub(crate) fn claim_fault(&self, device: DeviceId, faults: u64) -> bool {
        self.backend().claim_fault(device, faults)
    }

    /// Catches up with device recoveries made since this creator last looked, by anyone: the
    /// launchers hear of them, kept memories are released again (one atomic load when there
    /// was none).
    /// This thread is telling this creator's launchers of a recovery (a launcher's
    /// `device_recovered` called back into the creator): no guest launches meanwhile.
    pub(crate) fn telling_launchers_here(&self) -> bool {
        self.inner.kept.telling_here()
    }

    pub(crate) fn settle(&self) {
        self.inner.kept.settle(self.backend());
        // A pool's idle slab on a device fenced by anyone (another creator's tenant, say) goes,
        // so it never keeps that device from recovering.
        self.give_up_fenced_slabs();
    }

    /// The live memory at `view`'s base, if this creator made it (any other is `NotOurMemory`).
    fn record(&self, view: MemoryView) -> Result<Arc<MemoryRecord<B>>, TwmError> {
        self.inner
            .registry()
            .memories
            .get(&view.base)
            .cloned()
            .ok_or(TwmError::NotOurMemory)
    }

    /// The device of a memory this creator made (any other is `NotOurMemory`).
    pub(crate) fn memory_device(&self, view: MemoryView) -> Result<DeviceId, TwmError> {
        Ok(self.record(view)?.device())
    }

    /// A memory this creator made (any other is `NotOurMemory`), held for a device-access
    /// scope, with its visible size as the guest sees it.
    pub(crate) fn scoped(&self, view: MemoryView) -> Result<(ScopedMemory<B>, usize), TwmError> {
        let record = self.record(view)?;
        let size = record.with_storage(|storage| {
            if !storage.capabilities().device_accessible {
                return Err(TwmError::NotDeviceAccessible);
            }
            Ok(view.size.min(storage.len()))
        })?;
        Ok((ScopedMemory::of(&record), size))
    }

    /// Runs `f` on the storage of a memory this creator made (any other is `NotOurMemory`),
    /// with its visible size as the guest sees it.
    fn with_buffer<R>(
        &self,
        view: MemoryView,
        f: impl FnOnce(&Storage<B>, usize) -> Result<R, TwmError>,
    ) -> Result<R, TwmError> {
        self.record(view)?
            .with_storage(|storage| f(storage, view.size.min(storage.len())))
    }

    /// Resolves a guest range of `memory` to a device slice: only when `memory` came from this
    /// creator, its backing is device-accessible, and `offset..offset + len` lies inside the
    /// memory's current size without overflow. Any other memory (from `Memory::new`,
    /// `SharedMemory`, the pooling allocator, another creator) is refused.
    ///
    /// The slice borrows the Store: it cannot be kept past the Store (whose memories then go,
    /// and whose pool slots go to the next tenant), nor across a call into the guest (which
    /// needs the Store mutably, and may grow or write the memory). Keeping it does not compile
    /// (`tests/ui/slice_outlives_store.rs`).
    ///
    /// A memory of another Store than `store` is [`TwmError::ForeignMemory`] (Wasmtime's own
    /// `Memory` methods panic there), here and in [`advise`](Self::advise) and
    /// [`prefetch`](Self::prefetch).
    pub fn resolve<'s, S: AsContext>(
        &self,
        store: &'s S,
        memory: &Memory,
        offset: u64,
        len: u64,
    ) -> Result<GuestSlice<'s>, TwmError> {
        let slice = self.resolve_at(MemoryView::of(store, memory)?, offset, len)?;
        Ok(GuestSlice {
            slice,
            _store: PhantomData,
        })
    }

    pub(crate) fn resolve_at(
        &self,
        view: MemoryView,
        offset: u64,
        len: u64,
    ) -> Result<DeviceSlice, TwmError> {
        self.with_buffer(view, |buffer, size| {
            if !buffer.capabilities().device_accessible {
                return Err(TwmError::NotDeviceAccessible);
            }
            let range = guest_range(offset, len, size)?;
            buffer.device_slice(range.start, range.len())
        })
    }

    /// Applies `advice` to a guest range of `memory` (checked as in [`resolve`](Self::resolve)),
    /// widened to whole [`HINT_GRANULARITY`] blocks within the memory: advice is a hint, and a
    /// guest that advises every other byte leaves at most one range per block, not millions.
    pub fn advise(
        &self,
        store: impl AsContext,
        memory: &Memory,
        offset: u64,
        len: u64,
        advice: Advice,
    ) -> Result<(), TwmError> {
        self.with_buffer(MemoryView::of(store, memory)?, |buffer, size| {
            let range = hint_range(guest_range(offset, len, size)?, size);
            buffer.advise(range.start, range.len(), advice)
        })
    }

    /// Prefetches a guest range of `memory` to `to` on `stream` (checked as in
    /// [`resolve`](Self::resolve)), widened to whole [`HINT_GRANULARITY`] blocks within the
    /// memory (pages migrate in blocks, not bytes).
    pub fn prefetch(
        &self,
        store: impl AsContext,
        memory: &Memory,
        offset: u64,
        len: u64,
        to: Location,
        stream: &Stream,
    ) -> Result<(), TwmError> {
        self.prefetch_at(MemoryView::of(store, memory)?, offset, len, to, stream)
    }

    pub(crate) fn prefetch_at(
        &self,
        view: MemoryView,
        offset: u64,
        len: u64,
        to: Location,
        stream: &Stream,
    ) -> Result<(), TwmError> {
        self.with_buffer(view, |buffer, size| {
            let range = hint_range(guest_range(offset, len, size)?, size);
            buffer.prefetch(range.start, range.len(), to, stream)
        })
    }

    fn refuse(&self, error: &TwmError) -> String {
        self.inner.refused.fetch_add(1, Ordering::AcqRel);
        if matches!(error, TwmError::PoolShare { .. }) {
            self.inner.share_denials.fetch_add(1, Ordering::AcqRel);
        }
        tracing::debug!(%error, "twm: memory refused");
        error.to_string()
    }

    fn refusals(&self) -> std::sync::MutexGuard<'_, Vec<(std::thread::ThreadId, TwmError)>> {
        self.inner
            .refusals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `tenant` holds slots outside the shares: the tenant this creator is bound to,
    /// where the embedder set no share.
    fn is_exempt(&self, tenant: &Arc<Tenant>) -> bool {
        self.inner.bound_exempt
            && self
                .inner
                .tenant
                .as_ref()
                .is_some_and(|(bound, _)| Arc::ptr_eq(bound, tenant))
    }

    /// Keeps `error` as this thread's last refusal, for [`typed_error`](Self::typed_error).
    fn keep_refusal(&self, error: TwmError) {
        let me = std::thread::current().id();
        let mut kept = self.refusals();
        kept.retain(|(thread, _)| *thread != me);
        if kept.len() >= KEPT_REFUSALS {
            kept.remove(0);
        }
        kept.push((me, error));
    }

    /// `error`, what Wasmtime returned for an instantiation or a `Memory::new` on this thread,
    /// with the typed [`TwmError`] behind it where this creator refused a memory for it.
    ///
    /// Wasmtime passes a memory creator's refusal on as text only. With a tenant's Store and
    /// [`instantiate`](crate::instantiate) the typed error comes back by itself (the Store's
    /// books keep it); a creator bound to a tenant ([`CreatorBuilder::tenant`]) serves Stores
    /// with no books, and this is its one step: `creator.typed_error(e)` then
    /// `downcast_ref::<TwmError>()`. An error that is not that refusal (its text does not
    /// carry the refusal's) is returned as it came. The record is the thread's last refusal,
    /// taken by the first call that matches it (the 64 threads that refused last are kept).
    /// A tenant limiter's own refusal outside `instantiate` (a `Memory::new` its budget denies)
    /// is Wasmtime's text too: the limiter's [`last_denial`](crate::TenantLimiter::last_denial)
    /// names it.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tensor_wasm_mem_wasmtime::prelude::*;
    ///
    /// let tenant = Tenant::new(1, "alice", 64 << 10, IsolationLevel::StreamIsolated);
    /// let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
    ///     .tenant(tenant, ChargeMode::Touched)
    ///     .build()?;
    /// let engine = creator.engine()?;
    /// let module = Module::new(&engine, "(module (memory 2))")?; // two pages: past the cap
    /// let mut store = Store::new(&engine, ());
    /// let error = Linker::new(&engine)
    ///     .instantiate(&mut store, &module)
    ///     .unwrap_err();
    /// let error = creator.typed_error(error);
    /// let twm = error.downcast_ref::<TwmError>().expect("typed");
    /// assert!(matches!(twm, TwmError::Denied { .. }) && twm.is_denial());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn typed_error(&self, error: wasmtime::Error) -> wasmtime::Error {
        if error.downcast_ref::<TwmError>().is_some() {
            return error;
        }
        let me = std::thread::current().id();
        let mut kept = self.refusals();
        let Some(i) = kept.iter().position(|(thread, _)| *thread == me) else {
            return error;
        };
        if !format!("{error:#}").contains(&kept[i].1.to_string()) {
            return error;
        }
        wasmtime::Error::new(kept.remove(i).1)
    }

    /// Makes a memory: check, plan, find who pays, charge, acquire, register.
    fn create(
        &self,
        ty: &MemoryType,
        (reserved, guard): (Option<usize>, usize),
        payer: Payer,
    ) -> Result<TensorWasmLinearMemory<B>, TwmError> {
        self.settle();
        self.check_engine(ty, reserved, guard)?;
        let plan = self.plan(ty)?;
        let (slot, device) = self.home(payer.tenant())?;
        let made = self.create_on((slot, device), &plan, (reserved, guard), payer);
        if made.is_err() && self.backend().device_fenced(device) {
            // Refused on a fenced device (its pool's slot, or an allocation, lost with the
            // context): this creation held nothing there any more, and may have been what held
            // back the recovery the last Store there tried (a slot it was scrubbing). The
            // automatic recovery is tried again now, or no one would.
            self.recover_when_free(device);
        }
        made
    }

    /// [`create`](Self::create) on the served device at `slot`.
    fn create_on(
        &self,
        (slot, device): (usize, DeviceId),
        plan: &MemoryPlan,
        (reserved, guard): (Option<usize>, usize),
        payer: Payer,
    ) -> Result<TensorWasmLinearMemory<B>, TwmError> {
        let sizes = Sizes::new(plan, self.inner.pools.get(slot))?;
        let books = payer.books();
        // The tenant's share of the pool first: a memory its share refuses is never charged
        // (nor counted among its memories, nor in its peaks).
        if let (Some(tenant), Some(shares), Some(_)) = (
            payer.tenant(),
            &self.inner.shares,
            self.inner.pools.get(slot),
        ) && !self.is_exempt(tenant)
        {
            shares.check(tenant, sizes.capacity as u64)?;
        }
        let charge = payer.charge(&sizes)?;
        let _span = tracing::debug_span!(
            "twm.memory.create",
            backing = self.inner.backing.name(),
            isolation =
                charge
                    .as_ref()
                    .map_or("untenanted", |c| c.tenant().ledger().isolation().name()),
            device = device.0,
            initial = sizes.initial,
            capacity = sizes.capacity,
            held = sizes.held
        )
        .entered();
        let storage = self.acquire(slot, device, &sizes, reserved.unwrap_or(0), guard)?;
        let pooled = self.inner.pools.get(slot).is_some();
        let held = self.open(Held { storage, charge }, sizes.initial, pooled)?;
        Ok(self.register(held, device, books, &sizes))
    }

    /// Readies a memory just acquired: its charge covers what the storage really holds (a pool
    /// may hand out a slot of a larger class than the smallest that fits), and its first
    /// `initial` bytes are reachable. On failure the storage is released with its charge, or
    /// kept with it if the backend refuses.
    fn open(&self, mut held: Held<B>, initial: usize, pooled: bool) -> Result<Held<B>, TwmError> {
        let holds = held.storage.held_bytes() as u64;
        let opened = match &mut held.charge {
            // The slot is counted against its tenant's share of the slot's own class (known
            // once the pool chose it).
            Some(charge) => match (&self.inner.shares, pooled) {
                (Some(shares), true) if !self.is_exempt(charge.tenant()) => {
                    charge.take_share(shares, holds)
                }
                _ => Ok(()),
            }
            .and_then(|()| charge.hold_at_least(holds)),
            None => Ok(()),
        }
        .and_then(|()| held.storage.open(initial));
        match opened {
            Ok(()) => Ok(held),
            Err(e) => {
                if let Err(kept) = held.release() {
                    self.inner.kept.keep(kept);
                }
                Err(e)
            }
        }
    }

    /// Refuses what the engine asks that this backing cannot honour: managed memory has no
    /// guard pages and no reservation (Wasmtime must check bounds); a guarded backing maps (or
    /// its pool slot holds) what Wasmtime asks for.
    fn check_engine(
        &self,
        ty: &MemoryType,
        reserved: Option<usize>,
        guard: usize,
    ) -> Result<(), TwmError> {
        crate::error::check_memory_type(ty)?;
        if self.inner.backing != Backing::Managed {
            return Ok(());
        }
        if guard > 0 {
            return Err(TwmError::GuardNotHonoured { guard });
        }
        match reserved.filter(|&r| r > 0) {
            Some(reserved) => Err(TwmError::ReservationNotHonoured { reserved }),
            None => Ok(()),
        }
    }

    /// The memory's plan: the hard cap and the configured limit, before any allocation.
    fn plan(&self, ty: &MemoryType) -> Result<MemoryPlan, TwmError> {
        let plan_type = PlanType {
            minimum_pages: ty.minimum(),
            maximum_pages: ty.maximum(),
            page_size_log2: ty.page_size_log2(),
            memory64: ty.is_64(),
        };
        Ok(MemoryPlan::new(&plan_type, &self.inner.limits)?)
    }

    /// Who pays for a memory of `minimum` bytes: the Store whose limiter announced it (inside
    /// that Store's [`instantiate`](crate::instantiate)), the tenant the creator is bound to,
    /// or nobody where untenanted memories are allowed; else [`TwmError::NoTenant`].
    fn payer(&self, minimum: usize) -> Result<Payer, TwmError> {
        if let Some((books, grant)) = books::redeem_creation(minimum) {
            return Ok(Payer::Store { books, grant });
        }
        match &self.inner.tenant {
            Some((tenant, mode)) => Ok(Payer::Bound {
                tenant: Arc::clone(tenant),
                mode: *mode,
            }),
            None if self.inner.untenanted => Ok(Payer::Nobody),
            None => Err(TwmError::NoTenant),
        }
    }

    /// The served device a memory of `tenant` goes to (its home, which must be served; the
    /// first for no tenant), as its index in the served devices.
    fn home(&self, tenant: Option<&Arc<Tenant>>) -> Result<(usize, DeviceId), TwmError> {
        let Some(tenant) = tenant else {
            return Ok((0, self.inner.devices[0]));
        };
        let slot = self
            .inner
            .devices
            .iter()
            .position(|d| *d == tenant.device())
            .ok_or_else(|| TwmError::DeviceNotServed {
                tenant_name: tenant.name().to_string(),
                device: tenant.device(),
            })?;
        Ok((slot, tenant.device()))
    }

    /// The memory's storage: a slot of the device's pool, or a fresh allocation or region.
    fn acquire(
        &self,
        slot: usize,
        device: DeviceId,
        sizes: &Sizes,
        reserved: usize,
        guard: usize,
    ) -> Result<Storage<B>, TwmError> {
        let backend = || Arc::clone(&self.inner.backend);
        let capacity = sizes.allocate;
        // Nothing visible yet: `open` makes the initial bytes reachable, through the path that
        // keeps a storage the backend refuses to take back.
        Ok(match (self.inner.pools.get(slot), self.inner.backing) {
            (Some(CreatorPool::Managed(pool)), _) => Storage::Managed(
                pool.acquire(capacity, 0)
                    .map_err(|e| TwmError::from_core(e).on_device(device))?,
            ),
            (Some(CreatorPool::Guarded(pool)), _) => Storage::Guarded(
                pool.acquire(capacity, reserved, guard)
                    .map_err(|e| e.on_device(device))?,
            ),
            (None, Backing::Managed) => Storage::Managed(
                UnifiedBuffer::new(backend(), device, capacity, 0).map_err(TwmError::from_core)?,
            ),
            (None, Backing::Guarded(access)) => Storage::Guarded(GuardedRegion::new(
                backend(),
                (device, access),
                capacity,
                reserved,
                guard,
                self.inner.kept_mappings.clone(),
            )?),
        })
    }

    /// Registers a made memory by its base, and hands it to Wasmtime.
    fn register(
        &self,
        held: Held<B>,
        device: DeviceId,
        books: Option<Arc<StoreBooks>>,
        sizes: &Sizes,
    ) -> TensorWasmLinearMemory<B> {
        let base = held.storage.as_ptr() as usize;
        let kept = Arc::clone(&self.inner.kept);
        let record = Arc::new(MemoryRecord::new(held, device, books, kept));
        {
            let mut live = self.inner.registry();
            live.memories.insert(base, Arc::clone(&record));
            live.created += 1;
        }
        let registry: Arc<dyn Registry<B>> = self.inner.clone();
        TensorWasmLinearMemory::new(registry, record, (base, sizes.initial, sizes.capacity))
    }
}

/// The sizes of a memory about to be made.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    /// Visible bytes at first.
    initial: usize,
    /// The most it can grow to.
    capacity: usize,
    /// Bytes asked of the pool or the backend: the capacity, at least one byte (a linear
    /// memory's base must be non-null and unique, so a zero-capacity memory still holds one
    /// allocation).
    allocate: usize,
    /// Bytes it will hold: its pool slot's size, or its allocation's.
    held: usize,
}

impl Sizes {
    fn new<B: Backend>(plan: &MemoryPlan, pool: Option<&CreatorPool<B>>) -> Result<Self, TwmError> {
        let capacity = plan.capacity_usize()?;
        let allocate = capacity.max(1);
        // What the storage will hold at least: the smallest slot that fits, or the allocation
        // rounded up to a Wasm page (a driver allocation never holds less); `open` charges more
        // if the storage turns out to hold more.
        let held = match pool {
            Some(pool) => pool.slot_size_for(allocate).unwrap_or(allocate),
            None => allocate.next_multiple_of(SLOT_ALIGN),
        };
        Ok(Self {
            initial: plan.initial_usize()?,
            capacity,
            allocate,
            held,
        })
    }

    /// `(initial, capacity, held)` as a charge counts them.
    fn charged(&self) -> (u64, u64, u64) {
        (self.initial as u64, self.capacity as u64, self.held as u64)
    }
}

/// Who pays for a memory about to be made.
#[derive(Debug)]
enum Payer {
    /// The Store whose limiter granted its touched bytes.
    Store {
        books: Arc<StoreBooks>,
        grant: Reservation,
    },
    /// The tenant the creator is bound to.
    Bound {
        tenant: Arc<Tenant>,
        mode: ChargeMode,
    },
    /// Nobody: an untenanted memory (where the creator allows them).
    Nobody,
}

impl Payer {
    fn tenant(&self) -> Option<&Arc<Tenant>> {
        match self {
            Self::Store { books, .. } => Some(books.tenant()),
            Self::Bound { tenant, .. } => Some(tenant),
            Self::Nobody => None,
        }
    }

    fn books(&self) -> Option<Arc<StoreBooks>> {
        match self {
            Self::Store { books, .. } => Some(Arc::clone(books)),
            Self::Bound { .. } | Self::Nobody => None,
        }
    }

    /// The memory's charge, before its storage is acquired (`None`: nobody pays).
    fn charge(self, sizes: &Sizes) -> Result<Option<MemoryCharge>, TwmError> {
        let (tenant, mode, grant) = match self {
            Self::Store { books, grant } => (Arc::clone(books.tenant()), books.mode(), Some(grant)),
            Self::Bound { tenant, mode } => (tenant, mode, None),
            Self::Nobody => return Ok(None),
        };
        MemoryCharge::new(&tenant, mode, grant, sizes.charged()).map(Some)
    }
}

/// A class's slot size as the pool lays it out (and reports its slots): rounded up to
/// [`SLOT_ALIGN`].
fn laid_out(class: &tensor_wasm_mem_core::SizeClass) -> u64 {
    class.slot_bytes.next_multiple_of(SLOT_ALIGN) as u64
}

/// A scrub-ahead thread per pool. A thread on a managed pool that held a slot as the pool's device was
/// fenced tries the automatic recovery the slot held back (as the end of any other use of the
/// device does), through `kept`.
fn start_scrubbers<B: Backend>(
    pools: &[CreatorPool<B>],
    backend: &Arc<B>,
    kept: &Arc<KeptMemories<B>>,
) -> Result<Vec<crate::scrub_ahead::Scrubber>, TwmError> {
    pools
        .iter()
        .map(|pool| match pool {
            CreatorPool::Managed(pool) => {
                let (backend, kept, device) =
                    (Arc::clone(backend), Arc::clone(kept), pool.device());
                let recover = move || kept.recover_when_free(&backend, device);
                crate::scrub_ahead::Scrubber::start(pool, recover)
            }
            // Host pages, detached from the device before they come back: nothing for a
            // recovery to wait for.
            CreatorPool::Guarded(pool) => crate::scrub_ahead::Scrubber::start(pool, || {}),
        })
        .collect()
}

/// The largest slot of a pool's classes, in bytes (0 for none), as the pool lays it out.
fn largest_slot(config: &PoolConfig) -> u64 {
    config.classes.iter().map(laid_out).max().unwrap_or(0)
}

/// The plan fitted to a pool: no memory gets more capacity than the largest slot. The default
/// maximum (what a memory that declares none gets: every clang C guest) and the per-memory limit
/// (which clamps declared maxima) are each lowered to the largest slot where they pass it (said
/// in a log line, and in [`TensorWasmMemoryCreator::limits`]): a memory declaring more gets the
/// slot, and its growth past it is refused in the guest (-1), instead of every instantiation
/// being refused as too large.
fn fit_plan_to_pool(config: &PoolConfig, limits: PlanLimits) -> PlanLimits {
    let largest_slot = largest_slot(config);
    // What a memory that declares no maximum gets (the default, within the per-memory limit).
    let default_capacity = limits.default_maximum().min(limits.per_memory_limit());
    if largest_slot == 0
        || (largest_slot >= default_capacity && largest_slot >= limits.per_memory_limit())
    {
        return limits;
    }
    tracing::info!(
        largest_slot,
        default_maximum = limits.default_maximum(),
        per_memory_limit = limits.per_memory_limit(),
        "twm: memories get at most the pool's largest slot (a declared or default maximum past it is clamped)"
    );
    let limits = if largest_slot < default_capacity {
        limits.with_default_maximum(largest_slot).unwrap_or(limits)
    } else {
        limits
    };
    if largest_slot < limits.per_memory_limit() {
        return limits.with_per_memory_limit(largest_slot).unwrap_or(limits);
    }
    limits
}

/// Checks a guest range against `size`; overflow of the address type is reported as such.
pub(crate) fn guest_range(
    offset: u64,
    len: u64,
    size: usize,
) -> Result<std::ops::Range<usize>, TwmError> {
    let overflow =
        || TwmError::GuestRange(tensor_wasm_mem_core::RangeError::Overflow { offset, len });
    let offset = usize::try_from(offset).map_err(|_| overflow())?;
    let len_usize = usize::try_from(len).map_err(|_| overflow())?;
    check_range(offset, len_usize, size).map_err(TwmError::GuestRange)
}

/// The block advice and prefetches of a guest range are widened to (64 KiB, a Wasm page, and the
/// block in which a CUDA driver migrates managed pages): a memory of `n` such blocks holds at most
/// `n` ranges per kind of advice, whatever a guest asks.
pub const HINT_GRANULARITY: usize = 64 * 1024;

/// `range` (checked against `size`) widened to whole [`HINT_GRANULARITY`] blocks, clipped to
/// `size`; an empty range stays empty.
fn hint_range(range: std::ops::Range<usize>, size: usize) -> std::ops::Range<usize> {
    if range.is_empty() {
        return range;
    }
    let start = range.start - range.start % HINT_GRANULARITY;
    let end = range
        .end
        .checked_next_multiple_of(HINT_GRANULARITY)
        .map_or(size, |end| end.min(size));
    start..end
}

// SAFETY: every memory returned is a `TensorWasmLinearMemory`, whose safety argument is on its
// `LinearMemory` impl; memory handed out is zero-filled (`UnifiedBuffer` zeroes its visible
// window, pool slots are scrubbed), and guard or reservation requests that cannot be honoured are
// refused, so Wasmtime never elides a bounds check this memory cannot back.
unsafe impl<B: Backend> MemoryCreator for TensorWasmMemoryCreator<B> {
    fn new_memory(
        &self,
        ty: MemoryType,
        minimum: usize,
        _maximum: Option<usize>,
        reserved_size_in_bytes: Option<usize>,
        guard_size_in_bytes: usize,
    ) -> Result<Box<dyn LinearMemory>, String> {
        // Who pays: the Store's limiter announced this memory just before, on this thread.
        let payer = self.payer(minimum);
        let books = payer.as_ref().ok().and_then(Payer::books);
        let engine = (reserved_size_in_bytes, guard_size_in_bytes);
        match payer.and_then(|payer| self.create(&ty, engine, payer)) {
            Ok(memory) => Ok(Box::new(memory)),
            Err(e) => {
                // Wasmtime reports a creator's refusal as text only: the typed error is kept
                // for `instantiate` to return.
                let message = self.refuse(&e);
                match &books {
                    Some(books) => books.record_refusal(e),
                    None => self.keep_refusal(e),
                }
                Err(message)
            }
        }
    }
}
