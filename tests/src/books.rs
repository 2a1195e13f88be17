//! The tenant's books through Wasmtime, on every backend: a release the driver refuses keeps
//! its charge until the memory is really gone (issue 29, finding 2).

use std::sync::Arc;

use tensor_wasm_mem_core::{
    DeviceId, ErrorKind, HostAccess, HostMemory, IsolationLevel, ManagedAllocator, Operation,
    PoolConfig, SizeClass,
};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Memory, Module, Store};
use tensor_wasm_mem_wasmtime::{
    AccessRange, Backing, ChargeMode, DeviceAccess, Tenant, TenantStore, TensorWasmMemoryCreator,
    TwmError, instantiate, new_store,
};

use crate::Harness;
use crate::runner::skip;

const PAGE: u64 = 1 << 16;
const MEMORY: &str = r#"(module (memory (export "memory") 4 4)
  (func (export "touch") (i32.store (i32.const 196600) (i32.const 7))))"#;

type Data<H> = TenantStore<<H as Harness>::Backend>;

/// A creator of `backing` on `backend`, its engine and module, and a tenant.
struct Rig<H: Harness> {
    creator: TensorWasmMemoryCreator<H::Backend>,
    linker: Linker<Data<H>>,
    module: Module,
    tenant: Arc<Tenant>,
}

impl<H: Harness> Rig<H> {
    fn new(backend: &Arc<H::Backend>, backing: Backing) -> Self {
        let builder = TensorWasmMemoryCreator::builder(Arc::clone(backend)).backing(backing);
        // SAFETY: nothing but the creator's backend uses the devices' primary contexts here.
        Self::with(unsafe { builder.recover_automatically() }.build())
    }

    /// A rig of pooled managed memory (two 4-page slots) whose creator recovers a device on its
    /// own.
    fn pooled(backend: &Arc<H::Backend>) -> Self {
        let builder = TensorWasmMemoryCreator::builder(Arc::clone(backend))
            .backing(Backing::Managed)
            .pool(PoolConfig::new(
                DeviceId(0),
                [SizeClass::new(4 * PAGE as usize, 2)],
            ));
        // SAFETY: nothing but the creator's backend uses the devices' primary contexts here.
        Self::with(unsafe { builder.recover_automatically() }.build())
    }

    /// A rig of managed memory whose creator recovers a device only when asked.
    fn manual(backend: &Arc<H::Backend>) -> Self {
        Self::with(
            TensorWasmMemoryCreator::builder(Arc::clone(backend))
                .backing(Backing::Managed)
                .build(),
        )
    }

    fn with(creator: Result<TensorWasmMemoryCreator<H::Backend>, TwmError>) -> Self {
        let creator = creator.expect("creator");
        let engine = creator.engine().expect("engine");
        let module = Module::new(&engine, MEMORY).expect("module");
        let tenant = Tenant::new(1, "books", 64 * PAGE, IsolationLevel::StreamIsolated);
        Self {
            linker: Linker::new(&engine),
            creator,
            module,
            tenant,
        }
    }

    /// A Store of the tenant with one live, touched memory of 4 pages.
    fn store(&self) -> Store<Data<H>> {
        self.store_and_memory().0
    }

    /// [`store`](Self::store), and its memory.
    fn store_and_memory(&self) -> (Store<Data<H>>, Memory) {
        let engine = self.module.engine();
        let data = TenantStore::new(&self.creator, &self.tenant, ChargeMode::Touched, ());
        let mut store = new_store(engine, data);
        let instance = instantiate(&mut store, &self.linker, &self.module).expect("instance");
        let touch = instance
            .get_typed_func::<(), ()>(&mut store, "touch")
            .expect("touch");
        touch.call(&mut store, ()).expect("touch");
        let memory = instance.get_memory(&mut store, "memory").expect("memory");
        (store, memory)
    }

    /// The tenant's touched and held bytes and live memories.
    fn charged(&self) -> (u64, u64, u64) {
        let s = self.tenant.stats();
        (s.touched_bytes, s.held_bytes, s.live_memories)
    }

    /// What `kept` memories of 4 pages charge.
    fn charge_of(kept: u64) -> (u64, u64, u64) {
        (4 * PAGE * kept, 4 * PAGE * kept, kept)
    }
}

/// Frees the driver refuses (ten, over four memories): each memory is kept by its creator with
/// its whole charge while the driver holds it, and both go back when a later try frees it.
pub fn a_refused_free_keeps_its_charge<H: Harness>() {
    let backend = H::backend();
    let rig = Rig::<H>::new(&backend, Backing::Managed);
    let stores: Vec<_> = (0..4).map(|_| rig.store()).collect();
    assert_eq!(rig.charged(), Rig::<H>::charge_of(4));
    for n in 1..=10 {
        if !H::faults(&backend).is_some_and(|f| f.fail_nth(Operation::Free, n)) {
            drop(stores);
            return skip("no fault injection");
        }
    }
    drop(stores);
    let held = |kept| {
        if let Some(live) = H::counters(&backend).map(|c| c.live_allocations()) {
            assert_eq!(live, kept, "the driver holds what is kept");
        }
        assert_eq!(rig.creator.stats().kept_memories, kept);
        assert_eq!(
            rig.charged(),
            Rig::<H>::charge_of(kept),
            "charged while held"
        );
    };
    held(4);
    // Four more refusals, then two, then none.
    assert_eq!(rig.creator.retry_releases(), 4);
    held(4);
    assert_eq!(rig.creator.retry_releases(), 2);
    held(2);
    assert_eq!(rig.creator.retry_releases(), 0);
    held(0);
    assert_eq!(rig.creator.stats().kept_released, 4);
}

/// Faults the work of `store`'s tenant through a device-access scope over `memory` (its
/// stream-isolated stream, in the primary context): the scope's close reports it, typed, and the
/// device is fenced. `false` where the harness cannot launch a kernel.
fn fault_in<H: Harness>(
    backend: &Arc<H::Backend>,
    rig: &Rig<H>,
    store: &mut Store<Data<H>>,
    memory: &Memory,
) -> bool {
    let scope = DeviceAccess::open(
        &mut *store,
        &rig.creator,
        memory,
        &[AccessRange::read_write(0, 64)],
    )
    .expect("scope");
    if H::kernels(backend)
        .map(|k| k.fault(scope.stream()))
        .is_none()
    {
        drop(scope);
        return false;
    }
    let closed = scope.close().expect_err("the stray kernel faults");
    assert_eq!(closed.kind(), ErrorKind::ContextLost, "{closed}");
    assert!(backend.device_fenced(DeviceId(0)), "fenced");
    true
}

/// A kernel faults in the tenant's stream-isolated work (the primary context is lost): the
/// Store's memory cannot be freed in the lost context, so it is kept with its charge; when the
/// Store goes, nothing of the layer is left in the context and the device recovers on its own
/// (its primary context reset): the kept memory's free then succeeds, its charge goes back, every
/// driver counter is back to nothing, and the next Store works.
pub fn recover_gives_a_faulted_stores_charge_back<H: Harness>() {
    let backend = H::backend();
    let rig = Rig::<H>::new(&backend, Backing::Managed);
    let (mut store, memory) = rig.store_and_memory();
    if !fault_in(&backend, &rig, &mut store, &memory) {
        return skip("no simulated kernel");
    }
    assert_eq!(rig.charged(), Rig::<H>::charge_of(1), "charged while held");
    drop(store);
    assert!(
        !backend.device_fenced(DeviceId(0)),
        "recovered when its last user went"
    );
    let stats = rig.creator.stats();
    assert_eq!((stats.kept_memories, stats.recoveries), (0, 1));
    assert_eq!(stats.devices[0].health.recoveries, 1);
    assert_eq!(
        rig.charged(),
        Rig::<H>::charge_of(0),
        "the charge went back"
    );
    if let Some(live) = H::counters(&backend).map(|c| c.live_allocations()) {
        assert_eq!(live, 0, "the driver holds nothing");
    }
    if let Some(live) = H::counters(&backend).map(|c| c.live_streams()) {
        assert_eq!(live, 0, "no stream left");
    }
    let _again = rig.store();
    assert_eq!(
        rig.charged(),
        Rig::<H>::charge_of(1),
        "the next Store is served"
    );
    assert_eq!(
        // SAFETY: nothing but the creator's backend uses the device's primary context here.
        unsafe { rig.creator.recover(DeviceId(0)) }.expect("healthy"),
        None
    );
}

/// A Store the embedder keeps across a fault holds the device fenced (a recovery says what is
/// still in use, typed), its scopes are refused, and its charge stays; once it goes, the device
/// recovers and every tenant's books are back to what the survivors hold.
pub fn recover_waits_for_a_store_the_embedder_keeps<H: Harness>() {
    let backend = H::backend();
    let rig = Rig::<H>::new(&backend, Backing::Managed);
    let (mut faulty, faulty_memory) = rig.store_and_memory();
    let (mut kept, kept_memory) = rig.store_and_memory();
    if !fault_in(&backend, &rig, &mut faulty, &faulty_memory) {
        return skip("no simulated kernel");
    }
    drop(faulty);
    assert!(
        backend.device_fenced(DeviceId(0)),
        "the kept Store holds it"
    );
    // SAFETY: nothing but the creator's backend uses the device's primary context here.
    let waiting = unsafe { rig.creator.recover(DeviceId(0)) }.expect_err("still in use");
    assert_eq!(waiting.kind(), ErrorKind::ContextLost, "{waiting}");
    assert!(waiting.to_string().contains("in use"), "{waiting}");
    let refused = DeviceAccess::open(
        &mut kept,
        &rig.creator,
        &kept_memory,
        &[AccessRange::read(0, 64)],
    )
    .map(|_| ())
    .expect_err("the kept Store's device state is lost");
    assert_eq!(refused.kind(), ErrorKind::ContextLost, "{refused}");
    assert_eq!(
        rig.charged(),
        Rig::<H>::charge_of(2),
        "both charged while held"
    );
    drop(kept);
    assert!(
        !backend.device_fenced(DeviceId(0)),
        "recovered when the kept Store went"
    );
    assert_eq!(rig.charged(), Rig::<H>::charge_of(0));
    if let Some(live) = H::counters(&backend).map(|c| c.live_allocations()) {
        assert_eq!(live, 0);
    }
    let _next = rig.store();
    assert_eq!(rig.charged(), Rig::<H>::charge_of(1));
}

/// A device recovered by another creator on the same backend: this creator's memories kept
/// since the fault (their frees refused in the lost context) are released on its next call,
/// and their charges go back; they do not wait for this creator's own recovery, which never
/// comes (the device is healthy again).
pub fn recover_by_another_creator_gives_this_creators_charges_back<H: Harness>() {
    let backend = H::backend();
    let this = Rig::<H>::manual(&backend);
    let other = Rig::<H>::manual(&backend);
    let (mut store, memory) = this.store_and_memory();
    if !fault_in(&backend, &this, &mut store, &memory) {
        return skip("no simulated kernel");
    }
    drop(store);
    assert_eq!(
        this.creator.stats().kept_memories,
        1,
        "kept in the lost context"
    );
    assert_eq!(this.charged(), Rig::<H>::charge_of(1), "charged while held");
    // SAFETY: nothing but the creators' backend uses the device's primary context here.
    let recovery = unsafe { other.creator.recover(DeviceId(0)) }.expect("recovered");
    assert!(recovery.is_some(), "the other creator reset the device");
    // Asked to recover a device another creator recovered: nothing to reset, but this
    // creator catches up with it.
    // SAFETY: as above.
    let again = unsafe { this.creator.recover(DeviceId(0)) }.expect("healthy");
    assert_eq!(again, None);
    assert_eq!(this.creator.stats().kept_memories, 0, "released");
    assert_eq!(
        this.charged(),
        Rig::<H>::charge_of(0),
        "its charge went back"
    );
    let _next = this.store();
    assert_eq!(
        this.charged(),
        Rig::<H>::charge_of(1),
        "the next Store is served"
    );
    if let Some(live) = H::counters(&backend).map(|c| c.live_allocations()) {
        assert_eq!(live, 1, "the driver holds the next Store's memory only");
    }
}

/// A pooled creator's device recovers while the creator lives: on the fenced device the pool
/// hands out no slot (typed), and lets its slab go when its last slot comes back, so the
/// device recovers when the faulted Store goes; the next Store gets a slot carved from a new
/// slab, scrubbed, and every charge and driver counter is back to what the survivors hold.
pub fn recover_a_pooled_creator_while_it_lives<H: Harness>() {
    let backend = H::backend();
    let rig = Rig::<H>::pooled(&backend);
    let pool = Arc::clone(rig.creator.pool().expect("pooled"));
    let (mut store, memory) = rig.store_and_memory();
    if !fault_in(&backend, &rig, &mut store, &memory) {
        return skip("no simulated kernel");
    }
    let refused = pool
        .acquire(4 * PAGE as usize, PAGE as usize)
        .map(|_| ())
        .expect_err("no slot on a fenced device");
    assert_eq!(refused.kind(), ErrorKind::ContextLost, "{refused}");
    assert_eq!(rig.charged(), Rig::<H>::charge_of(1), "charged while held");
    drop(store);
    assert!(
        !backend.device_fenced(DeviceId(0)),
        "recovered when the faulted Store went, the pooled creator alive"
    );
    assert!(pool.with_slab(|_| ()).is_none(), "the old slab is gone");
    assert_eq!(rig.creator.stats().recoveries, 1);
    assert_eq!(
        rig.charged(),
        Rig::<H>::charge_of(0),
        "the charge went back"
    );
    if let Some(live) = H::counters(&backend).map(|c| c.live_allocations()) {
        assert_eq!(
            live, 0,
            "the reset destroyed the slab; nothing waits for it"
        );
    }
    if let Some(lost) = H::counters(&backend).map(|c| c.lost_allocations()) {
        assert_eq!(lost, 0, "no lost record of the forgotten slab");
    }
    let _next = rig.store();
    assert_eq!(
        rig.charged(),
        Rig::<H>::charge_of(1),
        "the next Store is served"
    );
    assert!(pool.with_slab(|_| ()).is_some(), "a new slab");
    if let Some(live) = H::counters(&backend).map(|c| c.live_allocations()) {
        assert_eq!(live, 1, "the new slab");
    }
}

/// A memory kept busy (its Store's stream could not be released, so work queued there might
/// still run) on a device a kernel fault then fences: that work was in the lost primary
/// context and never runs, so the memory is given up to the recovery instead of keeping the
/// device fenced while the creator lives; its charge goes back with the reset. Here the
/// creator recovers when asked.
pub fn recover_releases_a_busy_memory_whose_work_died<H: Harness>() {
    let backend = H::backend();
    busy_memory_through_a_fault(&backend, &Rig::<H>::manual(&backend), 2);
}

/// As [`recover_releases_a_busy_memory_whose_work_died`], where the creator recovers on its
/// own: its first try (when the faulting scope closes) already gives the busy memory up, so
/// only the live Store's memory is left to wait for.
pub fn recover_releases_a_busy_memory_at_its_first_try<H: Harness>() {
    let backend = H::backend();
    busy_memory_through_a_fault(&backend, &Rig::<H>::new(&backend, Backing::Managed), 1);
}

/// Keeps a memory busy, faults the device through another Store, checks that the recovery's
/// blockers are `blocking` memories, then drops the Store and recovers: every charge back.
fn busy_memory_through_a_fault<H: Harness>(backend: &Arc<H::Backend>, rig: &Rig<H>, blocking: u64) {
    let (mut busy, busy_memory) = rig.store_and_memory();
    // Its guest stream is made (a scope borrows it): the one whose waits are refused below.
    DeviceAccess::open(
        &mut busy,
        &rig.creator,
        &busy_memory,
        &[AccessRange::read(0, 64)],
    )
    .expect("scope")
    .close()
    .expect("close");
    // Every wait at the Store's end refused (three tries, then the release's own): its work
    // may still run. (A refused destroy after a wait that was done gives the memory back.)
    if !H::faults(backend).is_some_and(|f| (1..=4).all(|n| f.fail_nth(Operation::Synchronize, n))) {
        drop(busy);
        return skip("no fault injection");
    }
    drop(busy);
    assert_eq!(rig.creator.stats().kept_memories, 1, "kept busy");
    let (mut store, memory) = rig.store_and_memory();
    if !fault_in(backend, rig, &mut store, &memory) {
        return skip("no simulated kernel");
    }
    let blockers = rig.creator.recovery_blockers(DeviceId(0));
    assert_eq!(
        blockers.iter().map(|b| b.memories).sum::<u64>(),
        blocking,
        "the live Store's memory is listed, and the busy one until a recovery is tried"
    );
    drop(store);
    // SAFETY: nothing but the creator's backend uses the device's primary context here.
    let _ = unsafe { rig.creator.recover(DeviceId(0)) };
    assert!(
        !backend.device_fenced(DeviceId(0)),
        "recovered: the busy memory's work died with the context"
    );
    assert_eq!(rig.creator.stats().kept_memories, 0);
    assert_eq!(
        rig.charged(),
        Rig::<H>::charge_of(0),
        "every charge went back"
    );
}

/// Unregistrations the driver refuses (registered guarded memory): the region is kept with its
/// charge, its pages mapped and registered, until a later try unregisters them.
pub fn a_refused_unregister_keeps_its_charge<H: Harness>() {
    let backend = H::backend();
    if !backend.can_attach_host(DeviceId(0), HostAccess::Registered) {
        return skip("no host registration");
    }
    let rig = Rig::<H>::new(&backend, Backing::Guarded(HostAccess::Registered));
    let store = rig.store();
    if !(H::faults(&backend).is_some_and(|f| f.fail_nth(Operation::DetachHost, 1))
        && H::faults(&backend).is_some_and(|f| f.fail_nth(Operation::DetachHost, 2)))
    {
        drop(store);
        return skip("no fault injection");
    }
    drop(store);
    assert_eq!(rig.creator.stats().kept_memories, 1);
    assert_eq!(
        rig.charged(),
        Rig::<H>::charge_of(1),
        "charged while pinned"
    );
    assert_eq!(rig.creator.retry_releases(), 1, "refused again");
    assert_eq!(rig.charged(), Rig::<H>::charge_of(1));
    assert_eq!(rig.creator.retry_releases(), 0);
    assert_eq!(rig.charged(), Rig::<H>::charge_of(0));
    assert_eq!(rig.creator.stats().kept_released, 1);
}
