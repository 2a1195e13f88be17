//! A WASI guest on managed memory: WASI preview 1 added next to the `twm` host functions, one
//! WASI context per Store (its arguments, environment and stdout), the guest's `proc_exit`
//! status read back.
//!
//! `cargo run -p tensor-wasm-mem-wasmtime --features wasi --example wasi_guest`
//!
//! The guest is written in WAT so the example runs anywhere; a C program built with
//! `clang --target=wasm32-wasi` runs the same way (see the README and `tests/guests/`).

use std::sync::Arc;

use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::wasi::{WasiCtxBuilder, add_wasi_to_linker, exit_code};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, add_to_linker, instantiate, new_store,
};

/// Prints "hello from a WASI guest\n" with `fd_write`, prefetches its buffer with
/// `twm.prefetch`, and exits with the prefetch's result code plus 40 (40: success).
const GUEST: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "hello from a WASI guest\n")
  (func (export "_start")
    ;; one iovec at 0: { ptr = 64, len = 24 }
    (i32.store (i32.const 0) (i32.const 64))
    (i32.store (i32.const 4) (i32.const 24))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))
    (call $exit (i32.add (i32.const 40)
      (call $prefetch (i32.const 64) (i32.const 24) (i32.const -1))))))"#;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).build()?;
    let engine = creator.engine()?;
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker)?;
    add_wasi_to_linker(&mut linker)?;
    let module = Module::new(&engine, GUEST)?;
    for (id, name) in [(1, "alice"), (2, "bob")] {
        let tenant = Tenant::new(id, name, 16 << 20, IsolationLevel::StreamIsolated);
        // Per Store, so per tenant: its own arguments, environment and stdio.
        let wasi = WasiCtxBuilder::new()
            .inherit_stdout()
            .args(&["guest", name])
            .env("TENANT", name)
            .build_p1();
        let mut store = new_store(
            &engine,
            TenantStore::new(&creator, &tenant, ChargeMode::Touched, wasi),
        );
        let instance = instantiate(&mut store, &linker, &module)?;
        let start = instance.get_typed_func::<(), ()>(&mut store, "_start")?;
        let status = match start.call(&mut store, ()) {
            Ok(()) => 0,
            Err(e) => exit_code(&e).ok_or(e)?,
        };
        println!("{name}: exit status {status} (40: the prefetch succeeded)");
        assert_eq!(status, 40);
    }
    Ok(())
}
