//! Tenants on one Engine: caps at instantiation and growth, accounting back to zero, separate
//! tenants, charge modes, and a creator bound to one tenant.

mod common;

use std::sync::Arc;

use common::*;
use tensor_wasm_mem_core::{ErrorKind, IsolationLevel, PlanLimits};
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Linker, Module, Store};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, Tenant, TenantLimiter, TenantStore, TensorWasmMemoryCreator, TwmError, instantiate,
    new_store,
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
            .stats()
            .calls(tensor_wasm_mem_core::Operation::Allocate),
        0,
        "refused before the creator ran"
    );
    assert_eq!(tenant.stats().live_bytes, 0);
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
    assert_eq!(tenant.stats().live_bytes, PAGE as u64);
    assert_eq!(grow.call(&mut store, 2).unwrap(), 1);
    assert_eq!(tenant.stats().live_bytes, 3 * PAGE as u64);
    assert_eq!(grow.call(&mut store, 1).unwrap(), -1, "past the cap");
    assert_eq!(
        tenant.stats().live_bytes,
        3 * PAGE as u64,
        "a denied growth charges nothing"
    );
    // The guest keeps running.
    store32.call(&mut store, (3 * PAGE as i32 - 4, 9)).unwrap();
    assert_eq!(load32.call(&mut store, 3 * PAGE as i32 - 4).unwrap(), 9);
    assert_eq!(store.data().limiter().stats().denied_growths, 1);
    let s = tenant.stats();
    assert_eq!(
        (s.live_memories, s.memories_created, s.peak_bytes),
        (1, 1, 3 * PAGE as u64)
    );
    drop(store);
    let s = tenant.stats();
    assert_eq!(
        (s.live_bytes, s.live_memories),
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
        tenant.stats().live_bytes,
        PAGE as u64,
        "the failed growth is refunded"
    );
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
    assert_eq!(tenant.stats().live_bytes, 2 * PAGE as u64);
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
    assert_eq!(tenant.stats().live_bytes, 0, "nothing left charged");
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
    assert_eq!((stats.live_bytes, stats.live_memories), (PAGE as u64, 1));
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
    assert_eq!(alice.stats().live_bytes, 4 * PAGE as u64);
    assert_eq!(bob.stats().live_bytes, 2 * PAGE as u64);
    // A second instance of alice's is past her cap; bob is not affected.
    let err = instantiate(&mut a, &linker, &module).unwrap_err();
    assert!(matches!(
        err.downcast_ref::<TwmError>(),
        Some(TwmError::Denied { .. })
    ));
    assert_eq!(bob.stats().denials, 1);
    drop(a);
    assert_eq!(alice.stats().live_bytes, 0);
    assert_eq!(bob.stats().live_bytes, 2 * PAGE as u64);
    drop(b);
    assert_eq!(bob.stats().live_bytes, 0);
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
    assert_eq!(tenant.stats().live_bytes, 4 * PAGE as u64);
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 3).unwrap(), 1);
    assert_eq!(
        tenant.stats().live_bytes,
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
    assert_eq!(tenant.stats().live_bytes, PAGE as u64);
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
    assert_eq!(tenant.stats().live_bytes, 0);
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
    assert_eq!(store.data().stats().charged_bytes, 2 * PAGE as u64);
}
