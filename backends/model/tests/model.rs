//! The mock backend is `DriverBackend` over the simulated driver: these cases hold the model's
//! GPU rules (asynchronous streams, events, pool ordering, sticky kernel faults, raw result
//! codes, many devices) through the backend traits, as every other backend is driven.

use tensor_wasm_mem_core::{
    Advice, Advisor, Allocation, BackendError, DeviceId, DevicePoolConfig, DevicePools, DriverApi,
    ErrorKind, IsolationLevel, Location, ManagedAllocator, Operation, StreamProvider, TenantId,
    TenantKey,
};
use tensor_wasm_mem_model::{Call, ModelConfig as MockConfig, ModelDriver, ModelError, code};

/// The model under the core's `DriverBackend` (what the mock crate calls `MockBackend`).
type MockBackend = tensor_wasm_mem_core::DriverBackend<ModelDriver>;

/// A backend over a fresh machine as `config` describes.
fn with_config(config: MockConfig) -> MockBackend {
    MockBackend::new(ModelDriver::new(config))
}

const PAGE: usize = 1 << 16;

fn deferred() -> MockBackend {
    with_config(MockConfig {
        deferred_streams: true,
        ..MockConfig::default()
    })
}

fn key(id: u64) -> TenantKey {
    TenantKey::fresh(TenantId(id))
}

fn read(a: &Allocation, offset: usize) -> u8 {
    // SAFETY: host-accessible memory of a live allocation, read in bounds, no kernel queued on it
    // runs during the read (the model runs work only inside its own calls).
    unsafe { a.as_ptr().wrapping_add(offset).read() }
}

#[test]
fn fresh_memory_is_zero_unless_poisoned_and_every_push_is_popped() {
    let mock = MockBackend::default();
    assert!(
        mock.capabilities().comes_zeroed,
        "the model's fresh memory is zero"
    );
    let poisoned = with_config(MockConfig {
        poison_fresh_allocations: true,
        ..MockConfig::default()
    });
    assert!(!poisoned.capabilities().comes_zeroed);
    let a = poisoned.allocate(DeviceId(0), 10).unwrap();
    assert_eq!(read(&a, 0), 0xA5);
    // SAFETY: `a` came from `poisoned` and is not used again.
    unsafe { poisoned.free(a).unwrap() };
    assert_eq!(
        poisoned.driver().context_depth(),
        0,
        "every push was popped"
    );
}

/// A kernel's writes and a prefetch land when the stream is synchronised, in order, never at
/// the call; host reads see the old bytes until then. Fails on a synchronous model.
#[test]
fn kernel_writes_are_seen_by_the_host_only_after_the_stream_is_synchronised() {
    let mock = deferred();
    let a = mock.allocate(DeviceId(0), 2 * PAGE).unwrap();
    let s = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    let d0 = Location::Device(DeviceId(0));
    // SAFETY: the test holds no reference to the bytes while the kernels can run.
    unsafe { mock.driver().enqueue_fill(&s, a.device_ptr(), PAGE, 0xaa) }.unwrap();
    // SAFETY: as above.
    unsafe { mock.driver().enqueue_fill(&s, a.device_ptr() + 8, 8, 0xbb) }.unwrap();
    mock.prefetch(&a, 0, PAGE, d0, &s).unwrap();
    assert_eq!((read(&a, 0), read(&a, 8)), (0, 0), "nothing landed yet");
    assert_eq!(mock.driver().residency(&a, 0).unwrap(), None);
    assert_eq!(mock.driver().pending_work(), 3);
    // Stepping runs one item, as the device gets to it.
    assert!(mock.driver().step(&s).unwrap());
    assert_eq!((read(&a, 0), read(&a, 8)), (0xaa, 0xaa));
    mock.synchronize(&s).unwrap();
    assert_eq!(
        (read(&a, 0), read(&a, 8), read(&a, 16)),
        (0xaa, 0xbb, 0xaa),
        "in order"
    );
    assert_eq!(read(&a, PAGE), 0, "only the range");
    assert_eq!(mock.driver().residency(&a, 0).unwrap(), Some(d0));
    assert_eq!(mock.driver().pending_work(), 0);
    // Releasing the stream waits too; so does releasing the shared stream.
    // SAFETY: as above.
    unsafe { mock.driver().enqueue_fill(&s, a.device_ptr(), 1, 1) }.unwrap();
    mock.release_stream(s).unwrap();
    assert_eq!(read(&a, 0), 1);
    let shared = mock.acquire_stream(key(2), IsolationLevel::Shared).unwrap();
    // SAFETY: as above.
    unsafe { mock.driver().enqueue_fill(&shared, a.device_ptr(), 1, 2) }.unwrap();
    assert_eq!(read(&a, 0), 1);
    mock.release_stream(shared).unwrap();
    assert_eq!(read(&a, 0), 2);
    // SAFETY: `a` came from `mock`.
    unsafe { mock.free(a).unwrap() };
}

/// A scrub ordered after the tenant's pending work (its stream released first) is clean; one
/// before it is counted, and the tenant's write lands over the zeros, as on a GPU.
#[test]
fn a_scrub_is_ordered_after_the_tenants_pending_work() {
    let mock = deferred();
    let a = mock.allocate(DeviceId(0), PAGE).unwrap();
    let s = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    // SAFETY: no reference to the bytes while the kernel can run.
    unsafe { mock.driver().enqueue_fill(&s, a.device_ptr(), 16, 0x11) }.unwrap();
    mock.release_stream(s).unwrap(); // waits: the write lands before the scrub
    // SAFETY: live and unaliased.
    unsafe { mock.zero(&a, 0, PAGE).unwrap() };
    assert_eq!(read(&a, 0), 0);
    assert_eq!(mock.driver().stats().scrubs_over_pending_work, 0);

    // The wrong order: scrub first, then the stream's work lands on the "clean" slot.
    let s = mock
        .acquire_stream(key(2), IsolationLevel::StreamIsolated)
        .unwrap();
    // SAFETY: as above.
    unsafe { mock.driver().enqueue_fill(&s, a.device_ptr(), 16, 0x22) }.unwrap();
    // SAFETY: as above.
    unsafe { mock.zero(&a, 0, PAGE).unwrap() };
    assert_eq!(mock.driver().stats().scrubs_over_pending_work, 1, "counted");
    mock.release_stream(s).unwrap();
    assert_eq!(
        read(&a, 0),
        0x22,
        "the tenant's write landed after the scrub"
    );
    // SAFETY: `a` came from `mock`.
    unsafe { mock.free(a).unwrap() };
}

/// A free while a prefetch is queued is counted (the prefetch finds no memory when it runs);
/// ordered after a synchronize it is clean.
#[test]
fn a_free_while_a_prefetch_is_queued_is_counted() {
    let mock = deferred();
    let s = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    let d0 = Location::Device(DeviceId(0));
    let a = mock.allocate(DeviceId(0), PAGE).unwrap();
    mock.prefetch(&a, 0, PAGE, d0, &s).unwrap();
    mock.synchronize(&s).unwrap();
    // SAFETY: `a` came from `mock`, its work is done.
    unsafe { mock.free(a).unwrap() };
    assert_eq!(mock.driver().stats().frees_over_pending_work, 0);

    let b = mock.allocate(DeviceId(0), PAGE).unwrap();
    mock.prefetch(&b, 0, PAGE, d0, &s).unwrap();
    // SAFETY: `b` came from `mock` (the bug under test: its prefetch is still queued).
    unsafe { mock.free(b).unwrap() };
    assert_eq!(mock.driver().stats().frees_over_pending_work, 1);
    mock.release_stream(s).unwrap(); // the orphaned prefetch runs harmlessly
    assert_eq!(mock.driver().stats().kernel_faults, 0);
}

/// A kernel still queued over memory that was freed finds no memory when it runs, even when a
/// new allocation of the same size follows at once (the freed address is not handed out again
/// while work targets it): it faults, and the new allocation's bytes are untouched.
#[test]
fn stale_work_over_freed_memory_faults_and_never_lands_in_a_new_allocation() {
    let mock = deferred();
    let s = mock
        .acquire_stream(key(1), IsolationLevel::ContextIsolated)
        .unwrap();
    let a = mock.allocate(DeviceId(0), PAGE).unwrap();
    let old = a.device_ptr();
    // SAFETY: no reference to the bytes while the kernel can run (the bug under test frees them).
    unsafe { mock.driver().enqueue_fill(&s, old, PAGE, 0x77) }.unwrap();
    // SAFETY: `a` came from `mock` (its kernel is still queued: the bug under test).
    unsafe { mock.free(a).unwrap() };
    let b = mock.allocate(DeviceId(0), PAGE).unwrap();
    assert_ne!(b.device_ptr(), old, "the freed address is kept back");
    let err = mock.synchronize(&s).unwrap_err();
    assert_eq!(err.code(), Some(code::ILLEGAL_ADDRESS));
    assert_eq!(read(&b, 0), 0, "nothing landed in the new allocation");
    let _ = mock.release_stream(s);
    // SAFETY: `b` came from `mock`.
    unsafe { mock.free(b).unwrap() };
}

/// A pool block freed on one stream is reused by an allocation on another only once the free is
/// ordered before it (here by an event recorded after the free and synchronised); before that,
/// the other stream gets fresh memory.
#[test]
fn a_pool_block_is_reused_on_another_stream_only_after_an_event() {
    let mock = deferred();
    let tenant = key(1);
    let a = mock
        .acquire_stream(tenant, IsolationLevel::StreamIsolated)
        .unwrap();
    let b = mock
        .acquire_stream(tenant, IsolationLevel::StreamIsolated)
        .unwrap();
    let pool = mock
        .create_pool(
            tenant,
            DeviceId(0),
            &DevicePoolConfig {
                max_bytes: 0,
                release_threshold: u64::MAX,
            },
        )
        .unwrap();
    let first = mock.pool_allocate(&pool, PAGE, &a).unwrap();
    let address = first.device_ptr();
    mock.synchronize(&a).unwrap();
    mock.pool_free(&pool, first, &a).unwrap(); // queued on `a`
    let second = mock.pool_allocate(&pool, PAGE, &b).unwrap();
    assert_ne!(
        second.device_ptr(),
        address,
        "the free is not ordered before stream b's work: no reuse"
    );
    let event = mock.driver().event_create().unwrap();
    mock.driver().event_record(event, &a).unwrap();
    assert!(
        !mock.driver().event_query(event).unwrap(),
        "not reached yet"
    );
    mock.driver().stream_wait_event(&b, event).unwrap();
    mock.driver().event_synchronize(event).unwrap();
    assert!(mock.driver().event_query(event).unwrap());
    let third = mock.pool_allocate(&pool, PAGE, &b).unwrap();
    assert_eq!(third.device_ptr(), address, "reused after the event");
    mock.pool_free(&pool, second, &b).unwrap();
    mock.pool_free(&pool, third, &b).unwrap();
    mock.driver().event_destroy(event).unwrap();
    mock.destroy_pool(pool).unwrap();
    mock.release_stream(a).unwrap();
    mock.release_stream(b).unwrap();
    let s = mock.driver().stats();
    assert_eq!(
        (s.live_pools, s.live_pool_allocations, s.live_events),
        (0, 0, 0)
    );
}

/// A stream waiting on an event runs the event's stream up to the record first.
#[test]
fn a_wait_on_an_event_orders_two_streams() {
    let mock = deferred();
    let a_mem = mock.allocate(DeviceId(0), PAGE).unwrap();
    let x = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    let y = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    // SAFETY: no reference to the bytes while the kernels can run.
    unsafe { mock.driver().enqueue_fill(&x, a_mem.device_ptr(), 4, 1) }.unwrap();
    let event = mock.driver().event_create().unwrap();
    mock.driver().event_record(event, &x).unwrap();
    // SAFETY: as above.
    unsafe { mock.driver().enqueue_fill(&x, a_mem.device_ptr(), 4, 3) }.unwrap();
    mock.driver().stream_wait_event(&y, event).unwrap();
    // SAFETY: as above.
    unsafe { mock.driver().enqueue_fill(&y, a_mem.device_ptr(), 2, 2) }.unwrap();
    mock.synchronize(&y).unwrap();
    // x ran up to the record (fill 1), then y's fill 2; x's later fill 3 is still queued.
    assert_eq!((read(&a_mem, 0), read(&a_mem, 3)), (2, 1));
    mock.synchronize(&x).unwrap();
    assert_eq!(read(&a_mem, 0), 3);
    mock.driver().event_destroy(event).unwrap();
    mock.release_stream(x).unwrap();
    mock.release_stream(y).unwrap();
    // SAFETY: `a_mem` came from `mock`.
    unsafe { mock.free(a_mem).unwrap() };
}

/// A wait is for the record the event had when the wait was queued: recording the event again
/// elsewhere, or destroying it, before the waiting stream runs changes nothing (the driver's
/// `cuStreamWaitEvent`). A model that followed the event's latest record would let `y` run
/// before `x`'s work.
#[test]
fn a_wait_is_for_the_record_it_saw_whatever_happens_to_the_event_later() {
    for later in ["re-record", "destroy"] {
        let mock = deferred();
        let mem = mock.allocate(DeviceId(0), PAGE).unwrap();
        let [x, y, z] = [0, 1, 2].map(|_| {
            mock.acquire_stream(key(1), IsolationLevel::StreamIsolated)
                .unwrap()
        });
        // SAFETY: no reference to the bytes while the kernels can run.
        unsafe { mock.driver().enqueue_fill(&x, mem.device_ptr(), 4, 1) }.unwrap();
        let event = mock.driver().event_create().unwrap();
        mock.driver().event_record(event, &x).unwrap();
        mock.driver().stream_wait_event(&y, event).unwrap();
        match later {
            // The new record is on an idle stream: it completes at once when z runs.
            "re-record" => {
                mock.driver().event_record(event, &z).unwrap();
                mock.synchronize(&z).unwrap();
            }
            _ => mock.driver().event_destroy(event).unwrap(),
        }
        // SAFETY: as above.
        unsafe { mock.driver().enqueue_fill(&y, mem.device_ptr(), 2, 2) }.unwrap();
        mock.synchronize(&y).unwrap();
        assert_eq!(
            (read(&mem, 0), read(&mem, 3)),
            (2, 1),
            "{later}: x ran up to its record before y's fill"
        );
        if later == "re-record" {
            mock.driver().event_destroy(event).unwrap();
        }
        for s in [x, y, z] {
            mock.release_stream(s).unwrap();
        }
        // SAFETY: `mem` came from `mock`.
        unsafe { mock.free(mem).unwrap() };
        assert_eq!(mock.driver().stats().live_events, 0);
    }
}

/// Destroying a context lets the device finish what it queued first: a stream of another
/// context waiting on one of its events still sees its work, in order. A model that dropped the
/// destroyed context's queue would run the waiter over memory the first context never wrote.
#[test]
fn a_destroyed_context_finishes_its_work_before_a_waiter_elsewhere_goes_on() {
    let mock = deferred();
    let driver = mock.driver();
    let before = driver.stats();
    let mem = mock.allocate(DeviceId(0), PAGE).unwrap();
    let waiter = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    // A context of its own, made and used through the raw driver calls.
    let context = driver.context_create(DeviceId(0)).unwrap();
    driver.push_current(context).unwrap();
    let raw = driver.stream_create().unwrap();
    driver.pop_current().unwrap();
    let theirs =
        tensor_wasm_mem_core::Stream::new(raw, context, IsolationLevel::ContextIsolated, key(2));
    // SAFETY: no reference to the bytes while the kernels can run.
    unsafe { driver.enqueue_fill(&theirs, mem.device_ptr(), 4, 1) }.unwrap();
    let event = driver.event_create().unwrap();
    driver.event_record(event, &theirs).unwrap();
    driver.stream_wait_event(&waiter, event).unwrap();
    // SAFETY: as above.
    unsafe { driver.enqueue_fill(&waiter, mem.device_ptr(), 2, 2) }.unwrap();
    assert_eq!(read(&mem, 3), 0, "nothing ran yet");
    driver.context_destroy(context).unwrap();
    assert_eq!(read(&mem, 3), 1, "the context's fill ran before it went");
    mock.synchronize(&waiter).unwrap();
    assert_eq!((read(&mem, 0), read(&mem, 3)), (2, 1));
    driver.event_destroy(event).unwrap();
    mock.release_stream(waiter).unwrap();
    // SAFETY: `mem` came from `mock`.
    unsafe { mock.free(mem).unwrap() };
    let after = driver.stats();
    assert_eq!(
        (after.live_streams, after.live_contexts, after.live_events),
        (
            before.live_streams,
            before.live_contexts,
            before.live_events
        ),
        "the context took its stream with it"
    );
}

/// A kernel outside every live allocation poisons its context when it runs (sticky: the next
/// call in it is `CUDA_ERROR_ILLEGAL_ADDRESS`, typed), abandons its queued work, and leaves
/// another tenant's context working.
#[test]
fn a_kernel_fault_poisons_its_context_only() {
    let mock = deferred();
    let a = mock.allocate(DeviceId(0), PAGE).unwrap();
    let bad = mock
        .acquire_stream(key(1), IsolationLevel::ContextIsolated)
        .unwrap();
    let good = mock
        .acquire_stream(key(2), IsolationLevel::ContextIsolated)
        .unwrap();
    // SAFETY: the range is no live memory: the model refuses to touch it when it runs.
    unsafe { mock.driver().enqueue_fill(&bad, 64, 64, 1) }.unwrap(); // the launch succeeds
    // SAFETY: no reference to the bytes while the kernel can run.
    unsafe { mock.driver().enqueue_fill(&bad, a.device_ptr(), 4, 9) }.unwrap();
    let err = mock.synchronize(&bad).unwrap_err();
    assert_eq!(err.code(), Some(code::ILLEGAL_ADDRESS));
    assert_eq!(err.kind(), ErrorKind::ContextLost);
    assert!(
        err.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{err}"
    );
    assert_eq!(read(&a, 0), 0, "the context's queued work was abandoned");
    assert!(mock.driver().is_poisoned(bad.context()));
    let again = mock
        .prefetch(&a, 0, PAGE, Location::Host, &bad)
        .unwrap_err();
    assert_eq!(again.code(), Some(code::ILLEGAL_ADDRESS), "sticky");
    // The other tenant's context is unaffected.
    // SAFETY: as above.
    unsafe { mock.driver().enqueue_fill(&good, a.device_ptr(), 4, 5) }.unwrap();
    mock.synchronize(&good).unwrap();
    assert_eq!(read(&a, 0), 5);
    assert_eq!(mock.driver().stats().kernel_faults, 1);
    // Releasing the poisoned stream reports the fault (its destroy is refused, sticky); the
    // tenant's context still goes, and takes the stream with it: nothing is left held.
    let err = mock.release_stream(bad).unwrap_err();
    assert_eq!(err.code(), Some(code::ILLEGAL_ADDRESS));
    mock.release_stream(good).unwrap();
    let s = mock.stats();
    assert_eq!(
        (s.live_contexts, s.live_streams, s.pending_releases),
        (0, 0, 0)
    );
    let m = mock.driver().stats();
    assert_eq!((m.live_contexts, m.live_streams), (0, 0));
    // SAFETY: `a` came from `mock`.
    unsafe { mock.free(a).unwrap() };
}

/// The kernels a module names: copy and axpy over device pointers, on a stream.
#[test]
fn simulated_kernels_run_on_the_stream() {
    let mock = MockBackend::default();
    let x = mock.allocate(DeviceId(0), 64).unwrap();
    let y = mock.allocate(DeviceId(0), 64).unwrap();
    let s = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    let f32_at = |a: &Allocation, i: usize| a.as_ptr().cast::<f32>().wrapping_add(i);
    for i in 0..4 {
        // SAFETY: in bounds of live allocations, no other access meanwhile.
        unsafe { f32_at(&x, i).write_unaligned(i as f32) };
        // SAFETY: as above.
        unsafe { f32_at(&y, i).write_unaligned(1.0) };
    }
    let model = mock.driver();
    model
        .push_current(tensor_wasm_mem_core::DriverContext::from_raw(s.context()))
        .unwrap();
    let module = model.load_module().unwrap();
    let axpy = model.get_function(module, "axpy").unwrap();
    let copy = model.get_function(module, "copy").unwrap();
    assert_eq!(
        model.get_function(module, "nope").unwrap_err().code(),
        Some(code::NOT_FOUND)
    );
    model.pop_current().unwrap();
    let a = 2.0f32.to_bits().into();
    // SAFETY: in bounds of live allocations; nothing else accesses them while the kernel runs.
    unsafe { model.launch(&s, axpy, &[a, x.device_ptr(), y.device_ptr(), 4]) }.unwrap();
    // SAFETY: as above.
    let y3 = unsafe { f32_at(&y, 3).read_unaligned() };
    assert_eq!(y3, 7.0);
    // SAFETY: as above.
    unsafe { model.launch(&s, copy, &[x.device_ptr(), y.device_ptr(), 16]) }.unwrap();
    // SAFETY: as above.
    let x1 = unsafe { f32_at(&x, 1).read_unaligned() };
    assert_eq!(x1, 3.0);
    // Wrong arity and overflowing lengths are refused at the launch.
    // SAFETY: refused before anything runs.
    let arity = unsafe { model.launch(&s, copy, &[1, 2]) }.unwrap_err();
    assert_eq!(arity.code(), Some(code::INVALID_VALUE));
    // SAFETY: refused before anything runs.
    let overflow = unsafe { model.launch(&s, copy, &[u64::MAX, 0, 2]) }.unwrap_err();
    assert_eq!(overflow.code(), Some(code::INVALID_VALUE));
    mock.release_stream(s).unwrap();
    // SAFETY: both came from `mock`.
    unsafe {
        mock.free(x).unwrap();
    }
    // SAFETY: as above.
    unsafe { mock.free(y).unwrap() };
}

/// A result code no CUDA enum knows (a newer driver's) surfaces as a typed error with its
/// integer, never as undefined behaviour; the failed call changes nothing.
#[test]
fn an_unknown_driver_code_is_a_typed_error() {
    let mock = MockBackend::default();
    mock.driver().fail_call(Call::AllocManaged, 1, 1234);
    let err = mock.allocate(DeviceId(0), 10).unwrap_err();
    assert_eq!(err.code(), Some(1234));
    assert_eq!(err.kind(), ErrorKind::Driver);
    assert!(err.to_string().contains("1234"), "{err}");
    assert!(matches!(err, ModelError::Driver(e) if e.call == "cuMemAllocManaged"));
    assert_eq!(mock.stats().live_allocations, 0);
    let s = mock.driver().stats();
    assert_eq!((s.injected_failures, s.live_allocations), (1, 0));
    // The injection was once.
    let a = mock.allocate(DeviceId(0), 10).unwrap();
    // SAFETY: `a` came from `mock`.
    unsafe { mock.free(a).unwrap() };
}

/// Eight devices, each with its own memory; a ninth is refused before the driver is asked.
#[test]
fn eight_devices_each_with_its_own_memory() {
    let mock = with_config(MockConfig {
        device_count: 8,
        device_memory_bytes: 4 * PAGE as u64,
        ..MockConfig::default()
    });
    assert_eq!(mock.device_count(), 8);
    let all: Vec<_> = (0..8)
        .map(|d| mock.allocate(DeviceId(d), 4 * PAGE).unwrap())
        .collect();
    let full = mock.allocate(DeviceId(3), 1).unwrap_err();
    assert_eq!(full.kind(), ErrorKind::OutOfMemory);
    assert_eq!(
        mock.allocate(DeviceId(8), 1).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    for (d, a) in all.iter().enumerate() {
        assert_eq!(a.device(), DeviceId(d as u32));
        assert_eq!(
            mock.driver().device_bytes_used(DeviceId(d as u32)),
            4 * PAGE as u64
        );
        // Advice naming another device is taken; prefetch to another device too.
        mock.advise(
            a,
            0,
            PAGE,
            Advice::SetAccessedBy(Location::Device(DeviceId(7))),
        )
        .unwrap();
    }
    for a in all {
        // SAFETY: each came from `mock` and is not used again.
        unsafe { mock.free(a).unwrap() };
    }
}

/// Streams, contexts and pools on any of eight devices: each is on the device named, and a
/// pool refuses a stream of another device.
#[test]
fn streams_contexts_and_pools_on_any_of_eight_devices() {
    let mock = with_config(MockConfig {
        device_count: 8,
        ..MockConfig::default()
    });
    for d in [0, 3, 7] {
        let device = DeviceId(d);
        let tenant = key(u64::from(d) + 1);
        let isolated = mock
            .acquire_stream_on(tenant, IsolationLevel::ContextIsolated, device)
            .unwrap();
        let primary = mock.driver().primary_context(device).raw();
        assert_ne!(isolated.context(), primary, "a context of its own");
        let shared = mock
            .acquire_stream_on(tenant, IsolationLevel::Shared, device)
            .unwrap();
        assert_eq!(shared.context(), primary, "the device's primary context");
        let pool = mock
            .create_pool(tenant, device, &DevicePoolConfig::default())
            .unwrap();
        let block = mock.pool_allocate(&pool, PAGE, &isolated).unwrap();
        let elsewhere = DeviceId((d + 1) % 8);
        let other = mock
            .acquire_stream_on(tenant, IsolationLevel::StreamIsolated, elsewhere)
            .unwrap();
        let refused = mock.pool_allocate(&pool, PAGE, &other).unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::InvalidArgument);
        mock.pool_free(&pool, block, &isolated).unwrap();
        mock.destroy_pool(pool).unwrap();
        for s in [isolated, shared, other] {
            mock.release_stream(s).unwrap();
        }
    }
    let s = mock.stats();
    assert_eq!((s.live_streams, s.live_contexts, s.live_pools), (0, 0, 0));
    let m = mock.driver().stats();
    assert_eq!(
        (m.streams_created, m.streams_destroyed),
        (6, 6),
        "two streams of their own per device, each destroyed"
    );
    assert_eq!(
        (m.contexts_created, m.contexts_destroyed, m.live_contexts),
        (3, 3, 0),
        "a tenant context per device, destroyed with its last stream"
    );
}

/// Fault injection by backend operation reaches the entry point the backend calls; a failed
/// free frees nothing, and what is left is given back (and counted) at drop.
#[test]
fn injected_failures_reach_the_entry_point_and_lose_nothing() {
    let mock = MockBackend::default();
    assert!(mock.driver().fail_nth(Operation::Allocate, 2));
    let a = mock.allocate(DeviceId(0), 10).unwrap();
    let err = mock.allocate(DeviceId(0), 10).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    let s = mock.driver().stats();
    assert_eq!(
        (
            s.calls(Operation::Allocate),
            s.entry_calls(Call::AllocManaged)
        ),
        (2, 2)
    );
    assert!(mock.driver().fail_nth(Operation::Free, 1));
    // SAFETY: `a` came from `mock`; the failed free leaves it allocated.
    assert!(unsafe { mock.free(a) }.is_err());
    assert_eq!(
        mock.stats().live_allocations,
        1,
        "a failed free frees nothing"
    );
    assert_eq!(mock.driver().stats().live_allocations, 1);
    let report = mock.drop_report();
    drop(mock);
    assert!(report.reclaimed() > 0, "the backend gave it back at drop");
}

/// Advice and residency are tracked per range; ranges and streams are checked before the
/// driver is asked; a prefetch to a device without concurrent managed access is refused.
#[test]
fn hints_and_residency_are_tracked_per_range() {
    let mock = MockBackend::default();
    let a = mock.allocate(DeviceId(0), 4 * PAGE).unwrap();
    let s = mock.acquire_stream(key(1), IsolationLevel::Shared).unwrap();
    let d0 = Location::Device(DeviceId(0));
    mock.advise(&a, PAGE, PAGE, Advice::SetReadMostly).unwrap();
    mock.advise(&a, 0, 2 * PAGE, Advice::SetPreferredLocation(d0))
        .unwrap();
    mock.prefetch(&a, 0, PAGE, d0, &s).unwrap();
    let model = mock.driver();
    assert!(!model.hints(&a, 0).unwrap().read_mostly);
    assert!(model.hints(&a, PAGE).unwrap().read_mostly);
    assert_eq!(model.hints(&a, 0).unwrap().preferred_location, Some(d0));
    assert_eq!(model.hints(&a, 3 * PAGE).unwrap().preferred_location, None);
    assert_eq!(model.residency(&a, 0).unwrap(), Some(d0));
    assert_eq!(model.residency(&a, PAGE).unwrap(), None);
    let moved = model.stats().migrated_to_device_bytes;
    assert_eq!(moved, PAGE as u64, "the prefetch moved its page");
    mock.reset_hints(&a, 0, 4 * PAGE).unwrap();
    assert_eq!(model.hints(&a, PAGE).unwrap(), Default::default());
    // A reset leaves the pages where they are: nothing crosses the link.
    assert_eq!(model.residency(&a, 0).unwrap(), Some(d0));
    assert_eq!(model.stats().migrated_to_host_bytes, 0);
    assert_eq!(
        mock.advise(&a, 4 * PAGE, 1, Advice::SetReadMostly)
            .unwrap_err()
            .kind(),
        ErrorKind::OutOfRange
    );
    // SAFETY: `a` came from `mock`.
    unsafe { mock.free(a).unwrap() };

    let no_concurrent = with_config(MockConfig {
        concurrent_managed_access: false,
        ..MockConfig::default()
    });
    let b = no_concurrent.allocate(DeviceId(0), PAGE).unwrap();
    let s = no_concurrent
        .acquire_stream(key(2), IsolationLevel::Shared)
        .unwrap();
    let err = no_concurrent.prefetch(&b, 0, PAGE, d0, &s).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    // SAFETY: `b` came from `no_concurrent`.
    unsafe { no_concurrent.free(b).unwrap() };
}

/// Host memory for the host-access cases: `pages` pages of 64 KiB, `PROT_NONE` past `open`.
struct HostRange {
    base: *mut u8,
    len: usize,
}

impl HostRange {
    fn new(len: usize, open: usize) -> Self {
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choice.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: the first `open` bytes of our own mapping.
        let opened = unsafe { libc::mprotect(base, open, libc::PROT_READ | libc::PROT_WRITE) };
        assert_eq!(opened, 0);
        Self {
            base: base.cast(),
            len,
        }
    }

    fn at(&self, offset: usize) -> u64 {
        self.base as u64 + offset as u64
    }
}

impl Drop for HostRange {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn driver_code(e: &ModelError) -> Option<u32> {
    e.code()
}

/// `cuMemHostRegister`'s rules in the model: refused where the device cannot register, page
/// alignment, no overlap (712), no guard page pinned, unregister of what is registered only
/// (713); a kernel may touch a registered range and nothing past it.
#[test]
fn host_registration_keeps_the_drivers_rules() {
    let none = with_config(MockConfig::default());
    let host = HostRange::new(4 * PAGE, 2 * PAGE);
    let primary = none.driver().primary_context(DeviceId(0));
    let model = none.driver();
    model.push_current(primary).unwrap();
    let e = model.host_register(host.at(0), PAGE).unwrap_err();
    assert_eq!(driver_code(&e), Some(code::NOT_SUPPORTED));
    model.pop_current().unwrap();

    let mock = with_config(MockConfig {
        host_registration: true,
        deferred_streams: true,
        ..MockConfig::default()
    });
    let model = mock.driver();
    let primary = model.primary_context(DeviceId(0));
    model.push_current(primary).unwrap();
    let invalid = Some(code::INVALID_VALUE);
    assert_eq!(
        driver_code(&model.host_register(host.at(1), PAGE).unwrap_err()),
        invalid
    );
    assert_eq!(
        driver_code(&model.host_register(host.at(0), 0).unwrap_err()),
        invalid
    );
    assert_eq!(
        driver_code(&model.host_register(host.at(PAGE), 2 * PAGE).unwrap_err()),
        invalid,
        "a PROT_NONE page cannot be pinned"
    );
    model.host_register(host.at(0), PAGE).unwrap();
    assert_eq!(
        driver_code(&model.host_register(host.at(0), 2 * PAGE).unwrap_err()),
        Some(code::HOST_MEMORY_ALREADY_REGISTERED)
    );
    // SAFETY: not registered at that base: refused, nothing touched.
    let e = unsafe { model.host_unregister(host.at(PAGE)) }.unwrap_err();
    assert_eq!(driver_code(&e), Some(code::HOST_MEMORY_NOT_REGISTERED));
    model.pop_current().unwrap();
    assert_eq!(model.registered_ranges(), vec![(host.base as usize, PAGE)]);
    let st = model.stats();
    assert_eq!(
        (st.registered_ranges, st.registered_bytes),
        (1, PAGE as u64)
    );

    // A kernel on the registered page runs; one page further faults (not registered, and no
    // pageable access).
    let stream = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    // SAFETY: nothing else touches the range while the kernel can run.
    unsafe { model.enqueue_fill(&stream, host.at(0), PAGE, 9) }.unwrap();
    mock.synchronize(&stream).unwrap();
    // SAFETY: our own mapping, readable, the kernel done.
    assert_eq!(unsafe { host.base.wrapping_add(PAGE - 1).read() }, 9);
    // SAFETY: as above.
    unsafe { model.enqueue_fill(&stream, host.at(PAGE), 1, 9) }.unwrap();
    assert!(mock.synchronize(&stream).is_err(), "an illegal address");
    assert_eq!(model.stats().kernel_faults, 1);
    let _ = mock.release_stream(stream);
    model.push_current(primary).unwrap();
    // The primary context is poisoned now: every call in it answers the sticky error.
    // SAFETY: registered above; no work uses it.
    let e = unsafe { model.host_unregister(host.at(0)) }.unwrap_err();
    assert_eq!(driver_code(&e), Some(code::ILLEGAL_ADDRESS));
    model.pop_current().unwrap();
}

/// Pageable memory access in the model: advice and prefetch take host ranges outside every
/// allocation, kernels touch host memory that is mapped, and a guard page is an illegal
/// address. Without it, advice on host memory is refused and the kernel faults.
#[test]
fn pageable_access_reaches_mapped_host_memory_and_faults_on_guards() {
    let host = HostRange::new(2 * PAGE, PAGE);
    for pageable in [true, false] {
        let mock = with_config(MockConfig {
            pageable_memory_access: pageable,
            ..MockConfig::default()
        });
        let model = mock.driver();
        let primary = model.primary_context(DeviceId(0));
        model.push_current(primary).unwrap();
        let advised = model.advise(host.at(0), PAGE, Advice::SetReadMostly);
        model.pop_current().unwrap();
        assert_eq!(advised.is_ok(), pageable);
        let stream = mock
            .acquire_stream(key(1), IsolationLevel::StreamIsolated)
            .unwrap();
        // The model runs work at the call here (streams not deferred): a fault answers the
        // launch itself, or the wait after it.
        let run = |at: u64| {
            // SAFETY: nothing else touches the range while the kernel can run.
            unsafe { model.enqueue_fill(&stream, at, 16, 3) }.is_ok()
                && mock.synchronize(&stream).is_ok()
        };
        assert_eq!(run(host.at(0)), pageable);
        if pageable {
            // SAFETY: our own mapping, readable, the kernel done.
            assert_eq!(unsafe { host.base.read() }, 3);
            // The second page is PROT_NONE: the model must fault, not crash.
            assert!(!run(host.at(PAGE - 8)), "the guard page faults");
        }
        assert_eq!(model.stats().kernel_faults, 1);
        let _ = mock.release_stream(stream);
    }
}

/// Unregistering host memory that queued work still targets is counted, and the work faults
/// when it runs (the pages are no longer the device's); after a synchronise it is clean.
#[test]
fn an_unregister_over_queued_work_is_counted() {
    let mock = with_config(MockConfig {
        host_registration: true,
        deferred_streams: true,
        ..MockConfig::default()
    });
    let host = HostRange::new(2 * PAGE, 2 * PAGE);
    let model = mock.driver();
    let primary = model.primary_context(DeviceId(0));
    let stream = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    for (sync_first, counted) in [(true, 0), (false, 1)] {
        model.push_current(primary).unwrap();
        model.host_register(host.at(0), PAGE).unwrap();
        model.pop_current().unwrap();
        // SAFETY: nothing else touches the range while the kernel can run.
        unsafe { model.enqueue_fill(&stream, host.at(0), PAGE, 3) }.unwrap();
        if sync_first {
            mock.synchronize(&stream).unwrap();
        }
        model.push_current(primary).unwrap();
        // SAFETY: registered above; the case under test is whether work still uses it.
        unsafe { model.host_unregister(host.at(0)) }.unwrap();
        model.pop_current().unwrap();
        let s = model.stats();
        assert_eq!(s.unregisters_over_pending_work, counted);
        assert_eq!((s.registered_ranges, s.registered_bytes), (0, 0));
        // The late kernel finds the pages unpinned: an illegal address, as on a GPU.
        assert_eq!(mock.synchronize(&stream).is_err(), counted == 1);
    }
    assert_eq!(model.stats().kernel_faults, 1);
    let _ = mock.release_stream(stream);
}

/// With a worker (`worker_interval`), queued work completes with no one waiting for it: the
/// "device" gets to it on its own, in order.
#[test]
fn a_worker_completes_work_no_one_waits_for() {
    let mock = with_config(MockConfig {
        deferred_streams: true,
        worker_interval: Some(std::time::Duration::from_micros(100)),
        ..MockConfig::default()
    });
    let a = mock.allocate(DeviceId(0), PAGE).unwrap();
    let s = mock
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .unwrap();
    // SAFETY: the test reads the bytes only once the model says the work ran (under its lock,
    // which the worker holds while it writes).
    unsafe { mock.driver().enqueue_fill(&s, a.device_ptr(), PAGE, 7) }.unwrap();
    // SAFETY: as above.
    unsafe { mock.driver().enqueue_fill(&s, a.device_ptr(), 1, 8) }.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while mock.driver().pending_work() > 0 {
        assert!(std::time::Instant::now() < deadline, "the worker never ran");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!((read(&a, 0), read(&a, PAGE - 1)), (8, 7), "in order");
    mock.release_stream(s).unwrap();
    // SAFETY: `a` came from `mock`.
    unsafe { mock.free(a).unwrap() };
}

/// Advice and prefetch over a range that starts below an allocation and ends inside it are
/// refused (`CUDA_ERROR_INVALID_VALUE`), not applied to part of it.
#[test]
fn a_range_starting_below_an_allocation_is_refused() {
    let model = ModelDriver::default();
    let primary = model.primary_context(DeviceId(0));
    model.push_current(primary).unwrap();
    let p = model.alloc_managed(DeviceId(0), 2 * PAGE).unwrap();
    let below = p - 4096;
    let e = model
        .advise(below, 8192, Advice::SetReadMostly)
        .unwrap_err();
    assert_eq!(driver_code(&e), Some(code::INVALID_VALUE));
    let stream = tensor_wasm_mem_core::DriverStream::DEFAULT;
    let e = model
        .prefetch(below, 8192, Location::Host, stream)
        .unwrap_err();
    assert_eq!(driver_code(&e), Some(code::INVALID_VALUE));
    // SAFETY: allocated above, unused.
    unsafe { model.free(p) }.unwrap();
    model.pop_current().unwrap();
}
