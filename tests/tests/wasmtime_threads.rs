//! Through Wasmtime, on the cudarc backend (the simulated libcuda where no GPU is present): two
//! threads run Store after Store of one context-isolated tenant, each guest calling
//! `twm.prefetch` on its own memory. Every prefetch succeeds (its stream is never inside a
//! destroyed context), no Store drop panics, and afterwards the tenant holds no context or
//! stream, in the backend's figures and in the driver's.
//!
//! Before the driver layer's tenant contexts were made atomic, 2 threads x 3,000 Stores saw
//! 90-133 failed prefetches and 53-96 leaked contexts, and once a panicking Store drop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_tests::Harness;
use tensor_wasm_mem_tests::harness::CudarcHarness;
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, add_to_linker, instantiate, new_store,
};

const GUEST: &str = r#"(module
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 1)
  (func (export "run") (result i32)
    (call $prefetch (i32.const 0) (i32.const 65536) (i32.const 0))))"#;

#[test]
fn context_isolated_stores_on_two_threads_prefetch_and_leave_nothing() {
    let stores = CudarcHarness::rounds(1500);
    let backend = CudarcHarness::backend();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .build()
        .expect("creator");
    let engine = creator.engine().expect("engine");
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).expect("linker");
    let module = Module::new(&engine, GUEST).expect("module");
    let tenant = Tenant::new(1, "ci", 64 << 20, IsolationLevel::ContextIsolated);
    let failed = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                for _ in 0..stores {
                    let mut store = new_store(
                        &engine,
                        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
                    );
                    let instance = instantiate(&mut store, &linker, &module).expect("instance");
                    let run = instance
                        .get_typed_func::<(), i32>(&mut store, "run")
                        .expect("run");
                    if run.call(&mut store, ()).expect("call") != 0 {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    assert_eq!(failed.load(Ordering::Relaxed), 0, "failed prefetches");
    let counters = CudarcHarness::counters(&backend).expect("a driver backend counts");
    assert_eq!(
        (counters.live_streams(), counters.live_contexts()),
        (0, 0),
        "(streams, contexts) left, cross-checked against the driver"
    );
    assert_eq!(tenant.stats().touched_bytes, 0);
}
