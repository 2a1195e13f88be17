//! A real PTX kernel on a guest's memory, through the device-access scope, on the cudarc
//! backend: `cargo run -p tensor-wasm-mem-tests --example scope_kernel`.
//!
//! On a machine with a CUDA driver the PTX (`increment`: adds one to each byte) runs on the GPU;
//! without one it runs on the simulated libcuda, where the module loads and the simulator's host
//! kernel of the same name runs. Either way: the guest fills its memory, the scope checks the
//! range, prefetches it to the device on the tenant's stream and holds the Store (no guest code
//! runs), the kernel is launched on that stream, the scope closes (waiting for the stream), and
//! the guest reads what the kernel wrote.

use std::sync::Arc;

use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_cudarc::DriverSource;
use tensor_wasm_mem_tests::kernels::launch_increment;
use tensor_wasm_mem_tests::sim::{SIM_PATH, real_driver};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::{
    AccessRange, ChargeMode, DeviceAccess, Tenant, TenantStore, TensorWasmMemoryCreator,
    instantiate, new_store,
};

const GUEST: &str = r#"(module
  (memory (export "memory") 1 16)
  (func (export "fill") (param $len i32) (local $i i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
      (i32.store8 (local.get $i) (local.get $i))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next))))
  (func (export "byte") (param i32) (result i32) (i32.load8_u (local.get 0))))"#;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    const LEN: i32 = 1 << 16;
    // The system's driver where there is one, the simulated libcuda otherwise.
    let on_gpu = real_driver();
    let backend = Arc::new(tensor_wasm_mem_cudarc::start(&DriverSource::SystemOr(
        SIM_PATH.into(),
    ))?);
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend)).build()?;
    let engine = creator.engine()?;
    let tenant = Tenant::new(1, "example", 1 << 20, IsolationLevel::StreamIsolated);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let module = Module::new(&engine, GUEST)?;
    let instance = instantiate(&mut store, &Linker::new(&engine), &module)?;
    let memory = instance
        .get_memory(&mut store, "memory")
        .ok_or("no memory")?;
    let fill = instance.get_typed_func::<i32, ()>(&mut store, "fill")?;
    let byte = instance.get_typed_func::<i32, i32>(&mut store, "byte")?;
    fill.call(&mut store, LEN)?;

    let scope = DeviceAccess::open(
        &mut store,
        &creator,
        &memory,
        &[AccessRange::read_write(0, LEN as u64)],
    )?;
    let slice = scope.slice(0).ok_or("no range")?;
    let launched = launch_increment(
        slice.device_ptr(),
        slice.len() as u64,
        scope.stream().raw(),
        scope.stream().context(),
    );
    scope.close()?; // waits for the kernel, even if the launch failed
    launched?;

    let wrong = (0..LEN)
        .filter(|&i| !matches!(byte.call(&mut store, i), Ok(b) if b == (i + 1) & 0xff))
        .count();
    println!(
        "{} kernel over {} KiB of guest memory through a device-access scope: {}",
        if on_gpu { "PTX" } else { "simulated" },
        LEN / 1024,
        if wrong == 0 {
            "every byte incremented".to_string()
        } else {
            format!("{wrong} bytes wrong")
        }
    );
    if wrong != 0 {
        return Err("the guest does not see the kernel's writes".into());
    }
    Ok(())
}
