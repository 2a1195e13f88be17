//! A released pool slot is scrubbed where its pages are and moves no dead bytes: a slot only the
//! host wrote is zeroed on the host, a slot device work touched is zeroed on the device, and no
//! hint reset prefetches anything back. The simulated driver counts every byte that crosses the
//! link (`ModelStats::migrated_to_*_bytes`), so these fail if a release migrates anything.

mod common;

use std::sync::Arc;

use common::*;
use tensor_wasm_mem_core::Advice;
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::*;

/// Bytes moved each way so far.
fn migrated(backend: &MockBackend) -> (u64, u64) {
    let stats = backend.driver().stats();
    (stats.migrated_to_device_bytes, stats.migrated_to_host_bytes)
}

/// The next tenant takes the same slot: it reads zeros everywhere the last one wrote.
fn next_tenant_reads_zeros(creator: &TensorWasmMemoryCreator<MockBackend>, written: &[i32]) {
    let (mut store, instance, _memory) = tenant_store(creator, 2);
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(
        grow.call(&mut store, 1).unwrap(),
        1,
        "the same slot holds two pages"
    );
    let load = func::<_, i32, i32>(&mut store, &instance, "load32");
    for &at in written {
        assert_eq!(load.call(&mut store, at).unwrap(), 0, "scrubbed at {at}");
    }
}

#[test]
fn release_migrates_nothing_for_a_host_written_slot() {
    let backend = mock();
    let creator = pooled(&backend, 4 * PAGE, 1);
    let (mut store, instance, _memory) = tenant_store(&creator, 1);
    let store32 = func::<_, (i32, i32), ()>(&mut store, &instance, "store32");
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
    let written = [0, 4096, PAGE as i32 + 8, 2 * PAGE as i32 - 4];
    for &at in &written {
        store32.call(&mut store, (at, 0x5a5a_5a5a)).unwrap();
    }
    let before = migrated(&backend);
    drop(store);
    next_tenant_reads_zeros(&creator, &written);
    assert_eq!(
        migrated(&backend),
        before,
        "a host-written slot is scrubbed on the host"
    );
    let pool = creator.stats().pool.expect("pooled");
    assert!(pool.bytes_scrubbed >= 2 * PAGE as u64, "{pool:?}");
}

#[test]
fn release_migrates_nothing_for_a_kernel_written_slot() {
    let backend = mock();
    let creator = pooled(&backend, 4 * PAGE, 1);
    let (mut store, _instance, memory) = tenant_store(&creator, 1);
    // A kernel writes the first page through a device-access scope (which prefetches it to the
    // device): the pages are on the device when the tenant goes.
    let scope = DeviceAccess::open(
        &mut store,
        &creator,
        &memory,
        &[AccessRange::read_write(0, PAGE as u64)],
    )
    .unwrap();
    let slice = scope.slice(0).unwrap();
    // SAFETY: the scope holds the Store: nothing reads the bytes until it closes.
    unsafe {
        backend
            .driver()
            .enqueue_fill(scope.stream(), slice.device_ptr(), PAGE, 0x77)
    }
    .unwrap();
    scope.close().unwrap();
    // The tenant also advised it: the reset must not move pages either.
    creator
        .advise(&store, &memory, 0, PAGE as u64, Advice::SetReadMostly)
        .unwrap();
    let before = migrated(&backend);
    assert!(
        before.0 > 0,
        "the scope's prefetch placed the page on the device"
    );
    drop(store);
    next_tenant_reads_zeros(&creator, &[0, 4096, PAGE as i32 - 4]);
    assert_eq!(
        migrated(&backend),
        before,
        "a kernel-written slot is scrubbed on the device, and nothing is prefetched back"
    );
    let pool = creator.stats().pool.expect("pooled");
    assert_eq!(pool.hint_resets, 1, "{pool:?}");
}

/// The host-side scrub is a real scrub: with poisoned fresh memory (a driver whose allocations do
/// not come zeroed) every slot is zeroed before its first holder too, on the host, moving
/// nothing.
#[test]
fn release_migrates_nothing_when_a_poisoned_slab_is_scrubbed_on_the_host() {
    let backend = Arc::new(tensor_wasm_mem_mock::with_config(
        tensor_wasm_mem_mock::MockConfig {
            poison_fresh_allocations: true,
            ..tensor_wasm_mem_mock::MockConfig::default()
        },
    ));
    let creator = pooled(&backend, 4 * PAGE, 1);
    let before = migrated(&backend);
    next_tenant_reads_zeros(&creator, &[0, PAGE as i32 - 4]);
    assert_eq!(migrated(&backend), before);
}
