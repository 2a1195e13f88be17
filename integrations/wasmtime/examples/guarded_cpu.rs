//! The guarded host backing: linear memory with real PROT_NONE guard pages, so the guest runs
//! without explicit bounds checks on a CPU, and out-of-bounds accesses still trap.
//!
//! Run with `cargo run -p tensor-wasm-mem-wasmtime --example guarded_cpu`.

use tensor_wasm_mem_core::PlanLimits;
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Module, Store, Trap};
use tensor_wasm_mem_wasmtime::{GUARDED_CAPABILITIES, GuardedHostCreator};

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let creator = GuardedHostCreator::new(PlanLimits::default());
    let engine = creator.engine()?;
    let module = Module::new(
        &engine,
        r#"(module (memory (export "memory") 1 4)
             (func (export "load") (param i32) (result i32) (i32.load (local.get 0))))"#,
    )?;
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[])?;
    let load = instance.get_typed_func::<i32, i32>(&mut store, "load")?;
    println!("capabilities: {GUARDED_CAPABILITIES:?}");
    println!("load(0) = {}", load.call(&mut store, 0)?);
    let err = load.call(&mut store, 65536).expect_err("out of bounds");
    println!(
        "load(65536) traps: {:?}",
        err.downcast_ref::<Trap>().copied()
    );
    Ok(())
}
