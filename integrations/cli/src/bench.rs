//! `twm bench`: tensor-wasm-mem against Wasmtime's own allocators, in one run, medians and ratios.
//!
//! Method (see docs/BENCHMARKS.md): every figure is a median over samples; the guest loop is
//! measured at several code placements (the module padded with unused functions before the loop)
//! and the median over placements is reported; resident memory is measured in a fresh child
//! process per configuration.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use tensor_wasm_mem_core::{DeviceId, IsolationLevel, PlanLimits, PoolConfig, SizeClass};
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::deadline::{Interruption, NO_DEADLINE};
use tensor_wasm_mem_wasmtime::wasi::{WasiP1Ctx, add_wasi_to_linker};
use tensor_wasm_mem_wasmtime::wasmtime::{
    self, Config, Engine, InstanceAllocationStrategy, InstancePre, Linker, Module,
    PoolingAllocationConfig, Store,
};
use tensor_wasm_mem_wasmtime::{
    Access, Backing, ChargeMode, CreatorBuilder, GuardedHostCreator, Tenant, TenantStore,
    TensorWasmMemoryCreator, TwmError, instantiate_pre, new_store,
};

use crate::run::Failure;

/// `twm bench` arguments.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Fewer samples: finishes in well under a minute on 2 cores.
    #[arg(long)]
    pub quick: bool,
    /// Internal: the smallest run that reaches every row (a few lives each), for the CLI's
    /// tests: its figures are noise, and it says so (`"smoke": true`).
    #[arg(long, hide = true, conflicts_with = "quick")]
    pub smoke: bool,
    /// Print one JSON object with stable keys instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Internal: measure resident memory of one configuration in this (child) process.
    #[arg(long, hide = true, value_name = "CONFIG")]
    pub rss_child: Option<String>,
    /// Internal: run 1,000,000 instantiate+call+drop lives of one setup (its `--json` key) and
    /// print the microseconds per life (and the median of batches of 1,000): a loop to put
    /// under `perf record`, or to compare two builds.
    #[arg(long, hide = true, value_name = "SETUP")]
    pub lives_of: Option<String>,
    /// Internal: the lives `--lives-of` runs, in batches of 1,000 (at least one batch), in place
    /// of a million: few enough to run under an instruction counter (valgrind's `callgrind`),
    /// where the difference between two counts over the difference of their lives is what one
    /// life executes.
    #[arg(long, hide = true, value_name = "LIVES", requires = "lives_of")]
    pub lives: Option<u32>,
}

const SMALL: &str = r#"(module
  (memory (export "memory") 1 16)
  (func (export "run") (i32.store (i32.const 0) (i32.const 1))))"#;

const GROW: &str = r#"(module
  (memory 1 65536)
  (func (export "grow") (param $n i32) (result i32)
    (local $i i32)
    (loop $next
      (drop (memory.grow (i32.const 1)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $next (i32.lt_u (local.get $i) (local.get $n))))
    (memory.size)))"#;

const LOOP_BYTES: u32 = 16 << 20;

/// A guest that fills its first `n` bytes and sums them back, over 64 MiB plus a page.
const ROUNDTRIP: &str = r#"(module
  (import "twm" "kernel" (func $kernel (param i32 i32) (result i32)))
  (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1025 1025)
  (data (i32.const 67108928) "increment")
  ;; Launches the built-in increment on its first $n bytes (arguments past 64 MiB).
  (func (export "launch") (param $n i32) (result i32)
    (i64.store (i32.const 67108864) (i64.const 0))
    (i64.store (i32.const 67108872) (i64.extend_i32_u (local.get $n)))
    (call $launch (call $kernel (i32.const 67108928) (i32.const 9)) (i32.const 67108864) (i32.const 1)))
  (func (export "fill") (param $n i32) (local $i i32)
    (loop $next
      (i32.store8 (local.get $i) (local.get $i))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $next (i32.lt_u (local.get $i) (local.get $n)))))
  (func (export "sum") (param $n i32) (result i32) (local $i i32) (local $s i32)
    (loop $next
      (local.set $s (i32.add (local.get $s) (i32.load8_u (local.get $i))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $next (i32.lt_u (local.get $i) (local.get $n))))
    (local.get $s)))"#;

/// The kernel round-trip sizes.
const ROUNDTRIP_SIZES: [(&str, u32); 3] =
    [("64KiB", 64 << 10), ("1MiB", 1 << 20), ("64MiB", 64 << 20)];

#[derive(Clone, Copy)]
struct Sizes {
    instantiate_iters: usize,
    instantiate_batches: usize,
    grow_samples: usize,
    grow_per_sample: i32,
    loop_placements: usize,
    loop_samples: usize,
    loop_passes: i32,
    rss_instances: usize,
    /// Lives run unmeasured before a setup is timed.
    warm_up: usize,
    /// The fewest lives each thread of the threaded rows runs.
    threaded_lives: usize,
    /// Round trips timed per kernel round-trip size.
    roundtrip_samples: usize,
    /// Placement decisions: samples, and decisions per sample.
    decisions: (usize, u64),
    /// Tenants placed before a decision is timed, and for the bookkeeping-memory figure.
    placed_tenants: (u64, u64),
}

impl Sizes {
    fn new(args: &BenchArgs) -> Self {
        let full = Self {
            instantiate_iters: 20_000,
            instantiate_batches: 25,
            grow_samples: 41,
            grow_per_sample: 2000,
            loop_placements: 12,
            loop_samples: 9,
            loop_passes: 8,
            rss_instances: 1000,
            warm_up: 200,
            threaded_lives: 200,
            roundtrip_samples: 9,
            decisions: (31, 1000),
            placed_tenants: (PLACED_TENANTS, MEMORY_TENANTS),
        };
        if args.smoke {
            Self {
                instantiate_iters: 30,
                instantiate_batches: 3,
                grow_samples: 3,
                grow_per_sample: 20,
                loop_placements: 1,
                loop_samples: 1,
                loop_passes: 1,
                rss_instances: 20,
                warm_up: 2,
                threaded_lives: 2,
                roundtrip_samples: 1,
                decisions: (3, 5),
                placed_tenants: (20, 50),
            }
        } else if args.quick {
            Self {
                instantiate_iters: 6_000,
                instantiate_batches: 15,
                grow_samples: 21,
                grow_per_sample: 1000,
                loop_placements: 6,
                loop_samples: 5,
                roundtrip_samples: 5,
                loop_passes: 4,
                decisions: (15, 200),
                ..full
            }
        } else {
            full
        }
    }
}

fn other(e: impl std::fmt::Display) -> Failure {
    Failure::Other(e.to_string())
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The configurations compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    WasmtimeDefault,
    WasmtimePooling,
    TwmFresh,
    TwmPooled,
    /// `TwmPooled` with WASI in the linker and Store data that makes a WASI context only if the
    /// guest calls WASI (as `twm run` does), on the same module, which imports nothing.
    TwmPooledWasi,
    TwmGuarded,
    /// The device-visible guarded backing, fresh memories: what `Backing::detect` picks on a
    /// simulated device with pageable memory access (guard pages, no bounds checks, and a
    /// device that reaches the pages).
    TwmDeviceGuarded,
    /// The same from a guarded slot pool.
    TwmDeviceGuardedPooled,
    /// `TwmDeviceGuardedPooled` with the pool's scrub-ahead thread.
    TwmDeviceGuardedPooledScrubAhead,
    /// The floor: the same instantiate+call+drop of a module with no memory (a global instead),
    /// on the pooled setup's engine.
    NoMemoryFloor,
    /// `TwmPooled` for a tenant: its Store made by `new_store` (the limiter installed), the
    /// instance made by `instantiate`, the memory charged to the tenant.
    TwmPooledTenant,
    /// `TwmPooled` with the pool's scrub-ahead thread (`CreatorBuilder::scrub_ahead`): the
    /// slot an instantiation takes was zeroed on another core.
    TwmPooledScrubAhead,
    /// `TwmFresh` with epoch interruption compiled in (what `twm run --timeout` costs).
    TwmEpochs,
    /// `TwmFresh` with fuel compiled in (what `twm run --fuel` costs).
    TwmFuel,
}

/// The simulated machine the device-guarded setups run on: one device with pageable memory
/// access (HMM), on which `Backing::detect` picks the guarded pageable backing.
fn pageable_mock() -> Arc<MockBackend> {
    Arc::new(tensor_wasm_mem_mock::with_config(
        tensor_wasm_mem_mock::MockConfig {
            pageable_memory_access: true,
            ..tensor_wasm_mem_mock::MockConfig::default()
        },
    ))
}

/// The backing the device-guarded setups run on (named in the output).
fn device_guarded_backing() -> Backing {
    Backing::detect(&*pageable_mock(), &[DeviceId(0)])
}

impl Setup {
    fn key(self) -> &'static str {
        match self {
            Self::WasmtimeDefault => "wasmtime_default",
            Self::WasmtimePooling => "wasmtime_pooling",
            Self::TwmFresh => "twm_fresh",
            Self::TwmPooled => "twm_pooled",
            Self::TwmPooledWasi => "twm_pooled_wasi",
            Self::TwmGuarded => "twm_guarded",
            Self::TwmDeviceGuarded => "twm_device_guarded",
            Self::TwmDeviceGuardedPooled => "twm_device_guarded_pooled",
            Self::TwmDeviceGuardedPooledScrubAhead => "twm_device_guarded_pooled_scrub_ahead",
            Self::NoMemoryFloor => "no_memory_floor",
            Self::TwmPooledTenant => "twm_pooled_tenant",
            Self::TwmPooledScrubAhead => "twm_pooled_scrub_ahead",
            Self::TwmEpochs => "twm_checked_epochs",
            Self::TwmFuel => "twm_checked_fuel",
        }
    }

    fn from_key(key: &str) -> Option<Self> {
        [
            Self::WasmtimeDefault,
            Self::WasmtimePooling,
            Self::TwmFresh,
            Self::TwmPooled,
            Self::TwmPooledWasi,
            Self::TwmGuarded,
            Self::TwmDeviceGuarded,
            Self::TwmDeviceGuardedPooled,
            Self::TwmDeviceGuardedPooledScrubAhead,
            Self::NoMemoryFloor,
            Self::TwmPooledTenant,
            Self::TwmPooledScrubAhead,
            Self::TwmEpochs,
            Self::TwmFuel,
        ]
        .into_iter()
        .find(|s| s.key() == key)
    }

    /// An engine for this setup. `slots` sizes the pools.
    fn engine(self, slots: usize) -> Result<Engine, Failure> {
        let mock = || Arc::new(MockBackend::default());
        let engine = match self {
            Self::WasmtimeDefault => Engine::new(&Config::new()),
            Self::WasmtimePooling => {
                let mut pooling = PoolingAllocationConfig::new();
                pooling
                    .total_memories(slots as u32)
                    .total_tables(slots as u32)
                    .total_core_instances(slots as u32)
                    .max_memory_size(16 << 16);
                let mut config = Config::new();
                config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling));
                Engine::new(&config)
            }
            Self::TwmFresh => fresh_engine(mock(), Interruption::NONE),
            Self::TwmEpochs => fresh_engine(mock(), Interruption::EPOCHS),
            Self::TwmFuel => fresh_engine(mock(), Interruption::FUEL),
            Self::TwmPooled | Self::TwmPooledWasi | Self::NoMemoryFloor => {
                pooled_engine(mock(), slots)
            }
            Self::TwmPooledTenant => pooled_creator(mock(), slots).and_then(|c| c.engine()),
            Self::TwmPooledScrubAhead => {
                pooled_builder(mock(), slots).and_then(|b| built(b.scrub_ahead())?.engine())
            }
            Self::TwmGuarded => GuardedHostCreator::new(PlanLimits::default()).engine(),
            Self::TwmDeviceGuarded => fresh_engine(pageable_mock(), Interruption::NONE),
            Self::TwmDeviceGuardedPooled => pooled_engine(pageable_mock(), slots),
            Self::TwmDeviceGuardedPooledScrubAhead => pooled_builder(pageable_mock(), slots)
                .and_then(|b| built(b.scrub_ahead())?.engine()),
        };
        engine.map_err(other)
    }
}

/// An engine whose creator on `backend` makes a fresh memory each time (of the backing the
/// backend's devices call for). These rows measure the creator for Stores of no tenant, as
/// Wasmtime's rows do (untenanted memories allowed); the tenant's own path is measured apart.
fn fresh_engine(backend: Arc<MockBackend>, interruption: Interruption) -> wasmtime::Result<Engine> {
    TensorWasmMemoryCreator::builder(backend)
        .interruption(interruption)
        .allow_untenanted()
        .build()
        .map_err(wasmtime::Error::new)?
        .engine()
}

/// An engine whose creator on `backend` takes memories from a pool of `slots` 1 MiB slots.
fn pooled_engine(backend: Arc<MockBackend>, slots: usize) -> wasmtime::Result<Engine> {
    pooled_creator(backend, slots)?.engine()
}

/// The creator of [`pooled_engine`] (a tenant may hold every slot: one tenant is measured).
fn pooled_creator(
    backend: Arc<MockBackend>,
    slots: usize,
) -> wasmtime::Result<TensorWasmMemoryCreator<MockBackend>> {
    built(pooled_builder(backend, slots)?)
}

/// The builder of [`pooled_creator`].
fn pooled_builder(
    backend: Arc<MockBackend>,
    slots: usize,
) -> wasmtime::Result<CreatorBuilder<MockBackend>> {
    Ok(TensorWasmMemoryCreator::builder(backend)
        .limits(PlanLimits::new(16 << 16).map_err(wasmtime::Error::new)?)
        .pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(16 << 16, slots)],
        ))
        .slots_per_tenant(slots)
        .allow_untenanted())
}

fn built(
    builder: CreatorBuilder<MockBackend>,
) -> wasmtime::Result<TensorWasmMemoryCreator<MockBackend>> {
    builder.build().map_err(wasmtime::Error::new)
}

/// The steps of a pooled instantiation that are the pool's, in microseconds, on the mock's
/// driver path (`DriverBackend` over the model, as cudarc and cust run it): `(acquire + release
/// of an untouched slot, the same with the 64 KiB page its last holder touched scrubbed)`.
fn pool_steps_us(sizes: Sizes, bar: &ProgressBar) -> Result<(f64, f64), Failure> {
    let creator = pooled_creator(Arc::new(MockBackend::default()), 16).map_err(other)?;
    let pool = creator.pool().ok_or_else(|| other("no pool"))?;
    let slot = 16 << 16;
    let untouched = median_lives(sizes, bar, || {
        black_box(pool.acquire(slot, 0).map_err(other)?);
        Ok(())
    })?;
    let scrubbed = median_lives(sizes, bar, || {
        black_box(pool.acquire(slot, 64 << 10).map_err(other)?);
        Ok(())
    })?;
    Ok((untouched, scrubbed))
}

/// The launching guest: `go(n)` launches the built-in `fill` on its first 4 KiB `n` times.
const LAUNCHER: &str = r#"(module
  (import "twm" "kernel" (func $kernel (param i32 i32) (result i32)))
  (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "fill")
  (data (i32.const 64) "\00\10\00\00\00\00\00\00\00\10\00\00\00\00\00\00")
  (data (i32.const 80) "\07\00\00\00\00\00\00\00\00\00\00\00\00\00\00\00")
  (func (export "go") (param $n i32) (result i32)
    (local $k i32) (local $rc i32)
    (local.set $k (call $kernel (i32.const 0) (i32.const 4)))
    (block $done (loop $next
      (br_if $done (i32.eqz (local.get $n)))
      (local.set $rc (i32.or (local.get $rc)
        (call $launch (local.get $k) (i32.const 64) (i32.const 2))))
      (local.set $n (i32.sub (local.get $n) (i32.const 1)))
      (br $next)))
    (local.get $rc)))"#;

/// Microseconds per launch of a 4 KiB `fill` on the simulated device: `(a guest's whole
/// twm.launch of the built-in fill, the same launch of a kernel whose launcher does nothing)`.
/// The second is the host cost of a guest launch (reading and checking the arguments,
/// resolving, prefetching, the stream's wait, the tenant's figures); the first less the
/// second, the driver's own launch and run.
fn launch_us(sizes: Sizes, bar: &ProgressBar) -> Result<(f64, f64), Failure> {
    use tensor_wasm_mem_wasmtime::add_to_linker;
    use tensor_wasm_mem_wasmtime::kernels::{
        BufferLength, KernelParam, KernelSignature, Launch, LaunchShape, Scalar,
    };
    let mut registry = tensor_wasm_mem_wasmtime::kernels::builtin();
    registry
        .register(
            "noop",
            KernelSignature {
                params: vec![
                    KernelParam::Buffer {
                        access: Access::Write,
                        element_bytes: 1,
                        length: BufferLength::Any,
                    },
                    KernelParam::Scalar(Scalar::U32),
                ],
                shape: LaunchShape::Fixed {
                    grid: [1, 1, 1],
                    block: [256, 1, 1],
                },
            },
            |_: &MockBackend, _: &Launch<'_>| Ok::<(), TwmError>(()),
        )
        .map_err(other)?;
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .kernels(registry)
        .build()
        .map_err(other)?;
    let engine = creator.engine().map_err(other)?;
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).map_err(other)?;
    let tenant = Tenant::new(1, "bench", 1 << 30, IsolationLevel::StreamIsolated);
    let timed = |kernel: &str| -> Result<f64, Failure> {
        let module = Module::new(
            &engine,
            LAUNCHER.replace("\"fill\"", &format!("{kernel:?}")),
        )
        .map_err(other)?;
        let mut store = new_store(
            &engine,
            TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
        );
        let instance =
            tensor_wasm_mem_wasmtime::instantiate(&mut store, &linker, &module).map_err(other)?;
        let go = instance
            .get_typed_func::<i32, i32>(&mut store, "go")
            .map_err(other)?;
        median_lives(sizes, bar, || {
            match go.call(&mut store, 1).map_err(other)? {
                0 => Ok(()),
                rc => Err(other(format!("launch answered {rc}"))),
            }
        })
    };
    let fill = timed("fill")?;
    let noop = timed("noop")?;
    Ok((fill, noop))
}

/// The floor's module: the small module with a global where its memory was.
const NO_MEMORY: &str = r#"(module
  (global $g (mut i32) (i32.const 0))
  (func (export "run") (global.set $g (i32.const 1))))"#;

/// Hands `measure` one life of the small module for a tenant: `new_store`, `instantiate_pre`,
/// the memory charged to it.
fn tenant_lives() -> Result<Lives, Failure> {
    let creator = pooled_creator(Arc::new(MockBackend::default()), 16).map_err(other)?;
    let engine = creator.engine().map_err(other)?;
    let pre = pre_with(&Linker::new(&engine), &engine, SMALL)?;
    let tenant = Tenant::new(1, "bench", 1 << 30, IsolationLevel::StreamIsolated);
    Ok(Box::new(move || {
        let mut store = new_store(
            &engine,
            TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
        );
        let instance = instantiate_pre(&mut store, &pre).map_err(other)?;
        let run = instance
            .get_typed_func::<(), ()>(&mut store, "run")
            .map_err(other)?;
        run.call(&mut store, ()).map_err(other)
    }))
}

fn pre(engine: &Engine, wat: &str) -> Result<InstancePre<()>, Failure> {
    pre_with(&Linker::new(engine), engine, wat)
}

fn pre_with<T: 'static>(
    linker: &Linker<T>,
    engine: &Engine,
    wat: &str,
) -> Result<InstancePre<T>, Failure> {
    let module = Module::new(engine, wat).map_err(other)?;
    linker.instantiate_pre(&module).map_err(other)
}

/// One life of the small module: a new Store holding `data`, instantiate, call `run` (which
/// touches a page). Returns the Store, still holding the instance.
fn small_life<T: 'static>(
    engine: &Engine,
    pre: &InstancePre<T>,
    data: T,
) -> Result<Store<T>, Failure> {
    let mut store = Store::new(engine, data);
    let instance = pre.instantiate(&mut store).map_err(other)?;
    let run = instance
        .get_typed_func::<(), ()>(&mut store, "run")
        .map_err(other)?;
    run.call(&mut store, ()).map_err(other)?;
    Ok(store)
}

/// One life of a setup's small module, as often as it is called: the engine and all it needs
/// owned by the closure.
type Lives = Box<dyn FnMut() -> Result<(), Failure>>;

/// Microseconds per instantiate + call + drop of `(memory 1 16)`, one Store each, of every
/// setup in `setups`, measured interleaved: each round runs a batch of each setup in turn
/// (after as many lives unmeasured, to warm it up again), and each setup's figure is the
/// median of its batches. A burst of noise on the machine then lands on every setup alike rather
/// than on whichever was running, so the ratios between them (a pooled memory over the
/// no-memory floor) hold across runs.
fn interleaved_instantiate_us(
    setups: &[Setup],
    sizes: Sizes,
    bar: &ProgressBar,
) -> Result<Vec<f64>, Failure> {
    let mut all = setups
        .iter()
        .map(|&setup| lives(setup))
        .collect::<Result<Vec<_>, _>>()?;
    for once in &mut all {
        for _ in 0..sizes.warm_up {
            once()?;
        }
    }
    let per_batch = sizes.instantiate_iters / sizes.instantiate_batches;
    let mut samples = vec![Vec::with_capacity(sizes.instantiate_batches); setups.len()];
    for _ in 0..sizes.instantiate_batches {
        for (once, samples) in all.iter_mut().zip(&mut samples) {
            // As many lives unmeasured first: the setup's caches, and a thread that scrubs
            // ahead woken and busy again.
            for _ in 0..per_batch {
                once()?;
            }
            let start = Instant::now();
            for _ in 0..per_batch {
                once()?;
            }
            samples.push(start.elapsed().as_secs_f64() * 1e6 / per_batch as f64);
            bar.inc(1);
        }
    }
    Ok(samples.iter_mut().map(|s| median(s)).collect())
}

/// One life of `setup`'s small module (instantiate + call + drop, a new Store each): the life
/// its `instantiate_us` row measures (the floor's module has a global where the memory was;
/// the tenant's Store is made by `new_store`; the WASI setup's linker has WASI).
fn lives(setup: Setup) -> Result<Lives, Failure> {
    if setup == Setup::TwmPooledTenant {
        return tenant_lives();
    }
    let engine = setup.engine(16)?;
    if setup == Setup::NoMemoryFloor {
        let pre = pre(&engine, NO_MEMORY)?;
        return Ok(Box::new(move || small_life(&engine, &pre, ()).map(drop)));
    }
    if setup == Setup::TwmPooledWasi {
        let mut linker = Linker::<Option<WasiP1Ctx>>::new(&engine);
        add_wasi_to_linker(&mut linker).map_err(other)?;
        let pre = pre_with(&linker, &engine, SMALL)?;
        return Ok(Box::new(move || small_life(&engine, &pre, None).map(drop)));
    }
    let pre = pre(&engine, SMALL)?;
    Ok(Box::new(move || small_life(&engine, &pre, ()).map(drop)))
}

/// The pooled setups whose process CPU per life is measured beside their wall time.
const CPU_SETUPS: [Setup; 4] = [
    Setup::TwmPooled,
    Setup::TwmPooledScrubAhead,
    Setup::TwmDeviceGuardedPooled,
    Setup::TwmDeviceGuardedPooledScrubAhead,
];

/// Microseconds of the process's CPU (every thread's: a scrub-ahead thread's included) per
/// instantiate + call + drop of `(memory 1 16)` from one thread: what a life
/// costs the host, where [`interleaved_instantiate_us`] is what it costs the caller's latency.
fn process_cpu_us(setup: Setup, sizes: Sizes, bar: &ProgressBar) -> Result<f64, Failure> {
    let engine = setup.engine(16)?;
    let pre = pre(&engine, SMALL)?;
    let lives = sizes.instantiate_iters;
    for _ in 0..sizes.warm_up {
        small_life(&engine, &pre, ())?;
    }
    let mut samples = Vec::new();
    for _ in 0..3 {
        let start = process_cpu_s();
        for _ in 0..lives {
            small_life(&engine, &pre, ())?;
        }
        samples.push((process_cpu_s() - start) * 1e6 / lives as f64);
    }
    bar.inc(1);
    Ok(median(&mut samples))
}

/// Seconds of CPU the process has used so far, every thread's (`CLOCK_PROCESS_CPUTIME_ID`,
/// which counts running threads up to now, not up to their last tick).
fn process_cpu_s() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Thread counts of the threaded instantiation row.
const THREADS: [usize; 4] = [1, 2, 8, 32];

/// The setups of the threaded instantiation row.
const THREADED_SETUPS: [Setup; 2] = [Setup::WasmtimePooling, Setup::TwmPooled];

/// Microseconds of CPU per instantiate + call + drop of `(memory 1 16)` with `threads` threads
/// instantiating at once on one engine (a pool of `threads * 2` slots for the pooled setups):
/// the wall time of `threads * lives` lives times the cores that could run them (the fewer of
/// the threads and the machine's cores), divided by the lives. With no contention this is the
/// single thread's figure; what it gains above that is what the threads cost each other.
fn threaded_instantiate_us(
    setup: Setup,
    threads: usize,
    sizes: Sizes,
    bar: &ProgressBar,
) -> Result<f64, Failure> {
    let engine = setup.engine(threads * 2)?;
    let pre = pre(&engine, SMALL)?;
    let lives = (sizes.instantiate_iters / 4 / threads).max(sizes.threaded_lives);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let mut samples = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        for _ in 0..lives {
                            small_life(&engine, &pre, ())?;
                        }
                        Ok::<(), Failure>(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().map_err(|_| other("a bench thread panicked"))?)
        })?;
        let cpu = start.elapsed().as_secs_f64() * threads.min(cores) as f64;
        samples.push(cpu * 1e6 / (threads * lives) as f64);
    }
    bar.inc(1);
    Ok(median(&mut samples))
}

/// `--lives-of`: a million lives of one setup in one thread (each as its `instantiate_us` row
/// measures it), for a profiler.
fn lives_of(key: &str, count: Option<u32>) -> Result<(), Failure> {
    let setup = Setup::from_key(key)
        .ok_or_else(|| Failure::Usage(format!("--lives-of: no setup named {key:?}")))?;
    let per_batch = 1_000u32;
    let batches = count.map_or(1_000, |count| count.div_ceil(per_batch).max(1));
    let mut once = lives(setup)?;
    let mut samples = Vec::with_capacity(batches as usize);
    let start = Instant::now();
    for _ in 0..batches {
        let batch = Instant::now();
        for _ in 0..per_batch {
            once()?;
        }
        samples.push(batch.elapsed().as_secs_f64() * 1e6 / f64::from(per_batch));
    }
    let seconds = start.elapsed().as_secs_f64();
    outln!(
        "{key}: {:.3} us per life ({:.3} the median of {batches} batches of {per_batch})",
        seconds * 1e6 / f64::from(batches * per_batch),
        median(&mut samples)
    );
    Ok(())
}

/// Microseconds per call of `once`: warmed up, then the median over batches.
fn median_lives(
    sizes: Sizes,
    bar: &ProgressBar,
    mut once: impl FnMut() -> Result<(), Failure>,
) -> Result<f64, Failure> {
    for _ in 0..sizes.warm_up {
        once()?;
    }
    let per_batch = sizes.instantiate_iters / sizes.instantiate_batches;
    let mut samples = Vec::with_capacity(sizes.instantiate_batches);
    for _ in 0..sizes.instantiate_batches {
        let start = Instant::now();
        for _ in 0..per_batch {
            once()?;
        }
        samples.push(start.elapsed().as_secs_f64() * 1e6 / per_batch as f64);
        bar.inc(1);
    }
    Ok(median(&mut samples))
}

/// Nanoseconds per `memory.grow` of one page, from inside the guest.
fn grow_ns(setup: Setup, sizes: Sizes, bar: &ProgressBar) -> Result<f64, Failure> {
    let engine = setup.engine(1)?;
    let pre = pre(&engine, GROW)?;
    let mut samples = Vec::with_capacity(sizes.grow_samples);
    for sample in 0..sizes.grow_samples + 2 {
        let mut store = Store::new(&engine, ());
        let instance = pre.instantiate(&mut store).map_err(other)?;
        let grow = instance
            .get_typed_func::<i32, i32>(&mut store, "grow")
            .map_err(other)?;
        let start = Instant::now();
        let pages = grow
            .call(&mut store, sizes.grow_per_sample)
            .map_err(other)?;
        let elapsed = start.elapsed();
        if pages != sizes.grow_per_sample + 1 {
            return Err(Failure::Other(format!(
                "{}: memory.grow failed (memory is {pages} pages)",
                setup.key()
            )));
        }
        if sample >= 2 {
            samples.push(elapsed.as_secs_f64() * 1e9 / f64::from(sizes.grow_per_sample));
            bar.inc(1);
        }
    }
    Ok(median(&mut samples))
}

/// The guest loop module: `padding` unused functions before the loop shift its code placement.
fn loop_module(padding: usize, growable: bool, simd: bool) -> String {
    let pages = LOOP_BYTES >> 16;
    let memory = if growable {
        format!("(memory {pages} {})", pages * 2)
    } else {
        format!("(memory {pages} {pages})")
    };
    let pad: String = (0..padding)
        .map(|i| {
            let mut expr = "(local.get 0)".to_string();
            for k in 0..=(i % 5) {
                expr = format!("(i32.add {expr} (i32.const {k}))");
            }
            format!("(func (param i32) (result i32) {expr})")
        })
        .collect();
    let body = if simd {
        format!(
            r#"(local $i i32) (local $acc v128) (local $r i32)
               (loop $rep
                 (local.set $i (i32.const 0))
                 (loop $next
                   (local.set $acc (i32x4.add (local.get $acc) (v128.load (local.get $i))))
                   (local.set $i (i32.add (local.get $i) (i32.const 16)))
                   (br_if $next (i32.lt_u (local.get $i) (i32.const {LOOP_BYTES}))))
                 (local.set $r (i32.add (local.get $r) (i32.const 1)))
                 (br_if $rep (i32.lt_u (local.get $r) (local.get $reps))))
               (i32x4.extract_lane 0 (local.get $acc))"#
        )
    } else {
        format!(
            r#"(local $i i32) (local $acc i32) (local $r i32)
               (loop $rep
                 (local.set $i (i32.const 0))
                 (loop $next
                   (local.set $acc (i32.add (local.get $acc) (i32.load (local.get $i))))
                   (local.set $i (i32.add (local.get $i) (i32.const 4)))
                   (br_if $next (i32.lt_u (local.get $i) (i32.const {LOOP_BYTES}))))
                 (local.set $r (i32.add (local.get $r) (i32.const 1)))
                 (br_if $rep (i32.lt_u (local.get $r) (local.get $reps))))
               (local.get $acc)"#
        )
    };
    format!(
        r#"(module {memory} {pad}
             (func (export "sum") (param $reps i32) (result i32) {body}))"#
    )
}

/// Milliseconds per pass of a memory-bound loop over 16 MiB, for each of `setups`: at each code
/// placement every setup is measured in turn, sample after sample (so drift hits all alike), the
/// median over samples is taken per placement, and the median over placements is reported.
fn guest_loop_ms(
    setups: &[Setup],
    sizes: Sizes,
    growable: bool,
    simd: bool,
    bar: &ProgressBar,
) -> Result<Vec<f64>, Failure> {
    let engines = setups
        .iter()
        .map(|s| s.engine(1))
        .collect::<Result<Vec<_>, _>>()?;
    let mut per_placement = vec![Vec::with_capacity(sizes.loop_placements); setups.len()];
    for placement in 0..sizes.loop_placements {
        let wat = loop_module(placement * 3, growable, simd);
        let mut runs = Vec::with_capacity(setups.len());
        for engine in &engines {
            let pre = pre(engine, &wat)?;
            let mut store = Store::new(engine, ());
            // With interruption compiled in: no deadline, fuel enough (the checks run, never
            // fire). Without, these are no-ops (and the fuel call an error to ignore).
            store.set_epoch_deadline(NO_DEADLINE);
            let _ = store.set_fuel(u64::MAX);
            let instance = pre.instantiate(&mut store).map_err(other)?;
            let sum = instance
                .get_typed_func::<i32, i32>(&mut store, "sum")
                .map_err(other)?;
            // Fault every page in before timing.
            black_box(sum.call(&mut store, 1).map_err(other)?);
            runs.push((store, sum));
        }
        let mut samples = vec![Vec::with_capacity(sizes.loop_samples); setups.len()];
        for sample in 0..sizes.loop_samples {
            for k in 0..setups.len() {
                let i = (k + sample) % setups.len();
                let (store, sum) = &mut runs[i];
                let start = Instant::now();
                black_box(sum.call(&mut *store, sizes.loop_passes).map_err(other)?);
                samples[i].push(start.elapsed().as_secs_f64() * 1e3 / f64::from(sizes.loop_passes));
            }
        }
        for (i, s) in samples.iter_mut().enumerate() {
            per_placement[i].push(median(s));
        }
        bar.inc(setups.len() as u64);
    }
    Ok(per_placement.iter_mut().map(|p| median(p)).collect())
}

/// Microseconds for one round trip over `bytes`: the guest fills them, a kernel adds one to
/// every byte, the guest sums them. `(through a device-access scope, with an explicit copy out
/// to a separate buffer and back, the guest launching the kernel itself with twm.launch)`: what
/// zero-copy saves against a runtime that must copy. On the mock the kernel runs on the CPU and
/// the prefetches and waits are host-side bookkeeping, so the figures measure the layer's host
/// overhead against two copies, not a GPU.
fn kernel_roundtrip_us(
    bytes: u32,
    sizes: Sizes,
    bar: &ProgressBar,
) -> Result<(f64, f64, f64), Failure> {
    use tensor_wasm_mem_core::IsolationLevel;
    use tensor_wasm_mem_wasmtime::{
        AccessRange, ChargeMode, DeviceAccess, Tenant, TenantStore, instantiate, new_store,
    };
    let increment = |b: &mut [u8]| b.iter_mut().for_each(|x| *x = x.wrapping_add(1));
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .kernels(tensor_wasm_mem_wasmtime::kernels::builtin())
        .build()
        .map_err(other)?;
    let engine = creator.engine().map_err(other)?;
    let module = Module::new(&engine, ROUNDTRIP).map_err(other)?;
    let mut linker = Linker::new(&engine);
    tensor_wasm_mem_wasmtime::add_to_linker(&mut linker).map_err(other)?;
    let tenant = Tenant::new(1, "bench", u64::MAX, IsolationLevel::StreamIsolated);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &linker, &module).map_err(other)?;
    let memory = instance
        .get_memory(&mut store, "memory")
        .ok_or_else(|| other("no memory"))?;
    let fill = instance
        .get_typed_func::<i32, ()>(&mut store, "fill")
        .map_err(other)?;
    let sum = instance
        .get_typed_func::<i32, i32>(&mut store, "sum")
        .map_err(other)?;
    let launch = instance
        .get_typed_func::<i32, i32>(&mut store, "launch")
        .map_err(other)?;
    let n = bytes as i32;
    let len = bytes as usize;
    let samples = sizes.roundtrip_samples;
    let (mut scoped, mut copied, mut launched) = (Vec::new(), Vec::new(), Vec::new());
    let mut sums = Vec::new();
    // The "device" buffer of the copying runtime, allocated once (as it would be).
    let mut device = vec![0u8; len];
    for _ in 0..samples {
        let start = Instant::now();
        fill.call(&mut store, n).map_err(other)?;
        {
            let ranges = [AccessRange::read_write(0, u64::from(bytes))];
            let mut scope =
                DeviceAccess::open(&mut store, &creator, &memory, &ranges).map_err(other)?;
            increment(
                scope
                    .host_bytes_mut(0)
                    .map_err(other)?
                    .ok_or_else(|| other("not host-accessible"))?,
            );
            scope.close().map_err(other)?;
        }
        sums.push(sum.call(&mut store, n).map_err(other)?);
        scoped.push(start.elapsed().as_secs_f64() * 1e6);

        let start = Instant::now();
        fill.call(&mut store, n).map_err(other)?;
        device.copy_from_slice(&memory.data(&store)[..len]);
        increment(black_box(&mut device));
        memory.data_mut(&mut store)[..len].copy_from_slice(&device);
        sums.push(sum.call(&mut store, n).map_err(other)?);
        copied.push(start.elapsed().as_secs_f64() * 1e6);

        let start = Instant::now();
        fill.call(&mut store, n).map_err(other)?;
        match launch.call(&mut store, n).map_err(other)? {
            0 => {}
            rc => return Err(other(format!("the guest's launch answered {rc}"))),
        }
        sums.push(sum.call(&mut store, n).map_err(other)?);
        launched.push(start.elapsed().as_secs_f64() * 1e6);
    }
    if sums.windows(2).any(|w| w[0] != w[1]) {
        return Err(other("the two round trips disagree"));
    }
    bar.inc(1);
    Ok((
        median(&mut scoped),
        median(&mut copied),
        median(&mut launched),
    ))
}

fn resident_bytes() -> u64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(0);
    pages * 4096
}

/// In a child process: resident MiB added by `instances` live instances that each touched a page.
fn rss_child(key: &str, instances: usize) -> Result<(), Failure> {
    let setup =
        Setup::from_key(key).ok_or_else(|| Failure::Usage(format!("unknown setup {key}")))?;
    let engine = setup.engine(instances)?;
    let pre = pre(&engine, SMALL)?;
    // Warm up code paths, then measure.
    drop(small_life(&engine, &pre, ())?);
    let before = resident_bytes();
    let live = (0..instances)
        .map(|_| small_life(&engine, &pre, ()))
        .collect::<Result<Vec<_>, _>>()?;
    let after = resident_bytes();
    outln!("{}", after.saturating_sub(before) as f64 / (1 << 20) as f64);
    drop(live);
    Ok(())
}

/// Resident MiB of `setup`'s instances, measured in a child process (as many instances as the
/// child's sizes say: `--smoke` is passed on).
fn rss_mib(setup: Setup, smoke: bool, bar: &ProgressBar) -> Result<f64, Failure> {
    let exe = std::env::current_exe().map_err(other)?;
    let mut child = std::process::Command::new(exe);
    child.args(["bench", "--rss-child", setup.key()]);
    if smoke {
        child.arg("--smoke");
    }
    let output = child.output().map_err(other)?;
    bar.inc(1);
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse::<f64>()
        .map_err(|_| {
            Failure::Other(format!(
                "resident-memory child for {} failed: {}",
                setup.key(),
                String::from_utf8_lossy(&output.stderr)
            ))
        })
}

/// Tenants already placed when a placement decision is timed, and tenants placed for the
/// bookkeeping-memory figure.
const PLACED_TENANTS: u64 = 1_000;
const MEMORY_TENANTS: u64 = 20_000;

/// Placement on a simulated 8-device machine: the median cost of one decision (an `admit` with
/// `PLACED_TENANTS` tenants already placed, then the tenant dropped) per policy, and the host
/// memory the layer keeps per placed tenant (resident growth over `MEMORY_TENANTS` tenants;
/// fewer of each with `--smoke`).
fn placement_figures(sizes: Sizes, bar: &ProgressBar) -> Result<Value, Failure> {
    use tensor_wasm_mem_core::{IsolationLevel, TenantBudgets};
    use tensor_wasm_mem_wasmtime::{Placement, PlacementPolicy};
    let backend = tensor_wasm_mem_mock::with_config(tensor_wasm_mem_mock::MockConfig {
        device_count: 8,
        ..tensor_wasm_mem_mock::MockConfig::default()
    });
    // 1 MiB caps: 16 GiB devices take 16,384 tenants each, more than either figure places.
    let budgets = TenantBudgets::for_cap(1 << 20);
    let level = IsolationLevel::StreamIsolated;
    let (placed_tenants, memory_tenants) = sizes.placed_tenants;
    let mut decision_ns = serde_json::Map::new();
    for policy in [PlacementPolicy::LeastHeld, PlacementPolicy::RoundRobin] {
        let placement = Placement::for_backend(&backend, policy).map_err(other)?;
        let _placed = (0..placed_tenants)
            .map(|i| placement.admit(i, "t", budgets, level))
            .collect::<Result<Vec<_>, _>>()
            .map_err(other)?;
        let (samples, per) = sizes.decisions;
        let mut times = Vec::with_capacity(samples);
        for _ in 0..samples {
            let start = Instant::now();
            for i in 0..per {
                black_box(
                    placement
                        .admit(placed_tenants + i, "n", budgets, level)
                        .map_err(other)?,
                );
            }
            times.push(start.elapsed().as_nanos() as f64 / per as f64);
        }
        decision_ns.insert(policy.name().to_string(), json!(median(&mut times)));
    }
    bar.inc(1);
    let placement = Placement::for_backend(&backend, PlacementPolicy::RoundRobin).map_err(other)?;
    let before = resident_bytes();
    let tenants = (0..memory_tenants)
        .map(|i| placement.admit(i, format!("tenant-{i}"), budgets, level))
        .collect::<Result<Vec<_>, _>>()
        .map_err(other)?;
    let after = resident_bytes();
    drop(black_box(tenants));
    bar.inc(1);
    Ok(json!({
        "devices": 8,
        "placed_tenants": placed_tenants,
        "decision_ns": decision_ns,
        "bytes_per_tenant": after.saturating_sub(before) as f64 / memory_tenants as f64,
    }))
}

struct Row {
    group: &'static str,
    unit: &'static str,
    baseline: Setup,
    values: Vec<(Setup, f64, Option<f64>)>,
}

pub fn bench(args: &BenchArgs) -> Result<(), Failure> {
    let sizes = Sizes::new(args);
    if let Some(key) = &args.rss_child {
        return rss_child(key, sizes.rss_instances);
    }
    if let Some(key) = &args.lives_of {
        return lives_of(key, args.lives);
    }
    let instantiate_setups = [
        (Setup::WasmtimeDefault, None),
        (Setup::NoMemoryFloor, None),
        (Setup::WasmtimePooling, None),
        (Setup::TwmFresh, Some((Setup::WasmtimeDefault, 1.0))),
        (Setup::TwmPooled, Some((Setup::WasmtimePooling, 0.8))),
        (Setup::TwmPooledWasi, Some((Setup::TwmPooled, 1.1))),
        (Setup::TwmPooledTenant, Some((Setup::NoMemoryFloor, 1.5))),
        (
            Setup::TwmPooledScrubAhead,
            Some((Setup::NoMemoryFloor, 1.5)),
        ),
        (Setup::TwmDeviceGuarded, None),
        (
            Setup::TwmDeviceGuardedPooled,
            Some((Setup::WasmtimePooling, 0.8)),
        ),
        (
            Setup::TwmDeviceGuardedPooledScrubAhead,
            Some((Setup::NoMemoryFloor, 2.0)),
        ),
    ];
    let loop_setups = [
        (Setup::WasmtimeDefault, "wasmtime_default", None),
        (Setup::TwmFresh, "twm_checked", Some(1.3)),
        (Setup::TwmGuarded, "twm_guarded", Some(1.05)),
        (Setup::TwmDeviceGuarded, "twm_device_guarded", Some(1.05)),
        (Setup::TwmEpochs, "twm_checked_epochs", None),
        (Setup::TwmFuel, "twm_checked_fuel", None),
    ];
    let backing = device_guarded_backing();
    let details = [(false, false), (true, false), (false, true), (true, true)];
    let steps = instantiate_setups.len() * sizes.instantiate_batches
        + 2 * sizes.grow_samples
        + loop_setups.len() * details.len() * sizes.loop_placements
        + ROUNDTRIP_SIZES.len()
        + 4 * sizes.instantiate_batches
        + 4
        + THREADED_SETUPS.len() * THREADS.len()
        + CPU_SETUPS.len();
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>28} [{bar:30}] {pos}/{len}")
            .map_err(other)?
            .progress_chars("=> "),
    );

    bar.set_message("instantiate (interleaved)");
    let setups: Vec<Setup> = instantiate_setups.iter().map(|(s, _)| *s).collect();
    let figures = interleaved_instantiate_us(&setups, sizes, &bar)?;
    let instantiate: Vec<(Setup, f64)> = setups.into_iter().zip(figures).collect();
    let mut grow = Vec::new();
    for setup in [Setup::WasmtimeDefault, Setup::TwmFresh] {
        bar.set_message(format!("grow {}", setup.key()));
        grow.push((setup, grow_ns(setup, sizes, &bar)?));
    }
    let mut loops = Vec::new();
    let loop_engines: Vec<Setup> = loop_setups.iter().map(|(s, _, _)| *s).collect();
    for (growable, simd) in details {
        bar.set_message(format!(
            "loop {} {}",
            if growable { "growable" } else { "fixed" },
            if simd { "simd" } else { "scalar" }
        ));
        let times = guest_loop_ms(&loop_engines, sizes, growable, simd, &bar)?;
        let row: Vec<(&str, f64)> = loop_setups
            .iter()
            .zip(times)
            .map(|((_, key, _), t)| (*key, t))
            .collect();
        loops.push(((growable, simd), row));
    }
    let mut roundtrips = Vec::new();
    for (name, bytes) in ROUNDTRIP_SIZES {
        bar.set_message(format!("kernel round trip {name}"));
        roundtrips.push((name, kernel_roundtrip_us(bytes, sizes, &bar)?));
    }
    let mut rss = Vec::new();
    for setup in [Setup::WasmtimeDefault, Setup::TwmFresh] {
        bar.set_message(format!("resident {}", setup.key()));
        rss.push((setup, rss_mib(setup, args.smoke, &bar)?));
    }
    bar.set_message("pool steps");
    let (pool_untouched, pool_scrubbed) = pool_steps_us(sizes, &bar)?;
    bar.set_message("guest launch");
    let (launch_fill, launch_host) = launch_us(sizes, &bar)?;
    let mut threaded = Vec::new();
    for setup in THREADED_SETUPS {
        for threads in THREADS {
            bar.set_message(format!("{} x{threads} threads", setup.key()));
            threaded.push((
                setup,
                threads,
                threaded_instantiate_us(setup, threads, sizes, &bar)?,
            ));
        }
    }
    let mut process_cpu = Vec::new();
    for setup in CPU_SETUPS {
        bar.set_message(format!("{} process cpu", setup.key()));
        process_cpu.push((setup, process_cpu_us(setup, sizes, &bar)?));
    }
    bar.set_message("placement, 8 devices");
    let placement = placement_figures(sizes, &bar)?;
    bar.finish_and_clear();

    let get =
        |v: &[(Setup, f64)], s: Setup| v.iter().find(|(k, _)| *k == s).map_or(f64::NAN, |x| x.1);
    let headline_loop = &loops[0].1;
    let loop_get = |key: &str| {
        headline_loop
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(f64::NAN, |x| x.1)
    };
    let twm_key = |s: Setup| if s == Setup::TwmFresh { "twm" } else { s.key() };

    if args.json {
        let detail: serde_json::Map<String, Value> = loops
            .iter()
            .map(|((growable, simd), row)| {
                let name = format!(
                    "{}_{}",
                    if *growable { "growable" } else { "fixed" },
                    if *simd { "simd" } else { "scalar" }
                );
                let values: serde_json::Map<String, Value> = row
                    .iter()
                    .map(|(k, v)| ((*k).to_string(), json!(v)))
                    .collect();
                (name, Value::Object(values))
            })
            .collect();
        let report = json!({
            "quick": args.quick,
            "smoke": args.smoke,
            "instantiate_us": instantiate.iter().map(|(s, v)| (s.key().to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "grow_ns": grow.iter().map(|(s, v)| (twm_key(*s).to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "guest_loop_ms": {
                "wasmtime_default": loop_get("wasmtime_default"),
                "twm_checked": loop_get("twm_checked"),
                "twm_guarded": loop_get("twm_guarded"),
                "twm_device_guarded": loop_get("twm_device_guarded"),
                "twm_checked_epochs": loop_get("twm_checked_epochs"),
                "twm_checked_fuel": loop_get("twm_checked_fuel"),
            },
            "device_guarded_backing": backing.name(),
            "guest_loop_detail_ms": detail,
            "kernel_roundtrip_us": roundtrips.iter().map(|(name, (scope, copy, guest))| ((*name).to_string(), json!({"twm_scope": scope, "explicit_copy": copy, "twm_guest_launch": guest}))).collect::<serde_json::Map<_, _>>(),
            "rss_1000_mib": rss.iter().map(|(s, v)| (twm_key(*s).to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "placement": placement,
            "launch_us": {
                "guest_launch_fill_4KiB": launch_fill,
                "guest_launch_noop": launch_host,
                "driver_fill_4KiB": launch_fill - launch_host,
            },
            "instantiate_threads_cpu_us": THREADED_SETUPS.iter().map(|&s| (s.key().to_string(), json!(threaded.iter().filter(|(k, _, _)| *k == s).map(|(_, t, v)| (t.to_string(), json!(v))).collect::<serde_json::Map<_, _>>()))).collect::<serde_json::Map<_, _>>(),
            "instantiate_process_cpu_us": process_cpu.iter().map(|(s, v)| (s.key().to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "pool_steps_us": {
                "acquire_release_untouched": pool_untouched,
                "acquire_release_scrub_64KiB": pool_scrubbed,
            },
        });
        outln!("{report}");
        return Ok(());
    }

    let rows = [
        Row {
            group: "instantiate+call+drop",
            unit: "us",
            baseline: Setup::WasmtimeDefault,
            values: instantiate_setups
                .iter()
                .map(|(s, t)| (*s, get(&instantiate, *s), t.map(|t| t.1)))
                .collect(),
        },
        Row {
            group: "memory.grow 1 page",
            unit: "ns",
            baseline: Setup::WasmtimeDefault,
            values: vec![
                (
                    Setup::WasmtimeDefault,
                    get(&grow, Setup::WasmtimeDefault),
                    None,
                ),
                (Setup::TwmFresh, get(&grow, Setup::TwmFresh), Some(0.1)),
            ],
        },
        Row {
            group: "resident, 1000 instances",
            unit: "MiB",
            baseline: Setup::WasmtimeDefault,
            values: vec![
                (
                    Setup::WasmtimeDefault,
                    get(&rss, Setup::WasmtimeDefault),
                    None,
                ),
                (Setup::TwmFresh, get(&rss, Setup::TwmFresh), Some(1.5)),
            ],
        },
    ];
    outln!(
        "twm bench{} (medians; a ratio is over the group's first setup, except: twm_pooled and \
         twm_device_guarded_pooled over wasmtime_pooling, twm_pooled_wasi over twm_pooled, \
         twm_pooled_tenant and the scrub-ahead setups over no_memory_floor, threaded rows over \
         their setup's 1 thread; a target reads <= when met, MISS when not)",
        if args.smoke {
            " --smoke (a few lives each: the figures are noise)"
        } else if args.quick {
            " --quick"
        } else {
            ""
        }
    );
    outln!(
        "twm_device_guarded*: the {backing} backing, on a simulated device with pageable memory \
         access\n"
    );
    outln!(
        "{:<26} {:<37} {:>12} {:>8} {:>8}",
        "measure",
        "setup",
        "value",
        "ratio",
        "target"
    );
    for row in &rows {
        let base = row
            .values
            .iter()
            .find(|(s, _, _)| *s == row.baseline)
            .map_or(f64::NAN, |v| v.1);
        for (setup, value, target) in &row.values {
            // Pooled is held against Wasmtime's pooling allocator, the WASI-linked pooled setup
            // against the same without WASI.
            let base = match setup {
                Setup::TwmPooled | Setup::TwmDeviceGuardedPooled => {
                    get(&instantiate, Setup::WasmtimePooling)
                }
                Setup::TwmPooledWasi => get(&instantiate, Setup::TwmPooled),
                Setup::TwmPooledTenant
                | Setup::TwmPooledScrubAhead
                | Setup::TwmDeviceGuardedPooledScrubAhead => {
                    get(&instantiate, Setup::NoMemoryFloor)
                }
                _ => base,
            };
            let ratio = value / base;
            outln!(
                "{:<26} {:<37} {:>9.3} {:<3}{:>7.2}x {:>8}",
                row.group,
                setup.key(),
                value,
                row.unit,
                ratio,
                target.map_or(String::new(), |t| format!(
                    "{}{t}x",
                    if ratio <= t { "<=" } else { "MISS " }
                ))
            );
        }
    }
    for &(setup, threads, us) in &threaded {
        let single = threaded
            .iter()
            .find(|(s, t, _)| *s == setup && *t == 1)
            .map_or(f64::NAN, |x| x.2);
        outln!(
            "{:<26} {:<37} {:>9.3} {:<3}{:>7.2}x",
            format!("instantiate x{threads} thr (cpu)"),
            setup.key(),
            us,
            "us",
            us / single
        );
    }
    for (setup, us) in &process_cpu {
        outln!(
            "{:<26} {:<37} {:>9.3} {:<3}",
            "instantiate (process cpu)",
            setup.key(),
            us,
            "us"
        );
    }
    for (name, (scope, copy, guest)) in &roundtrips {
        let group = format!("kernel round trip {name}");
        for (key, value) in [
            ("explicit_copy", copy),
            ("twm_scope", scope),
            ("twm_guest_launch", guest),
        ] {
            outln!(
                "{:<26} {:<37} {:>9.3} {:<3}{:>7.2}x",
                group,
                key,
                value,
                "us",
                value / copy
            );
        }
    }
    for (policy, ns) in placement["decision_ns"].as_object().into_iter().flatten() {
        outln!(
            "{:<26} {:<37} {:>9.3} {:<3}",
            format!("place 1 of {PLACED_TENANTS}, 8 dev"),
            policy,
            ns.as_f64().unwrap_or(f64::NAN),
            "ns"
        );
    }
    outln!(
        "{:<26} {:<37} {:>9.1} {:<3}",
        "memory per placed tenant",
        "bookkeeping",
        placement["bytes_per_tenant"].as_f64().unwrap_or(f64::NAN),
        "B"
    );
    let driver = launch_fill - launch_host;
    outln!(
        "{:<26} {:<37} {:>9.3} {:<3}{:>7.2}x",
        "launch fill 4KiB",
        "driver's own",
        driver,
        "us",
        1.0
    );
    outln!(
        "{:<26} {:<37} {:>9.3} {:<3}{:>7.2}x",
        "launch fill 4KiB",
        "guest twm.launch",
        launch_fill,
        "us",
        launch_fill / driver
    );
    for (step, us) in [
        ("acquire+release untouched", pool_untouched),
        ("acquire+release scrub 64KiB", pool_scrubbed),
    ] {
        outln!("{:<26} {:<37} {:>9.3} {:<3}", "pool slot", step, us, "us");
    }
    for ((growable, simd), row) in &loops {
        let base = row[0].1;
        let group = format!(
            "loop 16MiB {} {}",
            if *growable { "growable" } else { "fixed" },
            if *simd { "simd" } else { "scalar" }
        );
        for ((key, value), (_, _, target)) in row.iter().zip(loop_setups) {
            let ratio = value / base;
            outln!(
                "{:<26} {:<37} {:>9.3} {:<3}{:>7.2}x {:>8}",
                group,
                key,
                value,
                "ms",
                ratio,
                target.map_or(String::new(), |t: f64| format!(
                    "{}{t}x",
                    if ratio <= t { "<=" } else { "MISS " }
                ))
            );
        }
    }
    Ok(())
}
