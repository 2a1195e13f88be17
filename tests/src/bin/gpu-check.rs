//! `gpu-check`: the checks of the GPU validation kit that need a device, on the cudarc backend.
//!
//! 1. Zero copy: a guest fills its linear memory; a PTX kernel (embedded as text, loaded with the
//!    driver's module API: no compiler needed) increments every byte of a range through the
//!    resolved device pointer, on the instance's stream; the guest then reads the new values.
//! 2. Timings on the device: cuMemAllocManaged + free against a pool slot (acquire + release) for
//!    64 KiB, 1 MiB and 64 MiB; prefetch of 256 MiB host -> device and back (GB/s).
//!
//! On the simulated driver the kernel step reports "skipped: simulated driver" and the timings are
//! labelled as simulated. Prints one short table; `--log FILE` also writes the details there.

use std::ffi::{CString, c_void};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use tensor_wasm_mem_core::{
    DeviceId, IsolationLevel, Location, ManagedAllocator, PoolConfig, SizeClass, SlotPool,
    StreamLease, StreamProvider, TenantId, TenantKey, UnifiedBuffer,
};
use tensor_wasm_mem_cudarc::{CudarcBackend, DriverSource};
use tensor_wasm_mem_tests::sim::{SIM_PATH, Sim};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, instantiate, new_store,
};

/// Adds one to each byte of `data[0..len]`, one thread per byte.
const INCREMENT_PTX: &str = r#"
.version 7.0
.target sm_75
.address_size 64

.visible .entry increment(
    .param .u64 data,
    .param .u64 len
)
{
    .reg .pred  %p<2>;
    .reg .b16   %rs<3>;
    .reg .b32   %r<5>;
    .reg .b64   %rd<6>;

    ld.param.u64        %rd1, [data];
    ld.param.u64        %rd2, [len];
    mov.u32             %r1, %ctaid.x;
    mov.u32             %r2, %ntid.x;
    mov.u32             %r3, %tid.x;
    mad.lo.s32          %r4, %r1, %r2, %r3;
    cvt.u64.u32         %rd3, %r4;
    setp.ge.u64         %p1, %rd3, %rd2;
    @%p1 bra            DONE;
    cvta.to.global.u64  %rd4, %rd1;
    add.s64             %rd5, %rd4, %rd3;
    ld.global.u8        %rs1, [%rd5];
    add.s16             %rs2, %rs1, 1;
    st.global.u8        [%rd5], %rs2;
DONE:
    ret;
}
"#;

const GUEST: &str = r#"(module
  (memory (export "memory") 1 16)
  (func (export "fill") (param $len i32)
    (local $i i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
      (i32.store8 (local.get $i) (local.get $i))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next))))
  (func (export "check") (param $len i32) (result i32)
    ;; Returns how many bytes read as (i + 1) mod 256.
    (local $i i32) (local $ok i32)
    (block $done (loop $next
      (br_if $done (i32.ge_u (local.get $i) (local.get $len)))
      (if (i32.eq (i32.load8_u (local.get $i)) (i32.and (i32.add (local.get $i) (i32.const 1)) (i32.const 255)))
        (then (local.set $ok (i32.add (local.get $ok) (i32.const 1)))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $next)))
    (local.get $ok)))"#;

struct Report {
    rows: Vec<(String, String)>,
    log: String,
}

impl Report {
    fn row(&mut self, step: impl Into<String>, result: impl Into<String>) {
        let (step, result) = (step.into(), result.into());
        let _ = writeln!(self.log, "{step}: {result}");
        self.rows.push((step, result));
    }
}

fn check(call: &str, result: sys::CUresult) -> Result<(), String> {
    if result == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {result:?}"))
    }
}

/// Launches the increment kernel on `data..data + len`, ordered on `stream`, and waits.
fn launch_increment(data: u64, len: u64, stream: u64, context: u64) -> Result<(), String> {
    let ptx = CString::new(INCREMENT_PTX).map_err(|e| e.to_string())?;
    let name = CString::new("increment").map_err(|e| e.to_string())?;
    // SAFETY: a live context of the backend (the stream's).
    check("cuCtxSetCurrent", unsafe {
        sys::cuCtxSetCurrent(context as sys::CUcontext)
    })?;
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `module` is a valid out-pointer; `ptx` is a NUL-terminated PTX image.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast())
    })?;
    let mut function: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: `module` was just loaded; `name` is a NUL-terminated string.
    let got = check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut function, module, name.as_ptr())
    });
    let launched = got.and_then(|()| {
        let (mut data, mut len) = (data, len);
        let mut params = [
            (&raw mut data).cast::<c_void>(),
            (&raw mut len).cast::<c_void>(),
        ];
        let blocks = len.div_ceil(256) as u32;
        // SAFETY: the kernel takes two u64 parameters, passed by address; the range lies inside
        // the guest's live memory (resolved and checked by the creator); the stream is live.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                blocks,
                1,
                1,
                256,
                1,
                1,
                0,
                stream as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        // SAFETY: a live stream of the backend.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream as sys::CUstream)
        })
    });
    // SAFETY: the module is not used after this.
    let _ = unsafe { sys::cuModuleUnload(module) };
    launched
}

fn zero_copy(
    backend: &Arc<CudarcBackend>,
    simulated: bool,
    report: &mut Report,
) -> Result<(), String> {
    const LEN: i32 = 4096;
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(backend))
        .build()
        .map_err(|e| e.to_string())?;
    let engine = creator.engine().map_err(|e| format!("{e:#}"))?;
    let module = Module::new(&engine, GUEST).map_err(|e| format!("{e:#}"))?;
    let tenant = Tenant::new(1, "gpu-check", 64 << 20, IsolationLevel::StreamIsolated);
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let instance =
        instantiate(&mut store, &Linker::new(&engine), &module).map_err(|e| format!("{e:#}"))?;
    let fill = instance
        .get_typed_func::<i32, ()>(&mut store, "fill")
        .map_err(|e| format!("{e:#}"))?;
    let check_fn = instance
        .get_typed_func::<i32, i32>(&mut store, "check")
        .map_err(|e| format!("{e:#}"))?;
    fill.call(&mut store, LEN).map_err(|e| format!("{e:#}"))?;
    let memory = instance
        .get_memory(&mut store, "memory")
        .ok_or("no memory export")?;
    let slice = creator
        .resolve(&store, &memory, 0, LEN as u64)
        .map_err(|e| e.to_string())?;
    report.row(
        "zero-copy: resolve",
        format!(
            "device pointer {:#x}, {} bytes",
            slice.device_ptr(),
            slice.len()
        ),
    );
    if simulated {
        report.row("zero-copy: kernel", "skipped: simulated driver");
        return Ok(());
    }
    let lease = StreamLease::acquire(
        Arc::clone(backend),
        TenantKey::fresh(TenantId(1)),
        IsolationLevel::StreamIsolated,
    )
    .map_err(|e| e.to_string())?;
    launch_increment(
        slice.device_ptr(),
        slice.len() as u64,
        lease.stream().raw(),
        lease.stream().context(),
    )?;
    let ok = check_fn
        .call(&mut store, LEN)
        .map_err(|e| format!("{e:#}"))?;
    report.row(
        "zero-copy: kernel",
        if ok == LEN {
            format!("ok: the guest reads all {LEN} bytes the kernel incremented")
        } else {
            format!("FAILED: only {ok} of {LEN} bytes read as incremented")
        },
    );
    if ok != LEN {
        return Err("zero-copy check failed".into());
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn timings(backend: &Arc<CudarcBackend>, label: &str, report: &mut Report) -> Result<(), String> {
    for (name, bytes, iterations) in [
        ("64KiB", 64usize << 10, 200),
        ("1MiB", 1 << 20, 200),
        ("64MiB", 64 << 20, 20),
    ] {
        let mut alloc = Vec::new();
        for _ in 0..iterations {
            let start = Instant::now();
            let a = backend
                .allocate(DeviceId(0), bytes)
                .map_err(|e| e.to_string())?;
            // SAFETY: `a` came from `backend` and is not used again.
            unsafe { backend.free(a) }.map_err(|e| e.to_string())?;
            alloc.push(start.elapsed().as_secs_f64() * 1e6);
        }
        let pool = Arc::new(
            SlotPool::new(
                Arc::clone(backend),
                PoolConfig::new(DeviceId(0), [SizeClass::new(bytes, 2)]),
            )
            .map_err(|e| e.to_string())?,
        );
        let mut slot = Vec::new();
        for _ in 0..iterations {
            let start = Instant::now();
            drop(pool.acquire(bytes, 0).map_err(|e| e.to_string())?);
            slot.push(start.elapsed().as_secs_f64() * 1e6);
        }
        let (a, s) = (median(alloc), median(slot));
        report.row(
            format!("alloc+free vs pool slot, {name}{label}"),
            format!("{a:.1} us vs {s:.2} us ({:.0}x)", a / s.max(1e-9)),
        );
    }
    // Prefetch 256 MiB host -> device -> host.
    let bytes = 256usize << 20;
    let mut buffer = UnifiedBuffer::new(Arc::clone(backend), DeviceId(0), bytes, bytes)
        .map_err(|e| e.to_string())?;
    let chunk = vec![1u8; 1 << 20];
    for i in 0..256 {
        buffer.write(i << 20, &chunk).map_err(|e| e.to_string())?;
    }
    let lease = StreamLease::acquire(
        Arc::clone(backend),
        TenantKey::fresh(TenantId(1)),
        IsolationLevel::StreamIsolated,
    )
    .map_err(|e| e.to_string())?;
    let rate = |to: Location| -> Result<f64, String> {
        let start = Instant::now();
        buffer
            .prefetch(0, bytes, to, lease.stream())
            .map_err(|e| e.to_string())?;
        backend
            .synchronize(lease.stream())
            .map_err(|e| e.to_string())?;
        Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e9)
    };
    let to_device = rate(Location::Device(DeviceId(0)))?;
    let to_host = rate(Location::Host)?;
    report.row(
        format!("prefetch 256MiB{label}"),
        format!("host->device {to_device:.1} GB/s, device->host {to_host:.1} GB/s"),
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    let log_path = std::env::args().skip_while(|a| a != "--log").nth(1);
    let mut report = Report {
        rows: Vec::new(),
        log: String::new(),
    };
    let simulated = Sim::get().is_some();
    let outcome = (|| -> Result<(), String> {
        let backend = Arc::new(
            tensor_wasm_mem_cudarc::start(&DriverSource::SystemOr(SIM_PATH.into()))
                .map_err(|e| format!("the cudarc backend did not start: {e}"))?,
        );
        let d = backend.driver();
        let names: Vec<_> = d.devices().map(|i| i.name.clone()).collect();
        report.row(
            "driver",
            format!(
                "{} {} ({})",
                if simulated { "simulated" } else { "CUDA" },
                d.driver_version(),
                names.join(", ")
            ),
        );
        zero_copy(&backend, simulated, &mut report)?;
        timings(
            &backend,
            if simulated { " (simulated)" } else { "" },
            &mut report,
        )?;
        let leaked = backend.stats();
        report.row(
            "backend counters after",
            format!(
                "{} allocations, {} streams live",
                leaked.live_allocations, leaked.live_streams
            ),
        );
        Ok(())
    })();
    if let Err(e) = &outcome {
        report.row("error", e.clone());
    }
    for (step, result) in &report.rows {
        println!("{step:<40} {result}");
    }
    if let Some(path) = log_path {
        let _ = std::fs::write(path, &report.log);
    }
    if outcome.is_ok() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
