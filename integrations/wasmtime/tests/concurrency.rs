//! Many threads instantiating and dropping guests of several tenants against one Engine and one
//! pool: afterwards every counter is back to zero and no cap was ever passed (peaks checked).

mod common;

use common::*;

use std::sync::Arc;

use tensor_wasm_mem_core::{DeviceId, IsolationLevel, PoolConfig, SizeClass};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::*;

const GUEST: &str = r#"(module
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 8)
  (func (export "run") (param $pages i32) (result i32)
    (drop (memory.grow (local.get $pages)))
    (memory.fill (i32.const 0) (i32.const 0x5a) (i32.mul (memory.size) (i32.const 65536)))
    (drop (call $prefetch (i32.const 0) (i32.const 65536) (i32.const 0)))
    (i32.load8_u (i32.const 0))))"#;

#[test]
fn threads_and_tenants_leave_every_counter_at_zero() {
    const THREADS: usize = 6;
    const ITERATIONS: usize = 150;
    let backend = mock();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(8 * PAGE, 8)]))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let module = Module::new(&engine, GUEST).unwrap();
    let tenants: Vec<Arc<Tenant>> = [
        (6 * PAGE, IsolationLevel::Shared),
        (10 * PAGE, IsolationLevel::StreamIsolated),
        (16 * PAGE, IsolationLevel::ContextIsolated),
    ]
    .iter()
    .enumerate()
    .map(|(i, &(cap, level))| Tenant::new(i as u64, format!("t{i}"), cap as u64, level))
    .collect();

    let outcomes: Vec<(u64, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|thread| {
                let (engine, linker, module, creator, tenants) =
                    (&engine, &linker, &module, &creator, &tenants);
                scope.spawn(move || {
                    let (mut ran, mut refused) = (0u64, 0u64);
                    for i in 0..ITERATIONS {
                        let tenant = &tenants[(thread + i) % tenants.len()];
                        let mut store = new_store(
                            engine,
                            TenantStore::new(creator, tenant, ChargeMode::Touched, ()),
                        );
                        match instantiate(&mut store, linker, module) {
                            Ok(instance) => {
                                let run = instance
                                    .get_typed_func::<i32, i32>(&mut store, "run")
                                    .unwrap();
                                let pages = ((thread * 7 + i) % 5) as i32;
                                assert_eq!(run.call(&mut store, pages).unwrap(), 0x5a);
                                ran += 1;
                            }
                            // A full pool or a tenant at its cap: refused, with a reason.
                            Err(e) => {
                                assert!(!format!("{e:#}").is_empty());
                                refused += 1;
                            }
                        }
                    }
                    (ran, refused)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ran: u64 = outcomes.iter().map(|o| o.0).sum();
    let refused: u64 = outcomes.iter().map(|o| o.1).sum();
    eprintln!("concurrency: {THREADS} threads, {ran} lives, {refused} refused instantiations");
    assert!(
        ran > (THREADS * ITERATIONS) as u64 / 2,
        "most lives must run"
    );
    for t in &tenants {
        let s = t.stats();
        assert_eq!((s.live_bytes, s.live_memories), (0, 0), "{}", s.name);
        assert!(
            s.peak_bytes <= s.cap,
            "{} passed its cap: {} > {}",
            s.name,
            s.peak_bytes,
            s.cap
        );
    }
    let c = creator.stats();
    assert_eq!(c.live_memories, 0);
    let pool = c.pool.unwrap();
    assert_eq!((pool.in_use(), pool.free()), (0, 8));
    assert_eq!(pool.acquisitions, pool.releases);
    let b = backend.stats();
    assert_eq!((b.live_streams, b.live_contexts), (0, 0));
    assert_eq!(b.live_allocations, 1, "only the pool's slab");
}
