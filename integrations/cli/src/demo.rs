//! `twm demo`: several tenants with caps and isolation levels on pooled managed memory, placed
//! across the devices (`--devices N` simulates N); guests fill their memory, a host-side "kernel"
//! reads and writes guest data through a device-access scope (`DeviceAccess`), a guest launches
//! a kernel on its own memory (`twm.launch`, where the backend has built-in kernels), and the
//! figures are printed, per tenant and per device.

use std::sync::Arc;

use tensor_wasm_mem_core::{
    DeviceId, DevicePoolConfig, ErrorKind, IsolationLevel, PoolConfig, SizeClass, Stream,
    TenantDevicePool,
};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::{
    AccessRange, Backend, ChargeMode, DeviceAccess, Placement, PlacementPolicy, ScopeOptions,
    TenantBudgets, TenantStore, TensorWasmMemoryCreator, add_to_linker, instantiate, new_store,
};

use crate::backend::{BackendKind, BuiltinKernels};
use crate::bytes::format_bytes;
use crate::report::{occupancy_table, stats_table};
use crate::run::Failure;

const GUEST: &str = r#"(module
  (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 64)
  ;; Grows towards $pages (past the tenant's cap memory.grow answers -1 and the guest carries on
  ;; with what it has), writes a pattern over all of it, marks it read-mostly and hands it to
  ;; its device. Returns the pages it has.
  (func (export "fill") (param $seed i32) (param $pages i32) (param $device i32) (result i32)
    (local $i i32) (local $end i32)
    (drop (memory.grow (i32.sub (local.get $pages) (memory.size))))
    (local.set $end (i32.mul (memory.size) (i32.const 65536)))
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $end)))
      (i32.store8 (local.get $i) (i32.add (local.get $seed) (local.get $i)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next)))
    (drop (call $advise (i32.const 0) (local.get $end) (i32.const 0) (i32.const -1)))
    (drop (call $prefetch (i32.const 0) (local.get $end) (local.get $device)))
    (memory.size))
  (func (export "checksum") (result i32)
    (local $i i32) (local $end i32) (local $acc i32)
    (local.set $end (i32.mul (memory.size) (i32.const 65536)))
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $end)))
      (local.set $acc (i32.add (local.get $acc) (i32.load8_u (local.get $i))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next)))
    (local.get $acc)))"#;

/// A guest that launches the host's `saxpy` on its own arrays through `twm.launch`: fills
/// `x[i] = i` and `y[i] = 1` over `n` floats, launches `y = 2x + y`, and counts the wrong results
/// (a negative result is the `twm` code of a refused launch).
const LAUNCHING_GUEST: &str = r#"(module
  (import "twm" "kernel" (func $kernel (param i32 i32) (result i32)))
  (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "saxpy")
  (func $x (param $i i32) (result i32) (i32.add (i32.const 4096) (i32.shl (local.get $i) (i32.const 2))))
  (func $y (param $i i32) (result i32) (i32.add (i32.const 8192) (i32.shl (local.get $i) (i32.const 2))))
  (func (export "saxpy") (param $n i32) (result i32)
    (local $i i32) (local $k i32) (local $rc i32) (local $wrong i32) (local $bytes i64)
    (block $d (loop $l
      (br_if $d (i32.ge_u (local.get $i) (local.get $n)))
      (f32.store (call $x (local.get $i)) (f32.convert_i32_u (local.get $i)))
      (f32.store (call $y (local.get $i)) (f32.const 1))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $l)))
    (local.set $k (call $kernel (i32.const 0) (i32.const 5)))
    (if (i32.lt_s (local.get $k) (i32.const 0)) (then (return (local.get $k))))
    ;; Arguments at 64, a pair each: (a, 0), (x, bytes), (y, bytes), (n, 0).
    (local.set $bytes (i64.extend_i32_u (i32.shl (local.get $n) (i32.const 2))))
    (i64.store (i32.const 64) (i64.extend_i32_u (i32.reinterpret_f32 (f32.const 2))))
    (i64.store (i32.const 72) (i64.const 0))
    (i64.store (i32.const 80) (i64.const 4096))
    (i64.store (i32.const 88) (local.get $bytes))
    (i64.store (i32.const 96) (i64.const 8192))
    (i64.store (i32.const 104) (local.get $bytes))
    (i64.store (i32.const 112) (i64.extend_i32_u (local.get $n)))
    (i64.store (i32.const 120) (i64.const 0))
    (local.set $rc (call $launch (local.get $k) (i32.const 64) (i32.const 4)))
    (if (i32.ne (local.get $rc) (i32.const 0)) (then (return (local.get $rc))))
    (local.set $i (i32.const 0))
    (block $d (loop $l
      (br_if $d (i32.ge_u (local.get $i) (local.get $n)))
      (if (f32.ne (f32.load (call $y (local.get $i)))
                  (f32.add (f32.mul (f32.const 2) (f32.convert_i32_u (local.get $i))) (f32.const 1)))
        (then (local.set $wrong (i32.add (local.get $wrong) (i32.const 1)))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $l)))
    (local.get $wrong)))"#;

/// A guest that hands the built-in `poke` kernel an index of its choosing: `poke(buf, index, 7)`
/// over the 256 bytes at 256 of its memory (the buffer checked; the index is the kernel's to
/// trust, and its device-side assert fails past the end). Returns the launch's code.
const POKING_GUEST: &str = r#"(module
  (import "twm" "kernel" (func $kernel (param i32 i32) (result i32)))
  (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "poke")
  (func (export "poke") (param $index i32) (result i32)
    (local $k i32)
    (local.set $k (call $kernel (i32.const 0) (i32.const 4)))
    (if (i32.lt_s (local.get $k) (i32.const 0)) (then (return (local.get $k))))
    ;; Arguments at 64, a pair each: (buf, 256), (index, 0), (value, 0).
    (i64.store (i32.const 64) (i64.const 256))
    (i64.store (i32.const 72) (i64.const 256))
    (i64.store (i32.const 80) (i64.extend_i32_u (local.get $index)))
    (i64.store (i32.const 88) (i64.const 0))
    (i64.store (i32.const 96) (i64.const 7))
    (i64.store (i32.const 104) (i64.const 0))
    (call $launch (local.get $k) (i32.const 64) (i32.const 3))))"#;

/// `twm demo` arguments.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// The backend.
    #[arg(long, value_enum, default_value_t = BackendKind::preferred())]
    pub backend: BackendKind,
    /// Simulate this many devices (`--backend mock` only; default 1) and spread the tenants
    /// over them, at least one per device.
    #[arg(long, value_name = "N", value_parser = crate::backend::parse_devices)]
    pub devices: Option<u32>,
}

/// The demo's tenants: name, cap, isolation and the pages its guest asks for, cycled to give
/// every device at least one.
const PROFILES: [(&str, u64, IsolationLevel, i32); 3] = [
    ("alice", 1 << 20, IsolationLevel::StreamIsolated, 12),
    ("bob", 256 << 10, IsolationLevel::ContextIsolated, 8),
    ("carol", 4 << 20, IsolationLevel::Shared, 48),
];

/// The kernel: halves every byte of the slice; returns the sum of the bytes it wrote. It runs
/// on the host, over the bytes a device-access scope hands out (`host_bytes_mut`): the same
/// managed memory a GPU kernel launched on the scope's stream with its device pointer would
/// read and write.
fn kernel(bytes: &mut [u8]) -> u32 {
    let mut sum = 0u32;
    for b in bytes.iter_mut() {
        *b /= 2;
        sum = sum.wrapping_add(u32::from(*b));
    }
    sum
}

pub fn demo<B: Backend + BuiltinKernels>(backend: Arc<B>) -> Result<(), Failure> {
    let other = |e: &dyn std::fmt::Display| Failure::Other(e.to_string());
    let devices = backend.device_count();
    let placement =
        Placement::for_backend(&*backend, PlacementPolicy::RoundRobin).map_err(|e| other(&e))?;
    let mut builder = TensorWasmMemoryCreator::builder(backend)
        .all_devices()
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(64 << 16, 6)]));
    if let Some(kernels) = B::builtin_kernels() {
        builder = builder.kernels(kernels);
    }
    let creator = builder.build().map_err(|e| other(&e))?;
    let engine = creator.engine().map_err(|e| other(&e))?;
    let module = Module::new(&engine, GUEST).map_err(|e| other(&e))?;
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).map_err(|e| other(&e))?;

    let count = PROFILES.len().max(devices as usize);
    let mut tenants = Vec::with_capacity(count);
    for i in 0..count {
        let (name, cap, isolation, pages) = PROFILES[i % PROFILES.len()];
        let name = match i / PROFILES.len() {
            0 => name.to_string(),
            k => format!("{name}{}", k + 1),
        };
        let tenant = placement
            .admit(i as u64 + 1, name, TenantBudgets::for_cap(cap), isolation)
            .map_err(|e| other(&e))?;
        tenants.push((tenant, pages));
    }
    outln!(
        "twm demo: {} tenants on one engine over {devices} device(s) ({} placement), memories \
         from a pool of 6 slots of 4MiB per device",
        tenants.len(),
        placement.policy().name()
    );
    // Each tenant's kernel scratch comes from its own device memory pool, under the same cap as
    // its linear memory.
    let scratch_bytes = 64 << 10;
    let pool_config = DevicePoolConfig {
        max_bytes: 0,
        release_threshold: 1 << 20,
    };
    let mut scratch = Vec::new();
    for (tenant, _) in &tenants {
        let shared = Stream::new(
            tensor_wasm_mem_core::DriverStream::DEFAULT,
            tensor_wasm_mem_core::DriverContext::from_raw(0),
            IsolationLevel::Shared,
            tenant.ledger().key(),
        )
        .on_device(tenant.device());
        match TenantDevicePool::new(
            std::sync::Arc::clone(creator.backend()),
            std::sync::Arc::clone(tenant.ledger()),
            tenant.device(),
            &pool_config,
        ) {
            Ok(pool) => {
                let buffer = pool
                    .allocate(scratch_bytes, &shared)
                    .map_err(|e| other(&e))?;
                scratch.push((pool, buffer));
            }
            Err(e) if e.kind() == ErrorKind::Unsupported => {
                outln!("({}: no device pools on this backend)", tenant.name());
            }
            Err(e) => return Err(other(&e)),
        }
    }
    outln!(
        "\n{:<6} {:<8} {:>6} {:<17} {:>6} {:>6} {:>7} {:>12} {:>12} {:>7}",
        "round",
        "tenant",
        "device",
        "isolation",
        "cap",
        "asked",
        "got",
        "sum before",
        "sum after",
        "kernel"
    );
    for round in 1..=2 {
        for (tenant, pages) in &tenants {
            let mut store = new_store(
                &engine,
                TenantStore::new(&creator, tenant, ChargeMode::Touched, ()),
            );
            let instance = instantiate(&mut store, &linker, &module).map_err(|e| other(&e))?;
            let fill = instance
                .get_typed_func::<(i32, i32, i32), i32>(&mut store, "fill")
                .map_err(|e| other(&e))?;
            let checksum = instance
                .get_typed_func::<(), i32>(&mut store, "checksum")
                .map_err(|e| other(&e))?;
            let seed = tenant.ledger().id().0 as i32;
            let device = tenant.device().0 as i32;
            let got = fill
                .call(&mut store, (seed, *pages, device))
                .map_err(|e| other(&e))?;
            let before = checksum.call(&mut store, ()).map_err(|e| other(&e))?;
            let memory = instance
                .get_memory(&mut store, "memory")
                .ok_or_else(|| Failure::Other("no memory export".into()))?;
            let len = memory.data_size(&store) as u64;
            // The scope holds the Store (no guest runs), checks the range, and waits for the
            // tenant's stream when it closes. The kernel runs on the CPU here, so nothing is
            // prefetched to the device (a GPU kernel would keep the default, prefetch on).
            let written = {
                let ranges = [AccessRange::read_write(0, len)];
                let cpu = ScopeOptions {
                    prefetch: false,
                    ..ScopeOptions::default()
                };
                let mut scope =
                    DeviceAccess::open_with(&mut store, &creator, &memory, &ranges, cpu)
                        .map_err(|e| other(&e))?;
                let bytes = scope
                    .host_bytes_mut(0)
                    .map_err(|e| other(&e))?
                    .ok_or_else(|| {
                        Failure::Other("the demo's kernel needs host-accessible memory".into())
                    })?;
                let written = kernel(bytes);
                scope.close().map_err(|e| other(&e))?;
                written
            };
            let after = checksum.call(&mut store, ()).map_err(|e| other(&e))?;
            // The guest must see exactly the bytes the kernel wrote.
            let ok = after as u32 == written && after != before;
            outln!(
                "{:<6} {:<8} {:>6} {:<17} {:>6} {:>6} {:>7} {:>12} {:>12} {:>7}",
                round,
                tenant.name(),
                tenant.device().0,
                tenant.ledger().isolation().name(),
                format_bytes(tenant.ledger().cap()),
                format_bytes(*pages as u64 * 65536),
                format_bytes(got as u64 * 65536),
                before as u32,
                after as u32,
                if ok { "ok" } else { "WRONG" }
            );
            if !ok {
                return Err(Failure::Other(
                    "the kernel's writes are not what the guest sees".into(),
                ));
            }
        }
    }
    if let Some((tenant, _)) = tenants.first() {
        guest_launch(&creator, &engine, tenant)?;
    }
    let stats: Vec<_> = tenants.iter().map(|(t, _)| t.stats()).collect();
    outln!(
        "\n(each tenant still holds {} of kernel scratch in its device pool)\n{}",
        format_bytes(scratch_bytes as u64),
        stats_table(&stats, &creator)
    );
    outln!("{}", occupancy_table(&placement, &creator));
    drop(scratch);
    let after: Vec<_> = tenants.iter().map(|(t, _)| t.stats()).collect();
    outln!(
        "every tenant back to zero once the pools are dropped: {}",
        after.iter().all(|s| s.touched_bytes == 0)
    );
    let backend = Arc::clone(creator.backend());
    // The fault is shown on a creator of its own; the pooled one is done (its pools would let
    // their slabs go on a fenced device, and carve new ones after the recovery).
    drop((linker, module, engine, creator));
    fault_and_recover(backend)
}

/// What a trap says: the layer's typed error where it is one.
fn cause(trap: &tensor_wasm_mem_wasmtime::wasmtime::Error) -> String {
    trap.downcast_ref::<tensor_wasm_mem_wasmtime::TwmError>()
        .map_or_else(|| format!("{trap:#}"), ToString::to_string)
}

/// A tenant's data makes a trusted kernel fault (`poke` past its buffer: a failed device-side
/// assert, sticky for the primary context), which fences device 0: the faulting guest and a
/// neighbour sharing the context trap with a typed error; when their Stores go the device
/// recovers (its primary context reset) and the next tenant's kernel runs.
fn fault_and_recover<B: Backend + BuiltinKernels>(backend: Arc<B>) -> Result<(), Failure> {
    let other = |e: &dyn std::fmt::Display| Failure::Other(e.to_string());
    let Some(kernels) = B::builtin_kernels() else {
        outln!(
            "\n(a faulting kernel and the recovery: this backend has no built-in kernels to fault)"
        );
        return Ok(());
    };
    let builder = TensorWasmMemoryCreator::builder(backend)
        .device(DeviceId(0))
        .kernels(kernels);
    let creator = B::recover_automatically(builder)
        .build()
        .map_err(|e| other(&e))?;
    let engine = creator.engine().map_err(|e| other(&e))?;
    let module = Module::new(&engine, POKING_GUEST).map_err(|e| other(&e))?;
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).map_err(|e| other(&e))?;
    let guest = |name: &str, id: u64| -> Result<_, Failure> {
        let tenant = tensor_wasm_mem_wasmtime::Tenant::new(
            id,
            name,
            1 << 20,
            IsolationLevel::StreamIsolated,
        );
        let data = TenantStore::new(&creator, &tenant, ChargeMode::Touched, ());
        let mut store = new_store(&engine, data);
        let instance = instantiate(&mut store, &linker, &module).map_err(|e| other(&e))?;
        let poke = instance
            .get_typed_func::<i32, i32>(&mut store, "poke")
            .map_err(|e| other(&e))?;
        Ok((tenant, store, poke))
    };
    outln!("\na faulting kernel, and the recovery (device 0, stream-isolated tenants):");
    let (mallory, mut m_store, m_poke) = guest("mallory", 101)?;
    let (trent, mut t_store, t_poke) = guest("trent", 102)?;
    let ok = t_poke.call(&mut t_store, 3).map_err(|e| other(&e))?;
    outln!("  trent's guest pokes index 3 of its buffer: {ok} (ran)");
    match m_poke.call(&mut m_store, 1 << 20) {
        Ok(code) => return Err(Failure::Other(format!("the fault did not trap ({code})"))),
        Err(trap) => outln!(
            "  mallory's guest pokes index 1048576 of 256 bytes: trapped: {}",
            cause(&trap)
        ),
    }
    match t_poke.call(&mut t_store, 3) {
        Ok(code) => {
            return Err(Failure::Other(format!(
                "the neighbour did not trap ({code})"
            )));
        }
        Err(trap) => outln!(
            "  trent's guest, sharing the lost context, next call: trapped: {}",
            cause(&trap)
        ),
    }
    let fenced = creator.backend().device_fenced(DeviceId(0));
    drop((m_store, t_store));
    let stats = creator.stats();
    outln!(
        "  fenced while their Stores lived: {fenced}; both Stores gone: recovered {} time(s) in {} \
         us, fenced now: {}, kept memories {}, charged: mallory {} trent {}",
        stats.recoveries,
        stats.last_recovery_us,
        creator.backend().device_fenced(DeviceId(0)),
        stats.kept_memories,
        format_bytes(mallory.stats().touched_bytes),
        format_bytes(trent.stats().touched_bytes),
    );
    let (_, mut store, poke) = guest("victor", 103)?;
    let code = poke.call(&mut store, 5).map_err(|e| other(&e))?;
    outln!("  the next tenant's kernel on device 0: {code} (ran)");
    if !fenced || stats.recoveries != 1 || code != 0 {
        return Err(Failure::Other("the device did not recover".into()));
    }
    Ok(())
}

/// A guest of `tenant` launches the built-in `saxpy` on its own memory through `twm.launch`
/// (checked against its memory and the kernel's signature, run on the tenant's stream), and
/// checks every element itself.
fn guest_launch<B: Backend>(
    creator: &TensorWasmMemoryCreator<B>,
    engine: &tensor_wasm_mem_wasmtime::wasmtime::Engine,
    tenant: &Arc<tensor_wasm_mem_wasmtime::Tenant>,
) -> Result<(), Failure> {
    let other = |e: &dyn std::fmt::Display| Failure::Other(e.to_string());
    if creator.kernels().is_none() {
        outln!(
            "\n(guest-launched kernels: this backend has no built-in kernels; an embedder registers its own)"
        );
        return Ok(());
    }
    let module = Module::new(engine, LAUNCHING_GUEST).map_err(|e| other(&e))?;
    let mut linker = Linker::new(engine);
    add_to_linker(&mut linker).map_err(|e| other(&e))?;
    let mut store = new_store(
        engine,
        TenantStore::new(creator, tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &linker, &module).map_err(|e| other(&e))?;
    let saxpy = instance
        .get_typed_func::<i32, i32>(&mut store, "saxpy")
        .map_err(|e| other(&e))?;
    let n = 1024;
    let wrong = saxpy.call(&mut store, n).map_err(|e| other(&e))?;
    drop(store);
    outln!(
        "\nguest-launched kernel: {}'s guest ran saxpy (y = 2x + y) over {n} floats of its own \
         memory on device {}: {}; launches {}",
        tenant.name(),
        tenant.device().0,
        match wrong {
            0 => "0 wrong".to_string(),
            w if w > 0 => format!("{w} WRONG"),
            code => format!("refused ({code})"),
        },
        tenant.stats().launches
    );
    if wrong != 0 {
        return Err(Failure::Other(
            "the guest-launched kernel went wrong".into(),
        ));
    }
    Ok(())
}
