//! A guest that calls the `twm` kernel host functions (`kernel`, `launch`, and whatever else its
//! module exports), on a creator with a kernel registry: what the kernel tests and the hostile
//! guest tests drive.

use std::sync::Arc;

use tensor_wasm_mem_wasmtime::kernels::KernelRegistry;
use tensor_wasm_mem_wasmtime::prelude::*;
use tensor_wasm_mem_wasmtime::wasmtime::{self, Instance, Memory, WasmParams, WasmResults};

/// Where [`Guest::kernel`] writes a kernel's name.
pub const NAMES: u64 = 0;
/// Where [`Guest::try_launch`] writes the launch arguments.
pub const ARGS: u64 = 1024;

pub type Data = TenantStore<MockBackend, ()>;

pub struct Guest {
    pub store: Store<Data>,
    pub instance: Instance,
    pub memory: Memory,
    pub tenant: Arc<Tenant>,
}

/// A creator on a fresh mock with `registry`, recovering a fenced device by itself.
pub fn creator_with(registry: KernelRegistry<MockBackend>) -> TensorWasmMemoryCreator<MockBackend> {
    let builder =
        TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).kernels(registry);
    // SAFETY: nothing but the creator's backend uses the device's primary context here (the
    // simulated launcher loads its module again after a reset).
    unsafe { builder.recover_automatically() }.build().unwrap()
}

/// `wat` instantiated for `tenant` (charging what it touches), with the `twm` host functions.
pub fn guest_of(
    creator: &TensorWasmMemoryCreator<MockBackend>,
    wat: &str,
    tenant: &Arc<Tenant>,
) -> Guest {
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let module = Module::new(&engine, wat).unwrap();
    let mut store = new_store(
        &engine,
        TenantStore::new(creator, tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    Guest {
        store,
        instance,
        memory,
        tenant: Arc::clone(tenant),
    }
}

impl Guest {
    /// Calls the guest's export `name`.
    pub fn call<P: WasmParams, R: WasmResults>(&mut self, name: &str, p: P) -> wasmtime::Result<R> {
        self.instance
            .get_typed_func::<P, R>(&mut self.store, name)
            .unwrap()
            .call(&mut self.store, p)
    }

    /// The guest asks for kernel `name` (written at [`NAMES`]): its handle or a code.
    pub fn kernel(&mut self, name: &str) -> i32 {
        self.memory
            .write(&mut self.store, NAMES as usize, name.as_bytes())
            .unwrap();
        self.call::<(i32, i32), i32>("kernel", (NAMES as i32, name.len() as i32))
            .unwrap()
    }

    /// Writes `args` (`(a, b)` pairs, little-endian) at `at`.
    pub fn write_args(&mut self, at: u64, args: &[(u64, u64)]) {
        let bytes: Vec<u8> = args
            .iter()
            .flat_map(|&(a, b)| a.to_le_bytes().into_iter().chain(b.to_le_bytes()))
            .collect();
        self.memory
            .write(&mut self.store, at as usize, &bytes)
            .unwrap();
    }

    /// Launches `handle` with `args` written at [`ARGS`]: the code.
    pub fn launch(&mut self, handle: i32, args: &[(u64, u64)]) -> i32 {
        self.try_launch(handle, args).unwrap()
    }

    /// [`launch`](Self::launch), with a trap as the error.
    pub fn try_launch(&mut self, handle: i32, args: &[(u64, u64)]) -> wasmtime::Result<i32> {
        self.write_args(ARGS, args);
        self.call::<(i32, i32, i32), i32>("launch", (handle, ARGS as i32, args.len() as i32))
    }
}
