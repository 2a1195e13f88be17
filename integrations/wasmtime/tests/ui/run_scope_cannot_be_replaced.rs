// `DeviceAccess::run` cannot be made to skip its wait: its closure cannot replace the scope it
// is lent with one over a leaked Store (and then forget the real one).
use std::sync::Arc;

use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::core::IsolationLevel;
use tensor_wasm_mem_wasmtime::wasmtime;
use tensor_wasm_mem_wasmtime::*;

type Data = TenantStore<MockBackend>;

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
    DeviceAccess::run(&mut store, &creator, &memory, &ranges, ScopeOptions::default(), |scope| {
        let (other, other_memory) = make();
        let leaked: &'static mut wasmtime::Store<Data> = Box::leak(Box::new(other));
        let fake = DeviceAccess::open(leaked, &creator, &other_memory, &ranges).unwrap();
        let real = std::mem::replace(scope, fake);
        std::mem::forget(real);
    })
    .unwrap();
}
