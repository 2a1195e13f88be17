// `DeviceAccess::run` cannot be made to skip its wait: its closure cannot swap the scope it is
// lent with the scope of a nested `run` (each is unique to its call: invariant in its lifetime).
use std::sync::Arc;

use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::core::IsolationLevel;
use tensor_wasm_mem_wasmtime::wasmtime;
use tensor_wasm_mem_wasmtime::*;

fn main() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t1", 1 << 20, IsolationLevel::StreamIsolated);
    let module = wasmtime::Module::new(&engine, r#"(module (memory (export "memory") 1))"#).unwrap();
    let make = || {
        let data = TenantStore::new(&creator, &tenant, ChargeMode::Touched, ());
        let mut store = new_store(&engine, data);
        let instance = instantiate(&mut store, &wasmtime::Linker::new(&engine), &module).unwrap();
        let memory = instance.get_memory(&mut store, "memory").unwrap();
        (store, memory)
    };
    let (mut store, memory) = make();
    let ranges = [AccessRange::write(0, 16)];
    let (mut second, second_memory) = make();
    DeviceAccess::run(&mut store, &creator, &memory, &ranges, ScopeOptions::default(), |outer| {
        DeviceAccess::run(
            &mut second,
            &creator,
            &second_memory,
            &ranges,
            ScopeOptions::default(),
            |inner| std::mem::swap(outer, inner),
        )
        .unwrap();
    })
    .unwrap();
}
