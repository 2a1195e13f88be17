//! The conformance suite, run against every backend available in this build.

mod with_mock {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::MockHarness);
}

mod with_knobless_mock {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::KnoblessMockHarness);
}

mod with_poisoned_mock {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::PoisonedMockHarness);
}

mod with_deferred_mock {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::DeferredMockHarness);
}

mod with_worker_mock {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::WorkerMockHarness);
}

mod with_eight_device_deferred_mock {
    tensor_wasm_mem_tests::conformance!(
        tensor_wasm_mem_tests::harness::EightDeviceDeferredMockHarness
    );
}

mod with_cudarc {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::CudarcHarness);
}

mod with_four_device_deferred_cudarc {
    tensor_wasm_mem_tests::conformance!(
        tensor_wasm_mem_tests::harness::FourDeviceDeferredCudarcHarness
    );
}

tensor_wasm_mem_tests::driver_harness!(
    /// The cust backend: on whatever `libcuda.so.1` the binary loaded (the real driver where
    /// there is one, the simulator otherwise; see `tests/build.rs`).
    CustHarness,
    tensor_wasm_mem_cust::CustBackend,
    tensor_wasm_mem_cust::start(),
    machine: tensor_wasm_mem_tests::harness::sim_machine(),
    advise: "cuMemAdvise",
    prefetch: "cuMemPrefetchAsync",
    pools: |b| b.driver().has_pools()
);

mod with_cust {
    tensor_wasm_mem_tests::conformance!(crate::CustHarness);
}

tensor_wasm_mem_tests::driver_harness!(
    /// The cust backend on four simulated devices with deferred streams that a background
    /// "device" completes on its own.
    FourDeviceWorkerCustHarness,
    tensor_wasm_mem_cust::CustBackend,
    tensor_wasm_mem_cust::start(),
    machine: tensor_wasm_mem_tests::harness::four_device_worker_machine(),
    advise: "cuMemAdvise",
    prefetch: "cuMemPrefetchAsync",
    pools: |b| b.driver().has_pools()
);

mod with_four_device_worker_cust {
    tensor_wasm_mem_tests::conformance!(crate::FourDeviceWorkerCustHarness);
}

fn main() -> std::process::ExitCode {
    use tensor_wasm_mem_tests::runner;
    let args = libtest_mimic::Arguments::from_args();
    let suites = vec![
        runner::trials("with_mock", with_mock::cases()),
        runner::trials("with_knobless_mock", with_knobless_mock::cases()),
        runner::trials("with_poisoned_mock", with_poisoned_mock::cases()),
        runner::trials("with_deferred_mock", with_deferred_mock::cases()),
        runner::trials("with_worker_mock", with_worker_mock::cases()),
        runner::trials(
            "with_eight_device_deferred_mock",
            with_eight_device_deferred_mock::cases(),
        ),
        runner::trials("with_cudarc", with_cudarc::cases()),
        runner::trials(
            "with_four_device_deferred_cudarc",
            with_four_device_deferred_cudarc::cases(),
        ),
        runner::trials("with_cust", with_cust::cases()),
        runner::trials(
            "with_four_device_worker_cust",
            with_four_device_worker_cust::cases(),
        ),
    ];
    runner::run(suites, &args).exit_code()
}
