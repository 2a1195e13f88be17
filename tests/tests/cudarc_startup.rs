//! Start-up failures of the cudarc backend, each in a fresh child process (a process loads one
//! driver library for good): no library, a missing entry point, no device, no managed memory.
//! On a machine with a real driver these cases cannot be staged and say so.

use std::process::Command;

use tensor_wasm_mem_core::{BackendError, DeviceId, ErrorKind};
use tensor_wasm_mem_cudarc::{CudarcError, DriverSource, start};
use tensor_wasm_mem_tests::sim::{
    SIM_PATH, SIM_WITHOUT_PREFETCH_PATH, Sim, SimConfig, real_driver,
};

const SCENARIO: &str = "TWM_CUDARC_STARTUP_SCENARIO";

/// The child side: runs one scenario and prints `OUTCOME <kind> <message>`.
#[test]
#[ignore = "run by the other tests of this file, in a child process"]
fn startup_child() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let result = match scenario.as_str() {
        "system_only" => start(&DriverSource::System),
        "no_library" => start(&DriverSource::SystemOr("/nonexistent/libcuda.so.1".into())),
        "missing_symbol" => start(&DriverSource::SystemOr(SIM_WITHOUT_PREFETCH_PATH.into())),
        "zero_devices" | "no_managed_memory" | "two_devices" => {
            let sim = Sim::get().expect("no real driver in the child");
            sim.configure(&match scenario.as_str() {
                "zero_devices" => SimConfig {
                    device_count: 0,
                    ..SimConfig::default()
                },
                "two_devices" => SimConfig {
                    device_count: 2,
                    concurrent: 0,
                    ..SimConfig::default()
                },
                _ => SimConfig {
                    managed: 0,
                    ..SimConfig::default()
                },
            });
            sim.reset();
            start(&DriverSource::SystemOr(SIM_PATH.into()))
        }
        "interop_context_refused" => {
            println!("OUTCOME {}", interop_context_refused());
            return;
        }
        other => panic!("unknown scenario {other}"),
    };
    match result {
        Ok(backend) => println!(
            "OUTCOME ok devices={} concurrent={}",
            backend.driver().devices().count(),
            tensor_wasm_mem_core::ManagedAllocator::capabilities(&backend)
                .concurrent_managed_access
        ),
        Err(e) => println!("OUTCOME {} {e} | {e:?}", e.kind()),
    }
}

/// cudarc's view of a device-access scope when cudarc's `CudaContext::new` is refused by the
/// driver: the typed error, `<kind> <message>`.
fn interop_context_refused() -> String {
    use std::sync::Arc;
    use tensor_wasm_mem_tests::sim::code;
    use tensor_wasm_mem_wasmtime::interop::cudarc::CudarcScope;
    use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
    use tensor_wasm_mem_wasmtime::{
        AccessRange, ChargeMode, DeviceAccess, Tenant, TenantStore, TensorWasmMemoryCreator,
        instantiate, new_store,
    };
    let sim = Sim::get().expect("no real driver in the child");
    let backend = start(&DriverSource::SystemOr(SIM_PATH.into())).expect("cudarc on the simulator");
    let creator = TensorWasmMemoryCreator::builder(Arc::new(backend))
        .build()
        .expect("creator");
    let engine = creator.engine().expect("engine");
    let module = Module::new(&engine, r#"(module (memory (export "memory") 1))"#).expect("module");
    let tenant = Tenant::new(
        1,
        "t",
        1 << 20,
        tensor_wasm_mem_core::IsolationLevel::StreamIsolated,
    );
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).expect("instance");
    let memory = instance.get_memory(&mut store, "memory").expect("memory");
    let scope = DeviceAccess::open(
        &mut store,
        &creator,
        &memory,
        &[AccessRange::read_write(0, 64)],
    )
    .expect("scope");
    sim.fail_nth("cuDevicePrimaryCtxRetain", 1, code::OUT_OF_MEMORY);
    // SAFETY: nothing cudarc makes outlives this call (it is refused).
    let err = unsafe { CudarcScope::new(&scope) }.expect_err("cudarc's context is refused");
    scope.close().expect("the scope closes");
    format!("{} {err}", err.kind())
}

fn child(scenario: &str) -> Option<String> {
    if real_driver() {
        eprintln!(
            "{scenario}: skipped: a real CUDA driver is present, the failure cannot be staged"
        );
        return None;
    }
    let output = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--ignored",
            "--exact",
            "startup_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SCENARIO, scenario)
        // `cargo test` puts the cust backend's fallback libcuda.so.1 on the loader path; a
        // child staging a start-up failure must not find it.
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("OUTCOME ").map(|(_, outcome)| outcome))
        .unwrap_or_else(|| {
            panic!(
                "{scenario}: no outcome (the child must not panic)\nstdout: {stdout}\nstderr: {}",
                String::from_utf8_lossy(&output.stderr)
            )
        });
    Some(line.to_string())
}

#[test]
fn no_library_is_driver_unavailable() {
    for scenario in ["system_only", "no_library"] {
        let Some(outcome) = child(scenario) else {
            return;
        };
        assert!(
            outcome.starts_with("driver_unavailable"),
            "{scenario}: {outcome}"
        );
        assert!(outcome.contains("DriverNotFound"), "{scenario}: {outcome}");
    }
}

#[test]
fn missing_symbol_is_named() {
    let Some(outcome) = child("missing_symbol") else {
        return;
    };
    assert!(outcome.starts_with("driver_unavailable"), "{outcome}");
    assert!(outcome.contains("cuMemPrefetchAsync_v2"), "{outcome}");
}

#[test]
fn zero_devices_is_no_device() {
    let Some(outcome) = child("zero_devices") else {
        return;
    };
    assert!(outcome.starts_with("no_device"), "{outcome}");
}

#[test]
fn no_managed_memory_is_unsupported() {
    let Some(outcome) = child("no_managed_memory") else {
        return;
    };
    assert!(outcome.starts_with("unsupported"), "{outcome}");
    assert!(outcome.contains("NoManagedMemory"), "{outcome}");
}

#[test]
fn capabilities_come_from_every_device() {
    let Some(outcome) = child("two_devices") else {
        return;
    };
    assert_eq!(outcome, "ok devices=2 concurrent=false");
}

/// A driver refusal under cudarc's `CudaContext::new` (in `CudarcScope::new`) keeps its code
/// and kind: a typed backend error naming `CUDA_ERROR_OUT_OF_MEMORY`, not opaque text.
#[test]
fn cudarc_interop_keeps_the_drivers_error() {
    let Some(outcome) = child("interop_context_refused") else {
        return;
    };
    assert!(outcome.starts_with("out_of_memory"), "{outcome}");
    assert!(outcome.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{outcome}");
    assert!(outcome.contains("cuDevicePrimaryCtxRetain"), "{outcome}");
}

#[test]
fn errors_name_what_is_missing() {
    let e = CudarcError::MissingSymbol {
        symbol: "cuMemAdvise_v2",
    };
    assert_eq!(e.kind(), ErrorKind::DriverUnavailable);
    assert!(e.to_string().contains("cuMemAdvise_v2"));
    let e = CudarcError::NoManagedMemory {
        device: DeviceId(3),
    };
    assert!(e.to_string().contains("device:3"));
}
