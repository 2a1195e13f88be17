//! Deadlines and fuel per call (`deadline`): an endless loop ends at its deadline, a call
//! without one runs on, fuel ends a loop, and what cannot be honoured is refused.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::deadline::{
    EpochTicker, Interruption, call_with_fuel, is_out_of_fuel, is_timeout,
};
use tensor_wasm_mem_wasmtime::wasmtime::{Engine, Instance, Linker, Module, Store};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, TwmError, instantiate, new_store,
};

const GUEST: &str = r#"(module
  (memory (export "memory") 1)
  (func (export "spin") (loop (br 0)))
  ;; Counts down from $n: about 3 instructions a turn.
  (func (export "count") (param $n i64) (result i64)
    (loop $l
      (local.set $n (i64.sub (local.get $n) (i64.const 1)))
      (br_if $l (i64.gt_s (local.get $n) (i64.const 0))))
    (local.get $n)))"#;

type Data = TenantStore<MockBackend, ()>;

fn setup(interruption: Interruption) -> (Engine, Store<Data>, Instance) {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .interruption(interruption)
        .build()
        .expect("creator");
    assert_eq!(creator.interruption(), interruption);
    let engine = creator.engine().expect("engine");
    let module = Module::new(&engine, GUEST).expect("module");
    let tenant = Tenant::new(1, "t", 64 << 20, IsolationLevel::StreamIsolated);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).expect("instance");
    (engine, store, instance)
}

fn count(
    store: &mut Store<Data>,
    instance: &Instance,
    n: i64,
) -> tensor_wasm_mem_wasmtime::wasmtime::Result<i64> {
    instance
        .get_typed_func::<i64, i64>(&mut *store, "count")?
        .call(store, n)
}

#[test]
fn an_endless_loop_ends_at_its_deadline() {
    let (engine, mut store, instance) = setup(Interruption::EPOCHS);
    let ticker = EpochTicker::start(&engine, Duration::from_millis(1)).expect("ticker");
    let spin = instance
        .get_typed_func::<(), ()>(&mut store, "spin")
        .expect("spin");
    let started = Instant::now();
    let error = ticker
        .call_within(&mut store, Duration::from_millis(50), |store| {
            spin.call(store, ())
        })
        .expect_err("interrupted");
    assert!(is_timeout(&error), "{error:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(50),
        "not before the deadline: {took:?}"
    );
    // The next call has no deadline: a loop of a few hundred milliseconds runs to its end.
    assert_eq!(
        count(&mut store, &instance, 50_000_000).expect("no deadline"),
        0
    );
    // And each call may have its own.
    let error = ticker
        .call_within(&mut store, Duration::from_millis(10), |store| {
            spin.call(store, ())
        })
        .expect_err("interrupted again");
    assert!(is_timeout(&error));
}

/// A deadline never fires early, whatever the ticker's phase: of a thousand short calls under a
/// deadline of one tick, any that is interrupted (a loaded machine may preempt a call past its
/// deadline) had run at least its deadline. No timing is asserted beyond that lower bound.
#[test]
fn a_deadline_never_fires_early() {
    let (engine, mut store, instance) = setup(Interruption::EPOCHS);
    let ticker = EpochTicker::start(&engine, Duration::from_millis(1)).expect("ticker");
    let deadline = Duration::from_millis(1);
    // Busy threads beyond the cores, so the ticker's thread wakes late now and then, as on a
    // loaded machine: a late ticker must not catch up with a burst of ticks.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    let busy: Vec<_> = (0..cores * 2)
        .map(|_| {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let _stop = StopOnDrop(stop, busy);
    for _ in 0..1000 {
        let start = Instant::now();
        let result = ticker.call_within(&mut store, deadline, |store| count(store, &instance, 10));
        if let Err(error) = result {
            let ran = start.elapsed();
            assert!(is_timeout(&error), "{error:?}");
            assert!(
                ran >= deadline,
                "interrupted after {ran:?}, before its deadline"
            );
        }
    }
}

/// Stops and joins the busy threads, also when the test fails.
struct StopOnDrop(
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    Vec<std::thread::JoinHandle<()>>,
);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in self.1.drain(..) {
            let _ = thread.join();
        }
    }
}

#[test]
fn with_interruption_on_a_store_runs_until_a_call_asks_for_a_limit() {
    let (_engine, mut store, instance) = setup(Interruption::BOTH);
    assert_eq!(count(&mut store, &instance, 1000).expect("runs"), 0);
}

#[test]
fn fuel_ends_a_loop_and_is_unlimited_again_after_the_call() {
    let (_engine, mut store, instance) = setup(Interruption::FUEL);
    let error = call_with_fuel(&mut store, 10_000, |store| {
        count(store, &instance, 1_000_000)
    })
    .expect_err("out of fuel");
    assert!(is_out_of_fuel(&error), "{error:?}");
    assert_eq!(
        call_with_fuel(&mut store, 10_000, |store| count(store, &instance, 100)).unwrap(),
        0,
        "a call within its fuel returns"
    );
    assert_eq!(count(&mut store, &instance, 1_000_000).unwrap(), 0);
}

#[test]
fn what_cannot_be_honoured_is_refused() {
    let (engine, mut store, instance) = setup(Interruption::NONE);
    // Fuel on an engine without it.
    let error = call_with_fuel(&mut store, 10, |store| count(store, &instance, 1)).unwrap_err();
    assert!(matches!(
        error.downcast_ref::<TwmError>(),
        Some(TwmError::Interruption(_))
    ));
    // A ticker of another engine.
    let other = Engine::default();
    let ticker = EpochTicker::start(&other, Duration::from_millis(1)).expect("ticker");
    let error = ticker
        .call_within(&mut store, Duration::from_millis(1), |_| Ok(()))
        .unwrap_err();
    assert!(matches!(
        error.downcast_ref::<TwmError>(),
        Some(TwmError::Interruption(_))
    ));
    // Ticks out of range.
    for tick in [
        Duration::ZERO,
        Duration::from_micros(99),
        Duration::from_secs(2),
    ] {
        assert!(matches!(
            EpochTicker::start(&engine, tick),
            Err(TwmError::Interruption(_))
        ));
    }
}

#[test]
fn ticks_round_up_and_never_overflow() {
    let engine = Engine::default();
    let ticker = EpochTicker::start(&engine, Duration::from_millis(10)).expect("ticker");
    // One more than the ticks in the duration: the next tick may come at once.
    assert_eq!(ticker.ticks_for(Duration::ZERO), 1);
    assert_eq!(ticker.ticks_for(Duration::from_millis(10)), 2);
    assert_eq!(ticker.ticks_for(Duration::from_millis(11)), 3);
    assert_eq!(
        ticker.ticks_for(Duration::MAX),
        tensor_wasm_mem_wasmtime::deadline::NO_DEADLINE
    );
}
