//! Every operation of the reserved slot answers `NotYetWired`, naming itself, and the slot
//! claims no capability.

use std::sync::Arc;

use rstest::rstest;
use tensor_wasm_mem_core::doc_support::HeapAllocator;
use tensor_wasm_mem_core::{
    Advice, Advisor, BackendError, Capabilities, DeviceId, ErrorKind, IsolationLevel, Location,
    ManagedAllocator, Operation, PoolConfig, SizeClass, SlotPool, Stream, StreamLease,
    StreamProvider, TenantId, TenantKey, UnifiedBuffer,
};
use tensor_wasm_mem_cuda_oxide::{CudaOxideBackend, OxideError};

fn assert_not_yet(result: Result<impl Sized, OxideError>, operation: Operation) {
    let Err(err) = result else {
        panic!("{operation} must not succeed on the reserved slot");
    };
    assert_eq!(err, OxideError::NotYetWired { operation });
    assert_eq!(err.kind(), ErrorKind::NotYetWired);
    assert!(err.to_string().contains("not wired"), "{err}");
    assert!(err.to_string().contains(operation.name()), "{err}");
}

#[test]
fn it_can_do_nothing() {
    let slot = CudaOxideBackend::new();
    assert_eq!(slot.capabilities(), Capabilities::NONE);
    assert_eq!(slot.device_count(), 0);
}

#[rstest]
#[case::zero_bytes(0)]
#[case::one_page(4096)]
#[case::huge(usize::MAX)]
fn allocate(#[case] bytes: usize) {
    assert_not_yet(
        CudaOxideBackend::new().allocate(DeviceId(0), bytes),
        Operation::Allocate,
    );
}

#[test]
fn every_other_operation() {
    let slot = CudaOxideBackend::new();
    // The slot never hands out memory, so these operations get a handle from elsewhere; the slot
    // must refuse without touching it.
    let heap = HeapAllocator::new();
    let stream = Stream::new(
        tensor_wasm_mem_core::DriverStream::DEFAULT,
        tensor_wasm_mem_core::DriverContext::from_raw(0),
        IsolationLevel::Shared,
        TenantKey::fresh(TenantId(1)),
    );
    let a = heap.allocate(DeviceId(0), 4096).unwrap();
    // SAFETY: the slot does not touch the memory (it refuses), and `a` stays live.
    assert_not_yet(unsafe { slot.zero(&a, 0, 16) }, Operation::Zero);
    assert_not_yet(
        slot.advise(&a, 0, 16, Advice::SetReadMostly),
        Operation::Advise,
    );
    assert_not_yet(
        slot.prefetch(&a, 0, 16, Location::Host, &stream),
        Operation::Prefetch,
    );
    let b = heap.allocate(DeviceId(0), 4096).unwrap();
    let (ptr, len, device) = (b.as_ptr(), b.len(), b.device());
    // SAFETY: the slot drops the handle without touching the memory; it is freed below through
    // a handle rebuilt from the same parts.
    assert_not_yet(
        unsafe { slot.free(b) }.map_err(tensor_wasm_mem_core::Refused::into_error),
        Operation::Free,
    );
    // SAFETY: rebuilds the handle of the allocation `heap` made above, still live.
    let b = unsafe {
        tensor_wasm_mem_core::Allocation::from_raw_parts(
            std::ptr::NonNull::new(ptr).unwrap(),
            len,
            device,
        )
    };
    for level in IsolationLevel::ALL {
        assert_not_yet(
            slot.acquire_stream(TenantKey::fresh(TenantId(1)), level),
            Operation::AcquireStream,
        );
    }
    assert_not_yet(slot.synchronize(&stream), Operation::Synchronize);
    assert_not_yet(slot.release_stream(stream), Operation::ReleaseStream);
    // SAFETY: both came from `heap` and are not used again.
    unsafe { heap.free(a).unwrap() };
    // SAFETY: as above.
    unsafe { heap.free(b).unwrap() };
}

#[test]
fn what_is_built_on_it_refuses_cleanly() {
    let slot = Arc::new(CudaOxideBackend::new());
    let err = UnifiedBuffer::new(Arc::clone(&slot), DeviceId(0), 4096, 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotYetWired);
    let err = SlotPool::new(
        Arc::clone(&slot),
        PoolConfig::new(DeviceId(0), [SizeClass::new(4096, 1)]),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotYetWired);
    assert!(
        StreamLease::acquire(
            slot,
            TenantKey::fresh(TenantId(1)),
            IsolationLevel::StreamIsolated
        )
        .is_err()
    );
}

#[test]
fn device_pools_are_unsupported() {
    use tensor_wasm_mem_core::{DevicePoolConfig, DevicePools, PoolAllocation, PoolHandle};
    let slot = CudaOxideBackend::new();
    let err = slot
        .create_pool(
            TenantKey::fresh(TenantId(1)),
            DeviceId(0),
            &DevicePoolConfig::default(),
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    let pool = PoolHandle::new(
        tensor_wasm_mem_core::DriverPool::from_raw(1),
        DeviceId(0),
        TenantKey::fresh(TenantId(1)),
    );
    let stream = Stream::new(
        tensor_wasm_mem_core::DriverStream::DEFAULT,
        tensor_wasm_mem_core::DriverContext::from_raw(0),
        IsolationLevel::Shared,
        TenantKey::fresh(TenantId(1)),
    );
    assert_eq!(
        slot.pool_allocate(&pool, 64, &stream).unwrap_err().kind(),
        ErrorKind::Unsupported
    );
    assert_eq!(
        slot.pool_free(&pool, PoolAllocation::new(1, 1), &stream)
            .unwrap_err()
            .kind(),
        ErrorKind::Unsupported
    );
    assert_eq!(
        slot.trim_pool(&pool, 0).unwrap_err().kind(),
        ErrorKind::Unsupported
    );
    assert_eq!(
        slot.pool_stats(&pool).unwrap_err().kind(),
        ErrorKind::Unsupported
    );
    assert_eq!(
        slot.destroy_pool(pool).unwrap_err().kind(),
        ErrorKind::Unsupported
    );
}
