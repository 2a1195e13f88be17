//! A guest's arrays under cudarc's own types: `cargo run -p tensor-wasm-mem-tests --example
//! scope_cudarc`.
//!
//! The guest fills `x` and `y` in its memory; the embedder opens a device-access scope over
//! them, takes cudarc's view of it (`interop::cudarc::CudarcScope`: cudarc's context, the
//! tenant's stream borrowed, the ranges as `CudaSlice`s cudarc never frees), loads its AXPY
//! PTX with cudarc, launches it with cudarc's `launch_builder` on that stream, closes the scope
//! (which waits for the stream) and the guest checks `y = 2x + y`. On a machine with a CUDA
//! driver the PTX runs on the GPU; without one, on the simulated libcuda (whose `axpy` is the
//! model's).

use std::sync::Arc;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_cudarc::DriverSource;
use tensor_wasm_mem_tests::kernels::AXPY_PTX;
use tensor_wasm_mem_tests::sim::{SIM_PATH, real_driver};
use tensor_wasm_mem_wasmtime::interop::cudarc::CudarcScope;
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::{
    AccessRange, ChargeMode, DeviceAccess, Tenant, TenantStore, TensorWasmMemoryCreator,
    instantiate, new_store,
};

const N: u32 = 4096;
const X: u64 = 0;
const Y: u64 = 4 * N as u64;

const GUEST: &str = r#"(module
  (memory (export "memory") 1 16)
  ;; x[i] = i, y[i] = 1 over n floats (x at 0, y at 4n).
  (func (export "fill") (param $n i32) (local $i i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
      (f32.store (i32.shl (local.get $i) (i32.const 2)) (f32.convert_i32_u (local.get $i)))
      (f32.store (i32.shl (i32.add (local.get $n) (local.get $i)) (i32.const 2)) (f32.const 1))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next))))
  ;; How many y[i] are not 2i + 1.
  (func (export "wrong") (param $n i32) (result i32) (local $i i32) (local $bad i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
      (if (f32.ne (f32.load (i32.shl (i32.add (local.get $n) (local.get $i)) (i32.const 2)))
                  (f32.add (f32.mul (f32.const 2) (f32.convert_i32_u (local.get $i))) (f32.const 1)))
        (then (local.set $bad (i32.add (local.get $bad) (i32.const 1)))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next)))
    (local.get $bad)))"#;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let on_gpu = real_driver();
    let backend = Arc::new(tensor_wasm_mem_cudarc::start(&DriverSource::SystemOr(
        SIM_PATH.into(),
    ))?);
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend)).build()?;
    let engine = creator.engine()?;
    let tenant = Tenant::new(1, "example", 1 << 20, IsolationLevel::StreamIsolated);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let module = Module::new(&engine, GUEST)?;
    let instance = instantiate(&mut store, &Linker::new(&engine), &module)?;
    let memory = instance
        .get_memory(&mut store, "memory")
        .ok_or("no memory export")?;
    let fill = instance.get_typed_func::<i32, ()>(&mut store, "fill")?;
    let wrong = instance.get_typed_func::<i32, i32>(&mut store, "wrong")?;
    fill.call(&mut store, N as i32)?;

    let bytes = 4 * u64::from(N);
    let scope = DeviceAccess::open(
        &mut store,
        &creator,
        &memory,
        &[
            AccessRange::read(X, bytes),
            AccessRange::read_write(Y, bytes),
        ],
    )?;
    {
        // SAFETY: nothing cudarc makes here (module, function, launch, views) outlives this
        // block, which ends before the scope closes.
        let cuda = unsafe { CudarcScope::new(&scope) }?;
        let ptx = cuda.context().load_module(Ptx::from_src(AXPY_PTX))?;
        let axpy = ptx.load_function("axpy")?;
        let x = cuda.slice::<f32>(0).ok_or("range 0")??;
        let mut y = cuda.slice_mut::<f32>(1).ok_or("range 1")??;
        let (a, n) = (2.0f32, u64::from(N));
        let mut launch = cuda.stream().launch_builder(&axpy);
        launch.arg(&a);
        launch.arg(x.get());
        let mut y = y.view_mut().ok_or("writable")?;
        launch.arg(&mut y);
        launch.arg(&n);
        // SAFETY: `axpy(a, x, y, n)` reads `n` floats of `x` and writes `n` of `y`: both ranges
        // are exactly that long, inside the guest's memory, opened for that access; the scope
        // holds the Store, so no guest code runs until it closes and waits for the stream.
        unsafe { launch.launch(LaunchConfig::for_num_elems(N)) }?;
    }
    scope.close()?;
    let bad = wrong.call(&mut store, N as i32)?;
    println!(
        "cudarc launched axpy over {N} floats of guest memory on {}: {bad} wrong",
        if on_gpu {
            "the GPU"
        } else {
            "the simulated libcuda"
        }
    );
    if bad != 0 {
        return Err("the guest does not see what the kernel wrote".into());
    }
    Ok(())
}
