//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod kernel_guest;

use std::sync::Arc;

use tensor_wasm_mem_core::{DeviceId, IsolationLevel, PoolConfig, SizeClass};
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::wasmtime::{
    Engine, Instance, Linker, Memory, Module, Store, Trap, TypedFunc, WasmParams, WasmResults,
};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, instantiate, new_store,
};

pub const PAGE: usize = 65536;

pub fn mock() -> Arc<MockBackend> {
    Arc::new(MockBackend::default())
}

/// One simulated device with pageable memory access (HMM): where `Backing::detect` picks the
/// guarded pageable backing.
pub fn pageable_mock() -> Arc<MockBackend> {
    Arc::new(tensor_wasm_mem_mock::with_config(
        tensor_wasm_mem_mock::MockConfig {
            pageable_memory_access: true,
            ..tensor_wasm_mem_mock::MockConfig::default()
        },
    ))
}

pub fn fresh(backend: &Arc<MockBackend>) -> TensorWasmMemoryCreator<MockBackend> {
    TensorWasmMemoryCreator::builder(Arc::clone(backend))
        .build()
        .expect("creator")
}

pub fn pooled(
    backend: &Arc<MockBackend>,
    slot_bytes: usize,
    slots: usize,
) -> TensorWasmMemoryCreator<MockBackend> {
    TensorWasmMemoryCreator::builder(Arc::clone(backend))
        .pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(slot_bytes, slots)],
        ))
        .build()
        .expect("pooled creator")
}

/// A fresh creator that also makes memories no tenant pays for (plain `Store`s): for tests of
/// the memory itself, not of its charges.
pub fn untenanted(backend: &Arc<MockBackend>) -> TensorWasmMemoryCreator<MockBackend> {
    TensorWasmMemoryCreator::builder(Arc::clone(backend))
        .allow_untenanted()
        .build()
        .expect("creator")
}

/// [`pooled`], also making memories no tenant pays for.
pub fn untenanted_pooled(
    backend: &Arc<MockBackend>,
    slot_bytes: usize,
    slots: usize,
) -> TensorWasmMemoryCreator<MockBackend> {
    TensorWasmMemoryCreator::builder(Arc::clone(backend))
        .pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(slot_bytes, slots)],
        ))
        .allow_untenanted()
        .build()
        .expect("pooled creator")
}

pub fn tenant(id: u64, cap: u64) -> Arc<Tenant> {
    Tenant::new(id, format!("t{id}"), cap, IsolationLevel::StreamIsolated)
}

/// Memory access functions over `(memory (export "memory") MIN MAX)`.
pub fn access_module(engine: &Engine, min: u32, max: u32) -> Module {
    Module::new(
        engine,
        format!(
            r#"(module
              (memory (export "memory") {min} {max})
              (func (export "load8") (param i32) (result i32) (i32.load8_u (local.get 0)))
              (func (export "load32") (param i32) (result i32) (i32.load (local.get 0)))
              (func (export "load64") (param i32) (result i64) (i64.load (local.get 0)))
              (func (export "load_off") (param i32) (result i32)
                (i32.load8_u offset=65536 (local.get 0)))
              (func (export "store8") (param i32 i32) (i32.store8 (local.get 0) (local.get 1)))
              (func (export "store32") (param i32 i32) (i32.store (local.get 0) (local.get 1)))
              (func (export "fill") (param i32 i32 i32)
                (memory.fill (local.get 0) (local.get 1) (local.get 2)))
              (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0)))
              (func (export "size") (result i32) (memory.size)))"#
        ),
    )
    .expect("module")
}

pub fn func<T, P: WasmParams, R: WasmResults>(
    store: &mut Store<T>,
    instance: &Instance,
    name: &str,
) -> TypedFunc<P, R> {
    instance
        .get_typed_func::<P, R>(&mut *store, name)
        .unwrap_or_else(|e| panic!("export {name}: {e}"))
}

pub fn is_oob(error: &tensor_wasm_mem_wasmtime::wasmtime::Error) -> bool {
    error.downcast_ref::<Trap>() == Some(&Trap::MemoryOutOfBounds)
}

/// A Store of tenant `id` (a 16-page cap, stream isolation) holding an instance of
/// [`access_module`] `(memory 1 4)`, and its memory.
pub fn tenant_store(
    creator: &TensorWasmMemoryCreator<MockBackend>,
    id: u64,
) -> (Store<TenantStore<MockBackend>>, Instance, Memory) {
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(
        id,
        format!("t{id}"),
        16 * PAGE as u64,
        IsolationLevel::StreamIsolated,
    );
    let mut store = new_store(
        &engine,
        TenantStore::new(creator, &tenant, ChargeMode::Touched, ()),
    );
    let module = access_module(&engine, 1, 4);
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    (store, instance, memory)
}
