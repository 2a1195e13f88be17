//! `gpu-check`: the checks of the GPU validation kit that need a device, on the cudarc backend.
//!
//! 1. Host access: the device attributes the device-visible guarded backing rests on (pageable
//!    memory access 88, its use of the host page tables 100, host registration 99 with the host
//!    pointer usable on the device 91), and the backing a creator picks from them.
//! 2. Zero copy, on every backing the device can serve (managed; guarded pageable; guarded
//!    registered): a guest fills its linear memory; a PTX kernel (embedded as text, loaded with
//!    the driver's module API: no compiler needed) increments every byte of a range through the
//!    resolved device pointer, on the instance's stream; the guest then reads the new values.
//!    On a guarded backing the guest runs under Wasmtime's guard-page Config, so the kernel
//!    writes host virtual memory with guard pages around it.
//! 3. Timings on the device: cuMemAllocManaged + free against a pool slot (acquire + release) for
//!    64 KiB, 1 MiB and 64 MiB; prefetch of 256 MiB host -> device and back (GB/s), of managed
//!    memory and, with pageable memory access, of plain host memory (what the guarded pageable
//!    backing prefetches).
//!
//! 4. A released slot moves no dead bytes: the cost of releasing and reacquiring a 64 MiB pool
//!    slot written by the host (scrubbed on the host) and one written by a kernel (scrubbed on
//!    the device), each with the next holder's first touch of every page from the host,
//!    against a fresh `cuMemAllocManaged` of the same size touched the same way.
//! 5. A faulting kernel: the PTX increment kernel writes out of bounds (an illegal address) in
//!    one tenant's stream; the backend sees the sticky fault and fences the device; the device
//!    is recovered (its primary context reset) and another tenant's next kernel runs.
//!
//! On the simulated driver the kernel is the simulator's host kernel of the same name (the PTX is
//! loaded, not run) and the timings are labelled as simulated. Prints one short table; `--log FILE` also writes the details there.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use tensor_wasm_mem_core::{
    Advisor, BackendError, DeviceId, HostAccess, HostMemory, IsolationLevel, Location,
    ManagedAllocator, PoolConfig, SizeClass, SlotPool, StreamLease, StreamProvider, TenantId,
    TenantKey, UnifiedBuffer,
};
use tensor_wasm_mem_cudarc::{CudarcBackend, DriverSource};
use tensor_wasm_mem_tests::kernels::launch_increment;
use tensor_wasm_mem_tests::sim::{SIM_PATH, Sim};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
use tensor_wasm_mem_wasmtime::{
    AccessRange, Backing, ChargeMode, DeviceAccess, Tenant, TenantStore, TensorWasmMemoryCreator,
    instantiate, new_store,
};

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

/// The device attributes the guarded backings rest on, and the backing a creator picks.
fn host_access(backend: &Arc<CudarcBackend>, report: &mut Report) -> Vec<Backing> {
    let yes = |b: bool| if b { "yes" } else { "no" };
    for info in backend.driver().devices() {
        report.row(
            format!("host access, device {}", info.id.0),
            format!(
                "pageable access (88) {}, host page tables (100) {}, registration (99 + 91) {}",
                yes(info.pageable_memory_access),
                yes(info.pageable_uses_host_page_tables),
                yes(info.host_registration),
            ),
        );
    }
    let device = [DeviceId(0)];
    report.row(
        "default backing",
        Backing::detect(&**backend, &device).name(),
    );
    Backing::ALL
        .into_iter()
        .filter(|b| b.check(&**backend, &device).is_ok())
        .collect()
}

fn zero_copy(
    backend: &Arc<CudarcBackend>,
    backing: Backing,
    simulated: bool,
    report: &mut Report,
) -> Result<(), String> {
    const LEN: i32 = 4096;
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(backend))
        .backing(backing)
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
    // The kernel runs inside a device-access scope: the ranges checked and prefetched to the
    // device on the tenant's stream, the Store held (no guest runs), the stream waited for at
    // close.
    let ranges = [AccessRange::read_write(0, LEN as u64)];
    let scope =
        DeviceAccess::open(&mut store, &creator, &memory, &ranges).map_err(|e| e.to_string())?;
    let slice = scope.slice(0).ok_or("no range")?;
    report.row(
        format!("zero-copy ({backing}): scope"),
        format!(
            "device pointer {:#x}, {} bytes, stream {:#x}",
            slice.device_ptr(),
            slice.len(),
            scope.stream().raw()
        ),
    );
    // On the simulated driver `increment` is its host kernel of that name (the PTX is loaded
    // but not run): the same launch, the same scope, no GPU.
    let launched = launch_increment(
        slice.device_ptr(),
        slice.len() as u64,
        scope.stream().raw(),
        scope.stream().context(),
    );
    // Closed (the stream waited for) whether or not the launch worked.
    let closed = scope.close().map_err(|e| e.to_string());
    launched?;
    closed?;
    let ok = check_fn
        .call(&mut store, LEN)
        .map_err(|e| format!("{e:#}"))?;
    report.row(
        format!(
            "zero-copy ({backing}): kernel{}",
            if simulated { " (simulated)" } else { "" }
        ),
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
    if backend.can_attach_host(DeviceId(0), HostAccess::Pageable) {
        pageable_prefetch(backend, &lease, label, report)?;
    }
    Ok(())
}

/// Prefetch of 256 MiB of plain host memory (what the guarded pageable backing hands the
/// driver) host -> device -> host.
fn pageable_prefetch(
    backend: &Arc<CudarcBackend>,
    lease: &StreamLease<Arc<CudarcBackend>>,
    label: &str,
    report: &mut Report,
) -> Result<(), String> {
    let bytes = 256usize << 20;
    let layout = std::alloc::Layout::from_size_align(bytes, 2 << 20).map_err(|e| e.to_string())?;
    // SAFETY: the layout has a non-zero size.
    let ptr =
        std::ptr::NonNull::new(unsafe { std::alloc::alloc(layout) }).ok_or("out of host memory")?;
    // SAFETY: a fresh allocation of `bytes` bytes, ours.
    unsafe { ptr.as_ptr().write_bytes(1, bytes) };
    // SAFETY: host memory, readable and writable, 2 MiB aligned, detached below before it is
    // freed.
    let chunk = unsafe { backend.attach_host(DeviceId(0), HostAccess::Pageable, ptr, bytes) }
        .map_err(|e| e.to_string())?;
    let rate = |to: Location| -> Result<f64, String> {
        let start = Instant::now();
        backend
            .prefetch(&chunk, 0, bytes, to, lease.stream())
            .map_err(|e| e.to_string())?;
        backend
            .synchronize(lease.stream())
            .map_err(|e| e.to_string())?;
        Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e9)
    };
    let rates = rate(Location::Device(DeviceId(0))).and_then(|d| Ok((d, rate(Location::Host)?)));
    // SAFETY: the stream was waited for; no device work uses the range.
    let detached = unsafe { backend.detach_host(chunk) }.map_err(|e| e.to_string());
    if detached.is_ok() {
        // SAFETY: allocated above with `layout`, detached.
        unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
    }
    let (to_device, to_host) = rates?;
    detached?;
    report.row(
        format!("prefetch 256MiB host memory{label}"),
        format!("host->device {to_device:.1} GB/s, device->host {to_host:.1} GB/s"),
    );
    Ok(())
}

/// Times one run of `f` in milliseconds.
fn millis<T>(f: impl FnOnce() -> Result<T, String>) -> Result<(T, f64), String> {
    let start = Instant::now();
    let value = f()?;
    Ok((value, start.elapsed().as_secs_f64() * 1e3))
}

/// Reads every page of `buffer` from the host (the next holder's first touch).
fn touch_all(buffer: &UnifiedBuffer<Arc<CudarcBackend>>) -> Result<(), String> {
    let mut chunk = vec![0u8; 1 << 20];
    for offset in (0..buffer.len()).step_by(chunk.len()) {
        buffer.read(offset, &mut chunk).map_err(|e| e.to_string())?;
        if chunk.iter().any(|&b| b != 0) {
            return Err(format!("a reacquired slot is not zero at {offset:#x}"));
        }
    }
    Ok(())
}

/// The cost of releasing and reacquiring a 64 MiB slot written by the host, and one written by
/// a kernel, against a fresh managed allocation of the same size (each then touched by the
/// host, as the next guest would).
fn slot_release(
    backend: &Arc<CudarcBackend>,
    label: &str,
    report: &mut Report,
) -> Result<(), String> {
    const BYTES: usize = 64 << 20;
    const ROUNDS: usize = 5;
    let pool = Arc::new(
        SlotPool::new(
            Arc::clone(backend),
            PoolConfig::new(DeviceId(0), [SizeClass::new(BYTES, 1)]),
        )
        .map_err(|e| e.to_string())?,
    );
    let lease = StreamLease::acquire(
        Arc::clone(backend),
        TenantKey::fresh(TenantId(3)),
        IsolationLevel::StreamIsolated,
    )
    .map_err(|e| e.to_string())?;
    let ones = vec![1u8; 1 << 20];
    let (mut host, mut kernel, mut fresh) = (Vec::new(), Vec::new(), Vec::new());
    // Releases `slot`, reacquires it, touches every page: both times go to `figures`.
    let reacquire = |slot, figures: &mut Vec<(f64, f64)>| -> Result<_, String> {
        let (slot, again) = millis(|| {
            drop(slot);
            pool.acquire(BYTES, BYTES).map_err(|e| e.to_string())
        })?;
        let ((), touch) = millis(|| touch_all(&slot))?;
        figures.push((again, touch));
        Ok(slot)
    };
    for _ in 0..ROUNDS {
        // Written by the host: scrubbed on the host, where its pages are.
        let mut slot = pool.acquire(BYTES, BYTES).map_err(|e| e.to_string())?;
        for offset in (0..BYTES).step_by(ones.len()) {
            slot.write(offset, &ones).map_err(|e| e.to_string())?;
        }
        let slot = reacquire(slot, &mut host)?;
        // Written by a kernel: scrubbed on the device, where its pages are.
        let device_ptr = slot.device_ptr();
        launch_increment(
            device_ptr,
            BYTES as u64,
            lease.stream().raw(),
            lease.stream().context(),
        )?;
        let slot = reacquire(slot, &mut kernel)?;
        drop(slot);
        // A fresh managed allocation, touched the same way.
        let (buffer, allocate) = millis(|| {
            UnifiedBuffer::new(Arc::clone(backend), DeviceId(0), BYTES, BYTES)
                .map_err(|e| e.to_string())
        })?;
        let ((), touch) = millis(|| touch_all(&buffer))?;
        let ((), free) = millis(|| {
            drop(buffer);
            Ok(())
        })?;
        fresh.push((allocate + free, touch));
    }
    let row = |v: &[(f64, f64)]| {
        let (a, t) = (
            median(v.iter().map(|p| p.0).collect()),
            median(v.iter().map(|p| p.1).collect()),
        );
        format!("{a:.2} ms + first touch {t:.2} ms")
    };
    report.row(
        format!("64MiB slot, host-written: release+reacquire{label}"),
        row(&host),
    );
    report.row(
        format!("64MiB slot, kernel-written: release+reacquire{label}"),
        row(&kernel),
    );
    report.row(format!("64MiB cuMemAllocManaged+free{label}"), row(&fresh));
    Ok(())
}

/// A kernel writes out of bounds in one tenant's stream; the device is fenced, recovered (its
/// primary context reset), and another tenant's next kernel runs.
fn fault_and_recover(
    backend: &Arc<CudarcBackend>,
    label: &str,
    report: &mut Report,
) -> Result<(), String> {
    let faulty = backend
        .acquire_stream(
            TenantKey::fresh(TenantId(7)),
            IsolationLevel::StreamIsolated,
        )
        .map_err(|e| e.to_string())?;
    // Out of bounds: an address no allocation covers (an illegal address on a GPU; the
    // simulator checks the range and faults the same way).
    let launched = launch_increment(
        tensor_wasm_mem_tests::harness::FAULT_AT,
        64,
        faulty.raw(),
        faulty.context(),
    );
    // The backend sees the sticky fault at its next call in that context.
    let waited = backend.synchronize(&faulty);
    let fenced = backend.device_fenced(DeviceId(0));
    let _ = backend.release_stream(faulty);
    let seen = match (&launched, &waited) {
        (_, Err(e)) => format!("fault seen ({})", e.kind()),
        (Err(e), Ok(())) => format!("the launch failed ({e}), the wait did not"),
        (Ok(()), Ok(())) => "no fault".to_string(),
    };
    if !fenced {
        report.row(
            format!("kernel fault{label}"),
            format!("FAILED: {seen}, device not fenced"),
        );
        return Err("a faulting kernel did not fence the device".into());
    }
    // SAFETY: nothing else in this process uses the device's primary context: every launch of
    // the kit loads and unloads its own module, and every creator of the earlier steps is gone.
    let (recovery, took) =
        millis(|| unsafe { backend.recover_device(DeviceId(0)) }.map_err(|e| e.to_string()))?;
    let lost = recovery.map_or(0, |r| r.allocations);
    // Another tenant's kernel on the recovered device.
    let next = StreamLease::acquire(
        Arc::clone(backend),
        TenantKey::fresh(TenantId(8)),
        IsolationLevel::StreamIsolated,
    )
    .map_err(|e| e.to_string())?;
    let mut buffer = UnifiedBuffer::new(Arc::clone(backend), DeviceId(0), 4096, 4096)
        .map_err(|e| e.to_string())?;
    buffer.write(0, &[0u8; 4096]).map_err(|e| e.to_string())?;
    launch_increment(
        buffer.device_ptr(),
        4096,
        next.stream().raw(),
        next.stream().context(),
    )?;
    let mut bytes = [0u8; 4096];
    buffer.read(0, &mut bytes).map_err(|e| e.to_string())?;
    let ok = bytes.iter().all(|&b| b == 1);
    report.row(
        format!("kernel fault and recovery{label}"),
        format!(
            "{seen}, device fenced; recovered in {took:.1} ms ({lost} allocations lost); next tenant's kernel: {}",
            if ok { "ok" } else { "FAILED" }
        ),
    );
    if ok {
        Ok(())
    } else {
        Err("the next tenant's kernel did not run after the recovery".into())
    }
}

fn main() -> std::process::ExitCode {
    let log_path = std::env::args().skip_while(|a| a != "--log").nth(1);
    let mut report = Report {
        rows: Vec::new(),
        log: String::new(),
    };
    let simulated = Sim::get().is_some();
    if let Some(sim) = Sim::get() {
        // The dry run: a simulated device that registers host memory, so the guarded
        // registered backing is exercised too (the simulator has no pageable access).
        sim.configure(&tensor_wasm_mem_tests::sim::SimConfig {
            host_register: 1,
            ..tensor_wasm_mem_tests::sim::SimConfig::default()
        });
    }
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
        let backings = host_access(&backend, &mut report);
        for backing in backings {
            zero_copy(&backend, backing, simulated, &mut report)?;
        }
        timings(
            &backend,
            if simulated { " (simulated)" } else { "" },
            &mut report,
        )?;
        slot_release(
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
        // Last: a reset of the primary context, after every other figure is in.
        fault_and_recover(
            &backend,
            if simulated { " (simulated)" } else { "" },
            &mut report,
        )
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
