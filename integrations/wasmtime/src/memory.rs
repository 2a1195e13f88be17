//! [`TensorWasmMemoryCreator`] and [`TensorWasmLinearMemory`]: Wasm linear memory on a backend's
//! managed memory, fresh or from a slot pool, with guest-pointer resolution.

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use tensor_wasm_mem_core::{
    Advice, Capabilities, DeviceId, DeviceSlice, Location, MemoryPlan, MemoryType as PlanType,
    PlanLimits, PoolConfig, PoolStats, Purpose, Reservation, SlotPool, Stream, StreamProvider,
    UnifiedBuffer, check_range,
};

use crate::backing::{Backing, CreatorPool, GuardedPool, GuardedRegion, MemoryBacking};
use wasmtime::{AsContext, Config, Engine, LinearMemory, Memory, MemoryCreator, MemoryType};

use crate::Backend;
use crate::config::configure;
use crate::error::TwmError;
use crate::tenancy::{self, ChargeMode, Creation, MemoryCharge, StoreCharge, Tenant};

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

/// What one live memory shares with the registry (for resolution and host calls). Fields drop
/// in order: the buffer (freed, or back in its pool) first, then the charges, so a tenant is
/// never charged less than it holds.
struct MemoryShared<B: Backend> {
    buffer: RwLock<MemoryBacking<B>>,
    /// The buffer's device (it never changes), read without the buffer's lock.
    device: DeviceId,
    charges: MemoryCharges,
}

impl<B: Backend> Drop for MemoryShared<B> {
    /// Before the buffer is freed or its slot goes back: waits for the Store's guest stream if
    /// it is still alive (its data outlived its memories), so no work queued on it can land
    /// after the scrub, in the next holder's memory. In Wasmtime's usual order the stream is
    /// already released (and waited for) and there is nothing to do.
    fn drop(&mut self) {
        let Some(store) = &self.charges._store else {
            return;
        };
        let buffer = self
            .buffer
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for id in store.streams() {
            if let Err(e) = buffer.allocator().synchronize(&id.handle()) {
                tracing::warn!(error = %e, "twm: waiting for a stream before freeing a memory failed");
            }
        }
    }
}

/// One memory held by a device-access scope (see [`crate::DeviceAccess`]).
pub(crate) struct ScopedMemory<B: Backend>(Arc<MemoryShared<B>>);

impl<B: Backend> ScopedMemory<B> {
    /// The charge of the Store that made it (`None`: a creator bound to a tenant, no limiter).
    pub(crate) fn store_charge(&self) -> Option<&Arc<StoreCharge>> {
        self.0.charges._store.as_ref()
    }

    fn buffer(&self) -> std::sync::RwLockReadGuard<'_, MemoryBacking<B>> {
        self.0.buffer.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// A device slice of a range already checked against the visible size.
    pub(crate) fn slice(&self, range: &std::ops::Range<usize>) -> Result<DeviceSlice, TwmError> {
        self.buffer().device_slice(range.start, range.len())
    }

    pub(crate) fn prefetch(
        &self,
        range: &std::ops::Range<usize>,
        to: Location,
        stream: &Stream,
    ) -> Result<(), TwmError> {
        self.buffer().prefetch(range.start, range.len(), to, stream)
    }

    pub(crate) fn advise(
        &self,
        range: &std::ops::Range<usize>,
        advice: Advice,
    ) -> Result<(), TwmError> {
        self.buffer().advise(range.start, range.len(), advice)
    }

    /// The host address of visible byte `offset`, where the backing is host-accessible.
    pub(crate) fn host_ptr(&self, offset: usize) -> Option<*mut u8> {
        let buffer = self.buffer();
        buffer
            .capabilities()
            .host_accessible
            .then(|| buffer.as_ptr().wrapping_add(offset))
    }

    pub(crate) fn backend(&self) -> Arc<B> {
        Arc::clone(self.buffer().allocator())
    }

    /// The device the memory is on.
    pub(crate) fn device(&self) -> DeviceId {
        self.0.device
    }
}

/// Everything a memory holds charged to its tenant.
#[derive(Debug, Default)]
struct MemoryCharges {
    /// Its count and held bytes (memories and held budgets); held only to be dropped.
    _memory: Option<MemoryCharge>,
    /// Its touched bytes when charged by the memory itself (a creator bound to a tenant, or
    /// `Capacity` mode under a limiter).
    touched: Option<Mutex<Reservation>>,
    /// The Store's charge (touched bytes and tables), kept until the memory is gone.
    _store: Option<Arc<StoreCharge>>,
}

struct CreatorInner<B: Backend> {
    backend: Arc<B>,
    /// The devices served, the default (for memories of no tenant) first.
    devices: Vec<DeviceId>,
    limits: PlanLimits,
    /// What memories are made of.
    backing: Backing,
    /// A pool per served device, in the same order (empty: fresh allocations).
    pools: Vec<CreatorPool<B>>,
    tenant: Option<(Arc<Tenant>, ChargeMode)>,
    /// Live memories by base address.
    registry: Mutex<HashMap<usize, Arc<MemoryShared<B>>>>,
    created: AtomicU64,
    dropped: AtomicU64,
    refused: AtomicU64,
}

impl<B: Backend> CreatorInner<B> {
    fn registry(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Arc<MemoryShared<B>>>> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }
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
}

/// Builds a [`TensorWasmMemoryCreator`].
pub struct CreatorBuilder<B: Backend> {
    backend: Arc<B>,
    backing: Option<Backing>,
    devices: Vec<DeviceId>,
    limits: PlanLimits,
    pool: Option<PoolConfig>,
    tenant: Option<(Arc<Tenant>, ChargeMode)>,
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
    #[must_use]
    pub fn pool(mut self, config: PoolConfig) -> Self {
        self.pool = Some(config);
        self
    }

    /// Bind the creator to one tenant (for an Engine per tenant): every memory is charged to it
    /// here, in the creator, as `mode` says.
    #[must_use]
    pub fn tenant(mut self, tenant: Arc<Tenant>, mode: ChargeMode) -> Self {
        self.tenant = Some((tenant, mode));
        self
    }

    /// Builds the creator (allocating the pools' slabs, if any). A device the backend does not
    /// have is [`TwmError::UnknownDevice`].
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
        let mut pools = Vec::new();
        if let Some(config) = self.pool {
            for &device in &self.devices {
                let config = PoolConfig {
                    device,
                    ..config.clone()
                };
                let backend = Arc::clone(&self.backend);
                pools.push(match backing {
                    Backing::Managed => CreatorPool::Managed(Arc::new(
                        SlotPool::new(backend, config).map_err(TwmError::from_core)?,
                    )),
                    Backing::Guarded(access) => CreatorPool::Guarded(Arc::new(GuardedPool::new(
                        backend, device, access, &config,
                    )?)),
                });
            }
        }
        Ok(TensorWasmMemoryCreator {
            inner: Arc::new(CreatorInner {
                backing,
                backend: self.backend,
                devices: self.devices,
                limits: self.limits,
                pools,
                tenant: self.tenant,
                registry: Mutex::new(HashMap::new()),
                created: AtomicU64::new(0),
                dropped: AtomicU64::new(0),
                refused: AtomicU64::new(0),
            }),
        })
    }
}

/// A Wasmtime `MemoryCreator` that puts every linear memory in a backend's managed memory.
///
/// Cheap to clone (shared state). Install it with [`install`](Self::install) or make an engine
/// with [`engine`](Self::engine); both apply the safe Config from [`configure`].
///
/// ```
/// use std::sync::Arc;
/// use tensor_wasm_mem_mock::MockBackend;
/// use tensor_wasm_mem_wasmtime::TensorWasmMemoryCreator;
///
/// let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).build()?;
/// let engine = creator.engine()?;
/// let module = wasmtime::Module::new(&engine, r#"(module (memory (export "memory") 1 4))"#)?;
/// let mut store = wasmtime::Store::new(&engine, ());
/// let instance = wasmtime::Instance::new(&mut store, &module, &[])?;
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
        configure(config, &self.capabilities()).with_host_memory(Arc::new(self.clone()))
    }

    /// An engine with the safe Config and this creator installed.
    pub fn engine(&self) -> wasmtime::Result<Engine> {
        let mut config = Config::new();
        self.install(&mut config);
        Engine::new(&config)
    }

    /// A snapshot of the creator's figures.
    #[must_use]
    pub fn stats(&self) -> CreatorStats {
        let created = self.inner.created.load(Ordering::Acquire);
        let dropped = self.inner.dropped.load(Ordering::Acquire);
        CreatorStats {
            backing: self.inner.backing,
            live_memories: created - dropped.min(created),
            created,
            dropped,
            refused: self.inner.refused.load(Ordering::Acquire),
            pool: self.inner.pools.first().map(CreatorPool::stats),
            devices: self.device_stats(),
        }
    }

    fn device_stats(&self) -> Vec<CreatorDeviceStats> {
        let mut live = vec![0u64; self.inner.devices.len()];
        for shared in self.inner.registry().values() {
            if let Some(i) = self.inner.devices.iter().position(|d| *d == shared.device) {
                live[i] += 1;
            }
        }
        self.inner
            .devices
            .iter()
            .zip(live)
            .enumerate()
            .map(|(i, (&device, live_memories))| CreatorDeviceStats {
                device,
                live_memories,
                pool: self.inner.pools.get(i).map(CreatorPool::stats),
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

    /// The live memory at `view`'s base, if this creator made it (any other is `NotOurMemory`).
    fn shared(&self, view: MemoryView) -> Result<Arc<MemoryShared<B>>, TwmError> {
        self.inner
            .registry()
            .get(&view.base)
            .cloned()
            .ok_or(TwmError::NotOurMemory)
    }

    /// The device of a memory this creator made (any other is `NotOurMemory`).
    pub(crate) fn memory_device(&self, view: MemoryView) -> Result<DeviceId, TwmError> {
        Ok(self.shared(view)?.device)
    }

    /// A memory this creator made (any other is `NotOurMemory`), held for a device-access
    /// scope, with its visible size as the guest sees it.
    pub(crate) fn scoped(&self, view: MemoryView) -> Result<(ScopedMemory<B>, usize), TwmError> {
        let shared = self.shared(view)?;
        let size = {
            let buffer = shared.buffer.read().unwrap_or_else(PoisonError::into_inner);
            if !buffer.capabilities().device_accessible {
                return Err(TwmError::NotDeviceAccessible);
            }
            view.size.min(buffer.len())
        };
        Ok((ScopedMemory(shared), size))
    }

    /// Runs `f` on the buffer of a memory this creator made (any other is `NotOurMemory`), with
    /// its visible size as the guest sees it.
    fn with_buffer<R>(
        &self,
        view: MemoryView,
        f: impl FnOnce(&MemoryBacking<B>, usize) -> Result<R, TwmError>,
    ) -> Result<R, TwmError> {
        let shared = self.shared(view)?;
        let buffer = shared.buffer.read().unwrap_or_else(PoisonError::into_inner);
        f(&buffer, view.size.min(buffer.len()))
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

    /// Applies `advice` to a guest range of `memory` (checked as in [`resolve`](Self::resolve)).
    pub fn advise(
        &self,
        store: impl AsContext,
        memory: &Memory,
        offset: u64,
        len: u64,
        advice: Advice,
    ) -> Result<(), TwmError> {
        self.with_buffer(MemoryView::of(store, memory)?, |buffer, size| {
            let range = guest_range(offset, len, size)?;
            buffer.advise(range.start, range.len(), advice)
        })
    }

    /// Prefetches a guest range of `memory` to `to` on `stream` (checked as in
    /// [`resolve`](Self::resolve)).
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
            let range = guest_range(offset, len, size)?;
            buffer.prefetch(range.start, range.len(), to, stream)
        })
    }

    fn refuse(&self, error: TwmError) -> String {
        self.inner.refused.fetch_add(1, Ordering::AcqRel);
        tracing::debug!(%error, "twm: memory refused");
        error.to_string()
    }

    /// Makes a memory; the Store's limiter's `creation`, if any, says whom to charge.
    fn create(
        &self,
        ty: &MemoryType,
        reserved: Option<usize>,
        guard: usize,
        creation: &Option<Creation>,
    ) -> Result<TensorWasmLinearMemory<B>, TwmError> {
        crate::error::check_memory_type(ty)?;
        // Managed memory has no guard pages and no reservation: Wasmtime must check bounds.
        // A guarded backing maps (or its pool slot holds) what Wasmtime asks for.
        let backing = self.inner.backing;
        if backing == Backing::Managed {
            if guard > 0 {
                return Err(TwmError::GuardNotHonoured { guard });
            }
            if let Some(reserved) = reserved.filter(|&r| r > 0) {
                return Err(TwmError::ReservationNotHonoured { reserved });
            }
        }
        let plan_type = PlanType {
            minimum_pages: ty.minimum(),
            maximum_pages: ty.maximum(),
            page_size_log2: ty.page_size_log2(),
            memory64: ty.is_64(),
        };
        // The hard cap and the configured limit are enforced here, before any allocation.
        let plan = MemoryPlan::new(&plan_type, &self.inner.limits)?;
        let initial = plan.initial_usize()?;
        let capacity = plan.capacity_usize()?;
        // A zero-capacity memory still gets a real (one page) allocation: the base pointer of a
        // linear memory must be non-null and unique.
        let allocate = capacity.max(1);
        // The tenant's home device (it must be served), or the default for no tenant.
        let tenant = match (creation, &self.inner.tenant) {
            (Some(creation), _) => Some(creation.store.tenant()),
            (None, Some((tenant, _))) => Some(tenant),
            (None, None) => None,
        };
        let slot = match tenant {
            Some(tenant) => self
                .inner
                .devices
                .iter()
                .position(|d| *d == tenant.device())
                .ok_or_else(|| TwmError::DeviceNotServed {
                    tenant_name: tenant.name().to_string(),
                    device: tenant.device(),
                })?,
            None => 0,
        };
        let device = self.inner.devices[slot];
        let pool = self.inner.pools.get(slot);
        let held = match pool {
            Some(pool) => pool.slot_size_for(allocate).unwrap_or(allocate),
            None => allocate,
        } as u64;
        let charges = match (&creation, &self.inner.tenant) {
            // The Store's limiter charged the touched bytes; the memory adds its count and what
            // it holds, and in `Capacity` mode its capacity.
            (Some(creation), _) => {
                let tenant = creation.store.tenant();
                let touched = match creation.store.mode() {
                    ChargeMode::Capacity => Some(Mutex::new(
                        tenant.reserve_for(plan.capacity_bytes(), Purpose::LinearMemory)?,
                    )),
                    ChargeMode::Touched => None,
                };
                MemoryCharges {
                    _memory: Some(tenant.charge_memory(held)?),
                    touched,
                    _store: Some(Arc::clone(&creation.store)),
                }
            }
            // A creator bound to one tenant charges everything here.
            (None, Some((tenant, mode))) => {
                let bytes = match mode {
                    ChargeMode::Touched => plan.initial_bytes(),
                    ChargeMode::Capacity => plan.capacity_bytes(),
                };
                let touched = tenant.reserve_for(bytes, Purpose::LinearMemory)?;
                MemoryCharges {
                    _memory: Some(tenant.charge_memory(held)?),
                    touched: Some(Mutex::new(touched)),
                    _store: None,
                }
            }
            (None, None) => MemoryCharges::default(),
        };
        let level = self
            .inner
            .tenant
            .as_ref()
            .map_or("unbound", |(t, _)| t.context().isolation().name());
        let _span = tracing::debug_span!(
            "twm.memory.create",
            backing = backing.name(),
            isolation = level,
            device = device.0,
            initial,
            capacity,
            held
        )
        .entered();
        let backend = Arc::clone(&self.inner.backend);
        let reserved = reserved.unwrap_or(0);
        let buffer = match (pool, backing) {
            (Some(CreatorPool::Managed(pool)), _) => MemoryBacking::Managed(
                pool.acquire(allocate, initial)
                    .map_err(TwmError::from_core)?,
            ),
            (Some(CreatorPool::Guarded(pool)), _) => {
                MemoryBacking::Guarded(pool.acquire(allocate, initial, reserved, guard)?)
            }
            (None, Backing::Managed) => MemoryBacking::Managed(
                UnifiedBuffer::new(backend, device, allocate, initial)
                    .map_err(TwmError::from_core)?,
            ),
            (None, Backing::Guarded(access)) => MemoryBacking::Guarded(GuardedRegion::new(
                backend, device, access, allocate, initial, reserved, guard,
            )?),
        };
        let base = buffer.as_ptr() as usize;
        let shared = Arc::new(MemoryShared {
            buffer: RwLock::new(buffer),
            device,
            charges,
        });
        self.inner.registry().insert(base, Arc::clone(&shared));
        self.inner.created.fetch_add(1, Ordering::AcqRel);
        Ok(TensorWasmLinearMemory {
            creator: Arc::clone(&self.inner),
            shared,
            base,
            len: initial,
            capacity,
        })
    }
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
        // The Store's limiter approved this memory just before, on this thread.
        let creation = tenancy::take_creation(minimum);
        match self.create(&ty, reserved_size_in_bytes, guard_size_in_bytes, &creation) {
            Ok(memory) => Ok(Box::new(memory)),
            Err(e) => {
                if let Some(creation) = &creation {
                    // Wasmtime tells the limiter nothing of a creator's refusal: the touched
                    // bytes it charged go back here, and a denial is kept for `instantiate`.
                    creation.store.refund_touched(creation.touched);
                    if let TwmError::Denied { denied, .. } = &e {
                        creation.store.record_refusal(*denied);
                    }
                }
                Err(self.refuse(e))
            }
        }
    }
}

/// One Wasm linear memory on managed memory: a fixed capacity, a growing visible size, a base
/// that never moves. Unregisters itself and frees (or returns its pool slot) on drop.
pub struct TensorWasmLinearMemory<B: Backend> {
    creator: Arc<CreatorInner<B>>,
    shared: Arc<MemoryShared<B>>,
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
        self.shared
            .buffer
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .capabilities()
            .is_uvm()
    }

    fn grow(&mut self, new_size: usize) -> Result<(), TwmError> {
        if new_size > self.capacity {
            return Err(TwmError::CapacityExceeded {
                requested: new_size,
                capacity: self.capacity,
            });
        }
        // A growth, not a creation: any announcement of one on this thread is stale.
        tenancy::forget_creation();
        let extra = new_size.saturating_sub(self.len) as u64;
        // A creator bound to a tenant charges growth here (a Store's limiter charged it before).
        let charged = match (&self.shared.charges.touched, &self.creator.tenant) {
            (Some(touched), Some((tenant, ChargeMode::Touched))) if extra > 0 => {
                touched
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .try_grow(extra)
                    .map_err(|denied| tenant.denied(denied))?;
                extra
            }
            _ => 0,
        };
        let grown = self
            .shared
            .buffer
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .grow_to(new_size);
        if let Err(e) = grown {
            if let Some(touched) = &self.shared.charges.touched {
                let mut touched = touched.lock().unwrap_or_else(PoisonError::into_inner);
                let keep = touched.bytes() - charged;
                touched.shrink_to(keep);
            }
            return Err(e);
        }
        self.len = self.len.max(new_size);
        Ok(())
    }
}

// SAFETY: `as_ptr` is the base of a live allocation (or pool slot) of at least `capacity` bytes,
// owned by this memory until it drops, and it never changes: growth only bumps `len` up to
// `capacity`, zeroing newly visible bytes where the backend does not hand out zeroed memory.
// `byte_size` bytes from the base are always readable and writable from the host.
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
        self.creator.registry().remove(&self.base);
        self.creator.dropped.fetch_add(1, Ordering::AcqRel);
        // The buffer is freed (or its slot returned) when the last `Arc` to it drops: here,
        // or at the end of a host call that is using it right now. Its charges go back after
        // it (`MemoryShared`'s field order).
    }
}
