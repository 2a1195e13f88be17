// A device slice cannot be kept past its Store: the Store's memories (and pool slots) go with it.
use std::sync::Arc;

use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::TensorWasmMemoryCreator;
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Module, Store};

fn main() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(&engine, r#"(module (memory (export "memory") 1))"#).unwrap();
    let mut store = Store::new(&engine, ());
    let instance = Instance::new(&mut store, &module, &[]).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    let slice = creator.resolve(&store, &memory, 0, 16).unwrap();
    drop(store);
    println!("{:#x}", slice.device_ptr());
}
