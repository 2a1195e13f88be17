//! Teardown reports are per backend: `DriverBackend::drop_report` says what the backend gave back
//! at drop (`reclaimed`) and what the driver refused even then (`unreleased`); the model's
//! `ModelDriver::drop_report` says what was still mapped when it dropped (`leaked`). No process
//! globals, so these run beside any other test.

use tensor_wasm_mem_core::{DeviceId, DriverApi, ManagedAllocator};
use tensor_wasm_mem_model::{Call, ModelDriver, code};

/// The model under the core's `DriverBackend` (what the mock crate calls `MockBackend`).
type MockBackend = tensor_wasm_mem_core::DriverBackend<ModelDriver>;

fn counts(mock: MockBackend) -> (u64, u64, u64) {
    let (backend, model) = (mock.drop_report(), mock.driver().drop_report());
    assert!(!backend.dropped());
    drop(mock);
    assert!(backend.dropped());
    (backend.reclaimed(), backend.unreleased(), model.leaked())
}

#[test]
fn a_clean_drop_reports_nothing() {
    let mock = MockBackend::default();
    let a = mock.allocate(DeviceId(0), 10).unwrap();
    // SAFETY: `a` came from `mock`.
    unsafe { mock.free(a) }.unwrap();
    assert_eq!(counts(mock), (0, 0, 0));
}

#[test]
fn an_allocation_left_alive_is_reclaimed_not_leaked() {
    let mock = MockBackend::default();
    let _kept = mock.allocate(DeviceId(0), 10).unwrap();
    assert_eq!(counts(mock), (1, 0, 0));
}

#[test]
fn a_free_refused_even_at_drop_is_unreleased_and_the_model_counts_it_leaked() {
    let mock = MockBackend::default();
    let _kept = mock.allocate(DeviceId(0), 10).unwrap();
    mock.driver().fail_call(Call::Free, 1, code::UNKNOWN);
    assert_eq!(counts(mock), (0, 1, 1));
}

#[test]
fn memory_handed_out_through_the_driver_api_and_never_freed_is_leaked() {
    let model = ModelDriver::default();
    let report = model.drop_report();
    model
        .push_current(model.primary_context(DeviceId(0)))
        .unwrap();
    model.alloc_managed(DeviceId(0), 10).unwrap();
    model.pop_current().unwrap();
    drop(model);
    assert_eq!(report.leaked(), 1);
}

#[test]
fn reports_are_per_backend() {
    let (leaky, clean) = (MockBackend::default(), MockBackend::default());
    let report = clean.drop_report();
    let _kept = leaky.allocate(DeviceId(0), 10).unwrap();
    drop(leaky);
    drop(clean);
    assert_eq!((report.reclaimed(), report.unreleased()), (0, 0));
}
