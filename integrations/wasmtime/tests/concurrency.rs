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
        assert_eq!((s.touched_bytes, s.live_memories), (0, 0), "{}", s.name);
        assert!(
            s.touched_peak_bytes <= s.touched_limit,
            "{} passed its cap: {} > {}",
            s.name,
            s.touched_peak_bytes,
            s.touched_limit
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

/// One hostile tenant (many memories, huge tables, growth past its cap, traps) beside honest
/// ones on one Engine and one pool, each on its own thread: the honest tenants never see a
/// denial, and every ledger, the pool and the backend are back at zero after.
#[test]
fn a_hostile_tenant_takes_nothing_from_the_others() {
    const ROUNDS: usize = 60;
    let backend = mock();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(8 * PAGE, 12)]))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let honest_module = Module::new(&engine, GUEST).unwrap();
    // Sized as docs/SAFETY.md says: the hostile tenant may hold 4 of the 12 slots; the two
    // honest ones need one each at a time.
    let hostile = Tenant::with_budgets(
        66,
        "hostile",
        tensor_wasm_mem_core::TenantBudgets {
            touched_bytes: PAGE as u64,
            held_bytes: 4 * 8 * PAGE as u64,
            memories: 8,
        },
        IsolationLevel::StreamIsolated,
    );
    let honest: Vec<Arc<Tenant>> = (1..=2)
        .map(|id| {
            Tenant::new(
                id,
                format!("honest{id}"),
                16 * PAGE as u64,
                IsolationLevel::StreamIsolated,
            )
        })
        .collect();
    let attacks: Vec<Module> = [
        "(module (memory 0 4) (memory 0 4) (memory 0 4) (memory 0 4) (memory 0 4) (memory 0 4))",
        "(module (memory 0 4) (memory 0 4) (memory 0 4))",
        "(module (table 5000000 funcref))",
        r#"(module (table 1 funcref)
             (func (export "run") (drop (table.grow (ref.null func) (i32.const 4000000)))))"#,
        r#"(module (memory 1 4)
             (func (export "run") (drop (memory.grow (i32.const 3))) (unreachable)))"#,
    ]
    .iter()
    .map(|wat| Module::new(&engine, wat).unwrap())
    .collect();
    std::thread::scope(|scope| {
        let (creator, linker, engine) = (&creator, &linker, &engine);
        let hostile = &hostile;
        let attacks = &attacks;
        let attacker = scope.spawn(move || {
            let mut refused = 0;
            for _ in 0..ROUNDS {
                let data = TenantStore::new(creator, hostile, ChargeMode::Touched, ());
                let mut store = new_store(engine, data);
                for module in attacks {
                    match instantiate(&mut store, linker, module) {
                        Ok(instance) => {
                            if let Ok(run) = instance.get_typed_func::<(), ()>(&mut store, "run") {
                                let _ = run.call(&mut store, ());
                            }
                        }
                        Err(_) => refused += 1,
                    }
                }
            }
            refused
        });
        let workers: Vec<_> = honest
            .iter()
            .map(|t| {
                let module = &honest_module;
                scope.spawn(move || {
                    for _ in 0..ROUNDS {
                        let data = TenantStore::new(creator, t, ChargeMode::Touched, ());
                        let mut store = new_store(engine, data);
                        let instance =
                            instantiate(&mut store, linker, module).expect("never denied");
                        let run = instance
                            .get_typed_func::<i32, i32>(&mut store, "run")
                            .unwrap();
                        assert_eq!(run.call(&mut store, 2).unwrap(), 0x5a);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert!(
            attacker.join().unwrap() >= 2 * ROUNDS,
            "the hostile tenant was refused"
        );
    });
    for t in &honest {
        let s = t.stats();
        assert_eq!(s.denials, 0, "{s:?}");
        assert_eq!((s.touched_bytes, s.held_bytes, s.live_memories), (0, 0, 0));
    }
    let s = hostile.stats();
    assert!(
        s.held_denials > 0 && s.held_peak_bytes <= 32 * PAGE as u64,
        "{s:?}"
    );
    assert_eq!((s.touched_bytes, s.held_bytes, s.live_memories), (0, 0, 0));
    assert_eq!(creator.stats().pool.unwrap().in_use(), 0);
    assert_eq!(backend.stats().live_streams, 0);
}
