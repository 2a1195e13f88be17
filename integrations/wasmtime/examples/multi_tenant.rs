//! Two tenants on one Engine with pooled managed memory: each guest fills its memory, two
//! "kernels" run on its bytes through a device-access scope (one on the simulated device, on the
//! tenant's stream, as a GPU kernel would be launched; one on the CPU, through typed host
//! views), and the figures are printed at the end.
//!
//! Run with `cargo run -p tensor-wasm-mem-wasmtime --example multi_tenant`.

use std::sync::Arc;

use tensor_wasm_mem_wasmtime::prelude::*;

const GUEST: &str = r#"(module
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 8)
  ;; Grows towards $pages (a growth past the tenant's cap answers -1: the guest goes on with
  ;; what it has), fills all of its memory, and hands it to device 0.
  (func (export "fill") (param $byte i32) (param $pages i32) (result i32)
    (drop (memory.grow (i32.sub (local.get $pages) (memory.size))))
    (memory.fill (i32.const 0) (local.get $byte) (i32.mul (memory.size) (i32.const 65536)))
    (call $prefetch (i32.const 0) (i32.mul (memory.size) (i32.const 65536)) (i32.const 0)))
  (func (export "sum") (param $len i32) (result i32)
    (local $i i32) (local $acc i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
      (local.set $acc (i32.add (local.get $acc) (i32.load8_u (local.get $i))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next)))
    (local.get $acc)))"#;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let backend = Arc::new(MockBackend::default());
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(8 << 16, 4)]))
        .build()?;
    let engine = creator.engine()?;
    let module = Module::new(&engine, GUEST)?;
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker)?;

    let tenants = [
        Tenant::new(1, "alice", 4 << 16, IsolationLevel::StreamIsolated),
        Tenant::new(2, "bob", 2 << 16, IsolationLevel::ContextIsolated),
    ];
    for (tenant, byte) in tenants.iter().zip([3, 5]) {
        let mut store = new_store(
            &engine,
            TenantStore::new(&creator, tenant, ChargeMode::Touched, ()),
        );
        let instance = instantiate(&mut store, &linker, &module)?;
        let fill = instance.get_typed_func::<(i32, i32), i32>(&mut store, "fill")?;
        let sum = instance.get_typed_func::<i32, i32>(&mut store, "sum")?;
        let code = fill.call(&mut store, (byte, 4))?;
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or("no memory export")?;
        let pages = memory.data_size(&store) >> 16;
        println!(
            "{}: asked for 4 pages, got {pages} (cap {} pages); prefetch -> {code}",
            tenant.name(),
            tenant.stats().touched_limit >> 16
        );

        // Kernels on the first 2 KiB, through a device-access scope: it holds the Store (no
        // guest code runs), checks and prefetches the ranges on the tenant's stream, and waits
        // for the stream when the closure returns.
        let ranges = [
            AccessRange::read_write(0, 1024),
            AccessRange::read_write(1024, 1024),
        ];
        let device_ptr = DeviceAccess::try_run(
            &mut store,
            &creator,
            &memory,
            &ranges,
            ScopeOptions::default(),
            |scope| -> Result<u64, TwmError> {
                // 1. A device kernel: the simulated device's fill over the first range, queued
                //    on the scope's stream with its device pointer (on a GPU: a launch with
                //    `slice.device_ptr()`, `slice.len()` on `scope.stream()`).
                let slice = scope.slice(0).expect("range 0");
                let (device_ptr, len) = (slice.device_ptr(), slice.len());
                // SAFETY: the scope holds the Store and waits for the stream before the guest
                // runs again; the range was checked inside the guest's memory.
                unsafe {
                    backend
                        .driver()
                        .enqueue_fill(scope.stream(), device_ptr, len, byte as u8 * 2)
                }
                .map_err(TwmError::from_backend)?;
                // 2. A CPU kernel: doubles the second range through a typed host view (which
                //    first waits for the stream).
                let mut views = scope.host_slices_mut::<u8>()?.expect("host-accessible");
                views[1].iter_mut().for_each(|b| *b *= 2);
                Ok(device_ptr)
            },
        )?;
        println!(
            "  kernels at device pointer {device_ptr:#x} (2 KiB); guest sum of the first 2 KiB = {}",
            sum.call(&mut store, 2048)?
        );
    }

    println!(
        "\n{:<8} {:>10} {:>10} {:>9} {:>8}",
        "tenant", "live B", "peak B", "memories", "denials"
    );
    for t in &tenants {
        let s = t.stats();
        println!(
            "{:<8} {:>10} {:>10} {:>9} {:>8}",
            s.name, s.touched_bytes, s.touched_peak_bytes, s.memories_created, s.denials
        );
    }
    let stats = creator.stats();
    let pool = stats.pool.unwrap_or_default();
    println!(
        "\npool: {} slot(s) in use, {} free, {} bytes scrubbed; creator: {} created, {} dropped",
        pool.in_use(),
        pool.free(),
        pool.bytes_scrubbed,
        stats.created,
        stats.dropped
    );
    Ok(())
}
