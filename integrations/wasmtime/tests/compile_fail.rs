//! What the borrow checker refuses: a device slice from `resolve` kept past its Store, or held
//! across a call into the guest; the Store used while a device-access scope is open
//! (`tests/ui/`, with the compiler's expected messages beside).

#[test]
fn device_slices_cannot_outlive_their_store() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}
