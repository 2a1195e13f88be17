//! The tenant's books under attack: the findings of the attack on the books (issue 29), each a
//! test that failed before the memory lifecycle gained its seam. (Finding 2, refused releases,
//! runs on every backend in the conformance suite: `tests/src/books.rs`; finding 5's swap is
//! refused by the compiler: `tests/ui/run_scope*.rs`.)

mod common;

use std::sync::{Arc, Weak};

use common::*;
use rstest::rstest;
use tensor_wasm_mem_core::{DeviceId, IsolationLevel, Operation, TenantBudgets};
use tensor_wasm_mem_mock::{Call, MockBackend, MockConfig, with_config};
use tensor_wasm_mem_wasmtime::wasmtime::{
    Engine, Instance, Linker, Memory, MemoryType, Module, Store,
};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, Placement, PlacementPolicy, TABLE_ELEMENT_BYTES, Tenant, TenantStore,
    TensorWasmMemoryCreator, TwmError, instantiate, new_store,
};

type Data = TenantStore<MockBackend>;

fn two_devices() -> Arc<MockBackend> {
    Arc::new(with_config(MockConfig {
        device_count: 2,
        ..MockConfig::default()
    }))
}

/// `tables` tables of `index` (`i32` or `i64`) elements, and `attack`, which grows each by
/// 2^20 - 1 elements and then by -1 (an overflowing `old + delta` for 64-bit tables), and
/// returns how many of the first growths succeeded.
fn table_attack(engine: &Engine, index: &str, tables: usize) -> Module {
    let declared: String = (0..tables)
        .map(|t| format!("(table $t{t} {index} 0 funcref)"))
        .collect();
    let grows: String = (0..tables)
        .map(|t| {
            format!(
                "(if ({index}.ne (table.grow $t{t} (ref.null func) ({index}.const 1048575))
                                 ({index}.const -1))
                   (then (local.set $ok (i32.add (local.get $ok) (i32.const 1)))))
                 (drop (table.grow $t{t} (ref.null func) ({index}.const -1)))"
            )
        })
        .collect();
    let wat = format!(
        "(module {declared} (func (export \"attack\") (result i32) (local $ok i32) {grows} (local.get $ok)))"
    );
    Module::new(engine, wat).expect("attack module")
}

/// Finding 1: a `table.grow` whose `old + delta` overflows makes Wasmtime report a failure with
/// no growth announced; it must not give back the growth granted before. At a cap of 32 MiB
/// exactly two tables of 2^20 - 1 elements (16 MiB each, at 16 bytes an element) fit, however
/// many tables the guest tries, with 64-bit tables as with 32-bit ones.
#[rstest]
#[case::tables_64_bit("i64")]
#[case::tables_32_bit("i32")]
fn finding_1_a_failed_table_growth_gives_back_no_grant(#[case] index: &str) {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 32 << 20);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(
        &mut store,
        &Linker::new(&engine),
        &table_attack(&engine, index, 40),
    )
    .unwrap();
    let attack = func::<_, (), i32>(&mut store, &instance, "attack");
    assert_eq!(
        attack.call(&mut store, ()).unwrap(),
        2,
        "two tables fit the cap"
    );
    let granted = 2 * ((1 << 20) - 1) * TABLE_ELEMENT_BYTES;
    let stats = tenant.stats();
    assert_eq!((stats.table_bytes, stats.touched_bytes), (granted, granted));
    assert_eq!(stats.held_bytes, granted);
    assert!(stats.touched_peak_bytes <= 32 << 20);
    let limiter = store.data().limiter().stats();
    assert_eq!(limiter.table_bytes, granted);
    // The two grown 64-bit tables' `-1` overflows `old + delta`: reported as failures with no
    // growth announced (the other tables' `0 + (2^64 - 1)` does not overflow: refused).
    let overflowed = if index == "i64" { 2 } else { 0 };
    assert_eq!(limiter.failed_growths, overflowed);
    drop(store);
    assert_eq!(tenant.stats().touched_bytes, 0);
}

/// Finding 3: `Memory::new` on a tenant's Store never calls the creator (Wasmtime makes the
/// memory itself), so the limiter's grant is redeemed by nobody: it is settled with the Store
/// (its memory is charged until the Store goes), nothing of it stays on the thread, the gone
/// tenant is really gone (ledger dropped, its device's commitment back), and a later Store on
/// the same thread without a limiter is never charged to it nor placed on its device.
#[test]
fn finding_3_an_announcement_never_outlives_its_call() {
    let backend = two_devices();
    let placement = Placement::for_backend(&*backend, PlacementPolicy::LeastHeld).unwrap();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .all_devices()
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let budgets = TenantBudgets::for_cap(16 << 20);
    let tenant = placement
        .admit_on(
            DeviceId(1),
            1,
            "gone",
            budgets,
            IsolationLevel::StreamIsolated,
        )
        .unwrap();
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let memory = Memory::new(&mut store, MemoryType::new(1, None)).unwrap();
    assert_eq!(
        tenant.stats().touched_bytes,
        PAGE as u64,
        "the bypass is charged"
    );
    assert!(
        creator.resolve(&store, &memory, 0, 1).is_err(),
        "and never device-visible"
    );
    let gone: Weak<Tenant> = Arc::downgrade(&tenant);
    drop((store, tenant));
    assert!(gone.upgrade().is_none(), "nothing keeps the tenant alive");
    let device = &placement.devices()[1];
    assert_eq!(
        (
            device.tenants,
            device.committed_bytes,
            device.touched_bytes,
            device.held_bytes
        ),
        (0, 0, 0, 0)
    );
    // The same thread, a Store without a limiter: refused, charged to no one.
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1))").unwrap();
    let mut plain = Store::new(&engine, ());
    let e = Instance::new(&mut plain, &module, &[]).unwrap_err();
    assert!(format!("{e:#}").contains("no tenant pays"), "{e:#}");
    // And where untenanted memories are allowed, it goes to the default device, uncharged.
    let open = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .all_devices()
        .allow_untenanted()
        .build()
        .unwrap();
    let open_engine = open.engine().unwrap();
    let module = Module::new(&open_engine, "(module (memory (export \"memory\") 1))").unwrap();
    let mut plain = Store::new(&open_engine, ());
    Instance::new(&mut plain, &module, &[]).unwrap();
    let live: Vec<u64> = open
        .stats()
        .devices
        .iter()
        .map(|d| d.live_memories)
        .collect();
    assert_eq!(live, [1, 0]);
    assert!(placement.devices().iter().all(|d| d.touched_bytes == 0));
}

/// Finding 3 with a live tenant: `Memory::new` on its Store, then on the same thread an
/// untenanted memory: the tenant pays for its own bypass memory only.
#[test]
fn finding_3_a_live_tenants_grant_is_never_taken_by_another_store() {
    let backend = mock();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .allow_untenanted()
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 16 << 20);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    Memory::new(&mut store, MemoryType::new(1, None)).unwrap();
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1))").unwrap();
    let mut plain = Store::new(&engine, ());
    Instance::new(&mut plain, &module, &[]).unwrap();
    let stats = tenant.stats();
    assert_eq!(
        (stats.touched_bytes, stats.live_memories, stats.held_bytes),
        (PAGE as u64, 0, 0),
        "only its own bypass memory's touched bytes"
    );
    drop(store);
    assert_eq!(tenant.stats().touched_bytes, 0);
}

/// Finding 4: a device's totals are the sum over its tenants. A memory whose free the driver
/// refuses keeps its tenant's charge, and so its tenant, on the device's books (a member with
/// its bytes) until the memory is really freed; then the device is empty again and least-held
/// placement goes back to it. A charge stranded when the creator goes leaves the device's
/// totals with its tenant.
#[test]
fn finding_4_device_totals_follow_the_charges() {
    let backend = two_devices();
    let placement = Placement::new(
        [(DeviceId(0), 1 << 30), (DeviceId(1), 1 << 30)],
        PlacementPolicy::LeastHeld,
    )
    .unwrap();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .all_devices()
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1 1))").unwrap();
    let budgets = TenantBudgets::for_cap(16 << 20);
    let admit = |id| {
        placement
            .admit_on(
                DeviceId(0),
                id,
                "t",
                budgets,
                IsolationLevel::StreamIsolated,
            )
            .unwrap()
    };
    let store_of = |tenant: &Arc<Tenant>| {
        let mut store: Store<Data> = new_store(
            &engine,
            TenantStore::new(&creator, tenant, ChargeMode::Touched, ()),
        );
        instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
        store
    };
    let device0 = || placement.devices()[0].clone();

    // A refused free, then a retry that frees.
    let tenant = admit(1);
    let store = store_of(&tenant);
    assert!(backend.driver().fail_nth(Operation::Free, 1));
    drop((store, tenant));
    assert_eq!(creator.stats().kept_memories, 1);
    let d = device0();
    assert_eq!(
        (d.tenants, d.touched_bytes, d.held_bytes),
        (1, PAGE as u64, PAGE as u64)
    );
    assert_eq!(creator.retry_releases(), 0);
    let d = device0();
    assert_eq!(
        (d.tenants, d.committed_bytes, d.touched_bytes, d.held_bytes),
        (0, 0, 0, 0)
    );
    let next = placement
        .admit(3, "next", budgets, IsolationLevel::StreamIsolated)
        .unwrap();
    assert_eq!(
        next.device(),
        DeviceId(0),
        "least held: the emptied device again"
    );
    drop(next);

    // Refused until the creator goes: stranded on the tenant, and gone from the device's totals
    // with it.
    let tenant = admit(2);
    let store = store_of(&tenant);
    for n in 1..=3 {
        assert!(backend.driver().fail_nth(Operation::Free, n));
    }
    drop(store);
    drop((creator, engine, module));
    let stats = tenant.stats();
    assert_eq!(
        (stats.touched_bytes, stats.stranded_bytes),
        (PAGE as u64, PAGE as u64)
    );
    let d = device0();
    assert_eq!(
        (d.tenants, d.touched_bytes, d.held_bytes),
        (1, PAGE as u64, PAGE as u64)
    );
    drop(tenant);
    let d = device0();
    assert_eq!(
        (d.tenants, d.committed_bytes, d.touched_bytes, d.held_bytes),
        (0, 0, 0, 0)
    );
    backend.driver().clear_faults();
}

/// Finding 6: table elements are real memory, charged to the cap: at a cap of 0 a guest grows
/// no table at all, however many it declares.
#[test]
fn finding_6_tables_at_cap_0_hold_nothing() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 0);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let attack = table_attack(&engine, "i32", 100);
    let instance = instantiate(&mut store, &Linker::new(&engine), &attack).unwrap();
    let attack = func::<_, (), i32>(&mut store, &instance, "attack");
    assert_eq!(attack.call(&mut store, ()).unwrap(), 0);
    let stats = tenant.stats();
    assert_eq!(
        (
            stats.table_bytes,
            stats.held_bytes,
            stats.touched_peak_bytes
        ),
        (0, 0, 0)
    );
    let ten = Module::new(&engine, "(module (table 10 funcref))").unwrap();
    let e = instantiate(&mut store, &Linker::new(&engine), &ten).unwrap_err();
    assert!(
        matches!(e.downcast_ref::<TwmError>(), Some(TwmError::Denied { .. })),
        "{e:#}"
    );
}

/// Finding 7: a tenant's Store made the ordinary Wasmtime way (`Store::new`), or refilled with
/// the data of another (`Store::into_data`), has no limiter: `instantiate` refuses it, and a
/// plain `Linker::instantiate` gets no memory from the creator (no tenant pays for it).
#[test]
fn finding_7_a_store_without_its_limiter_is_refused() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 8 << 20);
    let linker = Linker::new(&engine);
    let module = access_module(&engine, 200, 200); // 12.5 MiB: past the cap
    let small = access_module(&engine, 1, 1);
    let data = || TenantStore::new(&creator, &tenant, ChargeMode::Touched, ());

    let mut plain = Store::new(&engine, data());
    let e = instantiate(&mut plain, &linker, &module).unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<TwmError>(),
            Some(TwmError::NoLimiter { .. })
        ),
        "{e:#}"
    );
    let e = linker.instantiate(&mut plain, &small).unwrap_err();
    assert!(format!("{e:#}").contains("no tenant pays"), "{e:#}");

    let mut store = new_store(&engine, data());
    assert!(store.data().limiter().is_installed());
    let e = instantiate(&mut store, &linker, &module).unwrap_err();
    assert!(
        matches!(e.downcast_ref::<TwmError>(), Some(TwmError::Denied { .. })),
        "{e:#}"
    );
    instantiate(&mut store, &linker, &small).unwrap();
    let refilled = Store::new(&engine, store.into_data());
    let mut refilled = refilled;
    assert!(!refilled.data().limiter().is_installed());
    let e = instantiate(&mut refilled, &linker, &small).unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<TwmError>(),
            Some(TwmError::NoLimiter { .. })
        ),
        "{e:#}"
    );
    drop(refilled);
    assert_eq!(tenant.stats().touched_bytes, 0);
    assert_eq!(
        tenant.stats().touched_peak_bytes,
        PAGE as u64,
        "never more than it paid for"
    );
}

// What the hostile review of the new lifecycle found, each fixed and kept as a test.

/// A pool hands out a slot of a larger class when the smallest that fits is taken: the memory
/// is charged the slot it really holds, so the held budget bounds it (it was charged the
/// smallest class: 327,680 B charged for 67,174,400 B of slots), and a neighbour still gets a
/// slot.
#[rstest]
#[case::managed(tensor_wasm_mem_wasmtime::Backing::Managed)]
#[case::guarded_pageable(tensor_wasm_mem_wasmtime::Backing::Guarded(
    tensor_wasm_mem_core::HostAccess::Pageable
))]
fn review_a_larger_slot_is_charged_what_it_holds(
    #[case] backing: tensor_wasm_mem_wasmtime::Backing,
) {
    use tensor_wasm_mem_core::{PoolConfig, SizeClass};
    let backend = pageable_mock();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .backing(backing)
        .pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(64 << 10, 1), SizeClass::new(16 << 20, 4)],
        ))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let budgets = TenantBudgets {
        touched_bytes: 1 << 20,
        held_bytes: 1 << 20,
        memories: 1024,
    };
    let attacker = Tenant::with_budgets(1, "attacker", budgets, IsolationLevel::StreamIsolated);
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1 1))").unwrap();
    let linker = Linker::new(&engine);
    let store_of = |t: &Arc<Tenant>| {
        let mut store: Store<Data> = new_store(
            &engine,
            TenantStore::new(&creator, t, ChargeMode::Touched, ()),
        );
        let made = instantiate(&mut store, &linker, &module).map(drop);
        (store, made)
    };
    let (_first, made) = store_of(&attacker);
    made.unwrap();
    let (_second, made) = store_of(&attacker);
    let e = made.unwrap_err();
    assert!(
        matches!(e.downcast_ref::<TwmError>(), Some(TwmError::Denied { .. })),
        "{e:#}"
    );
    let stats = attacker.stats();
    assert_eq!(stats.held_bytes, 64 << 10, "its one small slot");
    assert!(stats.held_peak_bytes <= 1 << 20);
    let victim = tenant(2, 16 << 20);
    let (_victim, made) = store_of(&victim);
    made.unwrap();
    assert_eq!(victim.stats().held_bytes, 16 << 20, "the slot it holds");
}

/// A memory whose zeroing fails as it is made, and whose free the driver then refuses, is kept
/// with its charge like any refused release (it was left to the driver, charged to no one).
#[test]
fn review_a_failed_creation_keeps_what_the_driver_holds() {
    use tensor_wasm_mem_mock::Call;
    let backend = Arc::new(with_config(MockConfig {
        poison_fresh_allocations: true,
        ..MockConfig::default()
    }));
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 16 << 20);
    let mut store: Store<Data> = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1 16))").unwrap();
    backend.driver().fail_call(Call::Memset, 1, 999);
    assert!(backend.driver().fail_nth(Operation::Free, 1));
    assert!(instantiate(&mut store, &Linker::new(&engine), &module).is_err());
    assert_eq!(backend.stats().live_bytes, 1 << 20, "the driver holds it");
    assert_eq!(creator.stats().kept_memories, 1);
    assert_eq!(tenant.stats().held_bytes, 1 << 20, "charged while held");
    assert_eq!(creator.retry_releases(), 0);
    assert_eq!(
        (backend.stats().live_bytes, tenant.stats().held_bytes),
        (0, 0)
    );
}

/// Queues a fill of `memory`'s first page on the Store's stream (a kernel that may still run),
/// and has the driver refuse every wait of the Store's end (three tries, and the release's
/// own) and the stream's destroy.
fn queue_work_the_stores_end_cannot_wait_for(
    backend: &MockBackend,
    creator: &TensorWasmMemoryCreator<MockBackend>,
    store: &mut Store<Data>,
    memory: &Memory,
) {
    use tensor_wasm_mem_wasmtime::HasGuestContext;
    let slice = creator.resolve(&*store, memory, 0, PAGE as u64).unwrap();
    let (ptr, len) = (slice.device_ptr(), slice.len());
    let lease = store.data_mut().guest_context().stream().unwrap();
    // SAFETY: nothing reads these bytes while the kernel may run (the memory is kept).
    unsafe {
        backend
            .driver()
            .enqueue_fill(lease.stream(), ptr, len, 0xaa)
    }
    .unwrap();
    for n in 1..=4 {
        backend.driver().fail_call(Call::StreamSynchronize, n, 999);
    }
    backend.driver().fail_call(Call::StreamDestroy, 1, 999);
}

/// A stream the driver will not release (its wait and its destroy refused) may still have a
/// kernel queued: the Store's memory is kept, never scrubbed into the next tenant's hands, so the
/// late write lands in memory no one else holds (the next tenant saw 65,536 bytes of it).
#[test]
fn review_a_stream_not_released_keeps_its_stores_memory() {
    use tensor_wasm_mem_core::{PoolConfig, SizeClass};
    let backend = Arc::new(with_config(MockConfig {
        deferred_streams: true,
        ..MockConfig::default()
    }));
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 * PAGE, 2)]))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1 4))").unwrap();
    let store_of = |id| {
        let t = tenant(id, 4 * PAGE as u64);
        let mut store: Store<Data> = new_store(
            &engine,
            TenantStore::new(&creator, &t, ChargeMode::Touched, ()),
        );
        let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
        let memory = instance.get_memory(&mut store, "memory").unwrap();
        (store, memory)
    };
    let (mut a, memory) = store_of(1);
    queue_work_the_stores_end_cannot_wait_for(&backend, &creator, &mut a, &memory);
    drop(a);
    assert_eq!(creator.stats().kept_memories, 1, "kept, not scrubbed");
    let (b, memory) = store_of(2);
    assert_eq!(backend.driver().stats().scrubs_over_pending_work, 0);
    backend.driver().clear_faults();
    assert!(
        memory.data(&b).iter().all(|&x| x == 0),
        "the next tenant sees zeros"
    );
}

/// A pooled memory kept busy (its stream's waits and destroy refused, a kernel queued on it)
/// and abandoned when its creator goes is left to the driver with its slab: the pool forgets
/// the slab instead of freeing it, as an unpooled memory's allocation is forgotten. Before, the
/// pool's drop freed the whole slab under the queued kernel, whose write could then land in
/// the next allocation the driver made there, another tenant's (a red team).
#[rstest]
#[case::pooled(true)]
#[case::unpooled(false)]
fn review_a_busy_memory_abandoned_with_its_creator_is_not_freed_under_its_work(
    #[case] pooled: bool,
) {
    use tensor_wasm_mem_core::{PoolConfig, SizeClass};
    let backend = Arc::new(with_config(MockConfig {
        deferred_streams: true,
        ..MockConfig::default()
    }));
    let mut builder = TensorWasmMemoryCreator::builder(Arc::clone(&backend));
    if pooled {
        builder = builder.pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 * PAGE, 2)]));
    }
    let creator = builder.build().unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1 4))").unwrap();
    let t = tenant(1, 4 * PAGE as u64);
    let mut store: Store<Data> = new_store(
        &engine,
        TenantStore::new(&creator, &t, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    queue_work_the_stores_end_cannot_wait_for(&backend, &creator, &mut store, &memory);
    drop(store);
    assert_eq!(creator.stats().kept_memories, 1, "kept busy");
    let frees = backend.driver().stats().frees;
    drop((instance, module, engine, creator));
    let after = backend.driver().stats();
    assert_eq!(
        after.frees_over_pending_work, 0,
        "nothing freed under the queued kernel"
    );
    assert_eq!(
        after.frees, frees,
        "the memory's allocation is left to the driver"
    );
}

/// A destroy refused after the stream's work was waited for (of a stream-isolated tenant's
/// stream, or of a context-isolated tenant's context after its last stream), or a wait refused
/// once and then done (a shared tenant's release is only that wait): the work is provably done, so the Store's memory goes back, uncharged,
/// and the next tenant gets its slot scrubbed after the late write, not under it. Before, one
/// plain refusal kept the memory, slot and charge, for the creator's life (a red team drained a
/// pool so).
#[rstest]
#[case::stream_destroy(IsolationLevel::StreamIsolated, &[(Call::StreamDestroy, 1)])]
#[case::context_destroy(IsolationLevel::ContextIsolated, &[(Call::CtxDestroy, 1)])]
#[case::a_wait_refused_once(IsolationLevel::ContextIsolated, &[(Call::StreamSynchronize, 1)])]
#[case::both(
    IsolationLevel::StreamIsolated,
    &[(Call::StreamSynchronize, 1), (Call::StreamSynchronize, 2), (Call::StreamDestroy, 1)]
)]
#[case::the_releases_own_wait_and_destroy(
    IsolationLevel::StreamIsolated,
    &[(Call::StreamSynchronize, 2), (Call::StreamDestroy, 1)]
)]
#[case::a_shared_tenants_wait_refused_once(IsolationLevel::Shared, &[(Call::StreamSynchronize, 1)])]
fn a_refused_destroy_after_the_wait_gives_the_memory_back(
    #[case] level: IsolationLevel,
    #[case] refusals: &[(Call, u64)],
) {
    use tensor_wasm_mem_core::{PoolConfig, SizeClass};
    use tensor_wasm_mem_wasmtime::HasGuestContext;
    let backend = Arc::new(with_config(MockConfig {
        deferred_streams: true,
        ..MockConfig::default()
    }));
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 * PAGE, 1)]))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1 4))").unwrap();
    let store_of = |id| {
        let t = Tenant::new(id, format!("t{id}"), 4 * PAGE as u64, level);
        let mut store: Store<Data> = new_store(
            &engine,
            TenantStore::new(&creator, &t, ChargeMode::Touched, ()),
        );
        let made = instantiate(&mut store, &Linker::new(&engine), &module);
        let memory = made.map(|i| i.get_memory(&mut store, "memory").unwrap());
        (store, memory, t)
    };
    let (mut a, memory, tenant_a) = store_of(1);
    let memory = memory.unwrap();
    let slice = creator.resolve(&a, &memory, 0, PAGE as u64).unwrap();
    let (ptr, len) = (slice.device_ptr(), slice.len());
    let lease = a.data_mut().guest_context().stream().unwrap();
    // SAFETY: nothing reads these bytes while the fill may run (the Store's own memory).
    unsafe {
        backend
            .driver()
            .enqueue_fill(lease.stream(), ptr, len, 0xaa)
    }
    .unwrap();
    for &(call, n) in refusals {
        backend.driver().fail_call(call, n, 999);
    }
    drop(a);
    assert_eq!(creator.stats().kept_memories, 0, "given back");
    assert_eq!(tenant_a.stats().held_bytes, 0, "uncharged");
    // The pool's one slot: the next tenant gets it, scrubbed after the fill landed.
    let (b, memory, _) = store_of(2);
    let memory = memory.expect("the slot came back");
    assert_eq!(backend.driver().stats().scrubs_over_pending_work, 0);
    assert!(
        memory.data(&b).iter().all(|&x| x == 0),
        "the next tenant sees zeros"
    );
}

/// A Store of `tenant` paying in `mode`, with a memory the host made (`Memory::new`: one page,
/// at most `maximum`), and a linker that has it as `host.mem`.
fn with_host_memory(
    creator: &TensorWasmMemoryCreator<MockBackend>,
    tenant: &Arc<Tenant>,
    mode: ChargeMode,
    maximum: u32,
) -> (Store<Data>, Memory, Linker<Data>) {
    let engine = creator.engine().unwrap();
    let mut store = new_store(&engine, TenantStore::new(creator, tenant, mode, ()));
    let memory = Memory::new(&mut store, MemoryType::new(1, Some(maximum))).unwrap();
    let mut linker = Linker::new(&engine);
    linker.define(&mut store, "host", "mem", memory).unwrap();
    (store, memory, linker)
}

/// A memory the host makes (`Memory::new`: our creator never sees it) in a Store of either
/// charge mode is paid by the limiter's grants, its creation and every growth, and bounded by
/// the cap. Before, `ChargeMode::Capacity` granted nothing (it left the whole charge to the
/// creator), so such a memory grew to 6.5 MB under a 1 MiB cap, charged nothing (a red team).
#[rstest]
fn a_host_made_memory_is_paid_for_in_either_mode(
    #[values(ChargeMode::Touched, ChargeMode::Capacity)] mode: ChargeMode,
) {
    let backend = mock();
    let creator = fresh(&backend);
    let tenant = tenant(3, 1 << 20);
    let (mut store, memory, linker) = with_host_memory(&creator, &tenant, mode, 1000);
    let module = Module::new(
        store.engine(),
        r#"(module (import "host" "mem" (memory 1 1000))
             (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0))))"#,
    )
    .unwrap();
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(
        grow.call(&mut store, 9).unwrap(),
        1,
        "{mode:?}: within the cap"
    );
    assert_eq!(tenant.stats().touched_bytes, 10 * PAGE as u64, "{mode:?}");
    assert_eq!(
        grow.call(&mut store, 99).unwrap(),
        -1,
        "{mode:?}: past the cap"
    );
    assert_eq!(memory.data_size(&store), 10 * PAGE, "{mode:?}");
    drop(store);
    assert_eq!(
        tenant.stats().touched_bytes,
        0,
        "{mode:?}: back with the Store"
    );
}

/// In `ChargeMode::Capacity`, a Store with a host-made memory still grows its own memories
/// within their paid capacity (the growth's grant goes back), and they are charged their
/// capacity once.
#[test]
fn capacity_mode_with_a_host_memory_charges_its_own_memory_once() {
    let backend = mock();
    let creator = fresh(&backend);
    let tenant = tenant(4, 1 << 20);
    let (mut store, _, linker) = with_host_memory(&creator, &tenant, ChargeMode::Capacity, 1);
    let engine = store.engine().clone();
    let user = Module::new(&engine, r#"(module (import "host" "mem" (memory 1 1)))"#).unwrap();
    instantiate(&mut store, &linker, &user).unwrap();
    let module = Module::new(
        &engine,
        r#"(module (memory (export "own") 1 4)
             (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0))))"#,
    )
    .unwrap();
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    // The host's page, and the capacity of its own (4 pages).
    assert_eq!(tenant.stats().touched_bytes, 5 * PAGE as u64);
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 3).unwrap(), 1, "within its capacity");
    assert_eq!(
        tenant.stats().touched_bytes,
        5 * PAGE as u64,
        "paid already"
    );
}

/// A start function that grows an imported zero-page memory (not ours) and then makes another
/// Store's memory: the growth's grant is no creation, so the other Store's memory is refused (no
/// tenant pays for it) rather than charged to this tenant.
#[test]
fn review_a_zero_page_growth_announces_no_creation() {
    use tensor_wasm_mem_wasmtime::wasmtime::Caller;
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant_a = tenant(1, 16 << 20);
    let mut store: Store<Data> = new_store(
        &engine,
        TenantStore::new(&creator, &tenant_a, ChargeMode::Touched, ()),
    );
    let imported = Memory::new(&mut store, MemoryType::new(0, Some(4))).unwrap();
    let child = Module::new(&engine, "(module (memory (export \"memory\") 1 1))").unwrap();
    let outcome = Arc::new(std::sync::Mutex::new(None));
    let (engine2, seen) = (engine.clone(), Arc::clone(&outcome));
    let mut linker: Linker<Data> = Linker::new(&engine);
    linker.define(&store, "env", "m", imported).unwrap();
    linker
        .func_wrap("env", "spawn", move |_: Caller<'_, Data>| {
            let mut plain = Store::new(&engine2, ());
            let made = Instance::new(&mut plain, &child, &[]).map(drop);
            *seen.lock().unwrap() = Some(made.map_err(|e| format!("{e:#}")));
        })
        .unwrap();
    let parent = Module::new(
        &engine,
        r#"(module (import "env" "m" (memory 0 4)) (import "env" "spawn" (func $spawn))
           (func $start (drop (memory.grow (i32.const 1))) (call $spawn)) (start $start))"#,
    )
    .unwrap();
    instantiate(&mut store, &linker, &parent).unwrap();
    let child = outcome.lock().unwrap().take().unwrap();
    assert!(child.unwrap_err().contains("no tenant pays"));
    let s = tenant_a.stats();
    assert_eq!(
        (s.touched_bytes, s.live_memories),
        (PAGE as u64, 0),
        "its own page only"
    );
}

/// A limiter the embedder installs with its own `Store::limiter` call is not taken for
/// installed (nothing would tell it that its Store went): `instantiate` refuses the Store, and
/// `install_limiter` is the way to install it (then `into_data` is seen).
#[test]
fn review_only_an_install_that_sees_its_store_go_counts() {
    use tensor_wasm_mem_wasmtime::{HasTenantLimiter, install_limiter};
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 0);
    let module = Module::new(&engine, "(module (table 1 funcref))").unwrap();
    let data = || TenantStore::new(&creator, &tenant, ChargeMode::Touched, ());
    let mut own = Store::new(&engine, data());
    own.limiter(|d| d.tenant_limiter());
    let e = instantiate(&mut own, &Linker::new(&engine), &module).unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<TwmError>(),
            Some(TwmError::NoLimiter { .. })
        ),
        "{e:#}"
    );
    let mut ours = Store::new(&engine, data());
    install_limiter(&mut ours);
    assert!(ours.data().limiter().is_installed());
    let refilled = Store::new(&engine, ours.into_data());
    assert!(!refilled.data().limiter().is_installed());
}
