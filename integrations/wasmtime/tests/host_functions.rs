//! The `twm.advise` / `twm.prefetch` host functions: documented codes for good, out-of-range,
//! overflowing and unknown input; no trap; nothing reaches the backend on a bad call.

mod common;

use std::sync::Arc;

use common::*;
use rstest::rstest;
use tensor_wasm_mem_core::{IsolationLevel, Operation};
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Linker, Module, Store};
use tensor_wasm_mem_wasmtime::*;

const GUEST: &str = r#"(module
  (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 2)
  (func (export "advise") (param i32 i32 i32 i32) (result i32)
    (call $advise (local.get 0) (local.get 1) (local.get 2) (local.get 3)))
  (func (export "prefetch") (param i32 i32 i32) (result i32)
    (call $prefetch (local.get 0) (local.get 1) (local.get 2)))
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0))))"#;

struct Guest {
    backend: Arc<MockBackend>,
    store: Store<TenantStore<MockBackend>>,
    instance: Instance,
}

fn guest(isolation: IsolationLevel) -> Guest {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let tenant = Tenant::new(1, "guest", 1 << 20, isolation);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let module = Module::new(&engine, GUEST).unwrap();
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    Guest {
        backend,
        store,
        instance,
    }
}

impl Guest {
    fn advise(&mut self, ptr: i32, len: i32, advice: i32, location: i32) -> i32 {
        func::<_, (i32, i32, i32, i32), i32>(&mut self.store, &self.instance, "advise")
            .call(&mut self.store, (ptr, len, advice, location))
            .expect("a host call never traps")
    }

    fn prefetch(&mut self, ptr: i32, len: i32, location: i32) -> i32 {
        func::<_, (i32, i32, i32), i32>(&mut self.store, &self.instance, "prefetch")
            .call(&mut self.store, (ptr, len, location))
            .expect("a host call never traps")
    }
}

const P: i32 = PAGE as i32;

#[rstest]
#[case::whole_memory(0, P, 0, -1, TWM_OK)]
#[case::one_byte(P - 1, 1, 1, 0, TWM_OK)]
#[case::empty_at_end(P, 0, 2, 0, TWM_OK)]
#[case::preferred_host(0, 16, 2, -1, TWM_OK)]
#[case::unset_preferred(0, 16, 3, 0, TWM_OK)]
#[case::accessed_by(0, 16, 4, 0, TWM_OK)]
#[case::unset_accessed_by(0, 16, 5, -1, TWM_OK)]
#[case::one_past_the_end(P, 1, 0, -1, TWM_ERR_OUT_OF_RANGE)]
#[case::straddling(P - 1, 2, 0, -1, TWM_ERR_OUT_OF_RANGE)]
#[case::capacity_is_not_visible(0, P + 1, 0, -1, TWM_ERR_OUT_OF_RANGE)]
#[case::negative_length_is_huge(0, -1, 0, -1, TWM_ERR_OUT_OF_RANGE)]
#[case::wraps(-1, 2, 0, -1, TWM_ERR_OVERFLOW)]
#[case::wraps_large(-65536, 65537, 0, -1, TWM_ERR_OVERFLOW)]
#[case::unknown_advice(0, 1, 6, -1, TWM_ERR_UNKNOWN_ADVICE)]
#[case::negative_advice(0, 1, -1, -1, TWM_ERR_UNKNOWN_ADVICE)]
#[case::unknown_device(0, 1, 2, 1, TWM_ERR_UNKNOWN_DEVICE)]
#[case::location_below_host(0, 1, 2, -2, TWM_ERR_UNKNOWN_DEVICE)]
fn advise_codes(
    #[case] ptr: i32,
    #[case] len: i32,
    #[case] advice: i32,
    #[case] location: i32,
    #[case] expected: i32,
) {
    let mut g = guest(IsolationLevel::StreamIsolated);
    assert_eq!(g.advise(ptr, len, advice, location), expected);
    let reached = g.backend.driver().stats().calls(Operation::Advise);
    assert_eq!(
        reached,
        u64::from(expected == TWM_OK && len > 0),
        "only good calls reach the driver (an empty range is answered by the backend)"
    );
    assert_eq!(
        g.store.data().guest().calls(),
        (1, u64::from(expected != TWM_OK))
    );
}

#[rstest]
#[case::to_host(0, P, -1, TWM_OK)]
#[case::to_device(0, P, 0, TWM_OK)]
#[case::empty(P, 0, 0, TWM_OK)]
#[case::one_past_the_end(0, P + 1, -1, TWM_ERR_OUT_OF_RANGE)]
#[case::past_the_end(P, 1, 0, TWM_ERR_OUT_OF_RANGE)]
#[case::wraps(i32::MAX, i32::MAX, 0, TWM_ERR_OUT_OF_RANGE)]
#[case::wraps_address_space(-16, 32, 0, TWM_ERR_OVERFLOW)]
#[case::unknown_device(0, 1, 7, TWM_ERR_UNKNOWN_DEVICE)]
#[case::location_below_host(0, 1, -5, TWM_ERR_UNKNOWN_DEVICE)]
fn prefetch_codes(
    #[case] ptr: i32,
    #[case] len: i32,
    #[case] location: i32,
    #[case] expected: i32,
) {
    let mut g = guest(IsolationLevel::StreamIsolated);
    assert_eq!(g.prefetch(ptr, len, location), expected);
    let stats = g.backend.driver().stats();
    assert_eq!(
        stats.calls(Operation::Prefetch),
        u64::from(expected == TWM_OK && len > 0),
        "only good, non-empty calls reach the driver"
    );
    assert_eq!(
        stats.streams_created,
        u64::from(expected == TWM_OK),
        "a bad call creates no stream"
    );
}

#[test]
fn prefetch_uses_one_stream_per_instance_at_the_tenant_level() {
    let mut g = guest(IsolationLevel::ContextIsolated);
    for _ in 0..3 {
        assert_eq!(g.prefetch(0, P, 0), TWM_OK);
    }
    let s = g.backend.driver().stats();
    assert_eq!(
        (s.streams_created, s.live_streams, s.live_contexts),
        (1, 1, 1)
    );
    drop(g.store);
    let s = g.backend.driver().stats();
    assert_eq!(
        (s.live_streams, s.live_contexts),
        (0, 0),
        "released with the Store"
    );

    let mut g = guest(IsolationLevel::Shared);
    assert_eq!(g.prefetch(0, P, 0), TWM_OK);
    assert_eq!(
        g.backend.driver().stats().streams_created,
        0,
        "shared: the default stream"
    );
}

#[test]
fn ranges_follow_growth() {
    let mut g = guest(IsolationLevel::StreamIsolated);
    assert_eq!(g.advise(P, 16, 0, -1), TWM_ERR_OUT_OF_RANGE);
    let grow = func::<_, i32, i32>(&mut g.store, &g.instance, "grow");
    assert_eq!(grow.call(&mut g.store, 1).unwrap(), 1);
    assert_eq!(g.advise(P, 16, 0, -1), TWM_OK);
    assert_eq!(g.advise(2 * P - 1, 2, 0, -1), TWM_ERR_OUT_OF_RANGE);
}

#[test]
fn backend_failures_are_a_code_not_a_trap() {
    let mut g = guest(IsolationLevel::StreamIsolated);
    g.backend.driver().fail_nth(Operation::Advise, 1);
    assert_eq!(g.advise(0, 16, 0, -1), TWM_ERR_BACKEND);
    g.backend.driver().fail_nth(Operation::AcquireStream, 1);
    assert_eq!(g.prefetch(0, 16, -1), TWM_ERR_BACKEND);
    g.backend.driver().fail_nth(Operation::Prefetch, 1);
    assert_eq!(g.prefetch(0, 16, -1), TWM_ERR_BACKEND);
    assert_eq!(g.advise(0, 16, 0, -1), TWM_OK, "works again");
    assert_eq!(g.prefetch(0, 16, -1), TWM_OK);
}

#[test]
fn guests_without_a_device_visible_memory_get_a_code() {
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let tenant = Tenant::new(1, "guest", 1 << 20, IsolationLevel::Shared);
    // No exported memory at all.
    let module = Module::new(
        &engine,
        r#"(module
             (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
             (memory 1)
             (func (export "advise") (result i32)
               (call $advise (i32.const 0) (i32.const 1) (i32.const 0) (i32.const -1))))"#,
    )
    .unwrap();
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let advise = func::<_, (), i32>(&mut store, &instance, "advise");
    assert_eq!(
        advise.call(&mut store, ()).unwrap(),
        TWM_ERR_NOT_DEVICE_MEMORY
    );

    // An imported memory made with Memory::new: not from the creator.
    let module = Module::new(
        &engine,
        r#"(module
             (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
             (import "env" "memory" (memory 1))
             (export "memory" (memory 0))
             (func (export "advise") (result i32)
               (call $advise (i32.const 0) (i32.const 1) (i32.const 0) (i32.const -1))))"#,
    )
    .unwrap();
    let host_memory = tensor_wasm_mem_wasmtime::wasmtime::Memory::new(
        &mut store,
        tensor_wasm_mem_wasmtime::wasmtime::MemoryType::new(1, None),
    )
    .unwrap();
    linker
        .define(&mut store, "env", "memory", host_memory)
        .unwrap();
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let advise = func::<_, (), i32>(&mut store, &instance, "advise");
    assert_eq!(
        advise.call(&mut store, ()).unwrap(),
        TWM_ERR_NOT_DEVICE_MEMORY
    );
    assert_eq!(backend.driver().stats().calls(Operation::Advise), 0);
}

/// A guest that advises every other byte of its memory, alternating set and unset, leaves the
/// driver at most one advice range per [`HINT_GRANULARITY`] block of the memory (not one per
/// call), and every call succeeds.
#[test]
fn fragmenting_advice_is_bounded_by_the_memory_blocks() {
    const FRAGMENTER: &str = r#"(module
      (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
      (memory (export "memory") 4 4)
      (func (export "fragment") (result i32)
        (local $at i32) (local $codes i32)
        (block $done (loop $next
          (br_if $done (i32.ge_u (local.get $at) (i32.const 262144)))
          (local.set $codes (i32.or (local.get $codes)
            (call $advise (local.get $at) (i32.const 1)
              (i32.and (i32.shr_u (local.get $at) (i32.const 1)) (i32.const 1))
              (i32.const -1))))
          (local.set $at (i32.add (local.get $at) (i32.const 2)))
          (br $next)))
        (local.get $codes)))"#;
    let backend = mock();
    let creator = fresh(&backend);
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let tenant = Tenant::new(1, "guest", 1 << 20, IsolationLevel::StreamIsolated);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let module = Module::new(&engine, FRAGMENTER).unwrap();
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let before = backend.driver().hint_ranges();
    let codes = func::<_, (), i32>(&mut store, &instance, "fragment")
        .call(&mut store, ())
        .unwrap();
    assert_eq!(codes, TWM_OK, "every call succeeds");
    assert_eq!(store.data().guest().calls(), (131_072, 0));
    let blocks = 4 * PAGE / HINT_GRANULARITY;
    let held = backend.driver().hint_ranges() - before;
    assert!(
        held <= blocks,
        "{held} advice ranges for a memory of {blocks} blocks"
    );
}
