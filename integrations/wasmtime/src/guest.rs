//! What a guest can ask of the host: the `twm` host functions, and the per-Store state behind
//! them.
//!
//! # The guest ABI (module `twm`)
//!
//! ```wat
//! (import "twm" "advise"   (func (param i32 i32 i32 i32) (result i32))) ;; ptr len advice location
//! (import "twm" "prefetch" (func (param i32 i32 i32) (result i32)))     ;; ptr len location
//! ```
//!
//! `ptr` and `len` are unsigned 32-bit; the range is checked against the current size of the
//! guest's exported memory named `memory`. `location`: `-1` is the host, `n >= 0` is device `n`.
//! `advice`: the codes of [`Advice::guest_code`] (0 set_read_mostly, 1 unset_read_mostly,
//! 2 set_preferred_location, 3 unset_preferred_location, 4 set_accessed_by, 5 unset_accessed_by).
//!
//! | result | constant | meaning |
//! |---|---|---|
//! | `0` | [`TWM_OK`] | done |
//! | `-1` | [`TWM_ERR_OUT_OF_RANGE`] | the range ends past the memory's current size |
//! | `-2` | [`TWM_ERR_OVERFLOW`] | `ptr + len` wraps the 32-bit address space |
//! | `-3` | [`TWM_ERR_UNKNOWN_ADVICE`] | no such advice code |
//! | `-4` | [`TWM_ERR_UNKNOWN_DEVICE`] | a location below `-1`, a device that does not exist, one the tenant is not bound to ([`Tenant::devices`]), or an `accessed_by` device with no peer access to the memory's device |
//! | `-5` | [`TWM_ERR_BACKEND`] | the backend (driver) failed |
//! | `-6` | [`TWM_ERR_NOT_DEVICE_MEMORY`] | no exported `memory`, or one that is not device-visible |
//! | `-7` | [`TWM_ERR_UNSUPPORTED`] | the memory's backing or device cannot do this (advice on pinned host memory, the guarded registered backing; a prefetch to a device without concurrent managed access) |
//!
//! A bad call never traps and never touches memory outside the guest's.
//!
//! A good range is widened to whole 64 KiB blocks within the memory
//! ([`HINT_GRANULARITY`](crate::HINT_GRANULARITY)) before it reaches the driver: hints apply to
//! whole blocks, as a CUDA driver migrates managed pages in blocks, so a guest that advises
//! every other byte of a memory of `n` blocks leaves the driver at most `n` ranges per kind of
//! advice (and costs a constant per call, not one growing with its advice's fragmentation).

use std::fmt;
use std::sync::{Arc, PoisonError};

use tensor_wasm_mem_core::{
    Advice, BackendError, DeviceId, ErrorKind, IsolationLevel, Location, ManagedAllocator,
    StreamKey, StreamLease, TenantKey,
};
use wasmtime::{Caller, Extern, Linker};

use crate::Backend;
use crate::books::StoreBooks;
use crate::error::TwmError;
use crate::kernels::KernelCounters;
use crate::memory::{MemoryView, TensorWasmMemoryCreator};
use crate::tenancy::{ChargeMode, HasTenantLimiter, Tenant, TenantLimiter};

/// Success.
pub const TWM_OK: i32 = 0;
/// The range ends past the memory's current size.
pub const TWM_ERR_OUT_OF_RANGE: i32 = -1;
/// `ptr + len` wraps the 32-bit address space.
pub const TWM_ERR_OVERFLOW: i32 = -2;
/// Unknown advice code.
pub const TWM_ERR_UNKNOWN_ADVICE: i32 = -3;
/// Unknown location or device.
pub const TWM_ERR_UNKNOWN_DEVICE: i32 = -4;
/// The backend failed.
pub const TWM_ERR_BACKEND: i32 = -5;
/// No exported `memory`, or a memory that is not device-visible.
pub const TWM_ERR_NOT_DEVICE_MEMORY: i32 = -6;
/// The memory's backing or device cannot do this (advice on registered host memory).
pub const TWM_ERR_UNSUPPORTED: i32 = -7;

/// The per-Store state the `twm` host functions need: the creator (to resolve guest memory), the
/// tenant, and the instance's stream (acquired at the tenant's isolation level on first use,
/// released when the Store drops).
pub struct GuestContext<B: Backend> {
    creator: TensorWasmMemoryCreator<B>,
    tenant: TenantKey,
    isolation: IsolationLevel,
    /// The tenant's devices, its home first (where the stream is made).
    devices: Vec<DeviceId>,
    stream: Option<StreamLease<Arc<B>>>,
    /// The Store's books, which its memories keep: the stream is recorded there while it
    /// lives, so a memory that goes first waits for it.
    store: Option<Arc<StoreBooks>>,
    /// The tenant's launch figures (shared by all its Stores).
    kernels: Arc<KernelCounters>,
    /// Launches of this Store whose wait the driver kept refusing: their kernels may still run,
    /// so each keeps its place in the tenant's launches in flight until the Store's stream is
    /// waited for (or its work is lost with its context) when the Store goes; never, where
    /// that wait is refused too (its memories are kept for good then as well).
    launches_may_run: u32,
    /// The device an open device-access scope over the Store holds device work on
    /// ([`ManagedAllocator::begin_device_work`]), so no recovery resets that device's primary
    /// context under the kernels the embedder launches in the scope: at most one per Store,
    /// ended when the scope closes, or, for a scope forgotten with `mem::forget`, when the
    /// Store goes (so a forgotten scope keeps the device fenced no longer than a live Store
    /// does).
    scope_work: std::sync::Mutex<Option<DeviceId>>,
    calls: u64,
    failed_calls: u64,
}

impl<B: Backend> fmt::Debug for GuestContext<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestContext")
            .field("tenant", &self.tenant)
            .field("isolation", &self.isolation)
            .field("stream", &self.stream.as_ref().map(|s| s.stream().raw()))
            .field("calls", &self.calls)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> GuestContext<B> {
    /// State for a guest of `tenant` using memories from `creator`.
    pub fn new(creator: TensorWasmMemoryCreator<B>, tenant: &Tenant) -> Self {
        Self {
            creator,
            tenant: tenant.ledger().key(),
            isolation: tenant.ledger().isolation(),
            devices: tenant.devices().to_vec(),
            stream: None,
            store: None,
            kernels: Arc::clone(tenant.kernel_counters()),
            launches_may_run: 0,
            scope_work: std::sync::Mutex::new(None),
            calls: 0,
            failed_calls: 0,
        }
    }

    /// State for guests of `limiter`'s tenant, tied to the limiter's Store: the Store's
    /// memories wait for this context's stream before they go, whichever of the two Wasmtime
    /// drops first (`Store::into_data` drops the memories before the data). What
    /// [`TenantStore`] uses; custom Store data holding both should make its context this way.
    pub fn for_limiter(creator: TensorWasmMemoryCreator<B>, limiter: &TenantLimiter) -> Self {
        let mut guest = Self::new(creator, limiter.tenant());
        guest.store = Some(Arc::clone(limiter.books()));
        guest
    }

    /// The creator.
    #[must_use]
    pub fn creator(&self) -> &TensorWasmMemoryCreator<B> {
        &self.creator
    }

    /// The tenant's launch figures.
    pub(crate) fn kernel_counters(&self) -> &Arc<KernelCounters> {
        &self.kernels
    }

    /// Host calls made, and how many of them returned an error code.
    #[must_use]
    pub fn calls(&self) -> (u64, u64) {
        (self.calls, self.failed_calls)
    }

    /// The Store's books, when made with [`for_limiter`](Self::for_limiter).
    pub(crate) fn books(&self) -> Option<&Arc<StoreBooks>> {
        self.store.as_ref()
    }

    /// The tenant's home device (where its memories and its stream are).
    #[must_use]
    pub fn device(&self) -> DeviceId {
        self.devices[0]
    }

    /// The instance's stream, acquired on first use at the tenant's isolation level, on the
    /// tenant's home device (where its memories are).
    pub fn stream(&mut self) -> Result<&StreamLease<Arc<B>>, B::Error> {
        if self.stream.is_none() {
            let lease = StreamLease::acquire_on(
                Arc::clone(self.creator.backend()),
                self.tenant,
                self.isolation,
                self.device(),
            )?;
            if let Some(store) = &self.store {
                store.add_stream(lease.stream().key());
            }
            self.stream = Some(lease);
        }
        // Set just above when it was empty.
        Ok(self.stream.as_ref().unwrap_or_else(|| unreachable!()))
    }

    /// The instance's stream, acquired as [`stream`](Self::stream) does, and this context, for
    /// a device-access scope's life.
    pub(crate) fn scope_parts(
        &mut self,
    ) -> Result<(&tensor_wasm_mem_core::Stream, &Self), B::Error> {
        self.stream()?;
        let lease = self.stream.as_ref().unwrap_or_else(|| unreachable!());
        Ok((lease.stream(), self))
    }

    /// Begins a device-access scope's device work on `device`. Already begun there by a
    /// forgotten scope of this Store: kept, but a fenced device refuses the new scope all the
    /// same. Refused, typed ([`ErrorKind::ContextLost`]), on a fenced device.
    pub(crate) fn begin_scope_work(&self, device: DeviceId) -> Result<(), TwmError> {
        let mut held = self
            .scope_work
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *held == Some(device) {
            // The gate's own check, typed as any other refusal; the work stays counted once.
            self.creator.begin_device_work(device)?;
            self.creator.backend().end_device_work(device);
            return Ok(());
        }
        if let Some(d) = held.take() {
            self.creator.end_device_work(d);
        }
        self.creator.begin_device_work(device)?;
        *held = Some(device);
        Ok(())
    }
}

/// Ends a device-access scope's device work when dropped (a panicking wait included): the
/// guest context's two fields it needs, so the context's other fields stay free to use.
pub(crate) struct EndScopeWork<'a, B: Backend> {
    held: &'a std::sync::Mutex<Option<DeviceId>>,
    creator: &'a TensorWasmMemoryCreator<B>,
}

impl<'a, B: Backend> EndScopeWork<'a, B> {
    pub(crate) fn of(guest: &'a GuestContext<B>) -> Self {
        Self {
            held: &guest.scope_work,
            creator: &guest.creator,
        }
    }
}

impl<B: Backend> Drop for EndScopeWork<'_, B> {
    fn drop(&mut self) {
        let held = self
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(device) = held {
            self.creator.end_device_work(device);
        }
    }
}

impl<B: Backend> Drop for GuestContext<B> {
    /// Waits for the stream's work (a refusal that may pass is tried again), then releases it.
    /// Released, or waited for and then refused its destroy (the backend keeps counting the
    /// handle), it leaves the Store's list and the memories go back; a wait the backend keeps
    /// refusing leaves work that may still run, and the Store's memories are then kept rather
    /// than given back (`docs/SAFETY.md`, teardown).
    fn drop(&mut self) {
        // A scope forgotten over this Store held device work: it ends with the Store, once the
        // stream (its kernels included) was waited for.
        // (Its fields, not the context: the stream is taken meanwhile.)
        let _end = EndScopeWork {
            held: &self.scope_work,
            creator: &self.creator,
        };
        let Some(lease) = self.stream.take() else {
            return;
        };
        let id = lease.stream().key();
        // The work first, apart from the destroy: once it is waited for, nothing queued on the
        // stream can touch the Store's memories, whatever the destroy then answers.
        // (A shared tenant's release is itself a wait on the default stream: waited for here
        // first, its refusal that may pass is tried again too.)
        let quiet = crate::lifecycle::wait_for_work(&**lease.provider(), id).is_ok();
        let done = self.release_stream(lease, id, quiet);
        if done {
            // Nothing this Store launched runs any more: the launches whose own wait failed
            // give their places back.
            self.kernels
                .give_back_in_flight(core::mem::take(&mut self.launches_may_run));
        }
    }
}

impl<B: Backend> GuestContext<B> {
    /// Releases the Store's stream (its work waited for first: `quiet`): `true` if nothing
    /// queued there can run any more (released, waited for, or its context lost).
    fn release_stream(&self, lease: StreamLease<Arc<B>>, id: StreamKey, quiet: bool) -> bool {
        match (lease.release(), &self.store) {
            (Ok(()), Some(store)) => {
                store.remove_stream(id);
                true
            }
            (Ok(()), None) => true,
            // Waited for, then a destroy (of the stream, or of the tenant's context after it)
            // refused: the backend keeps counting the handle, but no work of this Store is
            // left, and its memories go back as after a release.
            (Err(e), store) if quiet && e.kind() != ErrorKind::ContextLost => {
                tracing::warn!(error = %e, "twm: destroying a guest stream failed after its work was done: the backend keeps counting it; its Store's memories go back");
                if let Some(store) = store {
                    store.remove_stream(id);
                }
                true
            }
            // Its context is lost to a kernel fault: the work queued there was abandoned and
            // never runs, so nothing can land in the Store's memories any more.
            (Err(e), store) if e.kind() == ErrorKind::ContextLost => {
                if let Some(store) = store {
                    store.remove_stream(id);
                }
                // The device's last user may have been this stream: it recovers now.
                // (Refused while a forgotten scope's work is held: its end, in the Store's
                // drop, tries again.)
                self.creator.recover_when_free(id.device());
                true
            }
            (Err(e), store) => {
                tracing::warn!(error = %e, "twm: releasing a guest stream failed: its Store's memories are kept");
                if let Some(store) = store {
                    store.mark_unsettled();
                }
                false
            }
        }
    }
}

impl<B: Backend> GuestContext<B> {
    /// A launch's wait failed and its kernel may still run: the Store's memories are kept when
    /// it goes ([`work_may_run`](Self::work_may_run)), and the launch keeps its place among the
    /// tenant's launches in flight until the Store's stream is waited for.
    pub(crate) fn launch_may_run(&mut self) {
        self.launches_may_run += 1;
        self.work_may_run();
    }

    /// A wait for the Store's stream failed and its work may still run: the Store's memories are
    /// kept when it goes (busy, never scrubbed for another tenant), as after a release the
    /// driver refused.
    pub(crate) fn work_may_run(&self) {
        tracing::warn!(
            "twm: a wait for a guest's stream failed: its Store's memories will be kept"
        );
        if let Some(store) = &self.store {
            store.mark_unsettled();
        }
    }
}

/// Store data that holds a [`GuestContext`].
pub trait HasGuestContext<B: Backend>: 'static {
    /// The guest context.
    fn guest_context(&mut self) -> &mut GuestContext<B>;
}

/// Ready-made Store data for one tenant's guests: the limiter, the guest context and the
/// embedder's own data `U`.
pub struct TenantStore<B: Backend, U = ()> {
    limiter: TenantLimiter,
    guest: GuestContext<B>,
    /// The embedder's data.
    pub data: U,
}

impl<B: Backend, U: fmt::Debug> fmt::Debug for TenantStore<B, U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantStore")
            .field("limiter", &self.limiter)
            .field("guest", &self.guest)
            .field("data", &self.data)
            .finish()
    }
}

impl<B: Backend, U> TenantStore<B, U> {
    /// State for `tenant`'s guests on `creator`, charged in `mode`.
    pub fn new(
        creator: &TensorWasmMemoryCreator<B>,
        tenant: &Arc<Tenant>,
        mode: ChargeMode,
        data: U,
    ) -> Self {
        let limiter = TenantLimiter::new(Arc::clone(tenant), mode, creator.limits());
        Self::with_limiter(creator, limiter, data)
    }

    /// State for the guests of `limiter`'s tenant on `creator`, with a limiter configured by
    /// the embedder (table and Store limits):
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tensor_wasm_mem_wasmtime::mock::MockBackend;
    /// use tensor_wasm_mem_wasmtime::core::IsolationLevel;
    /// use tensor_wasm_mem_wasmtime::*;
    ///
    /// let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).build()?;
    /// let engine = creator.engine()?;
    /// let tenant = Tenant::new(1, "t1", 1 << 20, IsolationLevel::StreamIsolated);
    /// let limiter = TenantLimiter::new(Arc::clone(&tenant), ChargeMode::Touched, creator.limits())
    ///     .with_max_table_elements(4096);
    /// let mut store = new_store(&engine, TenantStore::with_limiter(&creator, limiter, ()));
    /// let module = wasmtime::Module::new(&engine, "(module (table 5000 funcref))")?;
    /// let linker = wasmtime::Linker::new(&engine);
    /// assert!(instantiate(&mut store, &linker, &module).is_err()); // past 4096 elements
    /// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
    /// ```
    pub fn with_limiter(
        creator: &TensorWasmMemoryCreator<B>,
        limiter: TenantLimiter,
        data: U,
    ) -> Self {
        let guest = GuestContext::for_limiter(creator.clone(), &limiter);
        Self {
            limiter,
            guest,
            data,
        }
    }

    /// The limiter.
    #[must_use]
    pub fn limiter(&self) -> &TenantLimiter {
        &self.limiter
    }

    /// The guest context.
    #[must_use]
    pub fn guest(&self) -> &GuestContext<B> {
        &self.guest
    }
}

impl<B: Backend, U: 'static> HasTenantLimiter for TenantStore<B, U> {
    fn tenant_limiter(&mut self) -> &mut TenantLimiter {
        &mut self.limiter
    }
}

impl<B: Backend, U: 'static> HasGuestContext<B> for TenantStore<B, U> {
    fn guest_context(&mut self) -> &mut GuestContext<B> {
        &mut self.guest
    }
}

pub(crate) fn code_for(error: &TwmError) -> i32 {
    match error {
        TwmError::GuestRange(e) if e.kind() == ErrorKind::Overflow => TWM_ERR_OVERFLOW,
        TwmError::GuestRange(_) => TWM_ERR_OUT_OF_RANGE,
        TwmError::NotOurMemory | TwmError::NotDeviceAccessible | TwmError::NoMemoryExport(_) => {
            TWM_ERR_NOT_DEVICE_MEMORY
        }
        e if e.kind() == ErrorKind::Unsupported => TWM_ERR_UNSUPPORTED,
        e if e.kind() == ErrorKind::ContextLost => crate::kernels::TWM_ERR_DEVICE_LOST,
        _ => TWM_ERR_BACKEND,
    }
}

/// Decodes and checks `ptr`/`len` (unsigned 32-bit) and `location`: the host, or a device the
/// backend has and the tenant is bound to.
fn guest_args<B: Backend>(
    context: &GuestContext<B>,
    ptr: i32,
    len: i32,
    location: i32,
) -> Result<(u64, u64, Location), i32> {
    let (ptr, len) = (u64::from(ptr as u32), u64::from(len as u32));
    if ptr + len > 1 << 32 {
        return Err(TWM_ERR_OVERFLOW);
    }
    let location = Location::from_guest_code(location).ok_or(TWM_ERR_UNKNOWN_DEVICE)?;
    if let Location::Device(d) = location
        && (d.0 >= context.creator.backend().device_count() || !context.devices.contains(&d))
    {
        return Err(TWM_ERR_UNKNOWN_DEVICE);
    }
    Ok((ptr, len, location))
}

pub(crate) fn guest_memory<T>(caller: &mut Caller<'_, T>) -> Result<wasmtime::Memory, i32> {
    match caller.get_export("memory") {
        Some(Extern::Memory(memory)) => Ok(memory),
        _ => Err(TWM_ERR_NOT_DEVICE_MEMORY),
    }
}

fn advise_call<B: Backend, T: HasGuestContext<B>>(
    caller: &mut Caller<'_, T>,
    ptr: i32,
    len: i32,
    advice: i32,
    location: i32,
) -> Result<(), i32> {
    let context = caller.data_mut().guest_context();
    let (offset, len, location) = guest_args(context, ptr, len, location)?;
    let creator = context.creator.clone();
    let advice = Advice::from_guest_code(advice, location).ok_or(TWM_ERR_UNKNOWN_ADVICE)?;
    let memory = guest_memory(caller)?;
    // Mapping the memory for another device of the tenant's set takes peer access from that
    // device to the memory's.
    if let Advice::SetAccessedBy(Location::Device(d))
    | Advice::UnsetAccessedBy(Location::Device(d)) = advice
    {
        let view = MemoryView::of(&*caller, &memory).map_err(|e| code_for(&e))?;
        let home = creator.memory_device(view).map_err(|e| code_for(&e))?;
        if d != home && !creator.backend().can_access_peer(d, home) {
            return Err(TWM_ERR_UNKNOWN_DEVICE);
        }
    }
    creator
        .advise(&*caller, &memory, offset, len, advice)
        .map_err(|e| code_for(&e))
}

fn prefetch_call<B: Backend, T: HasGuestContext<B>>(
    caller: &mut Caller<'_, T>,
    ptr: i32,
    len: i32,
    location: i32,
) -> Result<(), i32> {
    let context = caller.data_mut().guest_context();
    let (offset, len, location) = guest_args(context, ptr, len, location)?;
    let creator = context.creator.clone();
    let memory = guest_memory(caller)?;
    let view = MemoryView::of(&*caller, &memory).map_err(|e| code_for(&e))?;
    // Check the range before acquiring a stream, so a bad call creates nothing.
    creator
        .resolve_at(view, offset, len)
        .map_err(|e| code_for(&e))?;
    let device = creator.memory_device(view).map_err(|e| code_for(&e))?;
    let stream = caller
        .data_mut()
        .guest_context()
        .stream()
        .map_err(|e| code_for(&TwmError::backend(e)))?;
    same_device(device, stream.stream().device()).map_err(|e| code_for(&e))?;
    creator
        .prefetch_at(view, offset, len, location, stream.stream())
        .map_err(|e| code_for(&e))
}

/// Refuses work on a memory of `memory`'s device through a stream of another device
/// ([`TwmError::DeviceMismatch`]): a memory made where its Store named no tenant (the creator's
/// default device) while the guest context's tenant lives elsewhere, which no stream of the
/// tenant orders work on. What a device-access scope, a launch and a prefetch all check.
pub(crate) fn same_device(memory: DeviceId, stream: DeviceId) -> Result<(), TwmError> {
    if memory == stream {
        Ok(())
    } else {
        Err(TwmError::DeviceMismatch { memory, stream })
    }
}

fn finish<B: Backend, T: HasGuestContext<B>>(
    caller: &mut Caller<'_, T>,
    op: &'static str,
    result: Result<(), i32>,
) -> wasmtime::Result<i32> {
    let context = caller.data_mut().guest_context();
    let _span =
        tracing::debug_span!("twm.host", op, isolation = context.isolation.name()).entered();
    context.calls += 1;
    match result {
        Ok(()) => Ok(TWM_OK),
        Err(crate::kernels::TWM_ERR_DEVICE_LOST) => {
            // The tenant's device state is gone: the guest cannot go on, it traps.
            context.failed_calls += 1;
            context
                .kernel_counters()
                .device_lost
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            tracing::warn!(
                op,
                "twm: a guest's device state was lost to a kernel fault: it traps"
            );
            Err(TwmError::DeviceLost { op }.into())
        }
        Err(crate::kernels::WORK_MAY_RUN) => {
            // The guest's kernel may still write its memory: the guest cannot go on over it.
            context.failed_calls += 1;
            Err(TwmError::WorkMayRun { op }.into())
        }
        Err(code) => {
            context.failed_calls += 1;
            tracing::debug!(op, code, "twm: host call refused");
            Ok(code)
        }
    }
}

/// Adds `twm.advise`, `twm.prefetch`, `twm.kernel` and `twm.launch` to `linker` (the last two
/// answer [`TWM_ERR_UNKNOWN_KERNEL`](crate::kernels::TWM_ERR_UNKNOWN_KERNEL) on a creator without
/// kernels; see [`kernels`](crate::kernels)).
pub fn add_to_linker<B: Backend, T: HasGuestContext<B>>(
    linker: &mut Linker<T>,
) -> wasmtime::Result<()> {
    linker.func_wrap(
        "twm",
        "kernel",
        |mut caller: Caller<'_, T>, ptr: i32, len: i32| -> wasmtime::Result<i32> {
            let result = crate::kernels::kernel_call(&mut caller, ptr, len);
            let handle = result.unwrap_or(0);
            Ok(match finish(&mut caller, "kernel", result.map(|_| ()))? {
                TWM_OK => handle,
                code => code,
            })
        },
    )?;
    linker.func_wrap(
        "twm",
        "launch",
        |mut caller: Caller<'_, T>, handle: i32, args: i32, nargs: i32| -> wasmtime::Result<i32> {
            let result = crate::kernels::launch_call(&mut caller, handle, args, nargs);
            finish(&mut caller, "launch", result)
        },
    )?;
    linker.func_wrap(
        "twm",
        "advise",
        |mut caller: Caller<'_, T>,
         ptr: i32,
         len: i32,
         advice: i32,
         location: i32|
         -> wasmtime::Result<i32> {
            let result = advise_call(&mut caller, ptr, len, advice, location);
            finish(&mut caller, "advise", result)
        },
    )?;
    linker.func_wrap(
        "twm",
        "prefetch",
        |mut caller: Caller<'_, T>, ptr: i32, len: i32, location: i32| -> wasmtime::Result<i32> {
            let result = prefetch_call(&mut caller, ptr, len, location);
            finish(&mut caller, "prefetch", result)
        },
    )?;
    Ok(())
}
