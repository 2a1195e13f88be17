//! Tenants on one Engine: caps at instantiation and growth, accounting back to zero, separate
//! tenants, charge modes, and a creator bound to one tenant.

mod common;

use std::sync::Arc;

use common::*;
use tensor_wasm_mem_core::{
    Budget, DeviceId, ErrorKind, IsolationLevel, PlanLimits, PoolConfig, SizeClass, TenantBudgets,
};
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Linker, Module, Store};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, TABLE_ELEMENT_BYTES, Tenant, TenantLimiter, TenantStore, TensorWasmMemoryCreator,
    TwmError, instantiate, new_store,
};

type Data = TenantStore<tensor_wasm_mem_mock::MockBackend>;

fn store_for(
    creator: &TensorWasmMemoryCreator<tensor_wasm_mem_mock::MockBackend>,
    engine: &tensor_wasm_mem_wasmtime::wasmtime::Engine,
    tenant: &Arc<Tenant>,
    mode: ChargeMode,
) -> Store<Data> {
    new_store(engine, TenantStore::new(creator, tenant, mode, ()))
}

#[test]
fn initial_size_past_the_cap_refuses_instantiation_naming_the_tenant() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(7, 3 * PAGE as u64);
    let module = access_module(&engine, 4, 8);
    let linker = Linker::new(&engine);
    let mut store = store_for(&creator, &engine, &tenant, ChargeMode::Touched);
    let err = instantiate(&mut store, &linker, &module).unwrap_err();
    let twm = err.downcast_ref::<TwmError>().expect("a typed error");
    assert_eq!(twm.kind(), ErrorKind::CapExceeded);
    match twm {
        TwmError::Denied { denied, .. } => {
            assert_eq!(denied.cap, 3 * PAGE as u64);
            assert_eq!(denied.requested, 4 * PAGE as u64);
        }
        other => panic!("{other}"),
    }
    let message = twm.to_string();
    assert!(
        message.contains("t7") && message.contains("tenant 7"),
        "{message}"
    );
    assert!(
        message.contains(&(3 * PAGE).to_string()),
        "names the cap: {message}"
    );
    assert!(
        message.contains(&(4 * PAGE).to_string()),
        "names the request: {message}"
    );
    assert_eq!(
        backend
            .driver()
            .stats()
            .calls(tensor_wasm_mem_core::Operation::Allocate),
        0,
        "refused before the creator ran"
    );
    assert_eq!(tenant.stats().touched_bytes, 0);
    assert_eq!(tenant.stats().denials, 1);

    // A plain Linker::instantiate is refused too, with the details kept by the limiter.
    let err = linker.instantiate(&mut store, &module).unwrap_err();
    assert!(err.downcast_ref::<TwmError>().is_none());
    let denial = store.data().limiter().last_denial().expect("recorded");
    assert_eq!(denial.requested, 4 * PAGE as u64);
}

#[test]
fn growth_past_the_cap_is_minus_one_and_the_guest_goes_on() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 3 * PAGE as u64);
    let module = access_module(&engine, 1, 16);
    let linker = Linker::new(&engine);
    let mut store = store_for(&creator, &engine, &tenant, ChargeMode::Touched);
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    let store32 = func::<_, (i32, i32), ()>(&mut store, &instance, "store32");
    let load32 = func::<_, i32, i32>(&mut store, &instance, "load32");
    assert_eq!(tenant.stats().touched_bytes, PAGE as u64);
    assert_eq!(grow.call(&mut store, 2).unwrap(), 1);
    assert_eq!(tenant.stats().touched_bytes, 3 * PAGE as u64);
    assert_eq!(grow.call(&mut store, 1).unwrap(), -1, "past the cap");
    assert_eq!(
        tenant.stats().touched_bytes,
        3 * PAGE as u64,
        "a denied growth charges nothing"
    );
    // The guest keeps running.
    store32.call(&mut store, (3 * PAGE as i32 - 4, 9)).unwrap();
    assert_eq!(load32.call(&mut store, 3 * PAGE as i32 - 4).unwrap(), 9);
    assert_eq!(store.data().limiter().stats().denied_growths, 1);
    let s = tenant.stats();
    assert_eq!(
        (s.live_memories, s.memories_created, s.touched_peak_bytes),
        (1, 1, 3 * PAGE as u64)
    );
    drop(store);
    let s = tenant.stats();
    assert_eq!(
        (s.touched_bytes, s.live_memories),
        (0, 0),
        "everything back when the Store drops"
    );
    assert_eq!(backend.stats().live_allocations, 0);
}

#[test]
fn growth_past_the_capacity_is_refunded() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 64 * PAGE as u64);
    let module = access_module(&engine, 1, 2);
    let linker = Linker::new(&engine);
    let mut store = store_for(&creator, &engine, &tenant, ChargeMode::Touched);
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(
        grow.call(&mut store, 5).unwrap(),
        -1,
        "past the declared maximum"
    );
    assert_eq!(
        tenant.stats().touched_bytes,
        PAGE as u64,
        "the failed growth is refunded"
    );
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
    assert_eq!(tenant.stats().touched_bytes, 2 * PAGE as u64);
}

/// A growth beyond what a memory type can represent (reachable only with 1-byte pages) is
/// reported to the limiter without a `memory_growing` call first; refunding it would refund the
/// previous, successful growth and let a guest alternate the two past its cap. The creator
/// refuses such memories, typed, even when the embedder turns the proposal back on, so the
/// limiter never has to tell the two failures apart by their message.
#[test]
fn custom_page_sizes_are_refused_even_when_the_engine_allows_them() {
    let backend = mock();
    let creator = fresh(&backend);
    let mut config = tensor_wasm_mem_wasmtime::wasmtime::Config::new();
    creator.install(&mut config).wasm_custom_page_sizes(true);
    let engine = tensor_wasm_mem_wasmtime::wasmtime::Engine::new(&config).unwrap();
    let tenant = tenant(1, 8 * PAGE as u64);
    let module = Module::new(
        &engine,
        r#"(module
             (memory (export "memory") 65536 (pagesize 1))
             (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0))))"#,
    )
    .unwrap();
    let linker = Linker::new(&engine);
    let mut store = store_for(&creator, &engine, &tenant, ChargeMode::Touched);
    let err = instantiate(&mut store, &linker, &module).expect_err("1-byte pages");
    let text = format!("{err:#}");
    assert!(text.contains("page size of 1 bytes"), "{text}");
    assert_eq!(backend.stats().live_allocations, 0, "nothing allocated");
    drop(store);
    assert_eq!(tenant.stats().touched_bytes, 0, "nothing left charged");
    // Under the engine Config of our own, such a module does not even compile.
    let ours = creator.engine().unwrap();
    assert!(Module::new(&ours, "(module (memory 1 (pagesize 1)))").is_err());
}

/// A start function's `memory.grow` on a memory declared with zero pages is a growth: past the
/// tenant's cap it returns -1 and the instantiation goes on (it used to be taken for a new memory
/// and refuse the whole instantiation, with a message about a minimum the module never
/// declared).
#[test]
fn a_start_functions_growth_from_zero_pages_is_a_growth() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, PAGE as u64);
    let module = Module::new(
        &engine,
        r#"(module
             (memory (export "memory") 0 4)
             (global $past_cap (export "past_cap") (mut i32) (i32.const 99))
             (global $in_cap (export "in_cap") (mut i32) (i32.const 99))
             (func $start
               (global.set $past_cap (memory.grow (i32.const 2)))
               (global.set $in_cap (memory.grow (i32.const 1))))
             (start $start))"#,
    )
    .unwrap();
    let linker = Linker::new(&engine);
    let mut store = store_for(&creator, &engine, &tenant, ChargeMode::Touched);
    let instance = instantiate(&mut store, &linker, &module).expect("the start function ran");
    let global = |store: &mut _, name| {
        instance
            .get_global(&mut *store, name)
            .unwrap()
            .get(&mut *store)
            .i32()
            .unwrap()
    };
    assert_eq!(global(&mut store, "past_cap"), -1, "two pages pass the cap");
    assert_eq!(
        global(&mut store, "in_cap"),
        0,
        "one page fits: the old size was 0"
    );
    let stats = tenant.stats();
    assert_eq!((stats.touched_bytes, stats.live_memories), (PAGE as u64, 1));
}

#[test]
fn two_tenants_on_one_engine_are_accounted_apart() {
    let backend = mock();
    let creator = pooled(&backend, 4 * PAGE, 4);
    let engine = creator.engine().unwrap();
    let alice = tenant(1, 4 * PAGE as u64);
    let bob = tenant(2, 2 * PAGE as u64);
    let module = access_module(&engine, 1, 4);
    let linker = Linker::new(&engine);
    let mut a = store_for(&creator, &engine, &alice, ChargeMode::Touched);
    let mut b = store_for(&creator, &engine, &bob, ChargeMode::Touched);
    let ia = instantiate(&mut a, &linker, &module).unwrap();
    let ib = instantiate(&mut b, &linker, &module).unwrap();
    let grow_a = func::<_, i32, i32>(&mut a, &ia, "grow");
    let grow_b = func::<_, i32, i32>(&mut b, &ib, "grow");
    assert_eq!(grow_a.call(&mut a, 3).unwrap(), 1);
    assert_eq!(grow_b.call(&mut b, 3).unwrap(), -1, "bob's cap is his own");
    assert_eq!(grow_b.call(&mut b, 1).unwrap(), 1);
    assert_eq!(alice.stats().touched_bytes, 4 * PAGE as u64);
    assert_eq!(bob.stats().touched_bytes, 2 * PAGE as u64);
    // A second instance of alice's is past her cap; bob is not affected.
    let err = instantiate(&mut a, &linker, &module).unwrap_err();
    assert!(matches!(
        err.downcast_ref::<TwmError>(),
        Some(TwmError::Denied { .. })
    ));
    assert_eq!(bob.stats().denials, 1);
    drop(a);
    assert_eq!(alice.stats().touched_bytes, 0);
    assert_eq!(bob.stats().touched_bytes, 2 * PAGE as u64);
    drop(b);
    assert_eq!(bob.stats().touched_bytes, 0);
    assert_eq!(creator.stats().pool.unwrap().in_use(), 0);
}

#[test]
fn capacity_mode_charges_the_whole_capacity_up_front() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, 8 * PAGE as u64);
    let module = access_module(&engine, 1, 4);
    let linker = Linker::new(&engine);
    let mut store = store_for(&creator, &engine, &tenant, ChargeMode::Capacity);
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    assert_eq!(tenant.stats().touched_bytes, 4 * PAGE as u64);
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 3).unwrap(), 1);
    assert_eq!(
        tenant.stats().touched_bytes,
        4 * PAGE as u64,
        "growth inside the capacity is free"
    );
    instantiate(&mut store, &linker, &module).unwrap();
    let err = instantiate(&mut store, &linker, &module).unwrap_err();
    assert!(matches!(
        err.downcast_ref::<TwmError>(),
        Some(TwmError::Denied { .. })
    ));
    // The default 256 MiB capacity of an unbounded memory is charged in full.
    let unbounded = Module::new(&engine, "(module (memory 1))").unwrap();
    let big = tenant_with_cap(255 << 20);
    let mut store = store_for(&creator, &engine, &big, ChargeMode::Capacity);
    assert!(instantiate(&mut store, &linker, &unbounded).is_err());
}

fn tenant_with_cap(cap: u64) -> Arc<Tenant> {
    Tenant::new(9, "big", cap, IsolationLevel::Shared)
}

#[test]
fn plan_errors_are_typed_at_instantiation() {
    let backend = mock();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .limits(PlanLimits::new(2 * PAGE as u64).unwrap())
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let tenant = tenant(1, u64::MAX);
    let module = access_module(&engine, 3, 3);
    let linker = Linker::new(&engine);
    let mut store = store_for(&creator, &engine, &tenant, ChargeMode::Touched);
    let err = instantiate(&mut store, &linker, &module).unwrap_err();
    let twm = err.downcast_ref::<TwmError>().expect("typed");
    assert_eq!(twm.kind(), ErrorKind::LimitExceeded);
    assert!(twm.kind().is_denial());
}

#[test]
fn a_creator_bound_to_one_tenant_charges_it_directly() {
    let backend = mock();
    let tenant = tenant(5, 3 * PAGE as u64);
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .tenant(Arc::clone(&tenant), ChargeMode::Touched)
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = access_module(&engine, 1, 8);
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    assert_eq!(tenant.stats().touched_bytes, PAGE as u64);
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 2).unwrap(), 1);
    assert_eq!(
        grow.call(&mut store, 1).unwrap(),
        -1,
        "past the bound tenant's cap"
    );
    let err = Instance::new(&mut store, &module, &[]).unwrap_err();
    assert!(format!("{err:#}").contains("tenant 5"), "{err:#}");
    drop(store);
    assert_eq!(tenant.stats().touched_bytes, 0);
}

#[test]
fn the_limiter_alone_works_as_store_data() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let tenant = tenant(3, 2 * PAGE as u64);
    let module = access_module(&engine, 1, 4);
    let mut store = new_store(
        &engine,
        TenantLimiter::new(Arc::clone(&tenant), ChargeMode::Touched, creator.limits()),
    );
    let linker = Linker::new(&engine);
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
    assert_eq!(grow.call(&mut store, 1).unwrap(), -1);
    assert_eq!(tenant.stats().touched_bytes, 2 * PAGE as u64);
    // Every touched byte is held by the memory itself: nothing is left with the Store.
    assert_eq!(store.data().stats().charged_bytes, 0);
    drop(store);
    assert_eq!(tenant.stats().touched_bytes, 0);
}

/// `(module (memory 0) (memory 0) ...)`: `count` zero-page memories with no maximum.
fn zero_page_memories(engine: &tensor_wasm_mem_wasmtime::wasmtime::Engine, count: usize) -> Module {
    let memories = "(memory 0) ".repeat(count);
    Module::new(engine, format!("(module {memories})")).unwrap()
}

fn denial(err: &tensor_wasm_mem_wasmtime::wasmtime::Error) -> tensor_wasm_mem_core::Denied {
    match err.downcast_ref::<TwmError>() {
        Some(TwmError::Denied { denied, .. }) => *denied,
        other => panic!("not a typed denial: {other:?} ({err:#})"),
    }
}

/// Attack 1: a tenant with a cap of 0 used to hold a whole 256 MiB allocation per `(memory 0)`,
/// charged nothing, until the device was full for everyone. Now the held budget (at least one
/// default-size memory) refuses the second, typed and named, and nothing stays allocated.
#[test]
fn zero_page_memories_are_charged_what_they_hold() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let linker = Linker::new(&engine);
    let hostile = tenant(1, 0);
    let mut store = store_for(&creator, &engine, &hostile, ChargeMode::Touched);
    let err = instantiate(&mut store, &linker, &zero_page_memories(&engine, 64)).unwrap_err();
    let denied = denial(&err);
    assert_eq!(denied.budget, Budget::Held);
    assert_eq!(denied.requested, 256 << 20, "one default-size memory");
    assert_eq!(denied.live, 256 << 20, "the first one fitted");
    let message = format!("{err:#}");
    assert!(message.contains("held budget"), "{message}");
    assert_eq!(backend.stats().live_allocations, 0, "nothing kept");
    let s = hostile.stats();
    assert_eq!((s.held_bytes, s.live_memories, s.held_denials), (0, 0, 1));

    // One such memory is within the defaults, and every other tenant is unaffected.
    instantiate(&mut store, &linker, &zero_page_memories(&engine, 1)).unwrap();
    assert_eq!(hostile.stats().held_bytes, 256 << 20);
    let other = tenant(2, 4 * PAGE as u64);
    let mut theirs = store_for(&creator, &engine, &other, ChargeMode::Touched);
    for _ in 0..3 {
        instantiate(&mut theirs, &linker, &access_module(&engine, 1, 4)).unwrap();
    }
    assert_eq!(other.stats().denials, 0);
    drop((store, theirs));
    assert_eq!(hostile.stats().held_bytes, 0);
    assert_eq!(other.stats().held_bytes, 0);
    assert_eq!(backend.stats().live_allocations, 0);
}

/// The same attack on a pool: each memory holds its slot (the smallest class it fits), so a
/// tenant with a held budget of two slots gets two, and the pool keeps the rest for others.
#[test]
fn pooled_memories_hold_their_slot_and_the_held_budget_bounds_them() {
    let backend = mock();
    // Every slot may go to one tenant: the held budget alone bounds the hostile one here.
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 * PAGE, 7)]))
        .slots_per_tenant(7)
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let linker = Linker::new(&engine);
    let budgets = TenantBudgets {
        touched_bytes: 0,
        held_bytes: 8 * PAGE as u64,
        memories: 64,
    };
    let hostile = Tenant::with_budgets(1, "hostile", budgets, IsolationLevel::StreamIsolated);
    let mut store = store_for(&creator, &engine, &hostile, ChargeMode::Touched);
    let bounded = Module::new(&engine, "(module (memory 0 4) (memory 0 4) (memory 0 4))").unwrap();
    let denied = denial(&instantiate(&mut store, &linker, &bounded).unwrap_err());
    assert_eq!(
        (denied.budget, denied.requested),
        (Budget::Held, 4 * PAGE as u64)
    );
    assert_eq!(creator.stats().pool.unwrap().in_use(), 0, "slots went back");
    let two = Module::new(&engine, "(module (memory 0 4) (memory 0 4))").unwrap();
    instantiate(&mut store, &linker, &two).unwrap();
    assert_eq!(hostile.stats().held_bytes, 8 * PAGE as u64);
    let other = tenant(2, 5 * PAGE as u64);
    let mut theirs = store_for(&creator, &engine, &other, ChargeMode::Touched);
    for _ in 0..5 {
        instantiate(&mut theirs, &linker, &access_module(&engine, 1, 4)).unwrap();
    }
    assert_eq!(other.stats().denials, 0);
    drop((store, theirs));
    assert_eq!(creator.stats().pool.unwrap().in_use(), 0);
    assert_eq!(hostile.stats().held_bytes, 0);
}

/// The live-memories budget counts across all of a tenant's Stores.
#[test]
fn the_memories_budget_spans_stores() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let linker = Linker::new(&engine);
    let budgets = TenantBudgets {
        memories: 2,
        ..TenantBudgets::for_cap(64 * PAGE as u64)
    };
    let t = Tenant::with_budgets(3, "t3", budgets, IsolationLevel::StreamIsolated);
    let module = access_module(&engine, 1, 1);
    let mut a = store_for(&creator, &engine, &t, ChargeMode::Touched);
    let mut b = store_for(&creator, &engine, &t, ChargeMode::Touched);
    instantiate(&mut a, &linker, &module).unwrap();
    instantiate(&mut b, &linker, &module).unwrap();
    let mut c = store_for(&creator, &engine, &t, ChargeMode::Touched);
    let err = instantiate(&mut c, &linker, &module).unwrap_err();
    let denied = denial(&err);
    assert_eq!(
        (denied.budget, denied.cap, denied.live),
        (Budget::Memories, 2, 2)
    );
    assert!(format!("{err:#}").contains("memories budget"), "{err:#}");
    assert_eq!(
        t.stats().touched_bytes,
        2 * PAGE as u64,
        "the refused one is refunded"
    );
    drop(a);
    instantiate(&mut c, &linker, &module).unwrap();
    assert_eq!(t.stats().memory_denials, 1);
}

/// Attack 2: tables used to be free. Their elements are charged to the held budget, a table
/// past the element limit refuses instantiation, and a `table.grow` past it is -1.
#[test]
fn tables_are_charged_and_bounded() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let t = tenant(4, 1 << 20);
    let limiter = |t: &Arc<Tenant>| {
        TenantLimiter::new(Arc::clone(t), ChargeMode::Touched, creator.limits())
            .with_max_table_elements(1000)
    };
    let linker = Linker::new(&engine);
    let mut store = new_store(&engine, limiter(&t));
    let huge = Module::new(&engine, "(module (table 10000000 funcref))").unwrap();
    let err = instantiate(&mut store, &linker, &huge).unwrap_err();
    match err.downcast_ref::<TwmError>() {
        Some(TwmError::Limit {
            what,
            requested,
            limit,
        }) => {
            assert_eq!(
                (*what, *requested, *limit),
                ("elements in one table", 10_000_000, 1000)
            );
        }
        other => panic!("{other:?}"),
    }
    let growing = Module::new(
        &engine,
        r#"(module (table 10 funcref)
             (func (export "grow") (param i32) (result i32)
               (table.grow (ref.null func) (local.get 0))))"#,
    )
    .unwrap();
    let instance = instantiate(&mut store, &linker, &growing).unwrap();
    assert_eq!(t.stats().held_bytes, 10 * TABLE_ELEMENT_BYTES);
    assert_eq!(
        t.stats().touched_bytes,
        10 * TABLE_ELEMENT_BYTES,
        "and touched"
    );
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 90).unwrap(), 10);
    assert_eq!(t.stats().held_bytes, 100 * TABLE_ELEMENT_BYTES);
    assert_eq!(t.stats().table_bytes, 100 * TABLE_ELEMENT_BYTES);
    assert_eq!(
        grow.call(&mut store, 901).unwrap(),
        -1,
        "past 1000 elements"
    );
    assert_eq!(store.data().stats().denied_table_growths, 1);
    assert_eq!(store.data().stats().table_bytes, 100 * TABLE_ELEMENT_BYTES);

    // A held budget of 800 bytes is 100 elements: the table is refused by the budget.
    let budgets = TenantBudgets {
        held_bytes: 800,
        ..TenantBudgets::unlimited()
    };
    let small = Tenant::with_budgets(5, "small", budgets, IsolationLevel::Shared);
    let mut store2 = new_store(&engine, limiter(&small));
    let table = Module::new(&engine, "(module (table 101 funcref))").unwrap();
    let denied = denial(&instantiate(&mut store2, &linker, &table).unwrap_err());
    assert_eq!(
        (denied.budget, denied.requested),
        (Budget::Held, 101 * TABLE_ELEMENT_BYTES)
    );
    drop((store, store2));
    assert_eq!(t.stats().held_bytes, 0);
    assert_eq!(t.stats().touched_bytes, 0);
    assert_eq!(small.stats().held_bytes, 0);
}

/// Instances, tables and memories per Store: past the limit, instantiation is refused, typed.
#[test]
fn store_counts_are_limited_and_typed() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let t = tenant(6, 64 * PAGE as u64);
    let limiter = TenantLimiter::new(Arc::clone(&t), ChargeMode::Touched, creator.limits())
        .with_store_limits(2, 1, 2);
    let mut store = new_store(&engine, limiter);
    let linker = Linker::new(&engine);
    let two_tables = Module::new(&engine, "(module (table 1 funcref) (table 1 funcref))").unwrap();
    let limit = |err: WasmtimeError| match err.downcast_ref::<TwmError>() {
        Some(TwmError::Limit { what, .. }) => *what,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        limit(instantiate(&mut store, &linker, &two_tables).unwrap_err()),
        "tables in one Store"
    );
    let one = access_module(&engine, 1, 1);
    instantiate(&mut store, &linker, &one).unwrap();
    instantiate(&mut store, &linker, &one).unwrap();
    let err = instantiate(&mut store, &linker, &one).unwrap_err();
    assert_eq!(limit(err), "instances in one Store");
    assert_eq!(t.stats().live_memories, 2);
}

type WasmtimeError = tensor_wasm_mem_wasmtime::wasmtime::Error;

/// In `Capacity` mode a start function's growth of a zero-page memory is inside the capacity
/// already charged: it is not charged twice.
#[test]
fn capacity_mode_growth_from_zero_is_not_charged_twice() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let t = tenant(7, 4 * PAGE as u64);
    let module = Module::new(
        &engine,
        r#"(module (memory 0 4)
             (global (export "g") (mut i32) (i32.const 99))
             (func $s (global.set 0 (memory.grow (i32.const 4))))
             (start $s))"#,
    )
    .unwrap();
    let mut store = store_for(&creator, &engine, &t, ChargeMode::Capacity);
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
    let g = instance
        .get_global(&mut store, "g")
        .unwrap()
        .get(&mut store)
        .i32();
    assert_eq!(g, Some(0));
    assert_eq!(t.stats().touched_bytes, 4 * PAGE as u64);
    assert_eq!(t.stats().touched_peak_bytes, 4 * PAGE as u64);
}

/// Attack 5: Wasmtime drops a Store's data before its memories. The tenant's charge is the
/// memory's, so it is still held while the data drops, and back once the memory is gone.
#[test]
fn the_charge_outlives_the_store_data_until_the_memory_is_gone() {
    struct Witness(Arc<Tenant>, Arc<std::sync::Mutex<Option<(u64, u64, u64)>>>);
    impl Drop for Witness {
        fn drop(&mut self) {
            let s = self.0.stats();
            *self.1.lock().unwrap() = Some((s.touched_bytes, s.held_bytes, s.live_memories));
        }
    }
    let backend = mock();
    let creator = pooled(&backend, 4 * PAGE, 2);
    let engine = creator.engine().unwrap();
    let t = tenant(8, 4 * PAGE as u64);
    let seen = Arc::new(std::sync::Mutex::new(None));
    let data = TenantStore::new(
        &creator,
        &t,
        ChargeMode::Touched,
        Witness(Arc::clone(&t), Arc::clone(&seen)),
    );
    let mut store = new_store(&engine, data);
    instantiate(
        &mut store,
        &Linker::new(&engine),
        &access_module(&engine, 2, 4),
    )
    .unwrap();
    drop(store);
    assert_eq!(
        *seen.lock().unwrap(),
        Some((2 * PAGE as u64, 4 * PAGE as u64, 1)),
        "while the Store data drops, the memory and its charge are still there"
    );
    let s = t.stats();
    assert_eq!((s.touched_bytes, s.held_bytes, s.live_memories), (0, 0, 0));
    assert_eq!(creator.stats().pool.unwrap().in_use(), 0);
}

/// Attack 3: tenant A advises (read-mostly, preferred location, accessed-by) and prefetches its
/// pooled memory through the `twm` host functions and goes; tenant B's memory in the same slot
/// carries none of it (the pool resets hints before reuse, as it scrubs bytes).
#[test]
fn a_tenants_hints_do_not_reach_the_next_holder_of_its_slot() {
    use tensor_wasm_mem_core::Location;
    use tensor_wasm_mem_mock::Hints;
    use tensor_wasm_mem_wasmtime::add_to_linker;

    let backend = mock();
    let creator = pooled(&backend, 4 * PAGE, 1);
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let module = Module::new(
        &engine,
        r#"(module
          (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
          (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
          (memory (export "memory") 1 4)
          (func (export "hint") (result i32)
            (i32.or
              (i32.or (call $advise (i32.const 0) (i32.const 65536) (i32.const 0) (i32.const -1))
                      (call $advise (i32.const 0) (i32.const 65536) (i32.const 2) (i32.const 0)))
              (i32.or
                (i32.or (call $advise (i32.const 0) (i32.const 65536) (i32.const 4) (i32.const 0))
                        (call $advise (i32.const 0) (i32.const 65536) (i32.const 4) (i32.const -1)))
                (call $prefetch (i32.const 0) (i32.const 65536) (i32.const 0))))))"#,
    )
    .unwrap();
    let pool = Arc::clone(creator.pool().expect("a pooled creator"));
    let at = |offset: usize| {
        pool.with_slab(|slab| backend.driver().hints(slab, offset).unwrap())
            .unwrap()
    };
    let resident = |offset: usize| {
        pool.with_slab(|slab| backend.driver().residency(slab, offset).unwrap())
            .unwrap()
    };

    let a = tenant(1, 4 * PAGE as u64);
    let mut store = store_for(&creator, &engine, &a, ChargeMode::Touched);
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let hint = func::<_, (), i32>(&mut store, &instance, "hint");
    assert_eq!(hint.call(&mut store, ()).unwrap(), 0, "every hint accepted");
    let d0 = Location::Device(tensor_wasm_mem_core::DeviceId(0));
    let set = at(PAGE - 1);
    assert!(
        set.read_mostly && set.preferred_location == Some(d0),
        "{set:?}"
    );
    assert_eq!(set.accessed_by.len(), 2, "{set:?}");
    assert_eq!(resident(0), Some(d0));
    drop(store);

    let b = tenant(2, 4 * PAGE as u64);
    let mut store = store_for(&creator, &engine, &b, ChargeMode::Touched);
    instantiate(&mut store, &linker, &module).unwrap();
    assert_eq!(pool.stats().hint_resets, 1);
    for offset in [0, PAGE / 2, PAGE - 1] {
        assert_eq!(at(offset), Hints::default(), "offset {offset}");
        // The pages stay where they are: a reset moves no dead bytes over the link.
        assert_eq!(resident(offset), Some(d0), "offset {offset}");
    }
    drop(store);
}
