//! An untouched 256 MiB mock allocation costs no resident memory. Its own test binary, so no
//! other test allocates while the resident size is read.

use tensor_wasm_mem_core::{DeviceId, UnifiedBuffer};
use tensor_wasm_mem_model::ModelDriver;

/// The model under the core's `DriverBackend`.
type MockBackend = tensor_wasm_mem_core::DriverBackend<ModelDriver>;

/// Resident bytes of this process, from `/proc/self/statm`.
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("statm resident field");
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * u64::try_from(page).expect("page size")
}

#[test]
fn untouched_256_mib_costs_a_few_pages_at_most() {
    const CAPACITY: usize = 256 << 20;
    const FEW_PAGES: u64 = 16 * 4096;
    let mock = MockBackend::default();
    // Warm up allocator paths so their one-time costs are not counted.
    drop(UnifiedBuffer::new(&mock, DeviceId(0), 1 << 16, 1 << 16).unwrap());
    let before = resident_bytes();
    let mut buf = UnifiedBuffer::new(&mock, DeviceId(0), CAPACITY, 1 << 16).unwrap();
    buf.grow_to(CAPACITY).unwrap(); // visible, still untouched
    let after = resident_bytes();
    assert!(
        after.saturating_sub(before) <= FEW_PAGES,
        "resident memory grew by {} bytes for an untouched 256 MiB allocation",
        after.saturating_sub(before)
    );
    // The measurement can see growth: touching 64 MiB shows up.
    let data = vec![1u8; 1 << 20];
    for i in 0..64 {
        buf.write(i << 20, &data).unwrap();
    }
    let touched = resident_bytes();
    assert!(
        touched.saturating_sub(after) >= 60 << 20,
        "touching 64 MiB raised resident memory by only {} bytes",
        touched.saturating_sub(after)
    );
}
