//! Real C programs (tests/guests/*.c) through the library: WASI added next to the `twm` host
//! functions with `add_wasi_to_linker`, per-Store WASI state, the guest's stdout captured, its
//! exit status read with `wasi::exit_code`, and a tenant cap turning a large allocation into the
//! program's own error path. Without the C toolchain each test says so and checks nothing more.

use std::sync::Arc;

use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_tests::guests::{c_guest, run_command};
use tensor_wasm_mem_wasmtime::{Tenant, TensorWasmMemoryCreator};

/// Runs `_start` of the C guest `name` for a tenant with `cap`: (exit status, stdout).
fn run_c_guest(name: &str, args: &[&str], cap: u64) -> Option<(i32, String)> {
    let wasm = c_guest(name)?;
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .build()
        .expect("creator");
    let tenant = Tenant::new(1, name, cap, IsolationLevel::StreamIsolated);
    let mut argv = vec![name];
    argv.extend_from_slice(args);
    let ran = run_command(
        &creator,
        &wasm,
        &tenant,
        &argv,
        &[("TWM_GREETING", "from the library")],
    );
    assert_eq!(tenant.stats().touched_bytes, 0, "everything given back");
    Some(ran)
}

#[test]
fn a_c_program_gets_its_arguments_environment_and_exit_status() {
    let Some((status, out)) = run_c_guest("hello", &["one", "exit=3"], u64::MAX) else {
        return;
    };
    assert_eq!(status, 3);
    assert_eq!(
        out,
        "argc=3\nargv[1]=one\nargv[2]=exit=3\nTWM_GREETING=from the library\n"
    );
}

#[test]
fn a_cap_makes_malloc_return_null_not_a_trap() {
    let Some((status, out)) = run_c_guest("grow", &["16"], 4 << 20) else {
        return;
    };
    assert_eq!(status, 12, "the program's own error path: {out}");
    let Some((status, out)) = run_c_guest("grow", &["16"], 64 << 20) else {
        return;
    };
    assert_eq!(status, 0, "{out}");
    assert!(out.starts_with("allocated 16 of 16 MiB"), "{out}");
}

#[test]
fn the_sdk_calls_reach_the_host_with_the_right_codes() {
    let Some((status, out)) = run_c_guest("hints", &[], u64::MAX) else {
        return;
    };
    assert_eq!(status, 0, "{out}");
    assert!(out.ends_with("all as expected\n"), "{out}");
}
