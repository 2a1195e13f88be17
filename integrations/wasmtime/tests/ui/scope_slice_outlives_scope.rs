// A device pointer handed out by a scope cannot be kept past it: the slice borrows the scope,
// and closing the scope consumes it.
use std::sync::Arc;

use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::core::IsolationLevel;
use tensor_wasm_mem_wasmtime::*;
use tensor_wasm_mem_wasmtime::wasmtime;

fn main() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t1", 1 << 20, IsolationLevel::StreamIsolated);
    let data = TenantStore::new(&creator, &tenant, ChargeMode::Touched, ());
    let mut store = new_store(&engine, data);
    let module = wasmtime::Module::new(&engine, r#"(module (memory (export "memory") 1))"#).unwrap();
    let instance = instantiate(&mut store, &wasmtime::Linker::new(&engine), &module).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    let scope =
        DeviceAccess::open(&mut store, &creator, &memory, &[AccessRange::write(0, 16)]).unwrap();
    let slice = scope.slice(0).unwrap();
    scope.close().unwrap();
    println!("{:#x}", slice.device_ptr());
}
