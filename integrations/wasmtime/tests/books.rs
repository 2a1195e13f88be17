//! The tenant's books under attack: the findings of the attack on the books (issue 29), each a
//! test that failed before the memory lifecycle gained its seam. (Finding 2, refused releases,
//! runs on every backend in the conformance suite: `tests/src/books.rs`; finding 5's swap is
//! refused by the compiler: `tests/ui/run_scope*.rs`.)

mod common;

use std::sync::{Arc, Weak};

use common::*;
use rstest::rstest;
use tensor_wasm_mem_core::{DeviceId, IsolationLevel, Operation, TenantBudgets};
use tensor_wasm_mem_mock::{MockBackend, MockConfig, with_config};
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
/// no growth announced; it must not give back the growth granted before. At a cap of 16 MiB
/// exactly two tables of 2^20 - 1 elements (8 MiB each) fit, however many tables the guest
/// tries, with 64-bit tables as with 32-bit ones.
#[rstest]
#[case::tables_64_bit("i64")]
#[case::tables_32_bit("i32")]
fn finding_1_a_failed_table_growth_gives_back_no_grant(#[case] index: &str) {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 16 << 20);
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
    assert_eq!((stats.table_bytes, stats.live_bytes), (granted, granted));
    assert_eq!(stats.held_bytes, granted);
    assert!(stats.peak_bytes <= 16 << 20);
    let limiter = store.data().limiter().stats();
    assert_eq!(limiter.table_bytes, granted);
    // The two grown 64-bit tables' `-1` overflows `old + delta`: reported as failures with no
    // growth announced (the other tables' `0 + (2^64 - 1)` does not overflow: refused).
    let overflowed = if index == "i64" { 2 } else { 0 };
    assert_eq!(limiter.failed_growths, overflowed);
    drop(store);
    assert_eq!(tenant.stats().live_bytes, 0);
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
        tenant.stats().live_bytes,
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
        (stats.live_bytes, stats.live_memories, stats.held_bytes),
        (PAGE as u64, 0, 0),
        "only its own bypass memory's touched bytes"
    );
    drop(store);
    assert_eq!(tenant.stats().live_bytes, 0);
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
        (stats.live_bytes, stats.stranded_bytes),
        (PAGE as u64, 2 * PAGE as u64)
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
        (stats.table_bytes, stats.held_bytes, stats.peak_bytes),
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
    assert_eq!(tenant.stats().live_bytes, 0);
    assert_eq!(
        tenant.stats().peak_bytes,
        PAGE as u64,
        "never more than it paid for"
    );
}
