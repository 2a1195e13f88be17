//! Two tenants on one Engine with pooled managed memory: each guest fills its memory, a host-side
//! "kernel" reads and writes guest bytes through the resolved device slice, and the figures are
//! printed at the end. On the mock backend the kernel runs on the CPU; on a GPU backend the same
//! device pointer would go to a kernel launch.
//!
//! Run with `cargo run -p tensor-wasm-mem-wasmtime --example multi_tenant`.

use std::sync::Arc;

use tensor_wasm_mem_core::{DeviceId, IsolationLevel, PoolConfig, SizeClass};
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, add_to_linker, instantiate, new_store,
};

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
            tenant.stats().cap >> 16
        );

        // The "kernel": doubles the first 1 KiB in place through the resolved device slice.
        // The slice borrows the Store: a kernel launch takes its raw pointer and length, and
        // the Store is free again for the guest once the kernel is done.
        let slice = creator.resolve(&store, &memory, 0, 1024)?;
        let (device_ptr, len) = (slice.device_ptr(), slice.len());
        let mut data = vec![0u8; len];
        memory.read(&store, 0, &mut data)?;
        data.iter_mut().for_each(|b| *b *= 2);
        memory.write(&mut store, 0, &data)?;
        println!(
            "  kernel at device pointer {device_ptr:#x} ({len} bytes); guest sum of the first KiB = {}",
            sum.call(&mut store, 1024)?
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
            s.name, s.live_bytes, s.peak_bytes, s.memories_created, s.denials
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
