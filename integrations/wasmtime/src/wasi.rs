//! WASI preview 1 for guests, next to the `twm` host functions (feature `wasi`).
//!
//! What a real toolchain produces (clang with wasi-libc, Rust's `wasm32-wasip1`) imports
//! `wasi_snapshot_preview1`. [`add_wasi_to_linker`] adds it to a [`Linker`] whose Store data
//! carries a [`WasiP1Ctx`] (see [`HasWasi`]); with [`TenantStore`] that is the embedder's data
//! `U = WasiP1Ctx` (or any type that holds one). WASI state is per Store, so per tenant: each
//! Store gets its own arguments, environment, preopened directories and stdio.
//!
//! ```
//! use std::sync::Arc;
//! use tensor_wasm_mem_core::IsolationLevel;
//! use tensor_wasm_mem_mock::MockBackend;
//! use tensor_wasm_mem_wasmtime::wasi::{WasiCtxBuilder, add_wasi_to_linker};
//! use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
//! use tensor_wasm_mem_wasmtime::{
//!     ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, add_to_linker, instantiate,
//!     new_store,
//! };
//!
//! let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).build()?;
//! let engine = creator.engine()?;
//! let mut linker = Linker::new(&engine);
//! add_to_linker(&mut linker)?; // twm.advise, twm.prefetch
//! add_wasi_to_linker(&mut linker)?; // wasi_snapshot_preview1
//!
//! // A guest that asks WASI for its argument count.
//! let module = Module::new(&engine, r#"(module
//!   (import "wasi_snapshot_preview1" "args_sizes_get"
//!     (func $sizes (param i32 i32) (result i32)))
//!   (memory (export "memory") 1)
//!   (func (export "argc") (result i32)
//!     (drop (call $sizes (i32.const 0) (i32.const 4)))
//!     (i32.load (i32.const 0))))"#)?;
//! let tenant = Tenant::new(1, "alice", 64 << 20, IsolationLevel::StreamIsolated);
//! let wasi = WasiCtxBuilder::new().args(&["guest", "--fast"]).build_p1();
//! let mut store = new_store(&engine, TenantStore::new(&creator, &tenant, ChargeMode::Touched, wasi));
//! let instance = instantiate(&mut store, &linker, &module)?;
//! let argc = instance.get_typed_func::<(), i32>(&mut store, "argc")?;
//! assert_eq!(argc.call(&mut store, ())?, 2);
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```
//!
//! A guest's `proc_exit(code)` ends the call with an [`I32Exit`] error carrying the code
//! ([`exit_code`] finds it); WASI preview 1 passes codes 0 to 125 and answers larger ones with an
//! error of its own.

use wasmtime::Linker;

use crate::Backend;
use crate::guest::TenantStore;

/// The WASI implementation itself, re-exported so embedders use the same version (for pipes,
/// clocks, and the rest of `WasiCtxBuilder`'s inputs).
pub use wasmtime_wasi;
pub use wasmtime_wasi::p1::WasiP1Ctx;
pub use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

/// Store data that carries a WASI preview-1 context.
pub trait HasWasi: Send + 'static {
    /// The WASI context.
    fn wasi(&mut self) -> &mut WasiP1Ctx;
}

impl HasWasi for WasiP1Ctx {
    fn wasi(&mut self) -> &mut WasiP1Ctx {
        self
    }
}

/// A WASI context made only when the guest first calls WASI: a Store whose guest imports
/// nothing from WASI pays nothing for it. Made lazily, it is an empty context (no arguments,
/// environment, preopened directories or stdio); give `Some(context)` to a guest that needs one.
impl HasWasi for Option<WasiP1Ctx> {
    fn wasi(&mut self) -> &mut WasiP1Ctx {
        self.get_or_insert_with(|| WasiCtxBuilder::new().build_p1())
    }
}

impl<B: Backend, U: HasWasi> HasWasi for TenantStore<B, U> {
    fn wasi(&mut self) -> &mut WasiP1Ctx {
        self.data.wasi()
    }
}

/// Adds WASI preview 1 (`wasi_snapshot_preview1`, synchronous) to `linker`. Modules that import
/// nothing from WASI are unaffected: a linker resolves only what a module imports.
pub fn add_wasi_to_linker<T: HasWasi>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    wasmtime_wasi::p1::add_to_linker_sync(linker, T::wasi)
}

/// Whether `module` imports anything from WASI preview 1 (`wasi_snapshot_preview1`).
#[must_use]
pub fn imports_wasi(module: &wasmtime::Module) -> bool {
    module
        .imports()
        .any(|import| import.module() == "wasi_snapshot_preview1")
}

/// The exit code of a guest that called `proc_exit`, if that is what ended `error`.
#[must_use]
pub fn exit_code(error: &wasmtime::Error) -> Option<i32> {
    error.downcast_ref::<I32Exit>().map(|e| e.0)
}
