// A device slice cannot be held across a call into the guest, which may grow or write the memory.
use std::sync::Arc;

use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::TensorWasmMemoryCreator;
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Module, Store};

fn main() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(
        &engine,
        r#"(module (memory (export "memory") 1 2)
             (func (export "grow") (result i32) (memory.grow (i32.const 1))))"#,
    )
    .unwrap();
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    let grow = instance.get_typed_func::<(), i32>(&mut store, "grow").unwrap();
    let slice = creator.resolve(&store, &memory, 0, 16).unwrap();
    grow.call(&mut store, ()).unwrap();
    println!("{:#x}", slice.device_ptr());
}
