//! The process-wide teardown counters, alone in their process (other tests would move them):
//! `DriverBackend` counts what it gave back at drop (`reclaimed_at_drop`) and what the driver
//! refused even then (`unreleased_at_drop`); the model counts what was still mapped when it
//! dropped (`leaked_at_drop`).

use tensor_wasm_mem_core::{
    DeviceId, DriverApi, ManagedAllocator, reclaimed_at_drop, unreleased_at_drop,
};
use tensor_wasm_mem_mock::{Call, MockBackend, ModelDriver, code, leaked_at_drop};

#[test]
fn teardown_counters_count_only_what_was_left() {
    // A clean drop moves none of them.
    let (reclaimed, unreleased, leaked) =
        (reclaimed_at_drop(), unreleased_at_drop(), leaked_at_drop());
    let mock = MockBackend::default();
    let a = mock.allocate(DeviceId(0), 10).unwrap();
    // SAFETY: `a` came from `mock`.
    unsafe { mock.free(a) }.unwrap();
    drop(mock);
    assert_eq!(
        (reclaimed_at_drop(), unreleased_at_drop(), leaked_at_drop()),
        (reclaimed, unreleased, leaked)
    );

    // An allocation left alive is given back by the backend at drop: reclaimed, not leaked.
    let mock = MockBackend::default();
    let _kept = mock.allocate(DeviceId(0), 10).unwrap();
    drop(mock);
    assert_eq!(reclaimed_at_drop(), reclaimed + 1);
    assert_eq!(
        (unreleased_at_drop(), leaked_at_drop()),
        (unreleased, leaked)
    );

    // A free the driver refuses even at drop stays unreleased; the model then unmaps it itself
    // and counts it as leaked.
    let mock = MockBackend::default();
    let _kept = mock.allocate(DeviceId(0), 10).unwrap();
    mock.driver().fail_call(Call::Free, 1, code::UNKNOWN);
    drop(mock);
    assert_eq!(unreleased_at_drop(), unreleased + 1);
    assert_eq!(leaked_at_drop(), leaked + 1);

    // Memory the model handed out straight through `DriverApi` and never freed: leaked.
    let model = ModelDriver::default();
    model
        .push_current(model.primary_context(DeviceId(0)))
        .unwrap();
    model.alloc_managed(DeviceId(0), 10).unwrap();
    model.pop_current().unwrap();
    drop(model);
    assert_eq!(leaked_at_drop(), leaked + 2);
}
