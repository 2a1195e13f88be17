//! Findings of a hostile review of the driver layer, each a test that failed before its fix:
//! relabelled stream levels, teardown racing releases, frees racing allocations of the same
//! address, handle values reused by the driver, allocations in flight during a destroy, refused
//! frees, foreign streams on a tenant's pool, and forged duplicate handles.
use super::*;
use crate::advisor::Advisor;
use crate::allocator::ManagedAllocator;
use crate::error::BackendError;
use crate::pools::{DevicePools, PoolAllocation, PoolHandle};
use core::sync::atomic::{AtomicUsize, Ordering as AO};
use std::string::String;

/// Fails (saying how many of `runs` schedules were bad, and one of them) unless none was.
fn assert_no_bad_schedule(case: &str, runs: usize, bad: &AtomicUsize, worst: &Mutex<String>) {
    let n = bad.load(AO::Relaxed);
    let example = worst.lock().unwrap_or_else(PoisonError::into_inner);
    assert_eq!(n, 0, "{case}: {n} of {runs} schedules bad; e.g. {example}");
}

/// A body that synchronises a copy of `s` (a caller holding the same handle as the one that
/// releases it), its answer ignored.
fn synchronizing_a_copy(backend: &Arc<DriverBackend<Fake>>, s: &Stream) -> Body<'static> {
    let copy = Stream::new(
        s.driver_stream(),
        s.driver_context(),
        s.level(),
        s.tenant_key(),
    );
    let backend = Arc::clone(backend);
    Box::new(move || {
        let _ = backend.synchronize(&copy);
    })
}

fn fake_with(f: impl FnOnce(&mut FakeState)) -> Fake {
    let fake = Fake::default();
    f(&mut fake.lock());
    fake
}

/// R1: a stream-isolated stream relabelled `ContextIsolated` is refused on release (the level
/// is the record's, never the handle's), and the tenant's context lives on under its live
/// context-isolated stream.
#[test]
fn r1_forged_level_destroys_a_context_under_a_live_stream() {
    let b = DriverBackend::new(Fake::default());
    let t = TenantKey::fresh(TenantId(1));
    let ci = b
        .acquire_stream(t, IsolationLevel::ContextIsolated)
        .unwrap();
    let si = b.acquire_stream(t, IsolationLevel::StreamIsolated).unwrap();
    let forged = Stream::new(
        si.driver_stream(),
        si.driver_context(),
        IsolationLevel::ContextIsolated,
        t,
    );
    let err = b.release_stream(forged).expect_err("a relabelled handle");
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let alive = b.driver().lock().contexts.contains(&ci.context());
    let usable = b.synchronize(&ci).is_ok();
    assert!(
        alive && usable,
        "a live context-isolated stream's context was destroyed"
    );
    b.release_stream(si).unwrap();
    b.release_stream(ci).unwrap();
    let s = b.stats();
    assert_eq!((s.live_streams, s.live_contexts), (0, 0));
}

/// R1b: the converse: a context-isolated stream released as `StreamIsolated` is refused, and
/// its genuine release leaves nothing.
#[test]
fn r1b_forged_level_leaks_the_context() {
    let b = DriverBackend::new(Fake::default());
    let t = TenantKey::fresh(TenantId(1));
    let ci = b
        .acquire_stream(t, IsolationLevel::ContextIsolated)
        .unwrap();
    let forged = Stream::new(
        ci.driver_stream(),
        ci.driver_context(),
        IsolationLevel::StreamIsolated,
        t,
    );
    assert!(b.release_stream(forged).is_err(), "a relabelled handle");
    b.release_stream(ci).unwrap();
    let s = b.stats();
    assert_eq!(
        (s.live_streams, s.live_contexts),
        (0, 0),
        "context kept with no stream"
    );
}

/// R2: a pool teardown (TenantDevicePool drop) racing the release of the stream its block was
/// allocated on, no forged handle. teardown_stream picks the live stream and its context, the
/// lock is dropped, the other thread destroys stream and context, the teardown then pushes /
/// uses the destroyed context: destroy fails spuriously, the tenant stays charged forever.
#[test]
fn r2_pool_teardown_racing_stream_release() {
    let bad = Arc::new(AtomicUsize::new(0));
    let worst = Arc::new(Mutex::new(String::new()));
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(Fake::default()));
        let tenant = Arc::new(TenantLedger::new(
            TenantId(1),
            u64::MAX,
            IsolationLevel::ContextIsolated,
        ));
        let pool = pool_of(&backend, &tenant);
        let stream = backend
            .acquire_stream(tenant.key(), IsolationLevel::ContextIsolated)
            .expect("stream");
        let block = pool.allocate(BLOCK, &stream).expect("block");
        let _unfreed = block;
        let dropper: Body<'_> = Box::new(move || drop(pool));
        let releaser: Body<'_> = {
            let backend = Arc::clone(&backend);
            Box::new(move || {
                let _ = backend.release_stream(stream);
            })
        };
        let (bad, worst) = (Arc::clone(&bad), Arc::clone(&worst));
        let check = Box::new(move || {
            let st = backend.stats();
            let d = backend.driver().lock();
            let msg = std::format!(
                "stats={st:?} tenant_live={} dead_pushes={} destroyed_while_current={}",
                tenant.stats().touched_bytes,
                d.dead_pushes,
                d.destroyed_while_current
            );
            if st.release_failures != 0
                || tenant.stats().touched_bytes != 0
                || d.dead_pushes != 0
                || d.destroyed_while_current != 0
            {
                bad.fetch_add(1, AO::Relaxed);
                *worst.lock().unwrap() = msg;
            }
        });
        (vec![dropper, releaser], check as Box<dyn FnOnce()>)
    });
    assert_no_bad_schedule("R2", runs, &bad, &worst);
}

/// R3: managed free racing an allocation that gets the same address (the pool bug, unfixed for
/// `ManagedAllocator`): the free removes the newcomer's record after the driver freed.
#[test]
fn r3_managed_free_racing_allocate_same_address() {
    let bad = Arc::new(AtomicUsize::new(0));
    let worst = Arc::new(Mutex::new(String::new()));
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(fake_with(|s| s.managed = true)));
        let first = backend.allocate(DeviceId(0), 4096).expect("first");
        let got = Arc::new(Mutex::new(None));
        let freeing: Body<'_> = {
            let backend = Arc::clone(&backend);
            // SAFETY: test only; the fake's memory is never touched.
            Box::new(move || unsafe { backend.free(first) }.expect("free"))
        };
        let allocating: Body<'_> = {
            let (backend, got) = (Arc::clone(&backend), Arc::clone(&got));
            Box::new(move || {
                *got.lock().unwrap() = Some(backend.allocate(DeviceId(0), 8192).expect("alloc"));
            })
        };
        let (bad, worst) = (Arc::clone(&bad), Arc::clone(&worst));
        let check = Box::new(move || {
            let a = got.lock().unwrap().take().unwrap();
            let known = backend.advise(&a, 0, 0, Advice::SetReadMostly).is_ok();
            let st = backend.stats();
            let in_driver = backend.driver().lock().managed_live.len() as u64;
            if !known || st.live_allocations != in_driver || st.live_bytes != 8192 {
                bad.fetch_add(1, AO::Relaxed);
                *worst.lock().unwrap() = std::format!(
                    "newcomer known={known} stats.live_allocations={} live_bytes={} driver holds {in_driver}",
                    st.live_allocations,
                    st.live_bytes
                );
            }
            let _unfreed = a;
        });
        (vec![freeing, allocating], check as Box<dyn FnOnce()>)
    });
    assert_no_bad_schedule("R3", runs, &bad, &worst);
}

/// R4: a stream release racing an acquire that gets the same (reused) stream handle: the
/// release removes the newcomer's record.
#[test]
fn r4_stream_release_racing_acquire_of_reused_handle() {
    let bad = Arc::new(AtomicUsize::new(0));
    let worst = Arc::new(Mutex::new(String::new()));
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(fake_with(|s| s.reuse_streams = true)));
        let t = TenantKey::fresh(TenantId(1));
        let old = backend
            .acquire_stream(t, IsolationLevel::StreamIsolated)
            .unwrap();
        let got = Arc::new(Mutex::new(None));
        let releasing: Body<'_> = {
            let backend = Arc::clone(&backend);
            Box::new(move || backend.release_stream(old).expect("release"))
        };
        let acquiring: Body<'_> = {
            let (backend, got) = (Arc::clone(&backend), Arc::clone(&got));
            Box::new(move || {
                *got.lock().unwrap() = Some(
                    backend
                        .acquire_stream(
                            TenantKey::fresh(TenantId(2)),
                            IsolationLevel::StreamIsolated,
                        )
                        .unwrap(),
                );
            })
        };
        let (bad, worst) = (Arc::clone(&bad), Arc::clone(&worst));
        let check = Box::new(move || {
            let s = got.lock().unwrap().take().unwrap();
            let usable = backend.synchronize(&s).is_ok();
            let st = backend.stats();
            let in_driver = backend.driver().lock().streams.len() as u64;
            let released = backend.release_stream(s).is_ok();
            if !usable || !released || st.live_streams != in_driver {
                bad.fetch_add(1, AO::Relaxed);
                *worst.lock().unwrap() = std::format!(
                    "newcomer usable={usable} releasable={released} live_streams={} driver={in_driver}",
                    st.live_streams
                );
            }
        });
        (vec![releasing, acquiring], check as Box<dyn FnOnce()>)
    });
    assert_no_bad_schedule("R4", runs, &bad, &worst);
}

/// R5: pool_allocate in flight (forged second handle) while destroy_pool runs: allocates from a
/// destroyed pool, the block is counted but recorded nowhere (never freed at drop).
#[test]
fn r5_pool_allocate_in_flight_during_destroy() {
    let bad = Arc::new(AtomicUsize::new(0));
    let worst = Arc::new(Mutex::new(String::new()));
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(Fake::default()));
        let t = TenantKey::fresh(TenantId(1));
        let pool = backend
            .create_pool(t, DeviceId(0), &DevicePoolConfig::default())
            .unwrap();
        let forged = PoolHandle::new(pool.driver_pool(), pool.device(), t);
        let shared = Stream::new(
            crate::DriverStream::DEFAULT,
            crate::DriverContext::from_raw(0),
            IsolationLevel::Shared,
            t,
        );
        let allocating: Body<'_> = {
            let backend = Arc::clone(&backend);
            Box::new(move || {
                let _ = backend.pool_allocate(&forged, BLOCK, &shared);
            })
        };
        let destroying: Body<'_> = {
            let backend = Arc::clone(&backend);
            Box::new(move || {
                let _ = backend.destroy_pool(pool);
            })
        };
        let (bad, worst) = (Arc::clone(&bad), Arc::clone(&worst));
        let check = Box::new(move || {
            let st = backend.stats();
            let d = backend.driver().lock();
            if d.alloc_from_dead_pool != 0 || (st.live_pools == 0 && st.live_pool_allocations != 0)
            {
                bad.fetch_add(1, AO::Relaxed);
                *worst.lock().unwrap() = std::format!(
                    "alloc_from_dead_pool={} stats={st:?} driver blocks={}",
                    d.alloc_from_dead_pool,
                    d.pool_live.len()
                );
            }
        });
        (vec![allocating, destroying], check as Box<dyn FnOnce()>)
    });
    assert_no_bad_schedule("R5", runs, &bad, &worst);
}

/// R6: a pool_free the driver refuses, in flight (forged handle) while destroy_pool runs: the
/// record was taken out before the driver call, the pool record is gone when it is put back:
/// the block is forgotten (counted in live_pool_allocations forever, never freed at drop).
#[test]
fn r6_refused_pool_free_racing_destroy_forgets_the_block() {
    let bad = Arc::new(AtomicUsize::new(0));
    let worst = Arc::new(Mutex::new(String::new()));
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(Fake::default()));
        let t = TenantKey::fresh(TenantId(1));
        let pool = backend
            .create_pool(t, DeviceId(0), &DevicePoolConfig::default())
            .unwrap();
        let shared = Stream::new(
            crate::DriverStream::DEFAULT,
            crate::DriverContext::from_raw(0),
            IsolationLevel::Shared,
            t,
        );
        let block = backend.pool_allocate(&pool, BLOCK, &shared).unwrap();
        backend
            .driver()
            .lock()
            .fail_pool_free
            .insert(block.device_ptr());
        let forged = PoolHandle::new(pool.driver_pool(), pool.device(), t);
        let freeing: Body<'_> = {
            let backend = Arc::clone(&backend);
            Box::new(move || {
                let _ = backend.pool_free(&forged, block, &shared);
            })
        };
        let destroying: Body<'_> = {
            let backend = Arc::clone(&backend);
            Box::new(move || {
                let _ = backend.destroy_pool(pool);
            })
        };
        let (bad, worst) = (Arc::clone(&bad), Arc::clone(&worst));
        let check = Box::new(move || {
            let st = backend.stats();
            // Either the pool is still held (retired, with its block) or the block is gone.
            if st.live_pools == 0 && st.live_pool_allocations != 0 {
                bad.fetch_add(1, AO::Relaxed);
                *worst.lock().unwrap() = std::format!(
                    "stats={st:?} driver still holds {} block(s) that no record has",
                    backend.driver().lock().pool_live.len()
                );
            }
        });
        (vec![freeing, destroying], check as Box<dyn FnOnce()>)
    });
    assert_no_bad_schedule("R6", runs, &bad, &worst);
}

/// R7: a pool teardown whose second block's free is refused, then retried by the destroy:
/// the tenant ends charged for exactly what the driver holds (it used to keep every charge when
/// the destroy failed part-way, and the backend's drop never uncharged).
#[test]
fn r7_a_refused_teardown_free_retried_by_the_destroy_charges_exactly() {
    let backend = Arc::new(DriverBackend::new(Fake::default()));
    let tenant = Arc::new(TenantLedger::new(
        TenantId(1),
        u64::MAX,
        IsolationLevel::Shared,
    ));
    let pool = pool_of(&backend, &tenant);
    let shared = Stream::new(
        crate::DriverStream::DEFAULT,
        crate::DriverContext::from_raw(0),
        IsolationLevel::Shared,
        tenant.key(),
    );
    let a = pool.allocate(BLOCK, &shared).unwrap();
    let b2 = pool.allocate(BLOCK, &shared).unwrap();
    backend.driver().lock().fail_pool_free_call = Some(2);
    let _unfreed = (a, b2);
    drop(pool);
    let in_driver = backend.driver().lock().pool_live.len() as u64 * BLOCK as u64;
    let charged = tenant.stats().touched_bytes;
    std::eprintln!("R7: tenant charged {charged}, driver holds {in_driver}");
    assert_eq!(
        charged, in_driver,
        "charged for exactly what the driver holds"
    );
}

/// R8: synchronize on a forged copy of a live stream racing its release (push switches): the
/// backend checks the stream, drops the lock, the release destroys stream and context, then the
/// backend pushes a destroyed context (a dangling CUcontext on a real driver).
#[test]
fn r8_synchronize_racing_release_pushes_a_dead_context() {
    let bad = Arc::new(AtomicUsize::new(0));
    let worst = Arc::new(Mutex::new(String::new()));
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(Fake::default()));
        let t = TenantKey::fresh(TenantId(1));
        let s = backend
            .acquire_stream(t, IsolationLevel::ContextIsolated)
            .unwrap();
        backend.driver().lock().switch_at_push = true;
        let syncing = synchronizing_a_copy(&backend, &s);
        let releasing: Body<'_> = {
            let backend = Arc::clone(&backend);
            Box::new(move || {
                let _ = backend.release_stream(s);
            })
        };
        let (bad, worst) = (Arc::clone(&bad), Arc::clone(&worst));
        let check = Box::new(move || {
            let d = backend.driver().lock();
            if d.dead_pushes != 0 || d.destroyed_while_current != 0 {
                bad.fetch_add(1, AO::Relaxed);
                *worst.lock().unwrap() = std::format!(
                    "dead_pushes={} destroyed_while_current={}",
                    d.dead_pushes,
                    d.destroyed_while_current
                );
            }
        });
        (vec![syncing, releasing], check as Box<dyn FnOnce()>)
    });
    assert_no_bad_schedule("R8", runs, &bad, &worst);
}

/// R9: a pool block remembers its stream by raw handle only. Its stream is released, the driver
/// reuses the handle for another tenant's stream (in that tenant's context), and the pool's
/// teardown frees the block on the other tenant's stream, in its context.
#[test]
fn r9_teardown_frees_on_another_tenants_stream_after_handle_reuse() {
    let backend = Arc::new(DriverBackend::new(fake_with(|s| s.reuse_streams = true)));
    let a = Arc::new(TenantLedger::new(
        TenantId(1),
        u64::MAX,
        IsolationLevel::StreamIsolated,
    ));
    let pool = pool_of(&backend, &a);
    let sa = backend
        .acquire_stream(a.key(), IsolationLevel::StreamIsolated)
        .unwrap();
    let _unfreed = pool.allocate(BLOCK, &sa).unwrap();
    let sa_raw = sa.raw();
    backend.release_stream(sa).unwrap();
    let sb = backend
        .acquire_stream(
            TenantKey::fresh(TenantId(2)),
            IsolationLevel::ContextIsolated,
        )
        .unwrap();
    assert_eq!(sb.raw(), sa_raw, "the driver reused the handle");
    backend.driver().lock().events.clear();
    drop(pool);
    let events = core::mem::take(&mut backend.driver().lock().events);
    std::eprintln!(
        "R9: tenant B's stream {:#x}; teardown events {events:?}",
        sb.raw()
    );
    assert!(
        !events.contains(&("pool_free", sb.raw())),
        "tenant A's block freed on tenant B's stream"
    );
}

/// R10: nothing ties a pool allocation's stream to the pool's tenant: tenant A's pool allocates
/// (and zero-fills) on tenant B's context-isolated stream, in B's context.
#[test]
fn r10_pool_accepts_another_tenants_stream() {
    let backend = Arc::new(DriverBackend::new(Fake::default()));
    let a = Arc::new(TenantLedger::new(
        TenantId(7),
        u64::MAX,
        IsolationLevel::ContextIsolated,
    ));
    let b = Arc::new(TenantLedger::new(
        TenantId(7),
        u64::MAX,
        IsolationLevel::ContextIsolated,
    ));
    let pool = pool_of(&backend, &a);
    let sb = backend
        .acquire_stream(b.key(), IsolationLevel::ContextIsolated)
        .unwrap();
    let r = pool.allocate(BLOCK, &sb);
    std::eprintln!("R10: A's pool on B's stream: {:?}", r.as_ref().map(|_| ()));
    assert!(
        r.is_err(),
        "tenant A's pool used tenant B's stream and context"
    );
}

// ---------------------------------------------------------------------------------------------
// Second hostile review: the counted uses and the deferred teardowns.
// ---------------------------------------------------------------------------------------------

/// Two pools of one tenant, each with a block allocated on the tenant's stream `s`.
struct TwoPools {
    backend: Arc<DriverBackend<Fake>>,
    tenant: Arc<TenantLedger>,
    first: TenantDevicePool<Arc<DriverBackend<Fake>>>,
    second: TenantDevicePool<Arc<DriverBackend<Fake>>>,
    s: Stream,
}

fn two_pools(level: IsolationLevel) -> TwoPools {
    let backend = Arc::new(DriverBackend::new(Fake::default()));
    let tenant = Arc::new(TenantLedger::new(TenantId(1), u64::MAX, level));
    let pool = || pool_of(&backend, &tenant);
    let (first, second) = (pool(), pool());
    let s = backend.acquire_stream(tenant.key(), level).expect("stream");
    // Left to the pools' teardown.
    let _ = first.allocate(BLOCK, &s).expect("block");
    let _ = second.allocate(BLOCK, &s).expect("block");
    TwoPools {
        backend,
        tenant,
        first,
        second,
        s,
    }
}

/// S1: a pool teardown holds a use of stream `s` (its block is freed on `s`, via
/// `stream_use_if`); the tenant releases `s` meanwhile, which only retires it (`Releasing`), and
/// then drops its other pool. That teardown's `stream_use_if` refuses the retired stream and
/// frees the block on the default stream of the primary context, while `s` has been neither
/// waited for nor destroyed: nothing orders the free after the work queued on `s` (a
/// non-blocking stream), contrary to `free_block_at_teardown`'s "a released stream was waited
/// for: its work is done". No forged handle: every call is the API's own.
#[test]
fn s1_teardown_frees_off_a_retired_stream_before_it_was_waited_for() {
    let mut failed = Vec::new();
    for level in [
        IsolationLevel::StreamIsolated,
        IsolationLevel::ContextIsolated,
    ] {
        let bad = Arc::new(AtomicUsize::new(0));
        let worst = Arc::new(Mutex::new(String::new()));
        let runs = Scheduler::explore(|| {
            let TwoPools {
                backend,
                tenant,
                first,
                second,
                s,
            } = two_pools(level);
            let s_raw = s.raw();
            let dropping: Body<'_> = Box::new(move || drop(first));
            let releasing: Body<'_> = {
                let backend = Arc::clone(&backend);
                Box::new(move || {
                    backend.release_stream(s).expect("release");
                    drop(second);
                })
            };
            let (bad, worst) = (Arc::clone(&bad), Arc::clone(&worst));
            let check = Box::new(move || {
                let st = backend.stats();
                let d = backend.driver().lock();
                if d.freed_off_live_stream != 0 {
                    bad.fetch_add(1, AO::Relaxed);
                    *worst.lock().unwrap() = std::format!(
                        "{} block(s) freed on the default stream while stream {s_raw:#x} was \
                         still unwaited in the driver; events={:?}",
                        d.freed_off_live_stream,
                        d.events
                    );
                }
                // What does hold: nothing leaks, nothing is counted twice.
                assert_eq!(st.release_failures, 0, "{st:?}");
                assert_eq!(
                    (st.live_streams, st.live_contexts, st.live_pools),
                    (0, 0, 0)
                );
                assert_eq!(st.live_pool_allocations, 0);
                assert!(d.streams.is_empty() && d.contexts.is_empty() && d.pool_live.is_empty());
                assert_eq!(tenant.stats().touched_bytes, 0);
            });
            (vec![dropping, releasing], check as Box<dyn FnOnce()>)
        });
        let n = bad.load(AO::Relaxed);
        std::eprintln!(
            "S1 {level:?}: {n} of {runs} schedules bad; e.g. {}",
            worst.lock().unwrap()
        );
        if n != 0 {
            failed.push(level);
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
}

/// S2: `release_stream` promises to wait for the work queued on the stream ("the wait is what
/// orders teardown after the tenant's GPU work"). When another call holds a use of the stream
/// (here, legitimately, the teardown of the tenant's pool freeing a block on it), the release
/// retires the record and returns `Ok` at once: the stream has not been waited for, and the
/// caller (an instance teardown) goes on to scrub or hand over memory the stream's work may
/// still be touching. It has no way to learn when the deferred wait happens.
#[test]
fn s2_release_returns_before_waiting_when_a_teardown_uses_the_stream() {
    let bad = Arc::new(AtomicUsize::new(0));
    let worst = Arc::new(Mutex::new(String::new()));
    let runs = Scheduler::explore(|| {
        let TwoPools {
            backend,
            tenant: _tenant,
            first,
            second,
            s,
        } = two_pools(IsolationLevel::StreamIsolated);
        drop(second);
        let s_raw = s.raw();
        let dropping: Body<'_> = Box::new(move || drop(first));
        let unwaited = Arc::new(AtomicUsize::new(0));
        let releasing: Body<'_> = {
            let (backend, unwaited) = (Arc::clone(&backend), Arc::clone(&unwaited));
            Box::new(move || {
                backend.driver().lock().events.clear();
                backend.release_stream(s).expect("release");
                // The release returned: was the stream waited for?
                let d = backend.driver().lock();
                if !d.events.contains(&("synchronize", s_raw)) {
                    unwaited.fetch_add(1, AO::Relaxed);
                }
            })
        };
        let (bad, worst) = (Arc::clone(&bad), Arc::clone(&worst));
        let check = Box::new(move || {
            if unwaited.load(AO::Relaxed) != 0 {
                bad.fetch_add(1, AO::Relaxed);
                *worst.lock().unwrap() = std::format!(
                    "release_stream returned Ok before stream {s_raw:#x} was waited for; \
                     events after: {:?}",
                    backend.driver().lock().events
                );
            }
        });
        (vec![dropping, releasing], check as Box<dyn FnOnce()>)
    });
    assert_no_bad_schedule("S2", runs, &bad, &worst);
}

/// S3: `TenantDevicePool::drop` keeps *every* refused block's charge when `destroy_pool` fails,
/// but `destroy_pool` retries those blocks one by one and may free some before it fails. Two
/// blocks, both refused by `pool_free_at_teardown` (free calls 1, 2); the destroy frees the
/// first again (call 3) and is refused the second (call 4). The pool cannot learn which blocks
/// the failed destroy left, so the tenant stays charged for both: never less than the driver
/// holds (the cap is safe), more in this corner (a known limit, in docs/BACKENDS.md).
#[test]
fn s3_a_partly_successful_destroy_retry_never_undercharges_the_tenant() {
    let backend = Arc::new(DriverBackend::new(Fake::default()));
    let tenant = Arc::new(TenantLedger::new(
        TenantId(1),
        u64::MAX,
        IsolationLevel::Shared,
    ));
    let pool = pool_of(&backend, &tenant);
    let shared = Stream::new(
        crate::DriverStream::DEFAULT,
        crate::DriverContext::from_raw(0),
        IsolationLevel::Shared,
        tenant.key(),
    );
    let _unfreed = (
        pool.allocate(BLOCK, &shared).unwrap(),
        pool.allocate(BLOCK, &shared).unwrap(),
    );
    backend.driver().lock().fail_pool_free_calls = [1, 2, 4].into_iter().collect();
    drop(pool);
    let in_driver = backend.driver().lock().pool_live.len() as u64 * BLOCK as u64;
    let charged = tenant.stats().touched_bytes;
    let st = backend.stats();
    std::eprintln!("S3: tenant charged {charged}, driver holds {in_driver}; {st:?}");
    assert_eq!(
        st.live_pool_allocations * BLOCK as u64,
        in_driver,
        "backend exact"
    );
    assert!(
        charged >= in_driver,
        "never charged less than the driver holds"
    );
    assert_eq!(
        charged,
        2 * BLOCK as u64,
        "the refused blocks' charges, no more"
    );
}

/// S3b: the same when every block is freed by the destroy's retry and only `cuMemPoolDestroy`
/// is refused: the tenant stays charged for the refused block (never less than held; here more,
/// the known limit).
#[test]
fn s3b_a_refused_pool_destroy_never_undercharges_the_tenant() {
    let backend = Arc::new(DriverBackend::new(Fake::default()));
    let tenant = Arc::new(TenantLedger::new(
        TenantId(1),
        u64::MAX,
        IsolationLevel::Shared,
    ));
    let pool = pool_of(&backend, &tenant);
    let shared = Stream::new(
        crate::DriverStream::DEFAULT,
        crate::DriverContext::from_raw(0),
        IsolationLevel::Shared,
        tenant.key(),
    );
    let _unfreed = pool.allocate(BLOCK, &shared).unwrap();
    {
        let mut d = backend.driver().lock();
        d.fail_pool_free_calls = [1].into_iter().collect();
        d.fail_pool_destroy = true;
    }
    drop(pool);
    let in_driver = backend.driver().lock().pool_live.len() as u64 * BLOCK as u64;
    let charged = tenant.stats().touched_bytes;
    let st = backend.stats();
    std::eprintln!("S3b: tenant charged {charged}, driver holds {in_driver}; {st:?}");
    assert_eq!(st.live_pool_allocations, 0, "backend exact");
    assert!(
        charged >= in_driver,
        "never charged less than the driver holds"
    );
    assert_eq!(charged, BLOCK as u64, "the refused block's charge, no more");
}

/// S4: R5's fix lets a `pool_allocate` in flight finish into a retired (`Releasing`) pool; the
/// allocation's own `PoolUse` is then the last use, and its drop runs `release_pool`, which
/// frees the block just allocated and destroys the pool, before `pool_allocate` returns
/// `Ok(allocation)`: the caller holds a device pointer the driver has already taken back (and
/// may hand to anyone). A forged second handle, as in R5.
#[test]
fn s4_an_allocation_finishing_into_a_retired_pool_is_returned_already_freed() {
    let bad = Arc::new(AtomicUsize::new(0));
    let worst = Arc::new(Mutex::new(String::new()));
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(Fake::default()));
        let t = TenantKey::fresh(TenantId(1));
        let pool = backend
            .create_pool(t, DeviceId(0), &DevicePoolConfig::default())
            .unwrap();
        let forged = PoolHandle::new(pool.driver_pool(), pool.device(), t);
        let shared = Stream::new(
            crate::DriverStream::DEFAULT,
            crate::DriverContext::from_raw(0),
            IsolationLevel::Shared,
            t,
        );
        let got = Arc::new(Mutex::new(None));
        let allocating: Body<'_> = {
            let (backend, got) = (Arc::clone(&backend), Arc::clone(&got));
            Box::new(move || {
                let r = backend.pool_allocate(&forged, BLOCK, &shared);
                // Looked at as it returns (no switch point in between).
                let held = r
                    .as_ref()
                    .is_ok_and(|a| backend.driver().lock().pool_live.contains(&a.device_ptr()));
                *got.lock().unwrap() = r.ok().map(|a| (a, held));
            })
        };
        let destroying: Body<'_> = {
            let backend = Arc::clone(&backend);
            Box::new(move || {
                let _ = backend.destroy_pool(pool);
            })
        };
        let (bad, worst) = (Arc::clone(&bad), Arc::clone(&worst));
        let check = Box::new(move || {
            let Some((a, held)) = got.lock().unwrap().take() else {
                return;
            };
            let d = backend.driver().lock();
            if !held {
                bad.fetch_add(1, AO::Relaxed);
                *worst.lock().unwrap() = std::format!(
                    "pool_allocate returned Ok({:#x}), which the driver no longer holds \
                     (pools live in the driver: {:?}; stats={:?})",
                    a.device_ptr(),
                    d.live_pools,
                    backend.stats()
                );
            }
        });
        (vec![allocating, destroying], check as Box<dyn FnOnce()>)
    });
    assert_no_bad_schedule("S4", runs, &bad, &worst);
}

/// What holds (H1): three threads on one context-isolated stream `s` (a synchronize on a copy,
/// its release, the teardown of a pool with a block on it), with a switch at every push: under
/// every schedule nothing is pushed or used dead, nothing is destroyed while current, nothing
/// is torn down twice, every counter ends at zero, and the tenant is uncharged.
#[test]
fn h1_use_release_and_teardown_of_one_stream_under_every_schedule() {
    let runs = Scheduler::explore(|| {
        let backend = Arc::new(DriverBackend::new(Fake::default()));
        let tenant = Arc::new(TenantLedger::new(
            TenantId(1),
            u64::MAX,
            IsolationLevel::ContextIsolated,
        ));
        let pool = pool_of(&backend, &tenant);
        let s = backend
            .acquire_stream(tenant.key(), IsolationLevel::ContextIsolated)
            .expect("stream");
        let _ = pool.allocate(BLOCK, &s).expect("block");
        backend.driver().lock().switch_at_push = true;
        let syncing = synchronizing_a_copy(&backend, &s);
        let releasing: Body<'_> = {
            let backend = Arc::clone(&backend);
            Box::new(move || backend.release_stream(s).expect("release"))
        };
        let dropping: Body<'_> = Box::new(move || drop(pool));
        let check = Box::new(move || {
            let st = backend.stats();
            let d = backend.driver().lock();
            assert_eq!((d.dead_pushes, d.destroyed_while_current), (0, 0));
            assert_eq!(st.release_failures, 0, "{st:?}");
            assert_eq!(
                (st.live_streams, st.live_contexts, st.live_pools),
                (0, 0, 0),
                "{st:?}"
            );
            assert_eq!(st.live_pool_allocations, 0);
            assert!(d.streams.is_empty() && d.contexts.is_empty() && d.pool_live.is_empty());
            assert!(d.live_pools.is_empty());
            let destroys = d
                .events
                .iter()
                .filter(|(c, _)| *c == "stream_destroy")
                .count();
            assert_eq!(destroys, 1, "destroyed once");
            assert_eq!(tenant.stats().touched_bytes, 0);
        });
        (
            vec![syncing, releasing, dropping],
            check as Box<dyn FnOnce()>,
        )
    });
    std::eprintln!("H1: {runs} schedules");
    assert!(runs > 100, "{runs}");
}

/// What holds (H2): a deferred destroy (the last user's) that the driver refuses: the record
/// goes back `Failed`, counted once in `pending_releases`, and a second release is refused. A
/// stream in the primary context stays until the backend's drop reclaims it; a context-isolated
/// tenant's stream goes with its context, which its last user destroys all the same (a context
/// a kernel fault poisoned refuses every call but its own destroy: holding it until the backend
/// drops would let a faulting tenant keep a context).
#[test]
fn h2_a_refused_deferred_destroy_is_kept_counted_and_reclaimed() {
    for level in [
        IsolationLevel::StreamIsolated,
        IsolationLevel::ContextIsolated,
    ] {
        let runs = Scheduler::explore(|| {
            let backend = Arc::new(DriverBackend::new(Fake::default()));
            let t = TenantKey::fresh(TenantId(1));
            let s = backend.acquire_stream(t, level).unwrap();
            backend
                .driver()
                .lock()
                .fail_stream_destroy_once
                .insert(s.raw());
            let copy2 = Stream::new(s.driver_stream(), s.driver_context(), s.level(), t);
            let syncing = synchronizing_a_copy(&backend, &s);
            let releasing: Body<'_> = {
                let backend = Arc::clone(&backend);
                Box::new(move || {
                    let _ = backend.release_stream(s);
                })
            };
            let check = Box::new(move || {
                let st = backend.stats();
                let expected = if level == IsolationLevel::ContextIsolated {
                    (0, 0, 0)
                } else {
                    (1, 0, 1)
                };
                assert_eq!(
                    (st.live_streams, st.live_contexts, st.pending_releases),
                    expected,
                    "{st:?}"
                );
                assert_eq!(st.release_failures, 1, "{st:?}");
                assert!(backend.release_stream(copy2).is_err(), "no live record");
                let report = backend.drop_report();
                let backend = Arc::into_inner(backend).expect("sole owner");
                assert!(
                    backend.driver().lock().streams.is_empty()
                        || level == IsolationLevel::StreamIsolated,
                    "the context took its stream"
                );
                drop(backend);
                if level == IsolationLevel::StreamIsolated {
                    assert!(report.reclaimed() > 0);
                }
            });
            (vec![syncing, releasing], check as Box<dyn FnOnce()>)
        });
        assert!(runs >= 2, "{runs}");
    }
}

/// What holds (H3): `pool_free_at_teardown` and `pool_free` of the same block (forged handles),
/// with the first or the second driver free refused, and a destroy of the pool racing both:
/// the block is freed at most once, a refused one goes back (into a retired record too) and is
/// freed by the last user or kept with its pool, and the counters equal what the driver holds.
#[test]
fn h3_teardown_free_and_free_of_one_block_racing_a_destroy() {
    for fail in [None, Some(1), Some(2)] {
        let runs = Scheduler::explore(|| {
            let backend = Arc::new(DriverBackend::new(Fake::default()));
            let t = TenantKey::fresh(TenantId(1));
            let pool = backend
                .create_pool(t, DeviceId(0), &DevicePoolConfig::default())
                .unwrap();
            let shared = Stream::new(
                crate::DriverStream::DEFAULT,
                crate::DriverContext::from_raw(0),
                IsolationLevel::Shared,
                t,
            );
            let x = backend.pool_allocate(&pool, BLOCK, &shared).unwrap();
            backend.driver().lock().fail_pool_free_call = fail;
            let (ptr, raw) = (x.device_ptr(), pool.driver_pool());
            let f1 = PoolHandle::new(raw, DeviceId(0), t);
            let f2 = PoolHandle::new(raw, DeviceId(0), t);
            let tearing: Body<'_> = {
                let backend = Arc::clone(&backend);
                Box::new(move || {
                    let _ = backend.pool_free_at_teardown(&f1, x);
                })
            };
            let freeing: Body<'_> = {
                let backend = Arc::clone(&backend);
                Box::new(move || {
                    let _ = backend.pool_free(&f2, PoolAllocation::new(ptr, BLOCK), &shared);
                })
            };
            let destroying: Body<'_> = {
                let backend = Arc::clone(&backend);
                Box::new(move || {
                    let _ = backend.destroy_pool(pool);
                })
            };
            let check = Box::new(move || {
                let st = backend.stats();
                let d = backend.driver().lock();
                assert_eq!(st.live_pool_allocations, d.pool_live.len() as u64, "{st:?}");
                assert_eq!(st.live_pools, d.live_pools.len() as u64, "{st:?}");
                assert!(st.live_pools == 1 || d.pool_live.is_empty(), "{st:?}");
                assert!(d.pool_free_calls <= 3);
            });
            (
                vec![tearing, freeing, destroying],
                check as Box<dyn FnOnce()>,
            )
        });
        std::eprintln!("H3 fail={fail:?}: {runs} schedules");
    }
}

/// S5 (documentation): BACKENDS.md says "a driver that panics mid-call leaves the in-flight
/// counts it held (a leak until drop, never a use after free)". It does not: the uses are
/// guards, released by unwinding, and a release that came meanwhile is carried out by the
/// unwinding thread (driver calls made while panicking; a second panic there aborts).
#[test]
fn s5_a_panicking_driver_call_does_not_leave_its_use() {
    let backend = DriverBackend::new(Fake::default());
    let t = TenantKey::fresh(TenantId(1));
    let s = backend
        .acquire_stream(t, IsolationLevel::StreamIsolated)
        .unwrap();
    backend.driver().lock().panic_in_synchronize = true;
    let panicked = std::panic::catch_unwind(core::panic::AssertUnwindSafe(|| {
        let _ = backend.synchronize(&s);
    }))
    .is_err();
    assert!(panicked);
    backend.driver().lock().panic_in_synchronize = false;
    // Were the count leaked, the release would only retire the stream (busy > 0).
    backend.release_stream(s).expect("release");
    let st = backend.stats();
    assert_eq!(
        st.live_streams, 0,
        "the use was released by unwinding: {st:?}"
    );
    assert!(backend.driver().lock().streams.is_empty());
}
