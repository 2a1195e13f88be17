//! Teardown order on a device whose streams complete work later than the call that queued it
//! (the mock with `deferred_streams`): a tenant's queued GPU work lands before its pool slot is
//! scrubbed for the next tenant, at every isolation level; and the model makes the wrong order
//! visible, so a test fails if teardown ever stops waiting.

mod common;

use std::sync::Arc;

use common::*;
use rstest::rstest;
use tensor_wasm_mem_core::{DeviceId, IsolationLevel, PoolConfig, SizeClass, StreamLease};
use tensor_wasm_mem_mock::{MockBackend, MockConfig};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Memory, Module, Store};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, HasGuestContext, Tenant, TenantStore, TensorWasmMemoryCreator, instantiate,
    new_store,
};

type Data = TenantStore<MockBackend>;

const SHARED: IsolationLevel = IsolationLevel::Shared;
const STREAM: IsolationLevel = IsolationLevel::StreamIsolated;
const CONTEXT: IsolationLevel = IsolationLevel::ContextIsolated;

const GUEST: &str = r#"(module (memory (export "memory") 1 4))"#;

struct Rig {
    backend: Arc<MockBackend>,
    creator: TensorWasmMemoryCreator<MockBackend>,
    module: Module,
    linker: Linker<Data>,
}

/// One pool slot, so every tenant's memory is the previous tenant's slot.
fn rig() -> Rig {
    rig_of(1)
}

/// A pool of `slots` slots, every one of which a tenant may hold.
fn rig_of(slots: usize) -> Rig {
    let backend = Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
        deferred_streams: true,
        ..MockConfig::default()
    }));
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(4 * PAGE, slots)],
        ))
        .slots_per_tenant(slots)
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(&engine, GUEST).unwrap();
    let linker = Linker::new(&engine);
    Rig {
        backend,
        creator,
        module,
        linker,
    }
}

impl Rig {
    fn tenant(&self, id: u64, isolation: IsolationLevel) -> (Store<Data>, Memory) {
        let tenant = Tenant::new(id, format!("t{id}"), 4 * PAGE as u64, isolation);
        self.store_of(&tenant)
    }

    /// A Store of `tenant` (one of several, maybe) with its instance's memory.
    fn store_of(&self, tenant: &Arc<Tenant>) -> (Store<Data>, Memory) {
        let engine = self.module.engine();
        let data = TenantStore::new(&self.creator, tenant, ChargeMode::Touched, ());
        let mut store = new_store(engine, data);
        let instance = instantiate(&mut store, &self.linker, &self.module).unwrap();
        let memory = instance.get_memory(&mut store, "memory").unwrap();
        (store, memory)
    }

    /// A kernel on the tenant's own stream writing `byte` over its whole memory.
    fn queue_fill(&self, store: &mut Store<Data>, memory: &Memory, byte: u8) {
        let slice = self
            .creator
            .resolve(&*store, memory, 0, PAGE as u64)
            .unwrap();
        let (ptr, len) = (slice.device_ptr(), slice.len());
        let lease = store.data_mut().guest_context().stream().unwrap();
        // SAFETY: nothing holds a view of the bytes while the kernel can run (the scope,
        // or the Store's teardown, waits for the stream before any access).
        unsafe {
            self.backend
                .driver()
                .enqueue_fill(lease.stream(), ptr, len, byte)
        }
        .unwrap();
    }
}

/// The Store's data (its stream lease) drops before its memory: the lease's release waits for
/// the stream, so the kernel's write lands in the tenant's own memory, and only then is the slot
/// scrubbed for the next tenant.
#[rstest]
fn queued_work_lands_before_the_slot_reaches_the_next_tenant(
    #[values(SHARED, STREAM, CONTEXT)] isolation: IsolationLevel,
) {
    let rig = rig();
    let (mut a, memory) = rig.tenant(1, isolation);
    rig.queue_fill(&mut a, &memory, 0xaa);
    assert!(
        memory.data(&a).iter().all(|&b| b == 0),
        "the write is queued, not done: the host sees the old bytes"
    );
    assert_eq!(rig.backend.driver().pending_work(), 1);
    drop(a);
    assert_eq!(
        rig.backend.driver().pending_work(),
        0,
        "teardown waited for the stream"
    );
    let (b, memory) = rig.tenant(2, isolation);
    assert!(
        memory.data(&b).iter().all(|&x| x == 0),
        "{isolation}: the next tenant sees zeros"
    );
    let stats = rig.backend.driver().stats();
    assert_eq!(stats.scrubs_over_pending_work, 0, "{isolation}");
    // The tenant's kernel, then the scrub's memset on the zeroing stream.
    assert_eq!(stats.work_completed, 2);
    assert_eq!(
        rig.creator.stats().pool.unwrap().bytes_scrubbed,
        PAGE as u64
    );
}

/// The wrong order, on purpose: work queued on a stream the Store does not own (the embedder's
/// own lease for the tenant) and still pending when the Store goes. The scrub runs first, the
/// write lands afterwards in the next tenant's memory: the cross-tenant leak a GPU would not
/// report. The model counts it and shows it, so the order above is really tested. (Work on the
/// embedder's own streams is the embedder's to wait for; the device-access scope of issue 15 is
/// meant to make that structural.)
#[test]
fn the_model_shows_a_scrub_that_runs_before_the_tenants_work() {
    let rig = rig();
    let (a, memory) = rig.tenant(1, IsolationLevel::StreamIsolated);
    let tenant_key = Tenant::new(1, "t1", 0, IsolationLevel::StreamIsolated)
        .ledger()
        .key();
    let own = StreamLease::acquire(
        Arc::clone(&rig.backend),
        tenant_key,
        IsolationLevel::StreamIsolated,
    )
    .unwrap();
    let slice = rig.creator.resolve(&a, &memory, 0, PAGE as u64).unwrap();
    let (ptr, len) = (slice.device_ptr(), slice.len());
    // SAFETY: the write lands at `own.release()` below, when no view of the bytes is held.
    unsafe {
        rig.backend
            .driver()
            .enqueue_fill(own.stream(), ptr, len, 0xaa)
    }
    .unwrap();
    drop(a);
    let (b, memory) = rig.tenant(2, IsolationLevel::StreamIsolated);
    assert_eq!(
        rig.backend.driver().stats().scrubs_over_pending_work,
        1,
        "counted"
    );
    own.release().unwrap();
    assert!(
        memory.data(&b).iter().all(|&x| x == 0xaa),
        "the late write landed in the next tenant's memory"
    );
}

/// `Store::into_data` drops the memories *before* handing the data (with its stream lease)
/// back: the memory itself waits for the Store's live guest stream before its slot goes back,
/// so the order holds whichever goes first.
#[rstest]
fn into_data_drops_the_memory_first_and_it_still_waits(
    #[values(SHARED, STREAM, CONTEXT)] isolation: IsolationLevel,
) {
    let rig = rig();
    let (mut a, memory) = rig.tenant(1, isolation);
    rig.queue_fill(&mut a, &memory, 0xaa);
    let data = a.into_data();
    assert_eq!(
        rig.backend.driver().pending_work(),
        0,
        "the memory waited for the stream"
    );
    let (b, memory) = rig.tenant(2, isolation);
    drop(data);
    assert!(
        memory.data(&b).iter().all(|&x| x == 0),
        "{isolation}: the next tenant sees zeros"
    );
    assert_eq!(rig.backend.driver().stats().scrubs_over_pending_work, 0);
}

/// A wait refused once (a plain driver error, not a lost context) when the memory goes first is
/// tried again: the work is waited for and the memory goes back, scrubbed after the fill; before,
/// it was kept for the creator's life.
#[rstest]
fn into_data_a_wait_refused_once_is_tried_again(
    #[values(SHARED, STREAM, CONTEXT)] isolation: IsolationLevel,
) {
    let rig = rig();
    let (mut a, memory) = rig.tenant(1, isolation);
    rig.queue_fill(&mut a, &memory, 0xaa);
    rig.backend
        .driver()
        .fail_call(tensor_wasm_mem_mock::Call::StreamSynchronize, 1, 999);
    let data = a.into_data();
    assert_eq!(rig.backend.driver().pending_work(), 0, "waited for");
    assert_eq!(
        rig.creator.stats().kept_memories,
        0,
        "{isolation}: given back"
    );
    let (b, memory) = rig.tenant(2, isolation);
    drop(data);
    assert!(memory.data(&b).iter().all(|&x| x == 0));
    assert_eq!(rig.backend.driver().stats().scrubs_over_pending_work, 0);
}

/// A context-isolated tenant with two Stores in its one context: A's stream is waited for and
/// its destroy refused (its memory goes back, as the work is done) while B's fill is still
/// queued on B's stream. A's slot reaches another tenant scrubbed with nothing pending over it,
/// and B's late fill lands in B's memory only.
#[test]
fn a_refused_destroy_gives_back_only_what_its_own_wait_covered() {
    let rig = rig_of(3);
    let tenant = Tenant::new(1, "c", 8 * PAGE as u64, CONTEXT);
    let (mut a, memory_a) = rig.store_of(&tenant);
    let (mut b, memory_b) = rig.store_of(&tenant);
    let base = |store: &Store<Data>, memory: &Memory| {
        rig.creator
            .resolve(store, memory, 0, PAGE as u64)
            .unwrap()
            .device_ptr()
    };
    let slot_a = base(&a, &memory_a);
    rig.queue_fill(&mut a, &memory_a, 0xaa);
    rig.queue_fill(&mut b, &memory_b, 0xbb);
    rig.backend
        .driver()
        .fail_call(tensor_wasm_mem_mock::Call::StreamDestroy, 1, 999);
    drop(a);
    assert_eq!(
        rig.creator.stats().kept_memories,
        0,
        "A's memory given back"
    );
    assert_eq!(
        rig.backend.driver().pending_work(),
        1,
        "B's fill still queued"
    );
    let (c, memory_c) = rig.tenant(2, STREAM);
    assert_eq!(base(&c, &memory_c), slot_a, "C has A's slot");
    assert!(memory_c.data(&c).iter().all(|&x| x == 0), "C sees zeros");
    drop(b);
    assert_eq!(rig.backend.driver().stats().scrubs_over_pending_work, 0);
    assert!(memory_c.data(&c).iter().all(|&x| x == 0), "and still does");
}

/// The same without a pool: the memory's allocation is freed at once when it goes, so a wait
/// placed after the free would show here as a free over pending work.
#[test]
fn into_data_on_a_fresh_memory_waits_before_the_free() {
    let backend = Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
        deferred_streams: true,
        ..MockConfig::default()
    }));
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let rig = Rig {
        module: Module::new(&engine, GUEST).unwrap(),
        linker: Linker::new(&engine),
        backend: Arc::clone(&backend),
        creator,
    };
    let (mut a, memory) = rig.tenant(1, STREAM);
    rig.queue_fill(&mut a, &memory, 0xaa);
    let data = a.into_data();
    let s = backend.driver().stats();
    assert_eq!((s.frees_over_pending_work, s.kernel_faults), (0, 0));
    assert_eq!(backend.driver().pending_work(), 0);
    drop(data);
}
