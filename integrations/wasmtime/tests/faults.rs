//! A failure injected at every fallible step of the whole stack, at every position of a realistic
//! guest's life (instantiate, grow, host calls, a second instance, drop), on fresh and pooled
//! memories, with pool exhaustion and ledger denial in the mix: every run ends with zero live
//! allocations, streams and contexts in the backend, zero bytes charged to the tenant, an error
//! the caller can read (or success, if the failing call never came), and never a panic.

mod common;

use common::*;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use tensor_wasm_mem_core::{DeviceId, IsolationLevel, Operation, PoolConfig, SizeClass};
use tensor_wasm_mem_mock::{MockBackend, MockConfig};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::*;

const GUEST: &str = r#"(module
  (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 8)
  (data (i32.const 16) "payload")
  (func (export "life") (result i32)
    (local $codes i32)
    (drop (memory.grow (i32.const 2)))
    (i32.store (i32.const 131072) (i32.const 7))
    (local.set $codes (call $advise (i32.const 0) (i32.const 65536) (i32.const 2) (i32.const 0)))
    (local.set $codes (i32.add (local.get $codes)
      (call $prefetch (i32.const 0) (i32.const 65536) (i32.const 0))))
    (local.set $codes (i32.add (local.get $codes)
      (call $prefetch (i32.const 0) (i32.const 65536) (i32.const -1))))
    (local.get $codes)))"#;

#[derive(Clone, Copy, Debug)]
enum Memory {
    Fresh,
    /// A pool of this many slots (one slot makes the second instance meet an exhausted pool).
    Pooled(usize),
}

struct Outcome {
    /// What the caller saw, when something failed.
    error: Option<String>,
}

/// One guest's life; every failure comes back as a readable error.
fn life(
    backend: &Arc<MockBackend>,
    memory: Memory,
    cap: u64,
    isolation: IsolationLevel,
    fault: Option<(Operation, u64)>,
) -> (Outcome, Arc<Tenant>) {
    let tenant = Tenant::new(1, "faulty", cap, isolation);
    let mut builder = TensorWasmMemoryCreator::builder(Arc::clone(backend));
    if let Memory::Pooled(slots) = memory {
        builder = builder.pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(8 * PAGE, slots)],
        ));
    }
    if let Some((op, n)) = fault {
        backend.driver().fail_nth(op, n);
    }
    let run = || -> Result<(), String> {
        let creator = builder.build().map_err(|e| format!("creator: {e}"))?;
        let engine = creator.engine().map_err(|e| format!("engine: {e:#}"))?;
        let mut linker = Linker::new(&engine);
        add_to_linker(&mut linker).map_err(|e| format!("{e:#}"))?;
        let module = Module::new(&engine, GUEST).map_err(|e| format!("{e:#}"))?;
        let mut store = new_store(
            &engine,
            TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
        );
        let first = instantiate(&mut store, &linker, &module).map_err(|e| format!("{e:#}"))?;
        let life = first
            .get_typed_func::<(), i32>(&mut store, "life")
            .map_err(|e| format!("{e:#}"))?;
        let codes = life.call(&mut store, ()).map_err(|e| format!("{e:#}"))?;
        // A second instance in the same Store: meets a full pool or the cap.
        let second =
            instantiate(&mut store, &linker, &module).map_err(|e| format!("second: {e:#}"));
        if let Ok(second) = &second {
            let life = second
                .get_typed_func::<(), i32>(&mut store, "life")
                .map_err(|e| format!("{e:#}"))?;
            life.call(&mut store, ()).map_err(|e| format!("{e:#}"))?;
        }
        drop(store);
        second?;
        if codes != 0 {
            return Err(format!("host calls answered codes summing to {codes}"));
        }
        Ok(())
    };
    let result = catch_unwind(AssertUnwindSafe(run))
        .unwrap_or_else(|panic| panic!("a panic escaped: {:?}", panic.downcast_ref::<String>()));
    backend.driver().clear_faults();
    (
        Outcome {
            error: result.err(),
        },
        tenant,
    )
}

#[test]
fn every_fault_at_every_position_leaves_nothing() {
    let ops = [
        Operation::Allocate,
        Operation::Zero,
        Operation::Advise,
        Operation::Prefetch,
        Operation::AcquireStream,
        Operation::ReleaseStream,
        Operation::Free,
    ];
    let setups = [
        (Memory::Fresh, u64::MAX),
        (Memory::Pooled(2), u64::MAX),
        (Memory::Pooled(1), u64::MAX),
        (Memory::Fresh, 4 * PAGE as u64),
        (Memory::Pooled(2), 3 * PAGE as u64),
    ];
    let (mut runs, mut injected, mut failed) = (0u64, 0u64, 0u64);
    for (memory, cap) in setups {
        for isolation in IsolationLevel::ALL {
            // First the clean life, then a failure at each of its first eight calls of each
            // operation.
            let faults = std::iter::once(None).chain(
                ops.iter()
                    .flat_map(|&op| (1..=8).map(move |n| Some((op, n)))),
            );
            for fault in faults {
                // Poisoned memory, so zeroing is a real step of the life.
                let backend = Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
                    poison_fresh_allocations: true,
                    ..MockConfig::default()
                }));
                let (outcome, tenant) = life(&backend, memory, cap, isolation, fault);
                let label = format!("{memory:?} cap={cap} {isolation} fault={fault:?}");
                runs += 1;
                injected += backend.driver().stats().injected_failures;
                if let Some(error) = &outcome.error {
                    failed += 1;
                    assert!(!error.is_empty(), "{label}: an error must say something");
                }
                let stats = backend.driver().stats();
                let t = tenant.stats();
                // A stream the driver would not release (its wait or its destroy refused) may
                // still have work queued: its Store's memories are kept, never given back nor
                // scrubbed for another tenant, and when the creator goes they are left to the
                // driver and charged to the tenant for good. Nothing else is left.
                let busy = t.live_memories;
                if busy > 0 {
                    assert!(
                        matches!(
                            fault,
                            Some((Operation::ReleaseStream | Operation::Synchronize, _))
                        ),
                        "{label}: {busy} memories left"
                    );
                    assert_eq!(t.held_bytes, t.stranded_bytes, "{label}: left, stranded");
                }
                // A memory whose free the driver refused is kept by its creator, with its
                // charge, and released again when the creator goes. (A pool's slab the driver
                // refuses to free is left to the backend, which frees it when it drops: no
                // tenant pays for it.)
                let lost_slabs = match (fault, memory) {
                    (Some((Operation::Free, _)), Memory::Pooled(_)) => stats.injected_failures,
                    _ => 0,
                };
                let left_fresh = if matches!(memory, Memory::Fresh) {
                    busy
                } else {
                    0
                };
                assert_eq!(
                    stats.live_allocations,
                    lost_slabs + left_fresh,
                    "{label}: allocations leaked"
                );
                // Likewise a failed stream release keeps the stream (and so the tenant's context):
                // the shared stream has nothing to lose.
                let lost_streams = match fault {
                    Some((Operation::ReleaseStream, _)) => stats.injected_failures,
                    _ => 0,
                };
                assert!(
                    stats.live_streams <= lost_streams,
                    "{label}: streams leaked"
                );
                assert!(
                    stats.live_contexts <= lost_streams,
                    "{label}: contexts leaked"
                );
                if busy == 0 {
                    assert_eq!(
                        (t.touched_bytes, t.held_bytes),
                        (0, 0),
                        "{label}: tenant charge left"
                    );
                }
                assert!(t.touched_peak_bytes <= cap, "{label}: cap passed");
            }
        }
    }
    eprintln!(
        "fault injection: {runs} runs, {injected} failures injected, {failed} runs reported an error"
    );
    assert!(
        injected > 100 && failed > 50,
        "the faults must actually bite"
    );
}
