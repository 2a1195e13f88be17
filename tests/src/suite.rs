//! The conformance cases. Each is generic over a [`Harness`] and panics on a violation.
//!
//! Cases that need a counter or fault injection the backend does not offer print that they were
//! skipped for it and check what they still can.

use std::sync::Arc;

use tensor_wasm_mem_core::{
    Advice, Advisor, Allocation, BackendError, DeviceId, DevicePoolConfig, DevicePools, Error,
    ErrorKind, HostAccess, HostMemory, IsolationLevel, Location, MIN_ALIGN, ManagedAllocator,
    Operation, PoolAllocation, PoolConfig, PoolError, SizeClass, SlotPool, Stream, StreamLease,
    StreamProvider, TenantDevicePool, TenantId, TenantKey, TenantLedger, UnifiedBuffer,
};

use crate::Harness;
use crate::harness::Completion;
use crate::runner::skip;

const PAGE: usize = 1 << 16;
const D0: DeviceId = DeviceId(0);

fn tenant(id: u64, cap: u64) -> Arc<TenantLedger> {
    Arc::new(TenantLedger::new(
        TenantId(id),
        cap,
        IsolationLevel::StreamIsolated,
    ))
}

/// The one tenant identity of number `id` in this process (the conformance cases speak of "tenant
/// 1" the way an embedder holds one tenant object).
fn key(id: u64) -> TenantKey {
    static KEYS: std::sync::Mutex<Vec<(u64, TenantKey)>> = std::sync::Mutex::new(Vec::new());
    let mut keys = KEYS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(&(_, k)) = keys.iter().find(|(n, _)| *n == id) {
        return k;
    }
    let k = TenantKey::fresh(TenantId(id));
    keys.push((id, k));
    k
}

fn all_advice(location: Location) -> [Advice; 6] {
    [
        Advice::SetReadMostly,
        Advice::UnsetReadMostly,
        Advice::SetPreferredLocation(location),
        Advice::UnsetPreferredLocation,
        Advice::SetAccessedBy(location),
        Advice::UnsetAccessedBy(location),
    ]
}

pub(crate) fn assert_no_leaks<H: Harness>(backend: &H::Backend) {
    if let Some(live) = H::counters(backend).map(|c| c.live_allocations()) {
        assert_eq!(live, 0, "allocations leaked");
    }
    if let Some(live) = H::counters(backend).map(|c| c.live_streams()) {
        assert_eq!(live, 0, "streams leaked");
    }
    if let Some(live) = H::counters(backend).map(|c| c.live_contexts()) {
        assert_eq!(live, 0, "contexts leaked");
    }
    if let Some(live) = H::counters(backend).map(|c| c.live_pools()) {
        assert_eq!(live, 0, "device pools leaked");
    }
}

/// `err` is the backend's failure of `op` (the driver's answer, not a refusal of ours, and not
/// another operation's).
fn assert_failed_in<E: std::fmt::Display>(err: &Error<E>, op: Operation) {
    assert!(
        matches!(err, Error::Backend { op: o, .. } if *o == op),
        "{err}"
    );
}

fn free<B: ManagedAllocator + ?Sized>(backend: &B, allocation: Allocation) {
    // SAFETY: every allocation passed here came from `backend` and is not used afterwards.
    unsafe { backend.free(allocation) }.expect("free");
}

/// Reads `len` bytes at `offset` of a live host-accessible allocation.
fn host_bytes(allocation: &Allocation, offset: usize, len: usize) -> Vec<u8> {
    let range = allocation.range(offset, len).expect("range inside");
    let mut out = vec![0u8; len];
    // SAFETY: `range` lies inside the live allocation, which callers only use from the host
    // (no device work) while reading.
    unsafe {
        std::ptr::copy_nonoverlapping(
            allocation.as_ptr().wrapping_add(range.start),
            out.as_mut_ptr(),
            len,
        );
    }
    out
}

/// Fills `len` bytes at `offset` of a live host-accessible allocation with `byte`.
fn host_fill(allocation: &Allocation, offset: usize, len: usize, byte: u8) {
    let range = allocation.range(offset, len).expect("range inside");
    // SAFETY: `range` lies inside the live allocation; nothing else accesses it meanwhile.
    unsafe {
        allocation
            .as_ptr()
            .wrapping_add(range.start)
            .write_bytes(byte, len)
    };
}

fn full<A: ManagedAllocator>(buf: &UnifiedBuffer<A>) -> Vec<u8> {
    let mut out = vec![0u8; buf.len()];
    buf.read(0, &mut out).expect("read the window");
    out
}

/// Capabilities are consistent with each other and with what the memory does.
pub fn capabilities_are_honest<H: Harness>() {
    let b = H::backend();
    let caps = b.capabilities();
    assert!(
        b.device_count() >= 1,
        "a backend serves at least one device"
    );
    assert_eq!(
        caps.is_uvm(),
        caps.managed && caps.host_accessible && caps.device_accessible
    );
    assert!(
        !(caps.managed && caps.guard_pages),
        "managed memory cannot carry guard pages"
    );
    let a = b.allocate(D0, 3 * PAGE).expect("allocate");
    if caps.host_accessible {
        if caps.comes_zeroed {
            for offset in [0, PAGE, 3 * PAGE - 64] {
                assert!(
                    host_bytes(&a, offset, 64).iter().all(|&x| x == 0),
                    "claims comes_zeroed, but fresh memory at {offset} is not zero"
                );
            }
        }
        host_fill(&a, 0, 3 * PAGE, 0x5a);
        assert!(host_bytes(&a, 0, 3 * PAGE).iter().all(|&x| x == 0x5a));
    }
    free(&*b, a);
    assert_no_leaks::<H>(&b);
}

/// Allocate, write, zero a sub-range exactly, free.
pub fn allocate_write_zero_free<H: Harness>() {
    let b = H::backend();
    let len = 3 * PAGE + 17;
    let a = b.allocate(D0, len).expect("allocate");
    assert_eq!(a.len(), len);
    assert_eq!(a.device(), D0);
    if b.capabilities().host_accessible {
        host_fill(&a, 0, len, 0xff);
        // SAFETY: `a` is live and nothing else touches it.
        unsafe { b.zero(&a, PAGE + 1, PAGE) }.expect("zero");
        let bytes = host_bytes(&a, 0, len);
        assert_eq!(bytes[PAGE], 0xff, "byte before the range untouched");
        assert!(bytes[PAGE + 1..2 * PAGE + 1].iter().all(|&x| x == 0));
        assert_eq!(bytes[2 * PAGE + 1], 0xff, "byte after the range untouched");
        // SAFETY: as above; the whole allocation.
        unsafe { b.zero(&a, 0, len) }.expect("zero all");
        assert!(host_bytes(&a, 0, len).iter().all(|&x| x == 0));
    } else {
        // SAFETY: as above.
        unsafe { b.zero(&a, 0, len) }.expect("zero");
    }
    free(&*b, a);
    assert_no_leaks::<H>(&b);
}

/// Size zero is an invalid argument, as `cuMemAllocManaged` says.
pub fn allocate_zero_bytes_is_refused<H: Harness>() {
    let b = H::backend();
    let err = b.allocate(D0, 0).expect_err("size 0 must be refused");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert_no_leaks::<H>(&b);
}

/// A device past `device_count()` is an invalid argument.
pub fn allocate_unknown_device_is_refused<H: Harness>() {
    let b = H::backend();
    let device = DeviceId(b.device_count());
    let err = b.allocate(device, PAGE).expect_err("unknown device");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let err = b
        .allocate(DeviceId(u32::MAX), PAGE)
        .expect_err("unknown device");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert_no_leaks::<H>(&b);
}

/// Asking for more than the device has is out-of-memory, and the backend keeps working.
pub fn allocate_too_much_is_out_of_memory<H: Harness>() {
    let b = H::backend();
    let err = b
        .allocate(D0, H::too_much(&b))
        .expect_err("more than the device has");
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    let a = b.allocate(D0, PAGE).expect("still serves");
    free(&*b, a);
    assert_no_leaks::<H>(&b);
}

/// Every allocation is aligned to `MIN_ALIGN` and overlaps no other.
pub fn allocations_are_aligned_and_disjoint<H: Harness>() {
    let b = H::backend();
    let sizes = [1, 100, 4096, PAGE, PAGE + 1, 3 * PAGE, 7, 1 << 20];
    let allocations: Vec<_> = sizes
        .iter()
        .map(|&s| b.allocate(D0, s).expect("allocate"))
        .collect();
    for a in &allocations {
        assert_eq!(a.as_ptr() as usize % MIN_ALIGN, 0, "aligned to MIN_ALIGN");
    }
    let mut ranges: Vec<_> = allocations
        .iter()
        .map(|a| (a.as_ptr() as usize, a.as_ptr() as usize + a.len()))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(w[0].1 <= w[1].0, "allocations overlap");
    }
    for a in allocations {
        free(&*b, a);
    }
    assert_no_leaks::<H>(&b);
}

/// `zero` refuses ranges outside the allocation, and writes nothing then.
pub fn zero_rejects_bad_ranges<H: Harness>() {
    let b = H::backend();
    let len = 2 * PAGE;
    let a = b.allocate(D0, len).expect("allocate");
    let host = b.capabilities().host_accessible;
    if host {
        host_fill(&a, 0, len, 0x11);
    }
    for (offset, n, kind) in [
        (len, 1, ErrorKind::OutOfRange),
        (len - 1, 2, ErrorKind::OutOfRange),
        (0, len + 1, ErrorKind::OutOfRange),
        (1, usize::MAX, ErrorKind::Overflow),
        (usize::MAX, 1, ErrorKind::Overflow),
    ] {
        // SAFETY: `a` is live and nothing else touches it; the range is bad on purpose.
        let err = unsafe { b.zero(&a, offset, n) }.expect_err("bad range");
        assert_eq!(err.kind(), kind, "zero({offset}, {n}): {err}");
    }
    if host {
        assert!(
            host_bytes(&a, 0, len).iter().all(|&x| x == 0x11),
            "a refused zero wrote"
        );
    }
    free(&*b, a);
    assert_no_leaks::<H>(&b);
}

/// Many allocate/free cycles: every byte comes back.
pub fn free_gives_memory_back<H: Harness>() {
    let b = H::backend();
    for i in 0..200 {
        let a = b.allocate(D0, PAGE * (1 + i % 5)).expect("allocate");
        free(&*b, a);
    }
    match H::counters(&b).map(|c| c.live_allocations()) {
        Some(live) => assert_eq!(live, 0),
        None => skip("no allocation counter"),
    }
}

/// A unified buffer grows by moving its end only, never past its capacity.
pub fn buffer_growth_never_moves_the_base<H: Harness>() {
    let b = H::backend();
    let mut buf = UnifiedBuffer::new(Arc::clone(&b), D0, 16 * PAGE, PAGE).expect("buffer");
    let base = buf.as_ptr();
    for pages in 2..=16 {
        buf.grow_to(pages * PAGE).expect("grow");
        assert_eq!(buf.as_ptr(), base, "growth moved the base");
    }
    let err = buf.grow_to(16 * PAGE + 1).expect_err("past capacity");
    assert_eq!(err.kind(), ErrorKind::OutOfRange);
    assert_eq!(buf.len(), 16 * PAGE);
    assert_eq!(buf.is_uvm_backed(), b.capabilities().is_uvm());
    drop(buf);
    assert_no_leaks::<H>(&b);
}

/// The visible window of a buffer reads as zero, also after growth, whatever the backend hands
/// out.
pub fn buffer_window_reads_zero<H: Harness>() {
    let b = H::backend();
    if !b.capabilities().host_accessible {
        return skip("not host-accessible");
    }
    let mut buf = UnifiedBuffer::new(Arc::clone(&b), D0, 4 * PAGE, PAGE + 3).expect("buffer");
    assert!(full(&buf).iter().all(|&x| x == 0));
    buf.write(0, &vec![0xee; PAGE + 3]).expect("write");
    buf.grow_to(4 * PAGE).expect("grow");
    let bytes = full(&buf);
    assert!(bytes[..PAGE + 3].iter().all(|&x| x == 0xee), "data kept");
    assert!(bytes[PAGE + 3..].iter().all(|&x| x == 0), "new bytes zero");
    drop(buf);
    assert_no_leaks::<H>(&b);
}

fn valid_ranges(len: usize) -> [(usize, usize); 6] {
    [
        (0, len),
        (0, 1),
        (len - 1, 1),
        (len, 0),
        (PAGE, PAGE),
        (17, len - 17),
    ]
}

fn bad_ranges(len: usize) -> [(usize, usize, ErrorKind); 5] {
    [
        (len, 1, ErrorKind::OutOfRange),
        (len - 1, 2, ErrorKind::OutOfRange),
        (0, len + 1, ErrorKind::OutOfRange),
        (1, usize::MAX, ErrorKind::Overflow),
        (usize::MAX, 1, ErrorKind::Overflow),
    ]
}

/// Every advice, at host and device 0, on every valid range (empty ranges included).
pub fn advise_accepts_every_valid_range<H: Harness>() {
    let b = H::backend();
    let len = 4 * PAGE;
    let a = b.allocate(D0, len).expect("allocate");
    for location in [Location::Host, Location::Device(D0)] {
        for advice in all_advice(location) {
            for (offset, n) in valid_ranges(len) {
                b.advise(&a, offset, n, advice)
                    .unwrap_or_else(|e| panic!("advise({offset}, {n}, {advice}): {e}"));
            }
        }
    }
    free(&*b, a);
    assert_no_leaks::<H>(&b);
}

/// Ranges outside the allocation are refused as out of range.
pub fn advise_rejects_out_of_range<H: Harness>() {
    let b = H::backend();
    let len = 2 * PAGE;
    let a = b.allocate(D0, len).expect("allocate");
    for (offset, n, kind) in bad_ranges(len) {
        if kind != ErrorKind::OutOfRange {
            continue;
        }
        for advice in all_advice(Location::Host) {
            let err = b.advise(&a, offset, n, advice).expect_err("out of range");
            assert_eq!(err.kind(), kind, "advise({offset}, {n}, {advice}): {err}");
        }
    }
    free(&*b, a);
}

/// Ranges whose end overflows are refused as overflow.
pub fn advise_rejects_overflow<H: Harness>() {
    let b = H::backend();
    let len = 2 * PAGE;
    let a = b.allocate(D0, len).expect("allocate");
    for (offset, n, kind) in bad_ranges(len) {
        if kind != ErrorKind::Overflow {
            continue;
        }
        let err = b
            .advise(&a, offset, n, Advice::SetReadMostly)
            .expect_err("overflow");
        assert_eq!(err.kind(), kind, "advise({offset}, {n}): {err}");
    }
    free(&*b, a);
}

/// Hints naming a device that does not exist are refused.
pub fn advise_rejects_unknown_device<H: Harness>() {
    let b = H::backend();
    let a = b.allocate(D0, PAGE).expect("allocate");
    let nowhere = Location::Device(DeviceId(b.device_count()));
    for advice in [
        Advice::SetPreferredLocation(nowhere),
        Advice::SetAccessedBy(nowhere),
        Advice::UnsetAccessedBy(nowhere),
    ] {
        let err = b.advise(&a, 0, PAGE, advice).expect_err("unknown device");
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{advice}: {err}");
    }
    free(&*b, a);
}

/// Prefetch of every valid range to the host, and to device 0 where concurrent managed access
/// allows it (refused as unsupported where it does not), on shared and isolated streams.
pub fn prefetch_accepts_every_valid_range<H: Harness>() {
    let b = H::backend();
    let len = 4 * PAGE;
    let a = b.allocate(D0, len).expect("allocate");
    let concurrent = b.capabilities().concurrent_managed_access;
    for level in [IsolationLevel::Shared, IsolationLevel::StreamIsolated] {
        let lease = StreamLease::acquire(&*b, key(1), level).expect("stream");
        for (offset, n) in valid_ranges(len) {
            b.prefetch(&a, offset, n, Location::Host, lease.stream())
                .unwrap_or_else(|e| panic!("prefetch({offset}, {n}) to host: {e}"));
            let to_device = b.prefetch(&a, offset, n, Location::Device(D0), lease.stream());
            match (concurrent, to_device) {
                (true, r) => r.unwrap_or_else(|e| panic!("prefetch({offset}, {n}) to device: {e}")),
                (false, Err(e)) => assert_eq!(e.kind(), ErrorKind::Unsupported),
                (false, Ok(())) => panic!("prefetch to a device without concurrent access"),
            }
        }
        b.synchronize(lease.stream()).expect("synchronize");
        lease.release().expect("release");
    }
    free(&*b, a);
    assert_no_leaks::<H>(&b);
}

/// Prefetch of ranges outside the allocation is refused as out of range.
pub fn prefetch_rejects_out_of_range<H: Harness>() {
    let b = H::backend();
    let len = 2 * PAGE;
    let a = b.allocate(D0, len).expect("allocate");
    let lease = StreamLease::acquire(&*b, key(1), IsolationLevel::Shared).expect("stream");
    for (offset, n, kind) in bad_ranges(len) {
        if kind != ErrorKind::OutOfRange {
            continue;
        }
        let err = b
            .prefetch(&a, offset, n, Location::Host, lease.stream())
            .expect_err("out of range");
        assert_eq!(err.kind(), kind, "prefetch({offset}, {n}): {err}");
    }
    drop(lease);
    free(&*b, a);
}

/// Prefetch of ranges whose end overflows is refused as overflow.
pub fn prefetch_rejects_overflow<H: Harness>() {
    let b = H::backend();
    let len = 2 * PAGE;
    let a = b.allocate(D0, len).expect("allocate");
    let lease = StreamLease::acquire(&*b, key(1), IsolationLevel::Shared).expect("stream");
    for (offset, n, kind) in bad_ranges(len) {
        if kind != ErrorKind::Overflow {
            continue;
        }
        let err = b
            .prefetch(&a, offset, n, Location::Host, lease.stream())
            .expect_err("overflow");
        assert_eq!(err.kind(), kind, "prefetch({offset}, {n}): {err}");
    }
    drop(lease);
    free(&*b, a);
}

/// Prefetch to a device that does not exist is refused.
pub fn prefetch_rejects_unknown_device<H: Harness>() {
    let b = H::backend();
    let a = b.allocate(D0, PAGE).expect("allocate");
    let lease = StreamLease::acquire(&*b, key(1), IsolationLevel::Shared).expect("stream");
    let nowhere = Location::Device(DeviceId(b.device_count()));
    let err = b
        .prefetch(&a, 0, PAGE, nowhere, lease.stream())
        .expect_err("unknown device");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    drop(lease);
    free(&*b, a);
}

/// The shared stream is one stream for everyone; releasing it destroys nothing.
pub fn shared_stream_is_shared<H: Harness>() {
    let b = H::backend();
    let one = b
        .acquire_stream(key(1), IsolationLevel::Shared)
        .expect("shared");
    let two = b
        .acquire_stream(key(2), IsolationLevel::Shared)
        .expect("shared");
    assert_eq!(one.raw(), two.raw(), "shared streams are the same stream");
    assert_eq!(one.context(), two.context(), "in the same context");
    assert!(one.is_shared());
    if let Some(live) = H::counters(&b).map(|c| c.live_streams()) {
        assert_eq!(live, 0, "the shared stream is not created per instance");
    }
    b.release_stream(one).expect("release");
    b.synchronize(&two)
        .expect("still usable after another holder released");
    b.release_stream(two).expect("release");
    assert_no_leaks::<H>(&b);
}

/// Streams are made on the device `acquire_stream_on` names, at every level, and work there
/// (a prefetch of that device's memory to it); a device that does not exist is refused before
/// anything is made.
pub fn streams_are_made_on_the_device_named<H: Harness>() {
    let b = H::backend();
    let devices = b.device_count();
    for d in 0..devices {
        let device = DeviceId(d);
        let a = b.allocate(device, 4 * PAGE).expect("allocate");
        for level in [
            IsolationLevel::Shared,
            IsolationLevel::StreamIsolated,
            IsolationLevel::ContextIsolated,
        ] {
            let s = b
                .acquire_stream_on(key(u64::from(d) + 1), level, device)
                .expect("acquire on the device");
            assert_eq!(s.device(), device, "{level}");
            if b.capabilities().concurrent_managed_access {
                b.prefetch(&a, 0, PAGE, Location::Device(device), &s)
                    .expect("prefetch on the device's stream");
            }
            b.synchronize(&s).expect("synchronize");
            b.release_stream(s).expect("release");
        }
        // SAFETY: `a` came from `b` and is not used again.
        unsafe { b.free(a).expect("free") };
    }
    for level in [
        IsolationLevel::Shared,
        IsolationLevel::StreamIsolated,
        IsolationLevel::ContextIsolated,
    ] {
        let err = b
            .acquire_stream_on(key(99), level, DeviceId(devices))
            .expect_err("no such device");
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{level}");
    }
    assert_no_leaks::<H>(&b);
}

/// Stream-isolated instances get distinct streams, destroyed on release.
pub fn isolated_streams_are_distinct_and_released<H: Harness>() {
    let b = H::backend();
    let shared = b
        .acquire_stream(key(1), IsolationLevel::Shared)
        .expect("shared");
    let streams: Vec<Stream> = (0..4)
        .map(|_| {
            b.acquire_stream(key(1), IsolationLevel::StreamIsolated)
                .expect("isolated")
        })
        .collect();
    let mut raws: Vec<u64> = streams.iter().map(Stream::raw).collect();
    raws.sort_unstable();
    raws.dedup();
    assert_eq!(raws.len(), 4, "isolated streams are distinct");
    assert!(!raws.contains(&shared.raw()), "and not the shared stream");
    for s in &streams {
        assert_eq!(s.context(), shared.context(), "in the primary context");
    }
    if let Some(live) = H::counters(&b).map(|c| c.live_streams()) {
        assert_eq!(live, 4);
    }
    for s in streams {
        b.synchronize(&s).expect("synchronize");
        b.release_stream(s).expect("release");
    }
    b.release_stream(shared).expect("release shared");
    assert_no_leaks::<H>(&b);
}

/// Context isolation: one context per tenant, shared by its streams, destroyed with the last.
pub fn context_isolation_is_per_tenant<H: Harness>() {
    let b = H::backend();
    let level = IsolationLevel::ContextIsolated;
    let primary = b
        .acquire_stream(key(9), IsolationLevel::Shared)
        .expect("shared")
        .context();
    let a1 = b.acquire_stream(key(1), level).expect("a1");
    let a2 = b.acquire_stream(key(1), level).expect("a2");
    let b1 = b.acquire_stream(key(2), level).expect("b1");
    assert_eq!(a1.context(), a2.context(), "one context per tenant");
    assert_ne!(a1.context(), b1.context(), "tenants do not share a context");
    assert_ne!(a1.context(), primary, "not the primary context");
    assert_ne!(a1.raw(), a2.raw(), "a stream per instance");
    if let Some(live) = H::counters(&b).map(|c| c.live_contexts()) {
        assert_eq!(live, 2);
    }
    b.release_stream(a1).expect("release");
    if let Some(live) = H::counters(&b).map(|c| c.live_contexts()) {
        assert_eq!(live, 2, "the tenant still has a stream");
    }
    b.release_stream(a2).expect("release");
    if let Some(live) = H::counters(&b).map(|c| c.live_contexts()) {
        assert_eq!(live, 1, "destroyed with the tenant's last stream");
    }
    b.release_stream(b1).expect("release");
    assert_no_leaks::<H>(&b);
}

/// Forged and already-released stream handles are refused, never trusted; so is a key (what
/// waits for a stream without owning it) whose stream is gone or that names another tenant.
pub fn unknown_streams_are_refused<H: Harness>() {
    let b = H::backend();
    let s = b
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .expect("stream");
    let (raw, context) = (s.driver_stream(), s.driver_context());
    let live_key = s.key();
    b.wait_for(live_key).expect("a live stream's key waits");
    let other = b
        .acquire_stream(key(2), IsolationLevel::StreamIsolated)
        .expect("stream");
    let foreign = Stream::new(
        other.driver_stream(),
        other.driver_context(),
        IsolationLevel::StreamIsolated,
        key(1),
    );
    let err = b
        .wait_for(foreign.key())
        .expect_err("another tenant's stream");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    b.release_stream(other).expect("release");
    b.release_stream(s).expect("release");
    let err = b.wait_for(live_key).expect_err("a released stream's key");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let stale = Stream::new(raw, context, IsolationLevel::StreamIsolated, key(1));
    let err = b.synchronize(&stale).expect_err("released stream");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let err = b.release_stream(stale).expect_err("released twice");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let forged = Stream::new(
        tensor_wasm_mem_core::DriverStream::from_raw(0xdead_beef),
        context,
        IsolationLevel::StreamIsolated,
        key(1),
    );
    assert!(b.release_stream(forged).is_err(), "forged handle");
    assert_no_leaks::<H>(&b);
}

fn pool<H: Harness>(b: &Arc<H::Backend>, classes: &[SizeClass]) -> Arc<SlotPool<Arc<H::Backend>>> {
    Arc::new(
        SlotPool::new(Arc::clone(b), PoolConfig::new(D0, classes.iter().copied())).expect("pool"),
    )
}

/// A reused slot reads as zeros after its previous holder filled it.
pub fn pool_reuse_scrubs<H: Harness>() {
    let b = H::backend();
    if !b.capabilities().host_accessible {
        return skip("not host-accessible");
    }
    let p = pool::<H>(&b, &[SizeClass::new(4 * PAGE, 1)]);
    let mut first = p.acquire(4 * PAGE, PAGE).expect("slot");
    first.grow_to(4 * PAGE).expect("grow");
    first.write(0, &vec![0xff; 4 * PAGE]).expect("fill");
    let base = first.as_ptr();
    drop(first);
    let second = p.acquire(4 * PAGE, 4 * PAGE).expect("slot again");
    assert_eq!(second.as_ptr(), base, "the same slot");
    assert!(full(&second).iter().all(|&x| x == 0), "scrubbed");
    assert!(p.stats().bytes_scrubbed >= 4 * PAGE as u64);
    drop((second, p));
    assert_no_leaks::<H>(&b);
}

/// What a tenant can leave behind on its memory besides bytes: each advice that sets
/// something. (Where its pages are is not left to reset: a scrub leaves them where they are.)
enum Leftover {
    Advice(Advice),
}

fn leftovers() -> Vec<Leftover> {
    [
        Advice::SetReadMostly,
        Advice::SetPreferredLocation(Location::Host),
        Advice::SetPreferredLocation(Location::Device(D0)),
        Advice::SetAccessedBy(Location::Host),
        Advice::SetAccessedBy(Location::Device(D0)),
    ]
    .into_iter()
    .map(Leftover::Advice)
    .collect()
}

impl std::fmt::Display for Leftover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Advice(a) => write!(f, "{a}"),
        }
    }
}

/// Checks, where the backend can be inspected, that `offsets` of `allocation` are (or are not)
/// as a fresh allocation has them. `false` when it cannot be inspected.
fn check_pristine<H: Harness>(
    b: &H::Backend,
    allocation: &Allocation,
    offsets: &[usize],
    pristine: bool,
    what: &str,
) -> bool {
    for &offset in offsets {
        let Some(state) = H::inspect(b).and_then(|i| i.hints(allocation, offset)) else {
            return false;
        };
        assert_eq!(
            state.is_pristine(),
            pristine,
            "{what} at offset {offset}: {state:?}"
        );
    }
    true
}

/// `reset_hints` puts each advice back as a fresh allocation has
/// them, over exactly the range, and keeps the bytes; it checks ranges as `advise` does.
pub fn reset_hints_restores_a_fresh_allocation<H: Harness>() {
    let b = H::backend();
    let len = 4 * PAGE;
    let a = b.allocate(D0, len).expect("allocate");
    let lease = StreamLease::acquire(&*b, key(1), IsolationLevel::StreamIsolated).expect("stream");
    let host = b.capabilities().host_accessible;
    if host {
        host_fill(&a, 0, len, 0x5a);
    }
    let mut inspected = false;
    for leftover in leftovers() {
        match leftover {
            Leftover::Advice(advice) => b.advise(&a, 0, len, advice).expect("advise"),
        }
        let what = format!("after {leftover}");
        inspected |= check_pristine::<H>(&b, &a, &[0, len - 1], false, &what);
        // Reset all but the last page: that page keeps what it had.
        b.reset_hints(&a, 0, len - PAGE).expect("reset_hints");
        let what = format!("after {leftover} and reset_hints");
        check_pristine::<H>(&b, &a, &[0, PAGE + 17, len - PAGE - 1], true, &what);
        check_pristine::<H>(
            &b,
            &a,
            &[len - PAGE, len - 1],
            false,
            &format!("{what} (outside)"),
        );
        b.reset_hints(&a, len - PAGE, PAGE).expect("reset_hints");
        check_pristine::<H>(&b, &a, &[len - 1], true, &what);
    }
    if !inspected {
        skip("hints cannot be inspected");
    }
    if host {
        assert!(
            host_bytes(&a, 0, len).iter().all(|&x| x == 0x5a),
            "contents kept"
        );
    }
    for (offset, n) in valid_ranges(len) {
        b.reset_hints(&a, offset, n)
            .unwrap_or_else(|e| panic!("reset_hints({offset}, {n}): {e}"));
    }
    for (offset, n, kind) in bad_ranges(len) {
        let err = b.reset_hints(&a, offset, n).expect_err("bad range");
        assert_eq!(err.kind(), kind, "reset_hints({offset}, {n}): {err}");
    }
    lease.release().expect("release");
    free(&*b, a);
    assert_no_leaks::<H>(&b);
}

/// Attack: a tenant sets each advice on its pooled memory and lets it go; the
/// next holder of the same slot finds it as a fresh allocation has it.
pub fn pool_reuse_resets_hints<H: Harness>() {
    let b = H::backend();
    let p = pool::<H>(&b, &[SizeClass::new(4 * PAGE, 1)]);
    let lease = StreamLease::acquire(&*b, key(1), IsolationLevel::StreamIsolated).expect("stream");
    let mut inspected = false;
    let mut resets = 0;
    for leftover in leftovers() {
        let mut first = p.acquire(4 * PAGE, PAGE).expect("slot");
        first.grow_to(3 * PAGE).expect("grow");
        match leftover {
            Leftover::Advice(advice) => first.advise(0, 3 * PAGE, advice).expect("advise"),
        }
        let slab_base = p.with_slab(|s| s.as_ptr() as usize).expect("a slab");
        let base = first.as_ptr() as usize - slab_base;
        let offsets = [base, base + 3 * PAGE - 1];
        inspected |= p
            .with_slab(|s| check_pristine::<H>(&b, s, &offsets, false, &format!("{leftover}")))
            .expect("a slab");
        drop(first);
        let second = p.acquire(4 * PAGE, 4 * PAGE).expect("slot again");
        assert_eq!(second.as_ptr() as usize - slab_base, base, "the same slot");
        resets += 1;
        assert_eq!(
            p.stats().hint_resets,
            resets,
            "the slot's hints were reset: {leftover}"
        );
        p.with_slab(|s| {
            check_pristine::<H>(&b, s, &offsets, true, &format!("reused after {leftover}"))
        })
        .expect("a slab");
        drop(second);
    }
    // A holder that hints nothing costs no reset.
    drop(p.acquire(4 * PAGE, PAGE).expect("slot"));
    drop(p.acquire(4 * PAGE, PAGE).expect("slot"));
    assert_eq!(
        p.stats().hint_resets,
        resets,
        "nothing hinted, nothing reset"
    );
    if !inspected {
        skip("hints cannot be inspected");
    }
    lease.release().expect("release");
    drop(p);
    assert_no_leaks::<H>(&b);
}

/// Acquiring and releasing ten times the slot count never exhausts the pool.
pub fn pool_reuse_never_exhausts<H: Harness>() {
    let b = H::backend();
    let p = pool::<H>(&b, &[SizeClass::new(PAGE, 3), SizeClass::new(2 * PAGE, 2)]);
    for _ in 0..10 * 5 {
        let held: Vec<_> = [PAGE, PAGE, PAGE, 2 * PAGE, 2 * PAGE]
            .iter()
            .map(|&c| p.acquire(c, PAGE).expect("a slot is free"))
            .collect();
        drop(held);
    }
    let s = p.stats();
    assert_eq!((s.in_use(), s.free(), s.exhaustions), (0, 5, 0));
    drop(p);
    assert_no_leaks::<H>(&b);
}

/// When every fitting slot is busy the answer is a typed exhaustion, and freeing one serves again.
pub fn pool_exhaustion_is_typed<H: Harness>() {
    let b = H::backend();
    let p = pool::<H>(&b, &[SizeClass::new(PAGE, 2)]);
    let one = p.acquire(PAGE, 0).expect("slot");
    let two = p.acquire(PAGE, 0).expect("slot");
    let err = p.acquire(PAGE, 0).expect_err("exhausted");
    assert!(
        matches!(err, Error::Pool(PoolError::Exhausted { .. })),
        "{err}"
    );
    assert_eq!(err.kind(), ErrorKind::PoolExhausted);
    let err = p.acquire(PAGE + 1, 0).expect_err("too large");
    assert!(
        matches!(err, Error::Pool(PoolError::TooLarge { .. })),
        "{err}"
    );
    drop(one);
    let three = p.acquire(PAGE, 0).expect("served again");
    drop((two, three, p));
    assert_no_leaks::<H>(&b);
}

/// Two tenants on one pool: neither reads the other's bytes, neither while both hold slots nor
/// after one slot passes from one tenant to the other.
pub fn tenants_never_see_each_others_bytes<H: Harness>() {
    let b = H::backend();
    if !b.capabilities().host_accessible {
        return skip("not host-accessible");
    }
    let p = pool::<H>(&b, &[SizeClass::new(2 * PAGE, 2)]);
    let (alice, bob) = (tenant(1, 4 * PAGE as u64), tenant(2, 4 * PAGE as u64));
    let alice_charge = alice.try_reserve(2 * PAGE as u64).expect("cap");
    let mut alice_mem = p.acquire(2 * PAGE, 2 * PAGE).expect("slot");
    let bob_charge = bob.try_reserve(2 * PAGE as u64).expect("cap");
    let mut bob_mem = p.acquire(2 * PAGE, 2 * PAGE).expect("slot");
    alice_mem.write(0, &vec![0xa1; 2 * PAGE]).expect("write");
    bob_mem.write(0, &vec![0xb0; 2 * PAGE]).expect("write");
    assert!(full(&alice_mem).iter().all(|&x| x == 0xa1));
    assert!(full(&bob_mem).iter().all(|&x| x == 0xb0));
    drop((alice_mem, alice_charge));
    // Bob takes Alice's old slot.
    let bob_charge2 = bob.try_reserve(2 * PAGE as u64).expect("cap");
    let bob_second = p.acquire(2 * PAGE, 2 * PAGE).expect("slot");
    assert!(
        full(&bob_second).iter().all(|&x| x == 0),
        "bob sees alice's bytes"
    );
    drop((bob_mem, bob_second, bob_charge, bob_charge2, p));
    assert_eq!(alice.stats().touched_bytes, 0);
    assert_eq!(bob.stats().touched_bytes, 0);
    assert_no_leaks::<H>(&b);
}

/// Device slices stay inside the visible window; overflow is refused.
pub fn device_slices_stay_in_the_window<H: Harness>() {
    let b = H::backend();
    let buf = UnifiedBuffer::new(Arc::clone(&b), D0, 4 * PAGE, 2 * PAGE).expect("buffer");
    let whole = buf.device_slice(0, 2 * PAGE).expect("whole window");
    assert_eq!(whole.device_ptr, buf.device_ptr());
    let tail = buf.device_slice(2 * PAGE - 1, 1).expect("last byte");
    assert_eq!(tail.device_ptr, buf.device_ptr() + 2 * PAGE as u64 - 1);
    assert!(
        buf.device_slice(2 * PAGE, 1).is_err(),
        "capacity is not visible"
    );
    assert!(buf.device_slice(1, usize::MAX).is_err(), "overflow");
    assert!(buf.device_slice(usize::MAX, 1).is_err(), "overflow");
    drop(buf);
    assert_no_leaks::<H>(&b);
}

/// An injected allocation failure: typed error, nothing allocated, the tenant charge undone.
pub fn injected_allocate_failure_rolls_back<H: Harness>() {
    let b = H::backend();
    if !H::faults(&b).is_some_and(|f| f.fail_nth(Operation::Allocate, 1)) {
        return skip("no fault injection");
    }
    let t = tenant(1, 16 * PAGE as u64);
    let result = t
        .try_reserve(4 * PAGE as u64)
        .map_err(Error::from)
        .and_then(|r| UnifiedBuffer::new(Arc::clone(&b), D0, 4 * PAGE, PAGE).map(|buf| (r, buf)));
    let err = result.expect_err("injected");
    assert_failed_in(&err, Operation::Allocate);
    assert_eq!(t.stats().touched_bytes, 0, "no tenant charge left");
    assert_no_leaks::<H>(&b);
    // The next allocation works.
    drop(UnifiedBuffer::new(Arc::clone(&b), D0, PAGE, PAGE).expect("works again"));
    assert_no_leaks::<H>(&b);
}

/// An injected zeroing failure while a slot is scrubbed on the device: nothing handed out, the
/// slot stays in the pool, the tenant charge undone; the next try scrubs and succeeds.
pub fn injected_zero_failure_rolls_back<H: Harness>() {
    let b = H::backend();
    let p = pool::<H>(&b, &[SizeClass::new(PAGE, 1)]);
    let dirty = p.acquire(PAGE, PAGE).expect("dirty the slot");
    // A device pointer into it was handed out: device work may have touched it, so its scrub
    // runs on the device (where the injected failure is).
    dirty.device_slice(0, PAGE).expect("device slice");
    drop(dirty);
    if !H::faults(&b).is_some_and(|f| f.fail_nth(Operation::Zero, 1)) {
        return skip("no fault injection");
    }
    let t = tenant(1, PAGE as u64);
    let result = t
        .try_reserve(PAGE as u64)
        .map_err(Error::from)
        .and_then(|r| p.acquire(PAGE, PAGE).map(|m| (r, m)));
    let err = result.expect_err("injected");
    assert_failed_in(&err, Operation::Zero);
    assert_eq!(t.stats().touched_bytes, 0);
    let s = p.stats();
    assert_eq!((s.in_use(), s.free(), s.scrub_failures), (0, 1, 1));
    let again = p.acquire(PAGE, PAGE).expect("scrubbed on the next try");
    if b.capabilities().host_accessible {
        assert!(full(&again).iter().all(|&x| x == 0));
    }
    drop((again, p));
    assert_no_leaks::<H>(&b);
}

/// An injected hint failure is reported and changes nothing else.
pub fn injected_advise_failure_rolls_back<H: Harness>() {
    let b = H::backend();
    let mut buf = UnifiedBuffer::new(Arc::clone(&b), D0, PAGE, PAGE).expect("buffer");
    if !H::faults(&b).is_some_and(|f| f.fail_nth(Operation::Advise, 1)) {
        return skip("no fault injection");
    }
    let host = b.capabilities().host_accessible;
    if host {
        buf.write(0, b"kept").expect("write");
    }
    let err = buf
        .advise(0, PAGE, Advice::SetReadMostly)
        .expect_err("injected");
    assert_failed_in(&err, Operation::Advise);
    assert!(!err.kind().is_denial(), "a failure, not a denial");
    buf.advise(0, PAGE, Advice::SetReadMostly)
        .expect("works again");
    if host {
        let mut out = [0u8; 4];
        buf.read(0, &mut out).expect("read");
        assert_eq!(&out, b"kept");
    }
    drop(buf);
    assert_no_leaks::<H>(&b);
}

/// A driver result no CUDA enum knows (a newer CUDA's code, here 4242: the highest any CUDA
/// names is 999) is a typed error carrying the integer, never undefined behaviour; the backend
/// goes on.
pub fn unknown_driver_code_is_a_typed_error<H: Harness>() {
    const UNKNOWN_TO_EVERY_ENUM: u32 = 4242;
    let b = H::backend();
    let buf = UnifiedBuffer::new(Arc::clone(&b), D0, PAGE, PAGE).expect("buffer");
    if !H::faults(&b).is_some_and(|f| f.fail_nth_with(Operation::Advise, 1, UNKNOWN_TO_EVERY_ENUM))
    {
        return skip("no fault injection");
    }
    let err = buf
        .advise(0, PAGE, Advice::SetReadMostly)
        .expect_err("injected");
    assert_failed_in(&err, Operation::Advise);
    assert_eq!(err.kind(), ErrorKind::Driver, "{err}");
    assert!(
        err.to_string().contains("4242"),
        "the code is reported: {err}"
    );
    buf.advise(0, PAGE, Advice::SetReadMostly)
        .expect("works again");
    drop(buf);
    assert_no_leaks::<H>(&b);
}

/// An injected prefetch failure is reported; the stream and memory go back as usual.
pub fn injected_prefetch_failure_rolls_back<H: Harness>() {
    let b = H::backend();
    let buf = UnifiedBuffer::new(Arc::clone(&b), D0, PAGE, PAGE).expect("buffer");
    let lease = StreamLease::acquire(Arc::clone(&b), key(1), IsolationLevel::StreamIsolated)
        .expect("stream");
    if !H::faults(&b).is_some_and(|f| f.fail_nth(Operation::Prefetch, 1)) {
        return skip("no fault injection");
    }
    let err = buf
        .prefetch(0, PAGE, Location::Host, lease.stream())
        .expect_err("injected");
    assert_failed_in(&err, Operation::Prefetch);
    buf.prefetch(0, PAGE, Location::Host, lease.stream())
        .expect("works again");
    drop((lease, buf));
    assert_no_leaks::<H>(&b);
}

/// An injected stream-creation failure creates nothing.
pub fn injected_stream_failure_rolls_back<H: Harness>() {
    let b = H::backend();
    for level in [
        IsolationLevel::StreamIsolated,
        IsolationLevel::ContextIsolated,
    ] {
        if !H::faults(&b).is_some_and(|f| f.fail_nth(Operation::AcquireStream, 1)) {
            return skip("no fault injection");
        }
        let err = StreamLease::acquire(Arc::clone(&b), key(1), level).expect_err("injected");
        assert!(!err.kind().is_denial());
        assert_no_leaks::<H>(&b);
        drop(StreamLease::acquire(Arc::clone(&b), key(1), level).expect("works again"));
        assert_no_leaks::<H>(&b);
    }
}

/// An injected free failure is reported to the caller (the memory stays accounted as live, as a
/// failing driver leaves it).
pub fn injected_free_failure_is_reported<H: Harness>() {
    let b = H::backend();
    let a = b.allocate(D0, PAGE).expect("allocate");
    if !H::faults(&b).is_some_and(|f| f.fail_nth(Operation::Free, 1)) {
        free(&*b, a);
        return skip("no fault injection");
    }
    // SAFETY: `a` came from `b` and is not used again.
    let err = unsafe { b.free(a) }.expect_err("injected");
    assert!(!err.kind().is_denial());
    if let Some(live) = H::counters(&b).map(|c| c.live_allocations()) {
        assert_eq!(live, 1, "a failed free must not pretend the memory is gone");
    }
}

/// One instance's life (charge, slot, grow, hints, stream, prefetch, sync), returning the first
/// error.
fn instance_life<H: Harness>(
    b: &Arc<H::Backend>,
    p: &Arc<SlotPool<Arc<H::Backend>>>,
    t: &Arc<TenantLedger>,
) -> Result<(), ErrorKind> {
    let mut charge = t.try_reserve(PAGE as u64).map_err(|e| e.kind())?;
    let mut memory = p.acquire(4 * PAGE, PAGE).map_err(|e| e.kind())?;
    charge.try_grow(PAGE as u64).map_err(|e| e.kind())?;
    memory.grow_to(2 * PAGE).map_err(|e| e.kind())?;
    memory
        .advise(
            0,
            2 * PAGE,
            Advice::SetPreferredLocation(Location::Device(D0)),
        )
        .map_err(|e| e.kind())?;
    let lease =
        StreamLease::acquire(Arc::clone(b), t.key(), t.isolation()).map_err(|e| e.kind())?;
    memory
        .prefetch(0, 2 * PAGE, Location::Host, lease.stream())
        .map_err(|e| e.kind())?;
    b.synchronize(lease.stream()).map_err(|e| e.kind())?;
    lease.release().map_err(|e| e.kind())?;
    let extra = UnifiedBuffer::new(Arc::clone(b), D0, PAGE, PAGE).map_err(|e| e.kind())?;
    drop((extra, memory, charge));
    Ok(())
}

/// A failure injected at every position of a realistic sequence: each run ends with an error the
/// caller can read (or success, if the injected call never came), and nothing live.
///
/// `Free` and `ReleaseStream` are left out: a driver that fails to free or destroy really keeps
/// the resource, which [`injected_free_failure_is_reported`] checks is reported, not hidden.
pub fn failures_at_every_step_leave_nothing<H: Harness>() {
    let ops = [
        Operation::Allocate,
        Operation::Zero,
        Operation::Advise,
        Operation::Prefetch,
        Operation::AcquireStream,
        Operation::Synchronize,
    ];
    let mut failed_runs = 0;
    for op in ops {
        for nth in 1..=3 {
            let b = H::backend();
            let p = pool::<H>(&b, &[SizeClass::new(4 * PAGE, 2)]);
            let t = Arc::new(TenantLedger::new(
                TenantId(1),
                16 * PAGE as u64,
                IsolationLevel::ContextIsolated,
            ));
            // Warm the slot so the sequence scrubs it.
            drop(p.acquire(4 * PAGE, PAGE).expect("warm"));
            if !H::faults(&b).is_some_and(|f| f.fail_nth(op, nth)) {
                return skip("no fault injection");
            }
            if let Err(kind) = instance_life::<H>(&b, &p, &t) {
                failed_runs += 1;
                assert!(!kind.is_denial(), "{op} #{nth}: a failure, not a denial");
            }
            if let Some(f) = H::faults(&b) {
                f.clear();
            }
            assert_eq!(
                t.stats().touched_bytes,
                0,
                "{op} #{nth}: tenant charge left"
            );
            assert_eq!(p.stats().in_use(), 0, "{op} #{nth}: slot leaked");
            drop(p);
            assert_no_leaks::<H>(&b);
            instance_life::<H>(&b, &pool::<H>(&b, &[SizeClass::new(4 * PAGE, 1)]), &t)
                .unwrap_or_else(|k| panic!("{op} #{nth}: backend unusable afterwards: {k}"));
            assert_no_leaks::<H>(&b);
        }
    }
    assert!(
        failed_runs >= ops.len(),
        "injection must actually fail runs"
    );
}

/// The bytes the pool cases count in: a 64 KiB page, or, where the driver reserves a pool's
/// memory in larger chunks (CUDA: megabytes), one such chunk, measured (what a fresh pool
/// reserves for a one-byte allocation, in whole pages). A tenant pays for what the driver
/// reserves for its pool, so a case whose cap is below one chunk would be refused throughout.
pub(crate) fn pool_unit<H: Harness>(b: &Arc<H::Backend>) -> usize {
    if !H::has_device_pools(b) {
        return PAGE;
    }
    let t = tenant(99, u64::MAX / 4);
    let pool = TenantDevicePool::new(
        Arc::clone(b),
        Arc::clone(&t),
        D0,
        &DevicePoolConfig::default(),
    )
    .expect("a pool to measure");
    let s = shared(&t);
    let one = pool.allocate(1, &s).expect("one byte");
    let reserved = pool.stats().expect("stats").reserved_bytes as usize;
    pool.free(one, &s).expect("free");
    b.synchronize(&s).expect("synchronize");
    drop(pool);
    reserved.max(PAGE).next_multiple_of(PAGE)
}

/// A tenant's device pool for the pool cases, or `None` (after checking the backend answers
/// `Unsupported`) when the backend has no pools.
fn device_pool<H: Harness>(
    b: &Arc<H::Backend>,
    tenant: &Arc<TenantLedger>,
    config: &DevicePoolConfig,
) -> Option<TenantDevicePool<Arc<H::Backend>>> {
    let made = TenantDevicePool::new(Arc::clone(b), Arc::clone(tenant), D0, config);
    if H::has_device_pools(b) {
        Some(made.expect("device pool"))
    } else {
        let err = made.expect_err("a backend without pools must refuse");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        None
    }
}

fn shared(tenant: &TenantLedger) -> Stream {
    Stream::new(
        tensor_wasm_mem_core::DriverStream::DEFAULT,
        tensor_wasm_mem_core::DriverContext::from_raw(0),
        IsolationLevel::Shared,
        tenant.key(),
    )
}

/// The tenant's cap is the pool's ceiling: allocate to it, one byte more is denied (the driver
/// is not asked), free, allocate again.
pub fn device_pool_cap_is_the_tenant_cap<H: Harness>() {
    let b = H::backend();
    let unit = pool_unit::<H>(&b);
    let t = tenant(1, 4 * unit as u64);
    let Some(pool) = device_pool::<H>(&b, &t, &DevicePoolConfig::default()) else {
        return skip("no device pools (Unsupported)");
    };
    let s = shared(&t);
    let a = pool.allocate(3 * unit, &s).expect("under the cap");
    let c = pool.allocate(unit, &s).expect("up to the cap");
    assert_eq!(t.stats().device_pool_bytes, 4 * unit as u64);
    let err = pool.allocate(1, &s).expect_err("one byte past the cap");
    assert!(matches!(err, Error::Denied(_)), "{err}");
    assert!(err.kind().is_denial());
    assert_eq!(
        pool.stats().expect("stats").live_bytes,
        4 * unit as u64,
        "nothing allocated"
    );
    pool.free(c, &s).expect("free");
    // Until the stream gets to the free, the pool holds the block (and the tenant pays for it):
    // a block the driver mapped anew meanwhile would take the pool past the cap.
    b.synchronize(&s).expect("synchronize");
    let d = pool.allocate(unit, &s).expect("usable after a denial");
    pool.free(a, &s).expect("free");
    pool.free(d, &s).expect("free");
    // Charged until the pool lets the blocks go, and the next call reads that it did.
    b.synchronize(&s).expect("synchronize");
    pool.trim(0).expect("trim");
    assert_eq!(t.stats().touched_bytes, 0);
    drop(pool);
    assert_no_leaks::<H>(&b);
}

/// Linear memory and pool memory share the one cap.
pub fn device_pool_shares_the_cap_with_linear_memory<H: Harness>() {
    let b = H::backend();
    let unit = pool_unit::<H>(&b);
    let t = tenant(1, 4 * unit as u64);
    let Some(pool) = device_pool::<H>(&b, &t, &DevicePoolConfig::default()) else {
        return skip("no device pools");
    };
    let memory = t
        .try_reserve(3 * unit as u64)
        .expect("linear memory charge");
    let s = shared(&t);
    let a = pool.allocate(unit, &s).expect("the rest of the cap");
    assert!(matches!(pool.allocate(1, &s), Err(Error::Denied(_))));
    drop(memory);
    let c = pool
        .allocate(3 * unit, &s)
        .expect("freed linear memory is pool headroom");
    pool.free(a, &s).expect("free");
    pool.free(c, &s).expect("free");
    drop(pool);
    assert_eq!(t.stats().touched_bytes, 0);
    assert_no_leaks::<H>(&b);
}

/// Two tenants' pools have two ceilings.
pub fn device_pool_tenants_do_not_share_a_ceiling<H: Harness>() {
    let b = H::backend();
    let unit = pool_unit::<H>(&b);
    let (alice, bob) = (tenant(1, 2 * unit as u64), tenant(2, 3 * unit as u64));
    let Some(pa) = device_pool::<H>(&b, &alice, &DevicePoolConfig::default()) else {
        return skip("no device pools");
    };
    let pb = device_pool::<H>(&b, &bob, &DevicePoolConfig::default()).expect("pools");
    let (sa, sb) = (shared(&alice), shared(&bob));
    let a = pa.allocate(2 * unit, &sa).expect("alice to her cap");
    assert!(matches!(pa.allocate(1, &sa), Err(Error::Denied(_))));
    let c = pb
        .allocate(3 * unit, &sb)
        .expect("bob is not affected by alice's cap");
    assert!(matches!(pb.allocate(1, &sb), Err(Error::Denied(_))));
    assert_eq!(alice.stats().touched_bytes, 2 * unit as u64);
    assert_eq!(bob.stats().touched_bytes, 3 * unit as u64);
    pa.free(a, &sa).expect("free");
    assert_eq!(bob.stats().touched_bytes, 3 * unit as u64);
    pb.free(c, &sb).expect("free");
    drop((pa, pb));
    assert_no_leaks::<H>(&b);
}

/// A failing driver allocation leaves no ledger charge, and the pool stays usable.
pub fn device_pool_failed_allocation_leaves_no_charge<H: Harness>() {
    let b = H::backend();
    let unit = pool_unit::<H>(&b);
    let t = tenant(1, 8 * unit as u64);
    let Some(pool) = device_pool::<H>(&b, &t, &DevicePoolConfig::default()) else {
        return skip("no device pools");
    };
    if !H::faults(&b).is_some_and(|f| f.fail_nth(Operation::PoolAllocate, 1)) {
        drop(pool);
        return skip("no fault injection");
    }
    let s = shared(&t);
    let err = pool.allocate(unit, &s).expect_err("injected");
    assert_failed_in(&err, Operation::PoolAllocate);
    assert!(!err.kind().is_denial());
    assert_eq!(t.stats().touched_bytes, 0, "no ledger charge left");
    let a = pool.allocate(unit, &s).expect("usable again");
    pool.free(a, &s).expect("free");
    drop(pool);
    assert_no_leaks::<H>(&b);
}

/// Dropping a pool with live allocations frees them and gives every byte back.
pub fn device_pool_drop_frees_everything<H: Harness>() {
    let b = H::backend();
    let unit = pool_unit::<H>(&b);
    let t = tenant(1, 16 * unit as u64);
    let Some(pool) = device_pool::<H>(&b, &t, &DevicePoolConfig::default()) else {
        return skip("no device pools");
    };
    let s = shared(&t);
    let held: Vec<PoolAllocation> = (1..=4)
        .map(|n| pool.allocate(n * unit, &s).expect("allocate"))
        .collect();
    assert_eq!(t.stats().device_pool_bytes, 10 * unit as u64);
    assert_eq!(pool.stats().expect("stats").live_allocations, 4);
    drop(pool);
    drop(held); // handles only: the memory went with the pool
    let s = t.stats();
    assert_eq!((s.touched_bytes, s.device_pool_bytes), (0, 0));
    assert_no_leaks::<H>(&b);
}

/// Memory a pool hands out is zero-filled, also when it reuses a block its tenant freed.
pub fn device_pool_memory_comes_zeroed<H: Harness>() {
    let b = H::backend();
    let unit = pool_unit::<H>(&b);
    let t = tenant(1, 16 * unit as u64);
    let config = DevicePoolConfig {
        max_bytes: 0,
        release_threshold: 16 * unit as u64,
    };
    let Some(pool) = device_pool::<H>(&b, &t, &config) else {
        return skip("no device pools");
    };
    if !H::inspect(&b).is_some_and(|i| i.pool_memory_host_readable()) {
        drop(pool);
        return skip("pool memory is not host-readable");
    }
    let s = shared(&t);
    let read = |a: &PoolAllocation| -> Vec<u8> {
        let mut out = vec![0u8; a.len()];
        // SAFETY: on this (simulated) backend pool memory is host memory of `a.len()` bytes at
        // the device pointer, and nothing else touches it meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(a.device_ptr() as *const u8, out.as_mut_ptr(), a.len());
        }
        out
    };
    // The zero fill is ordered on the stream: the host reads after waiting for it (a device with
    // work of its own, the worker harnesses, may not have run it yet).
    let a = pool.allocate(2 * unit, &s).expect("allocate");
    b.synchronize(&s).expect("wait for the fill");
    assert!(
        read(&a).iter().all(|&x| x == 0),
        "a fresh block comes zeroed"
    );
    // SAFETY: as in `read`.
    unsafe { (a.device_ptr() as *mut u8).write_bytes(0xff, a.len()) };
    pool.free(a, &s).expect("free");
    let again = pool.allocate(2 * unit, &s).expect("reuse");
    b.synchronize(&s).expect("wait for the fill");
    assert!(
        read(&again).iter().all(|&x| x == 0),
        "a reused block comes zeroed"
    );
    pool.free(again, &s).expect("free");
    drop(pool);
    assert_no_leaks::<H>(&b);
}

/// The driver-side maximum is a second line behind the ledger: past it the driver says out of
/// memory (a failure, not a denial) and the ledger is untouched.
pub fn device_pool_driver_maximum_is_a_second_line<H: Harness>() {
    let b = H::backend();
    // 64 MiB: a real driver rounds a pool's total up to its own granularity (32 MiB on an
    // H200 with CUDA 13: measured, a maximum of 128 KiB, 2 MiB or 32 MiB each let 32 MiB of
    // 64 KiB blocks through, 64 MiB exactly 64 MiB), so only a multiple of it is exact there.
    const MAX: usize = 64 << 20;
    let t = tenant(1, 2 * MAX as u64);
    let config = DevicePoolConfig {
        max_bytes: MAX as u64,
        release_threshold: 0,
    };
    let Some(pool) = device_pool::<H>(&b, &t, &config) else {
        return skip("no device pools");
    };
    let s = shared(&t);
    let a = pool.allocate(MAX, &s).expect("up to the pool maximum");
    let err = pool.allocate(PAGE, &s).expect_err("past the pool maximum");
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    assert_eq!(
        t.stats().touched_bytes,
        MAX as u64,
        "the failed request is not charged"
    );
    pool.free(a, &s).expect("free");
    drop(pool);
    assert_no_leaks::<H>(&b);
}

/// Trimming gives kept memory back to the driver.
pub fn device_pool_trim_gives_memory_back<H: Harness>() {
    let b = H::backend();
    let unit = pool_unit::<H>(&b);
    let t = tenant(1, 64 * unit as u64);
    let config = DevicePoolConfig {
        max_bytes: 0,
        release_threshold: 64 * unit as u64,
    };
    let Some(pool) = device_pool::<H>(&b, &t, &config) else {
        return skip("no device pools");
    };
    let s = shared(&t);
    let a = pool.allocate(4 * unit, &s).expect("allocate");
    pool.free(a, &s).expect("free");
    let kept = pool.stats().expect("stats");
    assert_eq!(kept.live_bytes, 0);
    assert!(
        kept.reserved_bytes >= 4 * unit as u64,
        "kept under the release threshold"
    );
    // A stream-ordered free is done when the stream gets to it: only then can a trim give the
    // block back (on an asynchronous driver, as on a GPU).
    b.synchronize(&s).expect("synchronize");
    pool.trim(0).expect("trim");
    assert_eq!(pool.stats().expect("stats").reserved_bytes, 0);
    drop(pool);
    assert_no_leaks::<H>(&b);
}

/// What the driver rounds a pool's allocations up to is charged: one-byte allocations from a
/// pool under a 64 KiB cap stop where the driver's blocks reach the cap (the simulated driver
/// maps a page for each; a GPU reserves chunks of megabytes, so there the first is refused),
/// and the tenant pays at every step for exactly what the driver reserves for the pool. (Before,
/// 1,024 of them held 4 MiB under this cap, charged 1 KiB.)
pub fn device_pool_rounding_is_charged<H: Harness>() {
    let b = H::backend();
    let cap = PAGE as u64;
    let t = tenant(1, cap);
    let Some(pool) = device_pool::<H>(&b, &t, &DevicePoolConfig::default()) else {
        return skip("no device pools");
    };
    let s = shared(&t);
    let mut held = Vec::new();
    let denied = loop {
        if held.len() == 1024 {
            break None;
        }
        match pool.allocate(1, &s) {
            Ok(a) => held.push(a),
            Err(e) => break Some(e),
        }
        let reserved = pool.stats().expect("stats").reserved_bytes;
        assert!(
            reserved <= cap,
            "{reserved} bytes held under a cap of {cap}"
        );
        assert_eq!(
            t.stats().device_pool_bytes,
            reserved,
            "charged what is held"
        );
    };
    let granule = if held.is_empty() {
        None
    } else {
        Some(pool.stats().expect("stats").reserved_bytes / held.len() as u64)
    };
    if granule.is_none_or(|g| g > 1) {
        let e = denied.expect("a driver that rounds reaches the cap");
        assert!(matches!(e, Error::Denied(_)), "{e}");
    }
    let after = pool.stats().expect("stats");
    assert_eq!(
        after.live_allocations,
        held.len() as u64,
        "the refused one was given back"
    );
    for a in held {
        pool.free(a, &s).expect("free");
    }
    b.synchronize(&s).expect("synchronize");
    pool.trim(0).expect("trim");
    assert_eq!(t.stats().touched_bytes, 0);
    drop(pool);
    assert_no_leaks::<H>(&b);
}

/// A tenant's device pool that keeps every block freed (a release threshold of `u64::MAX`).
fn keeping_pool<H: Harness>(
    b: &Arc<H::Backend>,
    tenant: &Arc<TenantLedger>,
) -> Option<TenantDevicePool<Arc<H::Backend>>> {
    let config = DevicePoolConfig {
        max_bytes: 0,
        release_threshold: u64::MAX,
    };
    device_pool::<H>(b, tenant, &config)
}

/// Blocks a pool keeps after their free (under its release threshold) are the tenant's, held
/// for it: they stay charged against its cap (a linear memory cannot take their bytes) until a
/// trim gives them back. (Before, a 1 GiB threshold kept 16 MB for a tenant, charged nothing.)
pub fn device_pool_kept_blocks_are_charged<H: Harness>() {
    let b = H::backend();
    let unit = pool_unit::<H>(&b);
    let cap = 64 * unit as u64;
    let t = tenant(1, cap);
    let Some(pool) = keeping_pool::<H>(&b, &t) else {
        return skip("no device pools");
    };
    let s = shared(&t);
    let a = pool.allocate(4 * unit, &s).expect("allocate");
    pool.free(a, &s).expect("free");
    // Charged by the free itself, before anything reads the figures again.
    let charged = t.stats().device_pool_bytes;
    assert!(
        charged >= 4 * unit as u64,
        "the freed block is still charged"
    );
    b.synchronize(&s).expect("the free is done");
    let kept = pool.stats().expect("stats").reserved_bytes;
    assert!(kept >= 4 * unit as u64, "kept under the release threshold");
    assert_eq!(t.stats().device_pool_bytes, kept, "kept, and charged");
    assert!(
        t.try_reserve(cap - kept + 1).is_err(),
        "the kept bytes count against the cap"
    );
    // Handed out again from what is kept: charged once.
    let again = pool.allocate(4 * unit, &s).expect("again");
    assert_eq!(
        t.stats().device_pool_bytes,
        pool.stats().expect("stats").reserved_bytes
    );
    pool.free(again, &s).expect("free");
    b.synchronize(&s).expect("synchronize");
    pool.trim(0).expect("trim");
    assert_eq!(pool.stats().expect("stats").reserved_bytes, 0);
    assert_eq!(t.stats().touched_bytes, 0, "given back with the blocks");
    let memory = t
        .try_reserve(cap)
        .expect("the whole cap for a linear memory");
    drop(memory);
    drop(pool);
    assert_no_leaks::<H>(&b);
}

/// A block the driver holds for a refused allocation is charged past the cap until it goes, and
/// the tenant is not stuck there: once the stream has run the free, the next allocation lets the
/// kept blocks go and is served. (A pool that keeps every freed block, a cap of one unit: on a
/// driver whose frees wait for their stream, the second allocation needs a second block while
/// the first's free is queued.)
pub fn device_pool_a_refusal_past_the_cap_does_not_stick<H: Harness>() {
    let b = H::backend();
    let unit = pool_unit::<H>(&b);
    let t = tenant(1, unit as u64);
    let Some(pool) = keeping_pool::<H>(&b, &t) else {
        return skip("no device pools");
    };
    let s = shared(&t);
    let a = pool.allocate(unit, &s).expect("the cap");
    pool.free(a, &s).expect("free");
    match pool.allocate(unit, &s) {
        // The freed block handed out again.
        Ok(again) => pool.free(again, &s).expect("free"),
        Err(e) => {
            assert!(matches!(e, Error::Denied(_)), "{e}");
            let held = t.stats().device_pool_bytes;
            assert!(
                held > unit as u64,
                "the refused block, queued to be freed, is charged past the cap: {held}"
            );
            assert!(t.try_reserve(1).is_err(), "nothing else meanwhile");
        }
    }
    b.synchronize(&s).expect("the frees are done");
    let c = pool.allocate(unit, &s).expect("not stuck past the cap");
    pool.free(c, &s).expect("free");
    b.synchronize(&s).expect("synchronize");
    let reserved = pool.stats().expect("stats").reserved_bytes;
    assert_eq!(
        t.stats().device_pool_bytes,
        reserved,
        "charged what is held"
    );
    assert!(reserved <= unit as u64);
    drop(pool);
    assert_eq!(t.stats().touched_bytes, 0);
    assert_no_leaks::<H>(&b);
}

/// Host memory the driver may register: 128 KiB aligned to 64 KiB (a whole number of pages of
/// any host page size up to 64 KiB), zeroed, freed on drop.
struct HostPages {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl HostPages {
    const LEN: usize = 128 << 10;

    fn new() -> Self {
        let layout = std::alloc::Layout::from_size_align(Self::LEN, 64 << 10).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        Self {
            ptr: std::ptr::NonNull::new(ptr).expect("host pages"),
            layout,
        }
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; every case detaches before dropping.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Host memory attached by registration follows the driver's rules on every backend: attached
/// exactly once, zeroed where it lies, prefetched as a no-op (pinned pages do not migrate),
/// refused advice and `free` (typed, the range still attached), detached and gone. A host
/// access the device lacks is refused as unsupported.
pub fn attached_host_memory_follows_the_drivers_rules<H: Harness>() {
    let b = H::backend();
    let device = DeviceId(0);
    if !b.can_attach_host(device, HostAccess::Registered) {
        skip("the device cannot register host memory");
        return;
    }
    let pages = HostPages::new();
    let attach = |len: usize| {
        // SAFETY: `pages` is host memory mapped readable and writable, 64 KiB aligned, owned
        // here, and detached below before it drops.
        unsafe { b.attach_host(device, HostAccess::Registered, pages.ptr, len) }
    };
    let e = attach(0).expect_err("an empty range");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let chunk = attach(HostPages::LEN).expect("attach");
    assert_eq!(chunk.as_ptr(), pages.ptr.as_ptr());
    assert_eq!(chunk.len(), HostPages::LEN);
    let again = attach(HostPages::LEN).expect_err("attached twice");
    assert!(!again.kind().is_denial(), "{again}");

    host_fill(&chunk, 0, 64, 0x77);
    // SAFETY: `chunk` is live and nothing else touches its bytes meanwhile.
    unsafe { b.zero(&chunk, 0, 32) }.expect("zero");
    assert_eq!(
        host_bytes(&chunk, 0, 33),
        [&[0u8; 32][..], &[0x77]].concat()
    );

    let e = b
        .advise(&chunk, 0, 4096, Advice::SetReadMostly)
        .expect_err("advice on pinned memory");
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    let stream = b
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .expect("stream");
    b.prefetch(&chunk, 0, 4096, Location::Device(device), &stream)
        .expect("a prefetch of pinned memory has nothing to do");
    b.prefetch(&chunk, 4096, HostPages::LEN, Location::Host, &stream)
        .expect_err("out of range, checked all the same");
    b.release_stream(stream).expect("release");
    b.reset_hints(&chunk, 0, HostPages::LEN)
        .expect("no hints to reset");

    // SAFETY: `chunk` came from this backend; `free` must refuse it (it is not the driver's).
    let refused = unsafe { b.free(chunk) };
    assert_eq!(
        refused.expect_err("free of attached host memory").kind(),
        ErrorKind::InvalidArgument
    );
    // The record survived the refusal: a handle for the same range detaches it.
    // SAFETY: the same range, attached above and still attached; no device work uses it.
    let handle = unsafe { Allocation::from_raw_parts(pages.ptr, HostPages::LEN, device) };
    // SAFETY: attached by this backend, no device work on it.
    unsafe { b.detach_host(handle) }.expect("detach");
    let chunk = attach(HostPages::LEN).expect("attachable again once detached");
    // SAFETY: as above.
    unsafe { b.detach_host(chunk) }.expect("detach");

    if !b.can_attach_host(device, HostAccess::Pageable) {
        // SAFETY: as for `attach`.
        let e = unsafe { b.attach_host(device, HostAccess::Pageable, pages.ptr, HostPages::LEN) }
            .expect_err("no pageable memory access");
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    }
    assert!(!b.can_attach_host(DeviceId(b.device_count()), HostAccess::Registered));
    assert_no_leaks::<H>(&b);
}

/// Host memory attached with pageable memory access takes advice and prefetch as managed memory
/// does (recorded by the driver where it can be inspected), and `reset_hints` puts it back as a
/// fresh range; where the device has no pageable access the case says it was skipped.
pub fn pageable_host_memory_takes_advice_and_prefetch<H: Harness>() {
    let b = H::backend();
    if !b.can_attach_host(D0, HostAccess::Pageable) {
        skip("the device has no pageable memory access");
        return;
    }
    let pages = HostPages::new();
    // SAFETY: `pages` is host memory mapped readable and writable, 64 KiB aligned, owned here,
    // and detached below before it drops.
    let chunk = unsafe { b.attach_host(D0, HostAccess::Pageable, pages.ptr, HostPages::LEN) }
        .expect("attach");
    b.advise(&chunk, 0, PAGE, Advice::SetReadMostly)
        .expect("advice on pageable host memory");
    let stream = b
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .expect("stream");
    let device = Location::Device(D0);
    b.prefetch(&chunk, 0, PAGE, device, &stream)
        .expect("prefetch of pageable host memory");
    b.synchronize(&stream).expect("synchronize");
    if let Some(h) = H::inspect(&b).and_then(|i| i.hints(&chunk, 0)) {
        assert!(h.read_mostly, "{h:?}");
        assert_eq!(h.resident, Some(device), "{h:?}");
    }
    b.reset_hints(&chunk, 0, HostPages::LEN).expect("reset");
    if let Some(h) = H::inspect(&b).and_then(|i| i.hints(&chunk, 0)) {
        assert!(h.is_pristine(), "{h:?}");
    }
    b.release_stream(stream).expect("release");
    // SAFETY: attached by this backend; the stream was waited for.
    unsafe { b.detach_host(chunk) }.expect("detach");
    assert_no_leaks::<H>(&b);
}

// ---- Asynchrony: work completes later than the call that queued it --------------------------

/// A kernel's writes reach the host only once its stream is synchronised (on a deferred driver
/// the host reads the old bytes until then); releasing a stream waits for its work too.
pub fn kernel_writes_land_when_the_stream_is_synchronised<H: Harness>() {
    let b = H::backend();
    let a = b.allocate(D0, 2 * PAGE).expect("allocate");
    // SAFETY: live, and nothing else uses it (fresh memory need not come zeroed).
    unsafe { b.zero(&a, 0, 2 * PAGE) }.expect("zero");
    let s = b
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .expect("stream");
    // SAFETY: nothing touches the bytes while the kernel can run (reads below come after a
    // synchronise, or only on a deferred driver, where nothing runs outside its own calls).
    if !unsafe {
        H::kernels(&b)
            .map(|k| k.fill(&s, a.device_ptr(), PAGE, 0xaa))
            .is_some()
    } {
        b.release_stream(s).expect("release");
        free(&*b, a);
        return skip("no simulated kernel");
    }
    if H::completion(&b) == Completion::Deferred {
        assert_eq!(
            host_bytes(&a, 0, 1),
            [0],
            "landed before the stream got to it"
        );
    }
    b.synchronize(&s).expect("synchronize");
    assert_eq!(host_bytes(&a, PAGE - 1, 2), [0xaa, 0], "exactly the range");
    // SAFETY: as above.
    assert!(unsafe {
        H::kernels(&b)
            .map(|k| k.fill(&s, a.device_ptr(), 1, 0xbb))
            .is_some()
    });
    b.release_stream(s)
        .expect("release waits for the stream's work");
    assert_eq!(host_bytes(&a, 0, 1), [0xbb]);
    assert_eq!(
        H::inspect(&b).map(|i| i.hazards()).map(|h| h[2]),
        H::inspect(&b).map(|i| i.hazards()).map(|_| 0),
        "no fault"
    );
    free(&*b, a);
    assert_no_leaks::<H>(&b);
}

/// A scrub after the tenant's stream is released is ordered after the tenant's pending work:
/// the zeros stay, and the driver saw no memset over pending work. (On a GPU the tenant's late
/// write over a "clean" slot is a cross-tenant leak.)
pub fn scrub_is_ordered_after_the_tenants_pending_work<H: Harness>() {
    let b = H::backend();
    let a = b.allocate(D0, PAGE).expect("allocate");
    let s = b
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .expect("stream");
    // SAFETY: nothing touches the bytes while the kernel can run.
    if !unsafe {
        H::kernels(&b)
            .map(|k| k.fill(&s, a.device_ptr(), 64, 0x11))
            .is_some()
    } {
        b.release_stream(s).expect("release");
        free(&*b, a);
        return skip("no simulated kernel");
    }
    let before = H::inspect(&b).map(|i| i.hazards());
    b.release_stream(s).expect("release"); // waits: the tenant's write lands first
    // SAFETY: live, and nothing else uses it.
    unsafe { b.zero(&a, 0, PAGE) }.expect("scrub");
    assert_eq!(
        host_bytes(&a, 0, 64),
        vec![0; 64],
        "the scrub is the last write"
    );
    assert_eq!(
        H::inspect(&b).map(|i| i.hazards()).map(|h| h[0]),
        before.map(|h| h[0]),
        "no memset over pending work"
    );
    free(&*b, a);
    assert_no_leaks::<H>(&b);
}

/// A free while a prefetch is still queued on a stream is seen by the driver (the prefetch finds
/// no memory when it runs); after a synchronise the same free is clean.
pub fn free_while_a_prefetch_is_queued_is_seen<H: Harness>() {
    let b = H::backend();
    let Some(start) = H::inspect(&b).map(|i| i.hazards()) else {
        return skip("no driver counters");
    };
    let s = b
        .acquire_stream(key(1), IsolationLevel::StreamIsolated)
        .expect("stream");
    let d0 = Location::Device(D0);
    let a = b.allocate(D0, PAGE).expect("allocate");
    b.prefetch(&a, 0, PAGE, d0, &s).expect("prefetch");
    b.synchronize(&s).expect("synchronize");
    free(&*b, a);
    assert_eq!(
        H::inspect(&b).map(|i| i.hazards()).map(|h| h[1]),
        Some(start[1]),
        "ordered: clean"
    );
    let c = b.allocate(D0, PAGE).expect("allocate");
    b.prefetch(&c, 0, PAGE, d0, &s).expect("prefetch");
    free(&*b, c); // the hazard under test: its prefetch may still be queued
    let seen = H::inspect(&b).map(|i| i.hazards()).map_or(0, |h| h[1]) - start[1];
    if H::completion(&b) == Completion::Deferred {
        assert_eq!(seen, 1, "a free over queued work is seen");
    } else if H::completion(&b) != Completion::OnItsOwn {
        assert_eq!(seen, 0, "work completes at the call here");
    }
    b.release_stream(s).expect("release"); // the orphaned prefetch runs harmlessly
    assert_eq!(
        H::inspect(&b).map(|i| i.hazards()).map(|h| h[2]),
        Some(start[2]),
        "no fault"
    );
    assert_no_leaks::<H>(&b);
}

/// A pool block freed on one stream is reused by an allocation on another only once the free is
/// ordered before that stream's work (an event); before, the other stream gets fresh memory.
pub fn pool_block_is_reused_on_another_stream_only_after_an_event<H: Harness>() {
    let b = H::backend();
    if !H::has_device_pools(&b) {
        return skip("no device pools");
    }
    let tenant = key(1);
    let sa = b
        .acquire_stream(tenant, IsolationLevel::StreamIsolated)
        .expect("stream a");
    let sb = b
        .acquire_stream(tenant, IsolationLevel::StreamIsolated)
        .expect("stream b");
    let config = DevicePoolConfig {
        max_bytes: 0,
        release_threshold: u64::MAX,
    };
    let pool = b.create_pool(tenant, D0, &config).expect("pool");
    let first = b.pool_allocate(&pool, PAGE, &sa).expect("first");
    let address = first.device_ptr();
    b.synchronize(&sa).expect("synchronize a");
    b.pool_free(&pool, first, &sa).expect("free on a");
    let second = b.pool_allocate(&pool, PAGE, &sb).expect("second");
    if H::completion(&b) == Completion::Deferred {
        assert_ne!(
            second.device_ptr(),
            address,
            "the free is not ordered before b's work: no reuse"
        );
    }
    let ordered = H::kernels(&b).map(|k| k.event_between(&sa, &sb)).is_some();
    b.synchronize(&sb)
        .expect("synchronize b (runs the wait, so a's free)");
    let third = b.pool_allocate(&pool, PAGE, &sb).expect("third");
    if ordered && H::completion(&b) == Completion::Deferred {
        assert_eq!(
            third.device_ptr(),
            address,
            "reused once ordered by the event"
        );
    }
    b.pool_free(&pool, second, &sb).expect("free");
    b.pool_free(&pool, third, &sb).expect("free");
    b.destroy_pool(pool).expect("destroy");
    b.release_stream(sa).expect("release");
    b.release_stream(sb).expect("release");
    assert_no_leaks::<H>(&b);
}
