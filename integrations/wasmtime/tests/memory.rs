//! Guest memory on the mock backend through the creator: growth, bounds, plans, data segments,
//! pool reuse, and the creator's refusals.

mod common;

use std::sync::Arc;

use common::*;
use tensor_wasm_mem_core::{Operation, PlanLimits};
use tensor_wasm_mem_wasmtime::TwmError;
use tensor_wasm_mem_wasmtime::wasmtime::{
    Config, Engine, Instance, Memory, MemoryType, Module, Store,
};

#[test]
fn store_load_grow_and_the_page_past_capacity() {
    let backend = mock();
    let creator = untenanted(&backend);
    let engine = creator.engine().unwrap();
    let module = access_module(&engine, 1, 4);
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let store32 = func::<_, (i32, i32), ()>(&mut store, &instance, "store32");
    let load32 = func::<_, i32, i32>(&mut store, &instance, "load32");
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    let size = func::<_, (), i32>(&mut store, &instance, "size");

    store32.call(&mut store, (100, 0x1234_5678)).unwrap();
    assert_eq!(load32.call(&mut store, 100).unwrap(), 0x1234_5678);
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    let base = memory.data_ptr(&store);
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
    assert_eq!(
        grow.call(&mut store, 2).unwrap(),
        2,
        "growth to the capacity works"
    );
    assert_eq!(size.call(&mut store, ()).unwrap(), 4);
    assert_eq!(memory.data_ptr(&store), base, "growth never moves the base");
    assert_eq!(
        grow.call(&mut store, 1).unwrap(),
        -1,
        "one page past capacity is -1"
    );
    assert_eq!(size.call(&mut store, ()).unwrap(), 4);
    // New pages read as zero and are usable.
    let last = (4 * PAGE - 4) as i32;
    assert_eq!(load32.call(&mut store, last).unwrap(), 0);
    store32.call(&mut store, (last, 7)).unwrap();
    assert_eq!(load32.call(&mut store, last).unwrap(), 7);
    assert_eq!(
        load32.call(&mut store, 100).unwrap(),
        0x1234_5678,
        "data kept"
    );
    assert_eq!(creator.stats().created, 1);
    drop(store);
    assert_eq!(creator.stats().live_memories, 0);
    assert_eq!(backend.stats().live_allocations, 0, "freed with the store");
}

#[test]
fn clamped_maximum_fails_growth_at_the_limit() {
    let backend = mock();
    let limits = PlanLimits::new(4 * PAGE as u64).unwrap();
    let creator = tensor_wasm_mem_wasmtime::TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .limits(limits)
        .allow_untenanted()
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = access_module(&engine, 1, 65536);
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 3).unwrap(), 1);
    assert_eq!(
        grow.call(&mut store, 1).unwrap(),
        -1,
        "declared 4 GiB, clamped to 4 pages"
    );
    assert_eq!(backend.stats().live_bytes, 4 * PAGE as u64);
}

/// Every out-of-bounds form traps, and a canary in the neighbouring pool slot survives.
#[test]
fn every_out_of_bounds_form_traps_and_the_neighbour_is_intact() {
    let backend = mock();
    let creator = untenanted_pooled(&backend, 2 * PAGE, 2);
    let engine = creator.engine().unwrap();
    let module = access_module(&engine, 1, 2);
    let mut store = Store::new(&engine, ());
    let guest = Instance::new(&mut store, &module, &[]).unwrap();
    let neighbour = Instance::new(&mut store, &module, &[]).unwrap();
    let guest_mem = guest.get_memory(&mut store, "memory").unwrap();
    let neighbour_mem = neighbour.get_memory(&mut store, "memory").unwrap();
    // The two memories are adjacent slots of one slab.
    let distance =
        (neighbour_mem.data_ptr(&store) as usize).abs_diff(guest_mem.data_ptr(&store) as usize);
    assert_eq!(distance, 2 * PAGE, "neighbouring slots");
    let canary = *b"CANARY!!";
    for offset in [0, PAGE - 8] {
        neighbour_mem.write(&mut store, offset, &canary).unwrap();
    }

    let load8 = func::<_, i32, i32>(&mut store, &guest, "load8");
    let load32 = func::<_, i32, i32>(&mut store, &guest, "load32");
    let load64 = func::<_, i32, i64>(&mut store, &guest, "load64");
    let load_off = func::<_, i32, i32>(&mut store, &guest, "load_off");
    let store8 = func::<_, (i32, i32), ()>(&mut store, &guest, "store8");
    let store32 = func::<_, (i32, i32), ()>(&mut store, &guest, "store32");
    let fill = func::<_, (i32, i32, i32), ()>(&mut store, &guest, "fill");
    let grow = func::<_, i32, i32>(&mut store, &guest, "grow");
    let end = PAGE as i32;

    assert_eq!(
        load8.call(&mut store, end - 1).unwrap(),
        0,
        "last byte is in bounds"
    );
    assert!(
        is_oob(&load8.call(&mut store, end).unwrap_err()),
        "one byte past the end"
    );
    assert!(
        is_oob(&load32.call(&mut store, end - 2).unwrap_err()),
        "straddling the end"
    );
    assert!(
        is_oob(&load64.call(&mut store, end - 4).unwrap_err()),
        "straddling, wider"
    );
    assert!(
        is_oob(&load_off.call(&mut store, 0).unwrap_err()),
        "static offset past the end"
    );
    assert!(is_oob(&store8.call(&mut store, (end, 0x66)).unwrap_err()));
    // Addresses that land in the neighbour's slot, and far beyond.
    for addr in [2 * end, 2 * end + 8, 3 * end - 8, i32::MAX, -1] {
        assert!(
            is_oob(&store32.call(&mut store, (addr, 0x6666_6666)).unwrap_err()),
            "store at {addr}"
        );
        assert!(
            is_oob(&load32.call(&mut store, addr).unwrap_err()),
            "load at {addr}"
        );
    }
    assert!(
        is_oob(&fill.call(&mut store, (end - 8, 0x66, 16)).unwrap_err()),
        "bulk fill past the end"
    );

    // After growth, the new end is the bound.
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
    let end = 2 * PAGE as i32;
    store8.call(&mut store, (end - 1, 1)).unwrap();
    assert!(
        is_oob(&load8.call(&mut store, end).unwrap_err()),
        "past the new end"
    );
    assert!(
        is_oob(&load32.call(&mut store, end - 1).unwrap_err()),
        "straddling the new end"
    );
    assert!(is_oob(&store8.call(&mut store, (end, 0x66)).unwrap_err()));
    assert_eq!(grow.call(&mut store, 1).unwrap(), -1);

    let mut seen = [0u8; 8];
    for offset in [0, PAGE - 8] {
        neighbour_mem.read(&store, offset, &mut seen).unwrap();
        assert_eq!(seen, canary, "neighbour canary at {offset}");
    }
    let mut rest = vec![0u8; PAGE - 16];
    neighbour_mem.read(&store, 8, &mut rest).unwrap();
    assert!(
        rest.iter().all(|&b| b == 0),
        "nothing else written in the neighbour"
    );
}

#[test]
fn huge_declared_maxima_allocate_no_more_than_the_limit() {
    let backend = mock();
    let creator = untenanted(&backend);
    let engine = creator.engine().unwrap();
    let mut store = Store::new(&engine, ());
    for wat in [
        "(module (memory (export \"memory\") 1 65536))",
        "(module (memory (export \"memory\") i64 1))",
        "(module (memory (export \"memory\") i64 1 281474976710656))",
    ] {
        let module = Module::new(&engine, wat).unwrap();
        let before = backend.stats().live_bytes;
        let instance = Instance::new(&mut store, &module, &[]).expect(wat);
        let grown = backend.stats().live_bytes - before;
        assert!(
            grown <= 256 << 20,
            "{wat}: asked the allocator for {grown} bytes"
        );
        let memory = instance.get_memory(&mut store, "memory").unwrap();
        assert_eq!(memory.data_size(&store), PAGE);
    }
    assert!(backend.driver().stats().peak_bytes <= 3 * (256 << 20));
}

#[test]
fn minimum_above_the_limit_is_refused_before_any_allocation() {
    let backend = mock();
    let creator = untenanted(&backend);
    let engine = creator.engine().unwrap();
    let mut store = Store::new(&engine, ());
    for wat in [
        "(module (memory 4097))",
        "(module (memory i64 4097))",
        "(module (memory 65536 65536))",
    ] {
        let module = Module::new(&engine, wat).unwrap();
        let err = Instance::new(&mut store, &module, &[]).expect_err(wat);
        assert!(
            format!("{err:#}").contains("per-memory limit"),
            "{wat}: {err:#}"
        );
    }
    assert_eq!(
        backend.driver().stats().calls(Operation::Allocate),
        0,
        "no allocation attempted"
    );
    assert_eq!(creator.stats().refused, 3);
}

#[test]
fn data_segments_work_with_copy_on_write_off() {
    let backend = mock();
    let creator = untenanted(&backend);
    let engine = creator.engine().unwrap();
    let module = Module::new(
        &engine,
        r#"(module (memory (export "memory") 2 2)
             (data (i32.const 0) "hello")
             (data (i32.const 65530) "straddles a page"))"#,
    )
    .unwrap();
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    let mut buf = [0u8; 16];
    memory.read(&store, 0, &mut buf[..5]).unwrap();
    assert_eq!(&buf[..5], b"hello");
    memory.read(&store, 65530, &mut buf).unwrap();
    assert_eq!(&buf, b"straddles a page");
}

#[test]
fn reused_pool_slot_reads_as_zeros() {
    let backend = mock();
    let creator = untenanted_pooled(&backend, 2 * PAGE, 1);
    let engine = creator.engine().unwrap();
    let module = access_module(&engine, 1, 2);
    let first_base;
    {
        let mut store = Store::new(&engine, ());
        let instance = Instance::new(&mut store, &module, &[]).unwrap();
        let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
        let fill = func::<_, (i32, i32, i32), ()>(&mut store, &instance, "fill");
        assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
        fill.call(&mut store, (0, 0xff, 2 * PAGE as i32)).unwrap();
        first_base = instance
            .get_memory(&mut store, "memory")
            .unwrap()
            .data_ptr(&store) as usize;
    }
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    assert_eq!(
        memory.data_ptr(&store) as usize,
        first_base,
        "the same slot"
    );
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
    let mut bytes = vec![1u8; 2 * PAGE];
    memory.read(&store, 0, &mut bytes).unwrap();
    assert!(
        bytes.iter().all(|&b| b == 0),
        "a reused slot must read as zeros"
    );
    let pool = creator.stats().pool.unwrap();
    assert_eq!(
        pool.bytes_scrubbed,
        2 * PAGE as u64,
        "scrubbed exactly the high-water mark"
    );
}

#[test]
fn exhausted_pool_refuses_instantiation_cleanly() {
    let backend = mock();
    let creator = untenanted_pooled(&backend, PAGE, 1);
    let engine = creator.engine().unwrap();
    let module = access_module(&engine, 1, 1);
    let mut store = Store::new(&engine, ());
    let _held = Instance::new(&mut store, &module, &[]).unwrap();
    let err = Instance::new(&mut store, &module, &[]).unwrap_err();
    assert!(format!("{err:#}").contains("exhausted"), "{err:#}");
}

#[test]
fn default_config_guard_and_reservation_are_refused_with_the_setting_to_change() {
    let backend = mock();
    let creator = untenanted(&backend);
    // A Config that keeps Wasmtime's defaults (4 GiB reservation, 32 MiB guard).
    let mut config = Config::new();
    config.with_host_memory(Arc::new(creator.clone()));
    let engine = Engine::new(&config).unwrap();
    let module = Module::new(&engine, "(module (memory 1))").unwrap();
    let mut store = Store::new(&engine, ());
    let err = Instance::new(&mut store, &module, &[]).unwrap_err();
    assert!(
        format!("{err:#}").contains("memory_guard_size(0)"),
        "{err:#}"
    );
    // Guard off, reservation on.
    let mut config = Config::new();
    config
        .signals_based_traps(false)
        .memory_guard_size(0)
        .with_host_memory(Arc::new(creator.clone()));
    let engine = Engine::new(&config).unwrap();
    let module = Module::new(&engine, "(module (memory 1))").unwrap();
    let mut store = Store::new(&engine, ());
    let err = Instance::new(&mut store, &module, &[]).unwrap_err();
    assert!(
        format!("{err:#}").contains("memory_reservation(0)"),
        "{err:#}"
    );
    assert_eq!(backend.driver().stats().calls(Operation::Allocate), 0);
}

#[test]
fn memories_that_bypass_the_creator_are_never_device_visible() {
    let backend = mock();
    let creator = untenanted(&backend);
    let engine = creator.engine().unwrap();
    let mut store = Store::new(&engine, ());
    // Memory::new never calls the creator.
    let host_made = Memory::new(&mut store, MemoryType::new(1, None)).unwrap();
    let err = creator.resolve(&store, &host_made, 0, 1).unwrap_err();
    assert!(matches!(err, TwmError::NotOurMemory), "{err}");
    assert!(matches!(
        creator.advise(
            &store,
            &host_made,
            0,
            1,
            tensor_wasm_mem_core::Advice::SetReadMostly
        ),
        Err(TwmError::NotOurMemory)
    ));

    // Nor does the pooling instance allocator.
    let mut config = Config::new();
    config.allocation_strategy(
        tensor_wasm_mem_wasmtime::wasmtime::InstanceAllocationStrategy::pooling(),
    );
    let pooling = Engine::new(&config).unwrap();
    let module = Module::new(&pooling, "(module (memory (export \"memory\") 1 1))").unwrap();
    let mut pool_store = Store::new(&pooling, ());
    let instance = Instance::new(&mut pool_store, &module, &[]).unwrap();
    let pooled_mem = instance.get_memory(&mut pool_store, "memory").unwrap();
    assert!(matches!(
        creator.resolve(&pool_store, &pooled_mem, 0, 1),
        Err(TwmError::NotOurMemory)
    ));

    // Ours resolves, within bounds only.
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1 2))").unwrap();
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let ours = instance.get_memory(&mut store, "memory").unwrap();
    let slice = creator.resolve(&store, &ours, 8, 16).unwrap();
    assert_eq!(slice.device_ptr(), ours.data_ptr(&store) as u64 + 8);
    assert_eq!(slice.len(), 16);
    assert!(creator.resolve(&store, &ours, PAGE as u64, 0).is_ok());
    assert!(matches!(
        creator.resolve(&store, &ours, PAGE as u64, 1),
        Err(TwmError::GuestRange(_))
    ));
    assert!(matches!(
        creator.resolve(&store, &ours, u64::MAX, 2),
        Err(TwmError::GuestRange(_))
    ));
    assert!(matches!(
        creator.resolve(&store, &ours, 1, u64::MAX),
        Err(TwmError::GuestRange(_))
    ));
}

#[test]
fn a_failing_backend_refuses_the_memory_and_leaks_nothing() {
    let backend = mock();
    let creator = untenanted(&backend);
    let engine = creator.engine().unwrap();
    let module = access_module(&engine, 1, 2);
    let mut store = Store::new(&engine, ());
    backend.driver().fail_nth(Operation::Allocate, 1);
    let err = Instance::new(&mut store, &module, &[]).unwrap_err();
    assert!(
        format!("{err:#}").contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{err:#}"
    );
    assert_eq!(backend.stats().live_allocations, 0);
    assert_eq!(creator.stats().live_memories, 0);
    Instance::new(&mut store, &module, &[]).expect("works again");
}
