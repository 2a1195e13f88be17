//! The guarded host backing: real guard pages, honest capabilities, bounds still enforced.

mod common;

use common::*;
use tensor_wasm_mem_core::PlanLimits;
use tensor_wasm_mem_wasmtime::wasmtime::{Config, Engine, Instance, Memory, MemoryType, Store};
use tensor_wasm_mem_wasmtime::{
    BoundsStrategy, GUARDED_CAPABILITIES, GUARDED_GUARD, GUARDED_RESERVATION, GuardedHostCreator,
    TwmError,
};

#[test]
fn capabilities_are_honest() {
    const { assert!(GUARDED_CAPABILITIES.guard_pages) };
    const { assert!(!GUARDED_CAPABILITIES.device_accessible) };
    const { assert!(!GUARDED_CAPABILITIES.is_uvm()) };
    assert_eq!(
        BoundsStrategy::for_capabilities(&GUARDED_CAPABILITIES),
        BoundsStrategy::GuardPages {
            reservation: GUARDED_RESERVATION,
            guard: GUARDED_GUARD
        }
    );
}

#[test]
fn guest_runs_and_every_out_of_bounds_form_traps() {
    let creator = GuardedHostCreator::new(PlanLimits::default());
    let engine = creator.engine().unwrap();
    let module = access_module(&engine, 1, 2);
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let load8 = func::<_, i32, i32>(&mut store, &instance, "load8");
    let load32 = func::<_, i32, i32>(&mut store, &instance, "load32");
    let load_off = func::<_, i32, i32>(&mut store, &instance, "load_off");
    let store32 = func::<_, (i32, i32), ()>(&mut store, &instance, "store32");
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    let end = PAGE as i32;
    store32.call(&mut store, (end - 4, 5)).unwrap();
    assert_eq!(load32.call(&mut store, end - 4).unwrap(), 5);
    assert!(is_oob(&load8.call(&mut store, end).unwrap_err()));
    assert!(is_oob(&load32.call(&mut store, end - 2).unwrap_err()));
    assert!(is_oob(&load_off.call(&mut store, 0).unwrap_err()));
    for addr in [2 * end, i32::MAX, -1] {
        assert!(
            is_oob(&store32.call(&mut store, (addr, 1)).unwrap_err()),
            "store at {addr}"
        );
    }
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
    assert_eq!(
        load8.call(&mut store, end).unwrap(),
        0,
        "grown pages are zero and accessible"
    );
    assert!(
        is_oob(&load8.call(&mut store, 2 * end).unwrap_err()),
        "past the new end"
    );
    assert_eq!(grow.call(&mut store, 1).unwrap(), -1);
    assert_eq!(creator.created(), 1);
}

#[test]
fn guarded_memory_is_never_device_visible() {
    let backend = mock();
    let managed = fresh(&backend);
    let creator = GuardedHostCreator::new(PlanLimits::default());
    let engine = creator.engine().unwrap();
    let module = access_module(&engine, 1, 1);
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    assert!(matches!(
        managed.resolve(&store, &memory, 0, 1),
        Err(TwmError::NotOurMemory)
    ));
    let _ = Memory::new(&mut store, MemoryType::new(1, None)).unwrap();
}

#[test]
fn honours_whatever_guard_the_engine_asks_for() {
    // A smaller reservation and guard than the recipe's: still honoured, still safe.
    let creator = GuardedHostCreator::new(PlanLimits::default());
    let mut config = Config::new();
    creator.install(&mut config);
    config
        .memory_reservation(1 << 20)
        .memory_guard_size(64 << 10);
    let engine = Engine::new(&config).unwrap();
    let module = access_module(&engine, 1, 16);
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let load8 = func::<_, i32, i32>(&mut store, &instance, "load8");
    let load_off = func::<_, i32, i32>(&mut store, &instance, "load_off");
    assert!(is_oob(&load8.call(&mut store, PAGE as i32).unwrap_err()));
    assert!(is_oob(&load_off.call(&mut store, 1 << 20).unwrap_err()));
}
