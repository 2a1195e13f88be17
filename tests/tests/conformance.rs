//! The conformance suite, run against every backend available in this build.

mod with_mock {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::MockHarness);
}

mod with_poisoned_mock {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::PoisonedMockHarness);
}

mod with_cudarc {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::CudarcHarness);
}
