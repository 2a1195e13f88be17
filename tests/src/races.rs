//! Conformance cases for the driver layer under threads and failures: tenant contexts raced by
//! many threads, device-pool records raced by frees and allocations, releases the driver
//! refuses, the caller's context stack, and tenants that share an id.
//!
//! Each was a bug found by embedders calling from many threads (see docs/RELIABILITY.md); each
//! case fails on the code before the fix.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

use tensor_wasm_mem_core::{
    Advisor, Allocation, BackendError, DeviceId, DevicePoolConfig, DevicePools, Error, ErrorKind,
    IsolationLevel, ManagedAllocator, Operation, Stream, StreamProvider, TenantDevicePool,
    TenantId, TenantKey, TenantLedger,
};

use crate::Harness;
use crate::harness::Release;
use crate::runner::skip;

const D0: DeviceId = DeviceId(0);
const BLOCK: usize = 1 << 16;

/// Drops the last handle of the backend and checks that the driver below holds nothing of it.
fn drop_and_check_driver<H: Harness>(b: Arc<H::Backend>) {
    let b = Arc::into_inner(b).expect("the case holds the last handle");
    drop(b);
    if let Some(holds) = H::driver_holds() {
        assert_eq!(
            holds, [0; 4],
            "the driver still holds [allocations, streams, contexts, pools] after the drop"
        );
    }
}

/// Rounds of two threads taking one tenant's first context-isolated stream at the same moment:
/// the tenant gets exactly one context, and it is destroyed with the last stream. (Before the
/// fix both threads created a context and one overwrote the other: up to 21 rounds in 1,500 on
/// the simulated driver ended with two contexts, the overwritten one never destroyed.)
pub fn context_first_stream_race_gives_one_context<H: Harness>() {
    let rounds = H::rounds(1500);
    let b = H::backend();
    let tenants: Vec<TenantKey> = (0..rounds)
        .map(|i| TenantKey::fresh(TenantId(i as u64)))
        .collect();
    let start = Barrier::new(2);
    let contexts: Vec<Vec<u64>> = thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let mut seen = Vec::with_capacity(rounds);
                    let mut streams = Vec::with_capacity(rounds);
                    for &tenant in &tenants {
                        start.wait();
                        let stream = b
                            .acquire_stream(tenant, IsolationLevel::ContextIsolated)
                            .expect("stream");
                        seen.push(stream.context());
                        streams.push(stream);
                    }
                    // Every round's streams are kept until both threads are done, so no round's
                    // context can be destroyed and its handle value reused meanwhile.
                    start.wait();
                    for stream in streams {
                        b.release_stream(stream).expect("release");
                    }
                    seen
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .collect()
    });
    let split = (0..rounds)
        .filter(|&i| contexts[0][i] != contexts[1][i])
        .count();
    assert_eq!(split, 0, "rounds in which one tenant got two contexts");
    if let Some(live) = H::counters(&b).map(|c| c.live_contexts()) {
        assert_eq!(live, 0, "every context destroyed with its last stream");
    }
    drop_and_check_driver::<H>(b);
}

/// Two threads acquire, use and release one tenant's context-isolated streams as fast as they
/// can: every stream handed out is usable (never inside a destroyed context), nothing panics,
/// and no context or stream is left. (Before the fix: 147-3,511 streams inside destroyed
/// contexts, a subtraction overflow on the stream count, 48-3,002 leaked contexts.)
pub fn context_storm_keeps_every_stream_usable<H: Harness>() {
    let cycles = H::rounds(5000);
    let b = H::backend();
    let tenant = TenantKey::fresh(TenantId(1));
    let unusable = AtomicU64::new(0);
    thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                for _ in 0..cycles {
                    let stream = b
                        .acquire_stream(tenant, IsolationLevel::ContextIsolated)
                        .expect("stream");
                    if b.synchronize(&stream).is_err() {
                        unusable.fetch_add(1, Ordering::Relaxed);
                    }
                    b.release_stream(stream).expect("release");
                }
            });
        }
    });
    assert_eq!(unusable.load(Ordering::Relaxed), 0, "unusable streams");
    if let (Some(streams), Some(contexts)) = (
        H::counters(&b).map(|c| c.live_streams()),
        H::counters(&b).map(|c| c.live_contexts()),
    ) {
        assert_eq!((streams, contexts), (0, 0), "(streams, contexts) left");
    }
    drop_and_check_driver::<H>(b);
}

/// Two tenant objects made with the same id are two tenants: separate contexts, and neither
/// can release (or use) the other's stream by naming the shared id.
pub fn tenants_sharing_an_id_are_isolated<H: Harness>() {
    let b = H::backend();
    let level = IsolationLevel::ContextIsolated;
    let alice = TenantLedger::new(TenantId(5), 1 << 20, level);
    let mallory = TenantLedger::new(TenantId(5), 1 << 20, level);
    let a = b.acquire_stream(alice.key(), level).expect("alice");
    let m = b.acquire_stream(mallory.key(), level).expect("mallory");
    assert_eq!(a.tenant(), m.tenant(), "the same id");
    assert_ne!(
        a.context(),
        m.context(),
        "one id, two tenants, two contexts"
    );
    if let Some(live) = H::counters(&b).map(|c| c.live_contexts()) {
        assert_eq!(live, 2);
    }
    // Mallory names Alice's stream with her own identity: refused.
    let forged = Stream::new(a.driver_stream(), a.driver_context(), level, mallory.key());
    let err = b.synchronize(&forged).expect_err("not mallory's stream");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let err = b.release_stream(forged).expect_err("not mallory's stream");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    b.synchronize(&a).expect("alice's stream still works");
    b.release_stream(a).expect("release");
    b.release_stream(m).expect("release");
    if let Some(live) = H::counters(&b).map(|c| c.live_contexts()) {
        assert_eq!(live, 0);
    }
    drop_and_check_driver::<H>(b);
}

fn pool_for<H: Harness>(
    b: &Arc<H::Backend>,
    tenant: &Arc<TenantLedger>,
) -> Option<TenantDevicePool<Arc<H::Backend>>> {
    if !H::has_device_pools(b) {
        return None;
    }
    // Freed blocks are kept by the pool, so a freed address comes straight back.
    let config = DevicePoolConfig {
        max_bytes: 0,
        release_threshold: u64::MAX,
    };
    Some(TenantDevicePool::new(Arc::clone(b), Arc::clone(tenant), D0, &config).expect("pool"))
}

fn shared_stream(tenant: &TenantLedger) -> Stream {
    Stream::new(
        tensor_wasm_mem_core::DriverStream::DEFAULT,
        tensor_wasm_mem_core::DriverContext::from_raw(0),
        IsolationLevel::Shared,
        tenant.key(),
    )
}

/// A free that returns late (the driver has the block back, the caller has not heard yet) while
/// another thread allocates the same address: the newcomer's charge survives the late free's
/// bookkeeping, so the cap holds. (Before the fix the late free deleted the newcomer's charge:
/// 12,288 bytes live under an 8,192 cap.)
pub fn device_pool_cap_holds_when_a_free_returns_late<H: Harness>() {
    let b = H::backend();
    let block = crate::suite::pool_unit::<H>(&b);
    let tenant = Arc::new(TenantLedger::new(
        TenantId(1),
        2 * block as u64,
        IsolationLevel::Shared,
    ));
    let Some(pool) = pool_for::<H>(&b, &tenant) else {
        return skip("no device pools");
    };
    let stream = shared_stream(&tenant);
    let first = pool.allocate(block, &stream).expect("first");
    let first_ptr = first.device_ptr();
    let Some(held) = H::faults(&b).and_then(|f| f.hold_next(Operation::PoolFree)) else {
        return skip("no way to hold a free");
    };
    let newcomer = thread::scope(|s| {
        let late = s.spawn(|| pool.free(first, &stream).expect("late free"));
        // The free has taken effect in the driver; its caller is held until released below.
        held.wait_held();
        // On an asynchronous driver the free is done when the stream gets to it: wait for it,
        // so the block can be handed back while the free's caller is still held.
        b.synchronize(&stream).expect("synchronize");
        let newcomer = pool.allocate(block, &stream).expect("newcomer");
        held.release();
        late.join().expect("free thread");
        newcomer
    });
    assert_eq!(
        newcomer.device_ptr(),
        first_ptr,
        "the pool handed the freed block straight back (the race this case stages)"
    );
    assert_eq!(
        tenant.stats().device_pool_bytes,
        block as u64,
        "the newcomer is still charged"
    );
    let second = pool.allocate(block, &stream).expect("up to the cap");
    let err = pool
        .allocate(block, &stream)
        .expect_err("a third block passes the cap");
    assert!(matches!(err, Error::Denied(_)), "{err}");
    pool.free(newcomer, &stream).expect("free");
    pool.free(second, &stream).expect("free");
    b.synchronize(&stream).expect("the frees are done");
    assert_kept_blocks_are_charged(&tenant, &pool);
    drop(pool);
    assert_eq!(tenant.stats().touched_bytes, 0, "back with the pool");
    drop_and_check_driver::<H>(b);
}

/// Three threads allocate and free one block at a time from a pool capped at two blocks: at no
/// moment do three blocks live.
pub fn device_pool_cap_holds_under_contention<H: Harness>() {
    let cycles = H::rounds(3000);
    let b = H::backend();
    let block = crate::suite::pool_unit::<H>(&b);
    let tenant = Arc::new(TenantLedger::new(
        TenantId(1),
        2 * block as u64,
        IsolationLevel::Shared,
    ));
    let Some(pool) = pool_for::<H>(&b, &tenant) else {
        return skip("no device pools");
    };
    let stream = shared_stream(&tenant);
    let held = AtomicU64::new(0);
    let most = AtomicU64::new(0);
    thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                for _ in 0..cycles {
                    let Ok(block) = pool.allocate(block, &stream) else {
                        continue;
                    };
                    let now = held.fetch_add(1, Ordering::AcqRel) + 1;
                    most.fetch_max(now, Ordering::AcqRel);
                    // Counted out before the free, so a block freed here and taken by another
                    // thread is never counted twice.
                    held.fetch_sub(1, Ordering::AcqRel);
                    pool.free(block, &stream).expect("free");
                }
            });
        }
    });
    assert!(
        most.load(Ordering::Acquire) <= 2,
        "{} blocks lived at once under a cap of 2",
        most.load(Ordering::Acquire)
    );
    b.synchronize(&stream).expect("the frees are done");
    assert_kept_blocks_are_charged(&tenant, &pool);
    drop(pool);
    assert_eq!(tenant.stats().touched_bytes, 0, "back with the pool");
    drop_and_check_driver::<H>(b);
}

/// Every block freed, the pool (whose release threshold keeps them all) still holds them, and
/// the tenant pays for exactly what it holds.
fn assert_kept_blocks_are_charged<B: tensor_wasm_mem_core::DevicePools>(
    tenant: &TenantLedger,
    pool: &TenantDevicePool<B>,
) {
    let held = pool.stats().expect("stats").reserved_bytes;
    assert_eq!(pool.charged_bytes(), held);
    assert_eq!(tenant.stats().device_pool_bytes, held);
}

/// A stream whose destroy the driver refuses stays counted (and is refused to callers), and is
/// destroyed when the backend drops; a context-isolated tenant's goes with its context, which
/// the last user destroys all the same.
pub fn failed_stream_destroy_stays_counted_until_drop<H: Harness>() {
    let b = H::backend();
    let tenant = TenantKey::fresh(TenantId(1));
    for level in [
        IsolationLevel::StreamIsolated,
        IsolationLevel::ContextIsolated,
    ] {
        let streams_before = H::counters(&b).map(|c| c.live_streams());
        let stream = b.acquire_stream(tenant, level).expect("stream");
        let (raw, context) = (stream.driver_stream(), stream.driver_context());
        if H::faults(&b)
            .map(|f| f.fail_release(Release::StreamDestroy, 1))
            .is_none()
        {
            b.release_stream(stream).expect("release");
            return skip("no fault injection");
        }
        b.release_stream(stream).expect_err("injected");
        if level == IsolationLevel::StreamIsolated {
            if let Some(live) = H::counters(&b).map(|c| c.live_streams()) {
                assert!(live >= 1, "the driver still has the stream: counted");
            }
        } else {
            // The tenant's context goes with its last user all the same, and takes the
            // refused stream with it: a faulting tenant cannot keep a context held.
            if let Some(live) = H::counters(&b).map(|c| c.live_contexts()) {
                assert_eq!(live, 0, "the context went, with its stream");
            }
            assert_eq!(
                H::counters(&b).map(|c| c.live_streams()),
                streams_before,
                "the stream went with its context"
            );
        }
        let again = Stream::new(raw, context, level, tenant);
        let err = b.synchronize(&again).expect_err("a retired stream");
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    }
    drop_and_check_driver::<H>(b);
}

/// A tenant context whose destroy the driver refuses (after its last stream, or while rolling
/// back a failed first stream) stays counted, does not serve the tenant again, and is destroyed
/// when the backend drops.
pub fn failed_context_destroy_stays_counted_until_drop<H: Harness>() {
    let b = H::backend();
    let level = IsolationLevel::ContextIsolated;
    let tenant = TenantKey::fresh(TenantId(1));
    let stream = b.acquire_stream(tenant, level).expect("stream");
    let old = stream.context();
    if H::faults(&b)
        .map(|f| f.fail_release(Release::ContextDestroy, 1))
        .is_none()
    {
        b.release_stream(stream).expect("release");
        return skip("no contexts to fail");
    }
    b.release_stream(stream)
        .expect_err("the context destroy failed");
    if let Some(live) = H::counters(&b).map(|c| c.live_contexts()) {
        assert_eq!(live, 1, "the driver still has the context: counted");
    }
    let fresh = b.acquire_stream(tenant, level).expect("a new context");
    assert_ne!(fresh.context(), old, "a retired context never serves again");
    b.release_stream(fresh).expect("release");
    // The rollback path: the first stream of a new context fails, then its destroy does too.
    assert!(H::faults(&b).is_some_and(|f| f.fail_nth(Operation::AcquireStream, 1)));
    assert!(
        H::faults(&b)
            .map(|f| f.fail_release(Release::ContextDestroy, 1))
            .is_some()
    );
    b.acquire_stream(TenantKey::fresh(TenantId(2)), level)
        .expect_err("injected");
    if let Some(live) = H::counters(&b).map(|c| c.live_contexts()) {
        assert_eq!(
            live, 2,
            "both contexts the driver refused to destroy are counted"
        );
    }
    drop_and_check_driver::<H>(b);
}

/// A context-isolated tenant has one context, on one device: a stream on another device while
/// it has streams is refused, typed (before, the stream was made in the first device's context
/// and recorded as on the second). Once its last stream is gone, its next may be anywhere.
pub fn a_context_isolated_tenants_context_is_on_one_device<H: Harness>() {
    let b = H::backend();
    if b.device_count() < 2 {
        return skip("one device");
    }
    let (level, d1) = (IsolationLevel::ContextIsolated, DeviceId(1));
    let tenant = TenantKey::fresh(TenantId(1));
    let first = b
        .acquire_stream_on(tenant, level, D0)
        .expect("a stream on device 0");
    let err = b
        .acquire_stream_on(tenant, level, d1)
        .expect_err("its context is on device 0");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let again = b
        .acquire_stream_on(tenant, level, D0)
        .expect("its own device");
    assert_eq!(again.context(), first.context(), "one context");
    b.release_stream(again).expect("release");
    b.release_stream(first).expect("release");
    let moved = b
        .acquire_stream_on(tenant, level, d1)
        .expect("no stream left: device 1");
    assert_eq!(moved.device(), d1);
    b.release_stream(moved).expect("release");
    drop_and_check_driver::<H>(b);
}

/// A device pool whose destroy fails (the driver refuses `cuMemPoolDestroy`, or making its
/// device's context current fails) stays counted with its blocks, and is freed at drop.
pub fn failed_pool_destroy_stays_counted_until_drop<H: Harness>() {
    let b = H::backend();
    if !H::has_device_pools(&b) {
        return skip("no device pools");
    }
    let tenant = TenantKey::fresh(TenantId(1));
    let shared = Stream::new(
        tensor_wasm_mem_core::DriverStream::DEFAULT,
        tensor_wasm_mem_core::DriverContext::from_raw(0),
        IsolationLevel::Shared,
        tenant,
    );
    let mut injected = 0;
    for what in [Release::PoolDestroy, Release::ContextPush] {
        let pool = b
            .create_pool(tenant, D0, &DevicePoolConfig::default())
            .expect("pool");
        let _block = b.pool_allocate(&pool, BLOCK, &shared).expect("block");
        if H::faults(&b).map(|f| f.fail_release(what, 1)).is_none() {
            b.destroy_pool(pool).expect("destroy");
            continue;
        }
        injected += 1;
        b.destroy_pool(pool).expect_err("injected");
        if let Some(live) = H::counters(&b).map(|c| c.live_pools()) {
            assert_eq!(live, injected, "the driver still has the pool: counted");
        }
    }
    if injected == 0 {
        skip("no fault injection");
    }
    drop_and_check_driver::<H>(b);
}

/// Whatever the backend does, the caller's context stack is as it was: same depth, same
/// current context (here the embedder's own, pushed before).
pub fn context_stack_is_left_as_it_was<H: Harness>() {
    let b = H::backend();
    let shared = b
        .acquire_stream(TenantKey::fresh(TenantId(9)), IsolationLevel::Shared)
        .expect("shared");
    if H::inspect(&b)
        .map(|i| i.push_context(shared.context()))
        .is_none()
    {
        return skip("no context stack");
    }
    let before = H::inspect(&b)
        .map(|i| i.context_stack())
        .expect("inspectable");
    let tenant = Arc::new(TenantLedger::new(
        TenantId(1),
        u64::MAX,
        IsolationLevel::ContextIsolated,
    ));
    for _ in 0..H::rounds(100) {
        for level in [
            IsolationLevel::StreamIsolated,
            IsolationLevel::ContextIsolated,
        ] {
            let stream = b.acquire_stream(tenant.key(), level).expect("stream");
            assert_eq!(
                H::inspect(&b).map(|i| i.context_stack()),
                Some(before),
                "after acquiring a {level} stream"
            );
            let a: Allocation = b.allocate(D0, BLOCK).expect("allocate");
            b.prefetch(
                &a,
                0,
                BLOCK,
                tensor_wasm_mem_core::Location::Device(D0),
                &stream,
            )
            .expect("prefetch");
            // SAFETY: `a` is live and unaliased.
            unsafe { b.zero(&a, 0, BLOCK) }.expect("zero");
            b.synchronize(&stream).expect("synchronize");
            if let Some(pool) = pool_for::<H>(&b, &tenant) {
                let block = pool.allocate(BLOCK, &stream).expect("pool block");
                pool.free(block, &stream).expect("pool free");
            }
            // SAFETY: `a` came from `b` and is not used again.
            unsafe { b.free(a) }.expect("free");
            b.release_stream(stream).expect("release");
        }
    }
    assert_eq!(
        H::inspect(&b).map(|i| i.context_stack()),
        Some(before),
        "(depth, current) of the caller's context stack"
    );
    if let Some(i) = H::inspect(&b) {
        i.pop_context();
    }
    b.release_stream(shared).expect("release shared");
    drop_and_check_driver::<H>(b);
}

/// A tenant's device pool refuses another tenant's stream (its work, and its zero-fill, would be
/// ordered on a stream the pool's tenant does not own, in another tenant's context).
pub fn device_pool_refuses_another_tenants_stream<H: Harness>() {
    let b = H::backend();
    let alice = Arc::new(TenantLedger::new(
        TenantId(1),
        u64::MAX,
        IsolationLevel::StreamIsolated,
    ));
    let Some(pool) = pool_for::<H>(&b, &alice) else {
        return skip("no device pools");
    };
    let mallory = TenantKey::fresh(TenantId(2));
    let theirs = b
        .acquire_stream(mallory, IsolationLevel::StreamIsolated)
        .expect("stream");
    let err = pool
        .allocate(BLOCK, &theirs)
        .expect_err("another tenant's stream");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert_eq!(
        alice.stats().touched_bytes,
        0,
        "a refused allocation leaves no charge"
    );
    let ours = b
        .acquire_stream(alice.key(), IsolationLevel::StreamIsolated)
        .expect("stream");
    let block = pool
        .allocate(BLOCK, &ours)
        .expect("the tenant's own stream");
    let err = pool
        .free(block, &theirs)
        .expect_err("freed on another tenant's stream");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert_eq!(
        alice.stats().touched_bytes,
        BLOCK as u64,
        "still charged: still live"
    );
    drop(pool);
    assert_eq!(alice.stats().touched_bytes, 0);
    b.release_stream(theirs).expect("release");
    b.release_stream(ours).expect("release");
    drop_and_check_driver::<H>(b);
}
