//! Recovery from a sticky fault: a kernel that faults in a device's primary context fences the
//! device (typed refusals, nothing new starts there), and the backend's `recover_device` resets
//! that context once what lived there is given up, after which the device serves again and every
//! counter is back to what the survivors hold. A fault in a context-isolated tenant's own
//! context fences nothing.

use std::sync::Arc;

use tensor_wasm_mem_core::{
    Allocation, BackendError, DeviceId, DevicePoolConfig, DevicePools, ErrorKind, IsolationLevel,
    ManagedAllocator, Operation, PoolConfig, PoolHandle, Purpose, SizeClass, SlotPool, Stream,
    StreamProvider, TenantDevicePool, TenantId, TenantKey, TenantLedger, UnifiedBuffer,
};

use crate::Harness;
use crate::runner::skip;

const PAGE: usize = 1 << 16;
const D0: DeviceId = DeviceId(0);

/// Recovers device 0.
fn recover<B: ManagedAllocator + ?Sized>(
    backend: &B,
) -> Result<Option<tensor_wasm_mem_core::Recovery>, B::Error> {
    // SAFETY: in these cases nothing but the backend uses the device's primary context.
    unsafe { backend.recover_device(D0) }
}

fn key(id: u64) -> TenantKey {
    TenantKey::fresh(TenantId(id))
}

fn assert_lost<E: BackendError + std::fmt::Display>(error: &E, what: &str) {
    assert_eq!(error.kind(), ErrorKind::ContextLost, "{what}: {error}");
}

/// Gives `allocation` up on a fenced device: its free is refused (not sent to the driver), and
/// the caller keeps the handle, as the Wasmtime integration keeps a memory with its charge.
fn give_up<B: ManagedAllocator>(backend: &B, allocation: Allocation) -> Allocation {
    // SAFETY: the allocation came from `backend` and is not used afterwards (but freed again).
    match unsafe { backend.free(allocation) } {
        Ok(()) => panic!("a free on a fenced device goes through"),
        Err(refused) => {
            assert_lost(&refused.error, "a free on a fenced device");
            refused.resource
        }
    }
}

/// Faults `stream`'s work and sees it at the next wait; `false` where the harness cannot launch a
/// kernel.
fn fault<H: Harness>(backend: &H::Backend, stream: &Stream) -> bool {
    if H::kernels(backend).map(|k| k.fault(stream)).is_none() {
        return false;
    }
    let waited = backend
        .synchronize(stream)
        .expect_err("the stray kernel faulted");
    assert_lost(&waited, "the wait after a fault");
    true
}

/// The device serves again after a recovery: an allocation, a stream, a kernel's write seen by
/// the host.
fn serves<H: Harness>(backend: &H::Backend, device: DeviceId) {
    let buffer = backend.allocate(device, PAGE).expect("allocate after");
    let stream = backend
        .acquire_stream_on(key(9), IsolationLevel::StreamIsolated, device)
        .expect("a stream after");
    // SAFETY: nothing else touches the buffer until the stream is waited for.
    if unsafe {
        H::kernels(backend)
            .map(|k| k.fill(&stream, buffer.device_ptr(), 64, 0x5a))
            .is_some()
    } {
        backend.synchronize(&stream).expect("the kernel runs");
        if backend.capabilities().host_accessible {
            // SAFETY: the kernel is done (waited for); the buffer is live.
            let byte = unsafe { buffer.as_ptr().read() };
            assert_eq!(byte, 0x5a, "the kernel wrote");
        }
    }
    backend.release_stream(stream).expect("release after");
    // SAFETY: ours, not used afterwards.
    unsafe { backend.free(buffer) }.expect("free after");
}

fn fault_then_recover<H: Harness>(level: IsolationLevel) {
    let b = H::backend();
    let buffer = b.allocate(D0, PAGE).expect("allocate");
    let stream = b.acquire_stream_on(key(1), level, D0).expect("stream");
    if !fault::<H>(&b, &stream) {
        b.release_stream(stream).expect("release");
        // SAFETY: ours, not used afterwards.
        unsafe { b.free(buffer) }.expect("free");
        return skip("no simulated kernel");
    }
    assert!(b.device_fenced(D0), "a fault in the primary context fences");
    // Nothing new starts on a fenced device, each refusal typed.
    assert_lost(&b.allocate(D0, PAGE).expect_err("fenced"), "allocate");
    let other = b.acquire_stream_on(key(2), IsolationLevel::StreamIsolated, D0);
    assert_lost(&other.expect_err("fenced"), "a new stream");
    // What lives in the context is in use: the recovery waits for it.
    let busy = recover(&*b).expect_err("still in use");
    assert_lost(&busy, "a recovery while in use");
    // The tenant lets go (its stream's wait fails: the work is lost; its free is refused).
    let _ = b.release_stream(stream);
    let buffer = give_up(&b, buffer);
    let recovery = recover(&*b).expect("recover").expect("it was fenced");
    assert_eq!((recovery.device, recovery.allocations), (D0, 1));
    assert_eq!(recovery.bytes, PAGE as u64);
    assert!(!b.device_fenced(D0), "the fence is lifted");
    // SAFETY: the handle of an allocation the reset destroyed; freeing it is all that is left.
    unsafe { b.free(buffer) }.expect("a lost allocation's free succeeds");
    crate::suite::assert_no_leaks::<H>(&b);
    serves::<H>(&b, D0);
    crate::suite::assert_no_leaks::<H>(&b);
    assert_eq!(recover(&*b).expect("healthy"), None, "nothing to do");
}

/// An allocation its owner gave up for good ([`ManagedAllocator::forget`]: a buffer dropped
/// while the fence refused its free, or a handle forgotten after the reset) leaves no lost
/// record: nothing waits for a free that never comes, and the backend's counters go back to
/// what the survivors hold. An allocation its owner keeps waits, as a lost record, for its free.
pub fn recover_leaves_no_record_of_a_forgotten_allocation<H: Harness>() {
    let b = H::backend();
    let dropped = UnifiedBuffer::new(Arc::clone(&b), D0, PAGE, PAGE).expect("buffer");
    let kept = b.allocate(D0, PAGE).expect("allocate");
    let stream = b
        .acquire_stream_on(key(1), IsolationLevel::StreamIsolated, D0)
        .expect("stream");
    if !fault::<H>(&b, &stream) {
        b.release_stream(stream).expect("release");
        // SAFETY: ours, not used afterwards.
        unsafe { b.free(kept) }.expect("free");
        return skip("no simulated kernel");
    }
    let _ = b.release_stream(stream);
    // Its free is refused on the fenced device, and no owner is left: forgotten.
    drop(dropped);
    let kept = give_up(&b, kept);
    let recovery = recover(&*b).expect("recover").expect("it was fenced");
    assert_eq!(recovery.allocations, 2, "the reset destroyed both");
    let Some(counters) = H::counters(&b) else {
        // SAFETY: the handle of an allocation the reset destroyed.
        unsafe { b.free(kept) }.expect("free");
        return skip("no counters");
    };
    assert_eq!(counters.lost_allocations(), 1, "only the kept one waits");
    b.forget(kept);
    assert_eq!(counters.lost_allocations(), 0, "forgotten: nothing waits");
    drop(counters);
    crate::suite::assert_no_leaks::<H>(&b);
}

/// The tenant of the device-pool cases: 64 pages, stream-isolated.
/// A pool tenant, its device pool on device 0, and a second handle to the same pool (the
/// embedder's, for another thread's call); `None`, the case skipped, where the backend has no
/// device pools.
fn pool_with_two_handles<H: Harness>(
    b: &H::Backend,
) -> Option<(Arc<TenantLedger>, PoolHandle, PoolHandle)> {
    if !H::has_device_pools(b) {
        skip("no device pools");
        return None;
    }
    let t = pool_tenant();
    let pool = b
        .create_pool(t.key(), D0, &DevicePoolConfig::default())
        .expect("pool");
    let same = PoolHandle::new(pool.driver_pool(), pool.device(), pool.tenant_key());
    Some((t, pool, same))
}

fn pool_tenant() -> Arc<TenantLedger> {
    Arc::new(TenantLedger::new(
        TenantId(1),
        64 * PAGE as u64,
        IsolationLevel::StreamIsolated,
    ))
}

/// A device pool dropped on a fenced device: its blocks' frees and its destroy are not sent to
/// the lost context, so the pool is retired with what its tenant pays for the blocks
/// ([`destroy_pool_charged`](tensor_wasm_mem_core::DevicePools::destroy_pool_charged)); the recovery's reset destroys the pool, and only
/// then do those charges go back, to the byte. Nothing is stranded.
pub fn recover_gives_a_dropped_device_pools_charge_back<H: Harness>() {
    let b = H::backend();
    if !H::has_device_pools(&b) {
        return skip("no device pools");
    }
    let unit = crate::suite::pool_unit::<H>(&b);
    let t = Arc::new(TenantLedger::new(
        TenantId(1),
        64 * unit as u64,
        IsolationLevel::StreamIsolated,
    ));
    let pool = TenantDevicePool::new(
        Arc::clone(&b),
        Arc::clone(&t),
        D0,
        &DevicePoolConfig::default(),
    )
    .expect("pool");
    let stream = b
        .acquire_stream_on(t.key(), IsolationLevel::StreamIsolated, D0)
        .expect("stream");
    let _block = pool.allocate(4 * unit, &stream).expect("block");
    if !fault::<H>(&b, &stream) {
        drop(pool);
        b.release_stream(stream).expect("release");
        return skip("no simulated kernel");
    }
    drop(pool);
    let held = t.stats();
    assert_eq!(
        held.device_pool_bytes,
        4 * unit as u64,
        "charged while the lost context holds the block"
    );
    let _ = b.release_stream(stream);
    let recovery = recover(&*b).expect("recover").expect("it was fenced");
    assert_eq!(recovery.pools, 1, "the reset destroyed the retired pool");
    let s = t.stats();
    assert_eq!(
        (s.device_pool_bytes, s.touched_bytes, s.stranded_bytes),
        (0, 0, 0),
        "the block's charge went back with the pool"
    );
    crate::suite::assert_no_leaks::<H>(&b);
    serves::<H>(&b, D0);
}

/// A kernel faults in a shared tenant's work (the legacy default stream of the primary context).
pub fn recover_after_a_fault_in_shared_work<H: Harness>() {
    fault_then_recover::<H>(IsolationLevel::Shared);
}

/// A kernel faults in a stream-isolated tenant's work (its own stream, in the primary context).
pub fn recover_after_a_fault_in_stream_isolated_work<H: Harness>() {
    fault_then_recover::<H>(IsolationLevel::StreamIsolated);
}

/// A kernel faults in a context-isolated tenant's own context: the device is not fenced, a
/// neighbour's work and new allocations go on, and the tenant's context goes with its last
/// stream, after which the tenant gets a fresh one.
pub fn recover_a_context_isolated_fault_is_the_tenants_alone<H: Harness>() {
    let b = H::backend();
    let (alice, bob) = (key(1), key(2));
    let mine = b
        .acquire_stream_on(alice, IsolationLevel::ContextIsolated, D0)
        .expect("stream");
    let theirs = b
        .acquire_stream_on(bob, IsolationLevel::StreamIsolated, D0)
        .expect("stream");
    if !fault::<H>(&b, &mine) {
        b.release_stream(mine).expect("release");
        b.release_stream(theirs).expect("release");
        return skip("no simulated kernel");
    }
    assert!(!b.device_fenced(D0), "its own context only");
    b.synchronize(&theirs).expect("the neighbour goes on");
    let buffer = b.allocate(D0, PAGE).expect("the device goes on");
    // SAFETY: ours, not used afterwards.
    unsafe { b.free(buffer) }.expect("free");
    let _ = b.release_stream(mine);
    let again = b
        .acquire_stream_on(alice, IsolationLevel::ContextIsolated, D0)
        .expect("a fresh context");
    b.synchronize(&again).expect("the fresh context works");
    b.release_stream(again).expect("release");
    b.release_stream(theirs).expect("release");
    assert_eq!(recover(&*b).expect("healthy"), None);
    crate::suite::assert_no_leaks::<H>(&b);
}

/// A second fault while the device is fenced counts once; a reset the driver refuses leaves the
/// device fenced until a later try; a fault after a recovery fences the device again, and it
/// recovers again.
pub fn recover_through_a_second_fault_and_a_refused_reset<H: Harness>() {
    let b = H::backend();
    let first = b
        .acquire_stream_on(key(1), IsolationLevel::StreamIsolated, D0)
        .expect("stream");
    let second = b
        .acquire_stream_on(key(2), IsolationLevel::StreamIsolated, D0)
        .expect("stream");
    if !fault::<H>(&b, &first) {
        b.release_stream(first).expect("release");
        b.release_stream(second).expect("release");
        return skip("no simulated kernel");
    }
    let _ = H::kernels(&b).map(|k| k.fault(&second)).is_some();
    assert_lost(&b.synchronize(&second).expect_err("lost too"), "the second");
    assert_eq!(b.device_health(D0).faults, 1, "one fault per fence");
    let _ = b.release_stream(first);
    let _ = b.release_stream(second);
    if H::faults(&b).is_some_and(|f| f.fail_nth(Operation::RecoverDevice, 1)) {
        let refused = recover(&*b).expect_err("the reset is refused");
        assert_ne!(refused.kind(), ErrorKind::ContextLost, "{refused}");
        assert!(b.device_fenced(D0), "still fenced after a refused reset");
    }
    assert!(recover(&*b).expect("recover").is_some());
    crate::suite::assert_no_leaks::<H>(&b);
    let third = b
        .acquire_stream_on(key(3), IsolationLevel::Shared, D0)
        .expect("stream after");
    assert!(fault::<H>(&b, &third), "launched before");
    assert!(b.device_fenced(D0), "fenced again");
    let _ = b.release_stream(third);
    assert!(recover(&*b).expect("again").is_some());
    assert_eq!(b.device_health(D0).faults, 2);
    serves::<H>(&b, D0);
    crate::suite::assert_no_leaks::<H>(&b);
}

/// Two devices, one faulting: the other never notices (its allocations, streams and kernels go
/// on through the fence and the recovery).
pub fn recover_one_device_of_two<H: Harness>() {
    let b = H::backend();
    if b.device_count() < 2 {
        return skip("one device");
    }
    let d1 = DeviceId(1);
    let kept = b.allocate(d1, PAGE).expect("allocate on the other");
    let steady = b
        .acquire_stream_on(key(1), IsolationLevel::StreamIsolated, d1)
        .expect("stream on the other");
    let faulty = b
        .acquire_stream_on(key(2), IsolationLevel::Shared, D0)
        .expect("stream");
    if !fault::<H>(&b, &faulty) {
        b.release_stream(faulty).expect("release");
        b.release_stream(steady).expect("release");
        // SAFETY: ours, not used afterwards.
        unsafe { b.free(kept) }.expect("free");
        return skip("no simulated kernel");
    }
    assert!(b.device_fenced(D0) && !b.device_fenced(d1));
    b.synchronize(&steady).expect("the other device goes on");
    serves::<H>(&b, d1);
    let _ = b.release_stream(faulty);
    assert!(recover(&*b).expect("recover").is_some());
    b.synchronize(&steady).expect("still");
    b.release_stream(steady).expect("release");
    // SAFETY: ours, not used afterwards.
    unsafe { b.free(kept) }.expect("the other device's memory was never touched");
    serves::<H>(&b, D0);
    crate::suite::assert_no_leaks::<H>(&b);
}

/// A driver call in flight on the device holds the recovery off: an allocation the driver made
/// before the fault, whose record is not in the table yet, is never reset under the caller (the
/// reset would destroy memory about to be handed out as live). Once the call returns, its memory
/// is given up like any other and the device recovers.
pub fn recover_waits_for_a_call_in_flight<H: Harness>() {
    let b = H::backend();
    let stream = b
        .acquire_stream_on(key(1), IsolationLevel::Shared, D0)
        .expect("stream");
    let Some(held) = H::faults(&b).and_then(|f| f.hold_next(Operation::Allocate)) else {
        b.release_stream(stream).expect("release");
        return skip("no holds");
    };
    std::thread::scope(|s| {
        let allocating = s.spawn(|| b.allocate(D0, PAGE));
        held.wait_held();
        if !fault::<H>(&b, &stream) {
            held.release();
            let buffer = allocating.join().expect("join").expect("allocate");
            b.release_stream(stream).expect("release");
            // SAFETY: ours, not used afterwards.
            unsafe { b.free(buffer) }.expect("free");
            return skip("no simulated kernel");
        }
        let busy = recover(&*b).expect_err("a call in flight");
        assert_lost(&busy, "a recovery under a call");
        assert!(busy.to_string().contains("1 calls in flight"), "{busy}");
        held.release();
        let buffer = allocating
            .join()
            .expect("join")
            .expect("made before the fault");
        let _ = b.release_stream(stream);
        let buffer = give_up(&b, buffer);
        let recovery = recover(&*b).expect("recover").expect("fenced");
        assert_eq!(
            recovery.allocations, 1,
            "the allocation in flight, given up"
        );
        // SAFETY: the handle of an allocation the reset destroyed; freeing it is all that is
        // left.
        unsafe { b.free(buffer) }.expect("a lost allocation's free succeeds");
        crate::suite::assert_no_leaks::<H>(&b);
        serves::<H>(&b, D0);
    });
}

/// A slot pool used by threads through faults and recoveries: each round a kernel faults the
/// device while two threads acquire, write and release slots; the pool refuses slots on the
/// fenced device (typed), lets its slab go once no slot is held, and after each recovery carves
/// its slots from a new slab, zeroed. No slot ever reads another holder's bytes, no acquisition
/// on a fenced device succeeds, and nothing is left held at the end.
pub fn recover_a_slot_pool_under_threads<H: Harness>() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let b = H::backend();
    let pool = Arc::new(
        SlotPool::new(
            Arc::clone(&b),
            PoolConfig::new(D0, [SizeClass::new(PAGE, 4)]),
        )
        .expect("pool"),
    );
    let host = b.capabilities().host_accessible;
    let rounds = H::rounds(20);
    let (stop, served) = (AtomicBool::new(false), AtomicU64::new(0));
    let mut recovered = 0;
    std::thread::scope(|s| {
        for id in 0..2u8 {
            let (pool, stop, served) = (&pool, &stop, &served);
            s.spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    match pool.acquire(PAGE, PAGE) {
                        Ok(mut slot) => {
                            if host {
                                let mut byte = [9u8];
                                slot.read(PAGE - 1, &mut byte).expect("read");
                                assert_eq!(byte, [0], "a slot handed out is zero");
                                slot.write(PAGE - 1, &[id + 1]).expect("write");
                            }
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => assert!(
                            matches!(e.kind(), ErrorKind::ContextLost | ErrorKind::PoolExhausted),
                            "{e}"
                        ),
                    }
                    std::thread::yield_now();
                }
            });
        }
        for _ in 0..rounds {
            // The threads are served on the healthy device before each fault.
            // (A minute is a bound for a broken case, never a timing it relies on.)
            let (before, since) = (served.load(Ordering::Acquire), std::time::Instant::now());
            while served.load(Ordering::Acquire) < before + 2 {
                if since.elapsed() > std::time::Duration::from_secs(60) {
                    stop.store(true, Ordering::Release);
                    panic!("the threads are not served after a recovery");
                }
                std::thread::yield_now();
            }
            let stream = b
                .acquire_stream_on(key(1), IsolationLevel::StreamIsolated, D0)
                .expect("stream");
            if !fault::<H>(&b, &stream) {
                b.release_stream(stream).expect("release");
                break;
            }
            let _ = b.release_stream(stream);
            // The threads' slots come back (nothing new is handed out on the fenced device);
            // the pool lets its slab go with the last of them.
            loop {
                pool.give_up_if_fenced();
                match recover(&*b) {
                    Ok(Some(_)) => break,
                    Ok(None) => panic!("the device was fenced"),
                    Err(e) => assert_lost(&e, "a recovery while slots are held"),
                }
                std::thread::yield_now();
            }
            recovered += 1;
        }
        stop.store(true, Ordering::Release);
    });
    if recovered == 0 {
        return skip("no simulated kernel");
    }
    assert_eq!(b.device_health(D0).recoveries, recovered);
    assert!(served.load(Ordering::Relaxed) > 0, "slots were served");
    assert_eq!(pool.stats().in_use(), 0, "nothing held");
    drop(pool);
    crate::suite::assert_no_leaks::<H>(&b);
}

/// An idle slot pool never keeps its device fenced: a pool made with `SlotPool::shared` (as the
/// Wasmtime integration's creators make theirs) is asked by the recovery itself to give its
/// slab up, so whoever recovers the device (another creator, say) need not wait for the pool's
/// own next call; a pool made with `new` keeps the device fenced until it gives its slab up
/// itself. Either pool then serves zeroed slots from a new slab.
pub fn recover_lets_an_idle_shared_slot_pool_go<H: Harness>() {
    let b = H::backend();
    let config = || PoolConfig::new(D0, [SizeClass::new(PAGE, 2)]);
    let shared = SlotPool::shared(Arc::clone(&b), config()).expect("a shared pool");
    let own = Arc::new(SlotPool::new(Arc::clone(&b), config()).expect("a pool of its own"));
    let host = b.capabilities().host_accessible;
    for pool in [&shared, &own] {
        let mut slot = pool.acquire(PAGE, PAGE).expect("a slot");
        if host {
            slot.write(0, &[7]).expect("write");
        }
    }
    let stream = b
        .acquire_stream_on(key(1), IsolationLevel::StreamIsolated, D0)
        .expect("stream");
    if !fault::<H>(&b, &stream) {
        b.release_stream(stream).expect("release");
        return skip("no simulated kernel");
    }
    let _ = b.release_stream(stream);
    // The recovery lets the shared pool's slab go; the other pool's slab keeps the device.
    let busy = recover(&*b).expect_err("the pool of its own holds its slab");
    assert_lost(
        &busy,
        "a recovery while an unregistered pool keeps its slab",
    );
    assert!(
        shared.with_slab(|_| ()).is_none() && shared.stats().slab_given_up,
        "the shared pool gave its slab up to the recovery"
    );
    assert!(
        own.with_slab(|_| ()).is_some(),
        "no one asked the other pool"
    );
    assert!(own.give_up_if_fenced(), "its own call gives it up");
    recover(&*b).expect("recover").expect("it was fenced");
    for pool in [&shared, &own] {
        let slot = pool.acquire(PAGE, PAGE).expect("a slot from a new slab");
        assert!(!pool.stats().slab_given_up, "a new slab");
        if host {
            let mut byte = [9u8];
            slot.read(0, &mut byte).expect("read");
            assert_eq!(byte, [0], "a new slab's slot is zero");
        }
    }
    drop((shared, own));
    crate::suite::assert_no_leaks::<H>(&b);
}

/// A pool's teardown by its last user (a destroy came while a call used the pool) is counted
/// in the device's gate until its last driver call returns: a recovery meanwhile is refused,
/// though the pool's record already left the tables, so no reset destroys the pool under the
/// teardown's call; the tenant's charge goes back with the pool, to the byte.
pub fn recover_does_not_overlap_a_last_users_pool_teardown<H: Harness>() {
    let b = H::backend();
    let Some((t, pool, same)) = pool_with_two_handles::<H>(&b) else {
        return;
    };
    let charge = t
        .try_reserve_for(PAGE as u64, Purpose::DevicePool)
        .expect("charge");
    let faults = H::faults(&b);
    let Some(trim) = faults
        .as_ref()
        .and_then(|f| f.hold_next(Operation::TrimPool))
    else {
        b.destroy_pool(pool).expect("destroy");
        return skip("no holds");
    };
    let faulting = b
        .acquire_stream_on(key(2), IsolationLevel::StreamIsolated, D0)
        .expect("a neighbour's stream");
    let faulted = std::thread::scope(|s| {
        // The trim is held in the driver: the destroy retires the pool, and the trim's call
        // tears it down when it returns; that teardown's destroy is held in turn.
        let trimming = s.spawn(|| b.trim_pool(&same, 0));
        trim.wait_held();
        b.destroy_pool_charged(pool, vec![charge])
            .expect("retired, torn down by its last user");
        let destroy = faults
            .as_ref()
            .and_then(|f| f.hold_next(Operation::DestroyPool))
            .expect("a hold on the destroy");
        trim.release();
        destroy.wait_held();
        let faulted = fault::<H>(&b, &faulting);
        let _ = b.release_stream(faulting);
        if faulted {
            let busy = recover(&*b).expect_err("the teardown's call is in flight");
            assert_lost(&busy, "a recovery under a last user's teardown");
        }
        destroy.release();
        trimming.join().expect("join").expect("the trim");
        faulted
    });
    if !faulted {
        return skip("no simulated kernel");
    }
    assert_eq!(
        t.stats().device_pool_bytes,
        0,
        "the pool was destroyed before the fault: its charge went with it"
    );
    recover(&*b).expect("recover").expect("it was fenced");
    crate::suite::assert_no_leaks::<H>(&b);
    serves::<H>(&b, D0);
}

/// Device work a caller queues itself (a kernel launch through its own driver calls, between
/// `begin_device_work` and `end_device_work`) is never overlapped by a reset: a recovery waits
/// for it (typed, with the call counted), and new work does not start on the fenced device.
pub fn recover_waits_for_device_work<H: Harness>() {
    let b = H::backend();
    b.begin_device_work(D0)
        .expect("device work on a healthy device");
    let stream = b
        .acquire_stream_on(key(1), IsolationLevel::StreamIsolated, D0)
        .expect("stream");
    if !fault::<H>(&b, &stream) {
        b.end_device_work(D0);
        b.release_stream(stream).expect("release");
        return skip("no simulated kernel");
    }
    let _ = b.release_stream(stream);
    let refused = b
        .begin_device_work(D0)
        .expect_err("no new work on a fenced device");
    assert_lost(&refused, "device work on a fenced device");
    let busy = recover(&*b).expect_err("device work in flight");
    assert_lost(&busy, "a recovery under device work");
    assert!(busy.to_string().contains("1 calls in flight"), "{busy}");
    b.end_device_work(D0);
    recover(&*b).expect("recover").expect("it was fenced");
    b.begin_device_work(D0)
        .expect("device work after the recovery");
    b.end_device_work(D0);
    crate::suite::assert_no_leaks::<H>(&b);
}

/// A pool torn down by its last user (a destroy while another thread's call used it) is torn
/// down inside its device's gate: a fault and a recovery meanwhile wait for it, and the charges
/// handed over with the destroy go back only when the reset destroys the pool.
pub fn recover_does_not_overlap_a_pool_teardown<H: Harness>() {
    let b = H::backend();
    let Some((t, pool, same)) = pool_with_two_handles::<H>(&b) else {
        return;
    };
    let stream = b
        .acquire_stream_on(t.key(), IsolationLevel::StreamIsolated, D0)
        .expect("stream");
    let first = b.pool_allocate(&pool, PAGE, &stream).expect("first");
    let _second = b.pool_allocate(&pool, 2 * PAGE, &stream).expect("second");
    let charge = t
        .try_reserve_for(2 * PAGE as u64, Purpose::DevicePool)
        .expect("charge");
    let Some(held) = H::faults(&b).and_then(|f| f.hold_next(Operation::PoolFree)) else {
        b.destroy_pool(pool).expect("destroy");
        b.release_stream(stream).expect("release");
        return skip("no holds");
    };
    let faulting = b
        .acquire_stream_on(key(2), IsolationLevel::StreamIsolated, D0)
        .expect("a neighbour's stream");
    let faulted = std::thread::scope(|s| {
        // One thread's free is held in the driver, the pool in use: the destroy retires the
        // pool (with the charge), and that thread's call tears it down when it returns.
        let freeing = s.spawn(|| b.pool_free(&same, first, &stream));
        held.wait_held();
        b.destroy_pool_charged(pool, vec![charge])
            .expect("retired, torn down by its last user");
        let faulted = fault::<H>(&b, &faulting);
        if faulted {
            let _ = b.release_stream(faulting);
            let busy = recover(&*b).expect_err("the teardown's call is in flight");
            assert_lost(&busy, "a recovery under a pool teardown");
        } else {
            b.release_stream(faulting).expect("release");
        }
        held.release();
        let _ = freeing.join().expect("join");
        faulted
    });
    if !faulted {
        b.release_stream(stream).expect("release");
        return skip("no simulated kernel");
    }
    let _ = b.release_stream(stream);
    assert_eq!(
        t.stats().device_pool_bytes,
        2 * PAGE as u64,
        "charged while the lost context holds the blocks"
    );
    recover(&*b).expect("recover").expect("it was fenced");
    let s = t.stats();
    assert_eq!(
        (s.device_pool_bytes, s.stranded_bytes),
        (0, 0),
        "the charge went back with the pool"
    );
    crate::suite::assert_no_leaks::<H>(&b);
}
