//! A creator that scrubs ahead (`CreatorBuilder::scrub_ahead`): its pool's thread zeroes a
//! slot a guest gave back while it is free, the next guest finds it zeroed with no scrub of its
//! own, and the thread is gone when the creator is; on a managed pool and on a guarded one. One
//! test in its own binary: it counts the process's threads by name, which tests running beside
//! it in one process would disturb.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tensor_wasm_mem_core::{DeviceId, PoolConfig, PoolStats, SizeClass};
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::*;

/// Threads of this process named `twm-scrub-*` now (Linux's `/proc`).
fn scrubbers() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| name.starts_with("twm-scrub-"))
        .count()
}

/// Waits (at most a minute) until `n` scrub-ahead threads run: a thread names itself as it
/// starts, a moment after it is spawned.
fn wait_scrubbers(n: usize) {
    let start = Instant::now();
    while scrubbers() != n {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{} scrub-ahead threads, not {n}",
            scrubbers()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits (at most a minute: a loaded machine is slow, never wrong) until the pool has scrubbed
/// `slots` slots ahead.
fn wait_scrubbed_ahead(creator: &TensorWasmMemoryCreator<MockBackend>, slots: u64) -> PoolStats {
    let start = Instant::now();
    loop {
        let pool = creator.stats().pool.expect("pooled");
        if pool.scrubbed_ahead >= slots {
            return pool;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "never scrubbed ahead: {pool:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_slot_scrubbed_ahead_reaches_the_next_guest_zeroed_and_the_thread_goes_with_the_creator() {
    assert_eq!(scrubbers(), 0);
    // A managed pool, then a guarded one (a device with pageable memory access).
    for (backend, guarded) in [(mock(), false), (pageable_mock(), true)] {
        let creator = TensorWasmMemoryCreator::builder(backend)
            .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 * PAGE, 1)]))
            .scrub_ahead()
            .build()
            .expect("pooled creator");
        assert_eq!(matches!(creator.backing(), Backing::Guarded(_)), guarded);
        wait_scrubbers(1); // one thread for the one pool
        scrubs_ahead(&creator);
        drop(creator);
        assert_eq!(scrubbers(), 0, "stopped and joined with the creator");
    }
}

/// A guest writes its page; the slot is scrubbed ahead, and the next guest reads zeros.
fn scrubs_ahead(creator: &TensorWasmMemoryCreator<MockBackend>) {
    let backing = creator.backing();
    let written = [0, 4096, PAGE as i32 - 4];
    {
        let (mut store, instance, _memory) = tenant_store(creator, 1);
        let store32 = func::<_, (i32, i32), ()>(&mut store, &instance, "store32");
        for &at in &written {
            store32.call(&mut store, (at, 0x5a5a_5a5a)).unwrap();
        }
    }
    let pool = wait_scrubbed_ahead(creator, 1);
    assert_eq!(
        (pool.scrubbed_ahead, pool.bytes_scrubbed),
        (1, PAGE as u64),
        "{backing:?}"
    );
    {
        let (mut store, instance, _memory) = tenant_store(creator, 2);
        let load = func::<_, i32, i32>(&mut store, &instance, "load32");
        for &at in &written {
            assert_eq!(
                load.call(&mut store, at).unwrap(),
                0,
                "scrubbed at {at} ({backing:?})"
            );
        }
    }
    // The second guest's page is scrubbed ahead too; every byte zeroed was zeroed ahead (an
    // acquisition's own scrub would add to `bytes_scrubbed` alone).
    let pool = wait_scrubbed_ahead(creator, 2);
    assert_eq!(
        (pool.acquisitions, pool.scrubbed_ahead, pool.bytes_scrubbed),
        (2, 2, 2 * PAGE as u64),
        "{backing:?}: {pool:?}"
    );
}
