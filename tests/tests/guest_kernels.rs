//! A guest launches an embedder's kernel on the real driver backends: the embedder registers
//! `increment` with a launcher that is its own driver code (a PTX module loaded and launched
//! through the libcuda the process loaded, on the guest's stream and context), and the guest
//! launches it through `twm.launch` on its own memory. On a machine with a CUDA driver the PTX
//! runs on the GPU; without one, on the simulated libcuda (whose `increment` is the model's).

use std::sync::Arc;

use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_cudarc::DriverSource;
use tensor_wasm_mem_tests::guests::{c_guest, run_command};
use tensor_wasm_mem_tests::kernels::{launch_axpy, launch_increment};
use tensor_wasm_mem_tests::sim::SIM_PATH;
use tensor_wasm_mem_wasmtime::kernels::{
    BufferLength, KernelParam, KernelRegistry, KernelSignature, Launch, LaunchShape, Scalar,
};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module, Store};
use tensor_wasm_mem_wasmtime::{
    Access, Backend, ChargeMode, TWM_ERR_OUT_OF_RANGE, Tenant, TenantStore,
    TensorWasmMemoryCreator, TwmError, add_to_linker, instantiate, new_store,
};

const GUEST: &str = r#"(module
  (import "twm" "kernel" (func $kernel (param i32 i32) (result i32)))
  (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "increment")
  ;; Fills [4096, 4096 + len) with 0, 1, 2, ... and launches increment on (off, len).
  (func (export "run") (param $off i64) (param $len i64) (result i32)
    (local $i i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (i32.const 4096)))
      (i32.store8 (i32.add (i32.const 4096) (local.get $i)) (local.get $i))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next)))
    (i64.store (i32.const 64) (local.get $off))
    (i64.store (i32.const 72) (local.get $len))
    (call $launch (call $kernel (i32.const 0) (i32.const 9)) (i32.const 64) (i32.const 1)))
  (func (export "byte") (param i32) (result i32) (i32.load8_u (local.get 0))))"#;

/// `increment(buf)`: the embedder's launcher, its own driver code on the guest's stream.
fn registry<B: Backend>() -> KernelRegistry<B> {
    let mut registry = KernelRegistry::new();
    registry
        .register(
            "increment",
            KernelSignature {
                params: vec![KernelParam::Buffer {
                    access: Access::ReadWrite,
                    element_bytes: 1,
                    length: BufferLength::Any,
                }],
                shape: LaunchShape::Fixed {
                    grid: [1, 1, 1],
                    block: [256, 1, 1],
                },
            },
            |_: &B, launch: &Launch<'_>| {
                let (ptr, len) = launch.buffers()[0];
                if len == 0 {
                    return Ok(()); // no grid of zero blocks: nothing to do
                }
                launch_increment(ptr, len, launch.stream().raw(), launch.stream().context())
                    .map_err(TwmError::Launch)
            },
        )
        .expect("a valid signature");
    registry
}

fn guest_launches_increment<B: Backend>(backend: B) {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(backend))
        .kernels(registry())
        .build()
        .expect("creator");
    let engine = creator.engine().expect("engine");
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).expect("twm");
    let module = Module::new(&engine, GUEST).expect("module");
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    let mut store: Store<TenantStore<B, ()>> = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &linker, &module).expect("instance");
    let run = instance
        .get_typed_func::<(i64, i64), i32>(&mut store, "run")
        .expect("run");
    let byte = instance
        .get_typed_func::<i32, i32>(&mut store, "byte")
        .expect("byte");
    assert_eq!(run.call(&mut store, (4096, 1024)).unwrap(), 0);
    for i in [0, 100, 1023] {
        assert_eq!(byte.call(&mut store, 4096 + i).unwrap(), (i + 1) & 0xff);
    }
    assert_eq!(
        byte.call(&mut store, 4096 + 1024).unwrap(),
        1024 & 0xff,
        "untouched"
    );
    // Hostile launches never reach the driver.
    assert_eq!(
        run.call(&mut store, (65_000, 4096)).unwrap(),
        TWM_ERR_OUT_OF_RANGE
    );
    assert_eq!(run.call(&mut store, (4096, 0)).unwrap(), 0, "empty");
    assert_ne!(run.call(&mut store, (-1, 2)).unwrap(), 0);
    assert_eq!(tenant.stats().launches, 2);
    assert_eq!(tenant.stats().kernel_failures, 0);
}

#[test]
fn a_guest_launches_the_embedders_cudarc_kernel() {
    let backend = tensor_wasm_mem_cudarc::start(&DriverSource::SystemOr(SIM_PATH.into()))
        .expect("cudarc on the driver or the simulator");
    guest_launches_increment(backend);
}

#[test]
fn a_guest_launches_the_embedders_kernel_on_cust() {
    let backend = tensor_wasm_mem_cust::start().expect("cust on the driver or the simulator");
    guest_launches_increment(backend);
}

/// `saxpy(a, x, y, n)` as the C guest declares it: the embedder's AXPY PTX, launched through the
/// libcuda the process loaded on the guest's stream.
fn saxpy_registry<B: Backend>() -> KernelRegistry<B> {
    let floats = |access| KernelParam::Buffer {
        access,
        element_bytes: 4,
        length: BufferLength::Arg(3),
    };
    let mut registry = KernelRegistry::new();
    registry
        .register(
            "saxpy",
            KernelSignature {
                params: vec![
                    KernelParam::Scalar(Scalar::F32),
                    floats(Access::Read),
                    floats(Access::ReadWrite),
                    KernelParam::Scalar(Scalar::U32),
                ],
                shape: LaunchShape::PerElement {
                    block: 256,
                    count: 3,
                },
            },
            |_: &B, launch: &Launch<'_>| {
                let args = launch.args();
                let a = f32::from_bits(u32::try_from(args[0]).unwrap_or(0));
                let (x, y) = (launch.buffers()[0].0, launch.buffers()[1].0);
                let n = args[3];
                if n == 0 {
                    return Ok(());
                }
                let on = (launch.stream().raw(), launch.stream().context());
                launch_axpy(a, (x, y), n, on).map_err(TwmError::Launch)
            },
        )
        .expect("a valid signature");
    registry
}

/// Runs the C guest `tests/guests/saxpy.c` (WASI) on `backend`: its exit status and stdout.
fn c_saxpy_on<B: Backend>(backend: B) -> Option<(i32, String)> {
    let wasm = c_guest("saxpy")?;
    let creator = TensorWasmMemoryCreator::builder(Arc::new(backend))
        .kernels(saxpy_registry())
        .build()
        .expect("creator");
    let tenant = Tenant::new(1, "saxpy", 64 << 20, IsolationLevel::StreamIsolated);
    let ran = run_command(&creator, &wasm, &tenant, &["saxpy"], &[]);
    let stats = tenant.stats();
    assert_eq!(
        (
            stats.launches,
            stats.refused_launches,
            stats.kernel_failures
        ),
        (1, 1, 0)
    );
    Some(ran)
}

fn expect_saxpy_output(result: Option<(i32, String)>) {
    let Some((status, out)) = result else {
        return; // no C toolchain here: `c_guest` said so (CI sets TWM_REQUIRE_C_GUESTS=1)
    };
    assert_eq!(
        out,
        "saxpy over 100000 floats: 0 wrong; an aliased launch: arguments do not match the kernel\n"
    );
    assert_eq!(status, 0, "{out}");
}

#[test]
fn a_c_guest_launches_saxpy_on_cudarc() {
    let backend = tensor_wasm_mem_cudarc::start(&DriverSource::SystemOr(SIM_PATH.into()))
        .expect("cudarc on the driver or the simulator");
    expect_saxpy_output(c_saxpy_on(backend));
}

#[test]
fn a_c_guest_launches_saxpy_on_cust() {
    let backend = tensor_wasm_mem_cust::start().expect("cust on the driver or the simulator");
    expect_saxpy_output(c_saxpy_on(backend));
}

/// cudarc's view of a scope refuses, typed, what cudarc cannot borrow: a read-only range for
/// writing, a range that is not whole elements, a context-isolated tenant's own context.
#[test]
fn cudarc_interop_refuses_what_it_cannot_borrow() {
    use tensor_wasm_mem_wasmtime::interop::cudarc::CudarcScope;
    use tensor_wasm_mem_wasmtime::{AccessRange, DeviceAccess};
    let backend = tensor_wasm_mem_cudarc::start(&DriverSource::SystemOr(SIM_PATH.into()))
        .expect("cudarc on the driver or the simulator");
    let creator = TensorWasmMemoryCreator::builder(Arc::new(backend))
        .build()
        .expect("creator");
    let engine = creator.engine().expect("engine");
    let module = Module::new(&engine, r#"(module (memory (export "memory") 1))"#).unwrap();
    for isolation in [
        IsolationLevel::StreamIsolated,
        IsolationLevel::ContextIsolated,
    ] {
        let tenant = Tenant::new(1, "t", 1 << 20, isolation);
        let mut store = new_store(
            &engine,
            TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
        );
        let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
        let memory = instance.get_memory(&mut store, "memory").unwrap();
        let scope = DeviceAccess::open(
            &mut store,
            &creator,
            &memory,
            &[AccessRange::read(0, 64), AccessRange::read_write(64, 6)],
        )
        .unwrap();
        // SAFETY: nothing cudarc makes from it outlives this match, before the close.
        match unsafe { CudarcScope::new(&scope) } {
            Ok(cuda) => {
                assert_eq!(isolation, IsolationLevel::StreamIsolated);
                let read_only = cuda.slice_mut::<f32>(0).expect("range 0");
                assert!(matches!(read_only, Err(TwmError::Interop(_))));
                let ragged = cuda.slice_mut::<f32>(1).expect("range 1");
                assert!(matches!(ragged, Err(TwmError::Interop(_))), "6 bytes");
                let mut bytes = cuda.slice_mut::<u8>(1).expect("range 1").expect("6 bytes");
                assert_eq!(bytes.get().len(), 6);
                assert!(bytes.view_mut().is_some());
                let mut read = cuda.slice::<u8>(0).expect("range 0").expect("64 bytes");
                assert!(
                    read.view_mut().is_none(),
                    "a read-only range has no mutable view"
                );
                assert!(cuda.slice::<u8>(2).is_none(), "no third range");
            }
            Err(e) => {
                assert_eq!(isolation, IsolationLevel::ContextIsolated, "{e}");
                assert!(matches!(e, TwmError::Interop(_)), "{e}");
            }
        }
        scope.close().unwrap();
        drop(store);
    }
    assert_eq!(creator.stats().live_memories, 0);
}
