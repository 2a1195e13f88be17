//! The tenant's books through Wasmtime, on every backend: a release the driver refuses keeps
//! its charge until the memory is really gone (issue 29, finding 2).

use std::sync::Arc;

use tensor_wasm_mem_core::{DeviceId, HostAccess, HostMemory, IsolationLevel, Operation};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Memory, Module, Store};
use tensor_wasm_mem_wasmtime::{
    AccessRange, Backing, ChargeMode, DeviceAccess, Tenant, TenantStore, TensorWasmMemoryCreator,
    instantiate, new_store,
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
        let creator = TensorWasmMemoryCreator::builder(Arc::clone(backend))
            .backing(backing)
            .build()
            .expect("creator");
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
        if !H::fail_nth(&backend, Operation::Free, n) {
            drop(stores);
            return skip("no fault injection");
        }
    }
    drop(stores);
    let held = |kept| {
        if let Some(live) = H::live_allocations(&backend) {
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

/// A kernel faults in the tenant's stream-isolated work (the primary context is poisoned): every
/// later free there is refused, so the memory stays kept and charged; when its creator goes it
/// is left to the driver and the charge stays with the tenant for good (stranded), never less
/// than what the driver holds.
pub fn a_sticky_fault_keeps_the_charge<H: Harness>() {
    let backend = H::backend();
    let rig = Rig::<H>::new(&backend, Backing::Managed);
    let (mut store, memory) = rig.store_and_memory();
    let scope = DeviceAccess::open(
        &mut store,
        &rig.creator,
        &memory,
        &[AccessRange::read_write(0, 64)],
    )
    .expect("scope");
    if !H::fault(&backend, scope.stream()) {
        drop(scope);
        return skip("no simulated kernel");
    }
    assert!(scope.close().is_err(), "the stray kernel faults");
    drop(store);
    assert_eq!(rig.creator.stats().kept_memories, 1, "kept, not lost");
    assert_eq!(rig.charged(), Rig::<H>::charge_of(1), "charged while held");
    assert_eq!(rig.creator.retry_releases(), 1, "the fault is sticky");
    let tenant = Arc::clone(&rig.tenant);
    drop(rig);
    let stats = tenant.stats();
    assert_eq!(
        (stats.touched_bytes, stats.held_bytes),
        (4 * PAGE, 4 * PAGE),
        "charged for good"
    );
    assert_eq!(stats.stranded_bytes, 4 * PAGE, "its held bytes, stranded");
    if let Some(live) = H::live_allocations(&backend) {
        assert_eq!(live, 1, "the driver still holds the memory");
    }
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
    if !(H::fail_nth(&backend, Operation::DetachHost, 1)
        && H::fail_nth(&backend, Operation::DetachHost, 2))
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
