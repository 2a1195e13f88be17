//! A kernel fault through Wasmtime, end to end (the mock backend, two devices): the faulting
//! tenant's device is fenced, the guests whose device state lived there trap on their next `twm`
//! call with a typed error, placement admits no one there, another device never notices, and
//! the device recovers when its last Store goes, with every charge back.

mod common;

use std::sync::Arc;

use tensor_wasm_mem_core::{DeviceId, ErrorKind, IsolationLevel, ManagedAllocator, TenantBudgets};
use tensor_wasm_mem_mock::{MockBackend, MockConfig};
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Linker, Memory, Module, Store};
use tensor_wasm_mem_wasmtime::*;

const PAGE: u64 = 1 << 16;
const D0: DeviceId = DeviceId(0);
const D1: DeviceId = DeviceId(1);

/// A guest that prefetches its first page to a device (`twm.prefetch`).
const GUEST: &str = r#"(module
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 4)
  (func (export "prefetch") (param i32) (result i32)
    (call $prefetch (i32.const 0) (i32.const 4096) (local.get 0))))"#;

type Data = TenantStore<MockBackend>;

struct Rig {
    backend: Arc<MockBackend>,
    creator: TensorWasmMemoryCreator<MockBackend>,
    placement: Placement,
    module: Module,
    linker: Linker<Data>,
}

impl Rig {
    fn new() -> Self {
        let backend = Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
            device_count: 2,
            ..MockConfig::default()
        }));
        let builder = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
            .all_devices()
            .backing(Backing::Managed);
        // SAFETY: nothing but the creator's backend uses the devices' primary contexts here.
        let creator = unsafe { builder.recover_automatically() }.build().unwrap();
        let engine = creator.engine().unwrap();
        let mut linker = Linker::new(&engine);
        add_to_linker(&mut linker).unwrap();
        let placement = Placement::new([(D0, 1 << 30), (D1, 1 << 30)], PlacementPolicy::LeastHeld)
            .unwrap()
            .watch_fences(Arc::clone(&backend));
        Self {
            module: Module::new(&engine, GUEST).unwrap(),
            backend,
            creator,
            placement,
            linker,
        }
    }

    fn guest(&self, tenant: &Arc<Tenant>) -> (Store<Data>, Instance, Memory) {
        let data = TenantStore::new(&self.creator, tenant, ChargeMode::Touched, ());
        let mut store = new_store(self.module.engine(), data);
        let instance = instantiate(&mut store, &self.linker, &self.module).unwrap();
        let memory = instance.get_memory(&mut store, "memory").unwrap();
        (store, instance, memory)
    }

    fn tenant_on(&self, device: DeviceId, id: u64) -> Arc<Tenant> {
        let budgets = TenantBudgets::for_cap(16 * PAGE);
        self.placement
            .admit_on(
                device,
                id,
                format!("t{id}"),
                budgets,
                IsolationLevel::StreamIsolated,
            )
            .unwrap()
    }
}

fn prefetch(
    store: &mut Store<Data>,
    instance: &Instance,
    device: DeviceId,
) -> wasmtime::Result<i32> {
    let f = instance
        .get_typed_func::<i32, i32>(&mut *store, "prefetch")
        .unwrap();
    f.call(&mut *store, device.0 as i32)
}

/// Faults tenant `store`'s work on its stream through a device-access scope.
fn fault(rig: &Rig, store: &mut Store<Data>, memory: &Memory) {
    let scope = DeviceAccess::open(
        &mut *store,
        &rig.creator,
        memory,
        &[AccessRange::write(0, 64)],
    )
    .unwrap();
    // SAFETY: address 64 lies in the never-mapped first page: the simulated kernel faults
    // instead of writing (an illegal address), reported at the launch or at the close.
    let _ = unsafe { rig.backend.driver().enqueue_fill(scope.stream(), 64, 64, 1) };
    let err = scope.close().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ContextLost, "{err}");
}

#[test]
fn recover_traps_the_guests_of_a_faulted_device_and_serves_again() {
    let rig = Rig::new();
    let (alice, bob, carol) = (
        rig.tenant_on(D0, 1),
        rig.tenant_on(D0, 2),
        rig.tenant_on(D1, 3),
    );
    let (mut a, _, a_memory) = rig.guest(&alice);
    let (mut b, b_instance, _) = rig.guest(&bob);
    let (mut c, c_instance, _) = rig.guest(&carol);
    assert_eq!(
        prefetch(&mut b, &b_instance, D0).unwrap(),
        0,
        "works before"
    );
    fault(&rig, &mut a, &a_memory);
    assert!(rig.backend.device_fenced(D0));
    // What keeps the device fenced: Alice's and Bob's memories there, not Carol's.
    let mut blockers = rig.creator.recovery_blockers(D0);
    blockers.sort_by_key(|b| b.tenant);
    let named: Vec<_> = blockers
        .iter()
        .map(|b| (b.name.clone().unwrap(), b.memories, b.bytes))
        .collect();
    assert_eq!(
        named,
        [("t1".to_string(), 1, PAGE), ("t2".to_string(), 1, PAGE)]
    );

    // Bob's guest shared the lost context: its next `twm` call traps, typed.
    let trap = prefetch(&mut b, &b_instance, D0).expect_err("the guest traps");
    let err = trap.downcast_ref::<TwmError>().expect("a TwmError");
    assert!(
        matches!(err, TwmError::DeviceLost { op: "prefetch" }),
        "{err}"
    );
    assert_eq!(bob.stats().device_lost, 1);

    // The other device never notices; placement sends newcomers there.
    assert_eq!(prefetch(&mut c, &c_instance, D1).unwrap(), 0);
    let budgets = TenantBudgets::for_cap(16 * PAGE);
    let dave = rig
        .placement
        .admit(4, "dave", budgets, IsolationLevel::StreamIsolated)
        .unwrap();
    assert_eq!(dave.device(), D1, "the fenced device takes no one");
    assert!(rig.placement.devices()[0].fenced);
    let refused = rig
        .placement
        .admit_on(D0, 5, "erin", budgets, IsolationLevel::StreamIsolated);
    assert!(matches!(refused, Err(TwmError::Unplaceable { .. })));

    // Both Stores on the fenced device go: it recovers on its own, every charge back.
    drop(a);
    assert!(rig.backend.device_fenced(D0), "Bob's Store still holds it");
    let blockers = rig.creator.recovery_blockers(D0);
    assert_eq!(blockers.len(), 1);
    assert_eq!(
        blockers[0].name.as_deref(),
        Some("t2"),
        "Bob's Store, named"
    );
    drop(b);
    assert!(
        !rig.backend.device_fenced(D0),
        "recovered when the last Store went"
    );
    assert_eq!((alice.stats().held_bytes, bob.stats().held_bytes), (0, 0));
    let stats = rig.creator.stats();
    assert_eq!((stats.recoveries, stats.kept_memories), (1, 0));
    assert_eq!(stats.devices[0].health.faults, 1);
    assert_eq!(
        rig.backend.stats().live_allocations,
        1,
        "Carol's memory only"
    );
    assert!(!rig.placement.devices()[0].fenced);
    assert!(rig.creator.recovery_blockers(D0).is_empty());

    // The device serves again.
    let frank = rig.tenant_on(D0, 6);
    let (mut f, f_instance, _) = rig.guest(&frank);
    assert_eq!(prefetch(&mut f, &f_instance, D0).unwrap(), 0);
    assert_eq!(
        prefetch(&mut c, &c_instance, D1).unwrap(),
        0,
        "Carol never noticed"
    );
}

/// Another creator's idle slot pool on the same backend never keeps the device fenced: the
/// automatic recovery (when the faulting tenant's Store goes) has the pool give its slab up,
/// though that creator makes no call meanwhile; the pool serves again from a new slab.
#[test]
fn recover_does_not_wait_for_another_creators_idle_pool() {
    idle_pool_lets_the_device_recover(false);
}

/// The same with the pool's scrub-ahead thread (`CreatorBuilder::scrub_ahead`), which holds the
/// pool (and scrubbed the first guest's device-touched slot before the fault): the pool still
/// lets its slab go, and its new slab serves.
#[test]
fn recover_does_not_wait_for_a_pool_that_scrubs_ahead() {
    idle_pool_lets_the_device_recover(true);
}

fn idle_pool_lets_the_device_recover(scrub_ahead: bool) {
    let rig = Rig::new();
    let mut builder = TensorWasmMemoryCreator::builder(Arc::clone(&rig.backend))
        .device(D0)
        .backing(Backing::Managed)
        .pool(tensor_wasm_mem_core::PoolConfig::new(
            D0,
            [tensor_wasm_mem_core::SizeClass::new(4 * PAGE as usize, 2)],
        ));
    if scrub_ahead {
        builder = builder.scrub_ahead();
    }
    let pooled = builder.build().unwrap();
    let engine = pooled.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let module = Module::new(&engine, GUEST).unwrap();
    let pooled_guest = |id: u64| {
        let tenant = Tenant::new(
            id,
            format!("p{id}"),
            16 * PAGE,
            IsolationLevel::StreamIsolated,
        );
        let data = TenantStore::new(&pooled, &tenant, ChargeMode::Touched, ());
        let mut store = new_store(&engine, data);
        let instance = instantiate(&mut store, &linker, &module).unwrap();
        let result = prefetch(&mut store, &instance, D0);
        (store, result)
    };
    let (store, result) = pooled_guest(10);
    assert_eq!(result.unwrap(), 0, "the pool serves before");
    drop(store);
    if scrub_ahead {
        // Bounded, never timed: a loaded machine only waits longer.
        let start = std::time::Instant::now();
        while pooled.stats().pool.unwrap().scrubbed_ahead == 0 {
            assert!(start.elapsed().as_secs() < 60, "never scrubbed ahead");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    assert_eq!(pooled.stats().pool.unwrap().in_use(), 0, "the pool is idle");

    let alice = rig.tenant_on(D0, 1);
    let (mut a, _, a_memory) = rig.guest(&alice);
    fault(&rig, &mut a, &a_memory);
    assert!(rig.backend.device_fenced(D0));
    drop(a);
    assert!(
        !rig.backend.device_fenced(D0),
        "recovered when Alice's Store went, the idle pool's slab given up"
    );
    assert!(pooled.stats().pool.unwrap().slab_given_up);
    assert_eq!(alice.stats().held_bytes, 0);

    let (_store, result) = pooled_guest(11);
    assert_eq!(result.unwrap(), 0, "the pool serves again");
    assert!(
        !pooled.stats().pool.unwrap().slab_given_up,
        "from a new slab"
    );
}

/// An open device-access scope is device work: a recovery meanwhile is refused with the scope
/// counted among the calls in flight (the kernels the embedder launches in it are never under
/// a reset), and the count goes when the scope closes. A scope forgotten with `mem::forget`
/// holds the device only until its Store goes.
#[test]
fn recover_waits_for_an_open_device_access_scope() {
    let rig = Rig::new();
    let (alice, bob) = (rig.tenant_on(D0, 1), rig.tenant_on(D0, 2));
    let (mut a, _, a_memory) = rig.guest(&alice);
    let (mut b, _, b_memory) = rig.guest(&bob);
    let refusal = |expect: &str| {
        // SAFETY: nothing but the creator's backend uses the devices' primary contexts here.
        let err = unsafe { rig.creator.recover(D0) }.expect_err("still in use");
        assert_eq!(err.kind(), ErrorKind::ContextLost, "{err}");
        assert!(err.to_string().contains(expect), "{err}");
    };
    let scope = DeviceAccess::open(&mut b, &rig.creator, &b_memory, &[AccessRange::read(0, 64)])
        .expect("a scope on the healthy device");
    fault(&rig, &mut a, &a_memory);
    refusal("(1 calls in flight)");
    let closed = scope.close().expect_err("its wait sees the lost context");
    assert_eq!(closed.kind(), ErrorKind::ContextLost, "{closed}");
    refusal("(0 calls in flight)");
    let refused = DeviceAccess::open(&mut b, &rig.creator, &b_memory, &[AccessRange::read(0, 64)]);
    let err = refused.expect_err("no scope opens on the fenced device");
    assert_eq!(err.kind(), ErrorKind::ContextLost, "{err}");
    drop((a, b));
    assert!(
        !rig.backend.device_fenced(D0),
        "recovered when the Stores went"
    );

    // A forgotten scope: its device work ends with its Store.
    let carol = rig.tenant_on(D0, 3);
    let dave = rig.tenant_on(D0, 4);
    let (mut c, _, c_memory) = rig.guest(&carol);
    let (mut d, _, d_memory) = rig.guest(&dave);
    let scope = DeviceAccess::open(&mut c, &rig.creator, &c_memory, &[AccessRange::read(0, 64)])
        .expect("a scope");
    // Forgotten (never dropped), but kept reachable: its few hundred bytes are the leak
    // `mem::forget` means, not one for LeakSanitizer to report.
    static FORGOTTEN: std::sync::atomic::AtomicPtr<u8> =
        std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());
    FORGOTTEN.store(
        Box::into_raw(Box::new(scope)).cast(),
        std::sync::atomic::Ordering::Relaxed,
    );
    fault(&rig, &mut d, &d_memory);
    drop(d);
    assert!(
        rig.backend.device_fenced(D0),
        "Carol's Store (and its scope) hold it"
    );
    refusal("(1 calls in flight)");
    let again = DeviceAccess::open(&mut c, &rig.creator, &c_memory, &[AccessRange::read(0, 64)]);
    let err = again.expect_err("no scope opens on the fenced device, a forgotten one held or not");
    assert_eq!(err.kind(), ErrorKind::ContextLost, "{err}");
    refusal("(1 calls in flight)");
    drop(c);
    assert!(
        !rig.backend.device_fenced(D0),
        "recovered when the forgotten scope's Store went"
    );
    assert_eq!((carol.stats().held_bytes, dave.stats().held_bytes), (0, 0));
}

/// Where nothing of a live Store is in the primary context (guarded pageable memory, shared
/// tenants on the default stream), an open scope is what holds the device: the automatic
/// recovery refused while it was open runs when it closes, with the Store still alive.
#[test]
fn recover_runs_when_the_scope_that_held_it_closes() {
    let backend = common::pageable_mock();
    let builder = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .backing(Backing::Guarded(tensor_wasm_mem_core::HostAccess::Pageable));
    // SAFETY: nothing but the creator's backend uses the device's primary context here.
    let creator = unsafe { builder.recover_automatically() }.build().unwrap();
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let module = Module::new(&engine, GUEST).unwrap();
    let guest = |id: u64| {
        let tenant = Tenant::new(id, format!("s{id}"), 16 * PAGE, IsolationLevel::Shared);
        let data = TenantStore::new(&creator, &tenant, ChargeMode::Touched, ());
        let mut store = new_store(&engine, data);
        let instance = instantiate(&mut store, &linker, &module).unwrap();
        let memory = instance.get_memory(&mut store, "memory").unwrap();
        (store, memory)
    };
    let (mut x, x_memory) = guest(1);
    let (mut y, y_memory) = guest(2);
    let scope = DeviceAccess::open(&mut y, &creator, &y_memory, &[AccessRange::read(0, 64)])
        .expect("Y's scope on the healthy device");
    {
        let faulting =
            DeviceAccess::open(&mut x, &creator, &x_memory, &[AccessRange::write(0, 64)]).unwrap();
        // SAFETY: address 64 lies in the never-mapped first page: the simulated kernel faults.
        let _ = unsafe { backend.driver().enqueue_fill(faulting.stream(), 64, 64, 1) };
        let err = faulting.close().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ContextLost, "{err}");
    }
    assert!(backend.device_fenced(D0));
    drop(x);
    assert!(backend.device_fenced(D0), "Y's open scope holds it");
    let _ = scope.close();
    assert!(
        !backend.device_fenced(D0),
        "recovered when the scope closed, Y's Store alive"
    );
    assert_eq!(creator.stats().recoveries, 1);
    let scope = DeviceAccess::open(&mut y, &creator, &y_memory, &[AccessRange::read(0, 64)])
        .expect("Y's scopes open again");
    scope.close().expect("and close");
}

/// A fault names one suspect on the backend, whichever creator's launch claims it first (every
/// creator on the backend asks the backend, so two creators' tenants whose waits both saw it
/// are not both counted in `TenantStats::kernel_faults`).
#[test]
fn a_fault_is_claimed_once_on_the_backend() {
    let rig = Rig::new();
    let backend = &rig.backend;
    assert!(backend.claim_fault(D0, 1), "the first claimant");
    assert!(
        !backend.claim_fault(D0, 1),
        "a second claimant of the same fault"
    );
    assert!(
        backend.claim_fault(D1, 1),
        "another device's fault is its own"
    );
    assert!(backend.claim_fault(D0, 2), "the next fault");
    assert!(!backend.claim_fault(D0, 1), "an older fault");
    assert!(
        !backend.claim_fault(DeviceId(9), 1),
        "a device the backend does not have"
    );
}

/// A Store whose instantiation was refused on a fenced device holds nothing there: the
/// automatic recovery runs as the refusal comes back. (Before, nothing tried it again: a
/// refused acquisition, which may have been scrubbing the slot that held back the recovery the
/// last Store there tried, left the device fenced with no user until the embedder called
/// `recover`.)
#[test]
fn a_refused_instantiation_on_a_fenced_device_lets_it_recover() {
    let backend = Arc::new(MockBackend::default());
    let builder = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .backing(Backing::Managed)
        .pool(tensor_wasm_mem_core::PoolConfig::new(
            D0,
            [tensor_wasm_mem_core::SizeClass::new(4 * PAGE as usize, 2)],
        ));
    // SAFETY: nothing but the creator's backend uses the device's primary context here.
    let creator = unsafe { builder.recover_automatically() }.build().unwrap();
    let engine = creator.engine().unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let module = Module::new(&engine, GUEST).unwrap();
    let tenant = Tenant::new(1, "t", 16 * PAGE, IsolationLevel::StreamIsolated);
    let guest = || {
        let data = TenantStore::new(&creator, &tenant, ChargeMode::Touched, ());
        let mut store = new_store(&engine, data);
        instantiate(&mut store, &linker, &module).map(|instance| (store, instance))
    };
    // A guest whose prefetch reaches the device: its slot's next scrub is a device memset.
    let (mut store, instance) = guest().unwrap();
    assert_eq!(prefetch(&mut store, &instance, D0).unwrap(), 0);
    drop(store);
    // That memset meets a sticky fault: the context is lost as the next guest's slot is
    // scrubbed, and the instantiation is refused, typed.
    backend
        .driver()
        .fail_call(tensor_wasm_mem_mock::Call::Memset, 1, 700);
    let err = guest().map(drop).unwrap_err();
    let err = err.downcast_ref::<TwmError>().expect("typed");
    assert_eq!(err.kind(), ErrorKind::ContextLost, "{err}");
    // It held nothing: the device recovered as the refusal came back, and serves again.
    assert!(!backend.device_fenced(D0), "recovered");
    assert_eq!(creator.stats().recoveries, 1);
    let (mut store, instance) = guest().unwrap();
    assert_eq!(prefetch(&mut store, &instance, D0).unwrap(), 0);
    drop(store);
    assert_eq!(tenant.stats().held_bytes, 0);
}

/// Many threads, each a tenant's guests on a guarded pool that grow, advise and now and then
/// fault the device through a scope, recovering as they go: once every Store is gone the device
/// is not fenced, the driver holds no stream, and every slot is free. (A red team found a
/// stream's release refused while another thread's recovery looked at the device: its record
/// stayed, counted in use by every later recovery, and the device fenced for good; and a
/// growth refused on the fenced device withdrew its slot for good.)
#[test]
fn concurrent_faults_and_recoveries_leave_nothing_behind() {
    for access in [
        tensor_wasm_mem_core::HostAccess::Pageable,
        tensor_wasm_mem_core::HostAccess::Registered,
    ] {
        let pageable = access == tensor_wasm_mem_core::HostAccess::Pageable;
        let backend = Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
            pageable_memory_access: pageable,
            host_registration: !pageable,
            ..MockConfig::default()
        }));
        let builder = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
            .backing(Backing::Guarded(access))
            .pool(tensor_wasm_mem_core::PoolConfig::new(
                D0,
                [tensor_wasm_mem_core::SizeClass::new(4 * PAGE as usize, 6)],
            ));
        // SAFETY: nothing but the creator's backend uses the device's primary context here.
        let creator = unsafe { builder.recover_automatically() }.build().unwrap();
        let engine = creator.engine().unwrap();
        let linker = Linker::new(&engine);
        let module = Module::new(
            &engine,
            r#"(module (memory (export "memory") 1 4)
                 (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0))))"#,
        )
        .unwrap();
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (creator, backend, engine, linker, module) =
                    (&creator, &backend, &engine, &linker, &module);
                s.spawn(move || {
                    let tenant = Tenant::new(
                        t,
                        format!("t{t}"),
                        16 * PAGE,
                        IsolationLevel::StreamIsolated,
                    );
                    for i in 0..1500u64 {
                        let data = TenantStore::new(creator, &tenant, ChargeMode::Touched, ());
                        let mut store = new_store(engine, data);
                        // Refused while the device is fenced: the next one tries again.
                        let Ok(instance) = instantiate(&mut store, linker, module) else {
                            continue;
                        };
                        let memory = instance.get_memory(&mut store, "memory").unwrap();
                        let grow = instance
                            .get_typed_func::<i32, i32>(&mut store, "grow")
                            .unwrap();
                        let _ = grow.call(&mut store, 1 + (i % 3) as i32);
                        let _ = creator.advise(
                            &store,
                            &memory,
                            0,
                            PAGE,
                            tensor_wasm_mem_core::Advice::SetReadMostly,
                        );
                        if i % 16 == t % 16
                            && let Ok(scope) = DeviceAccess::open(
                                &mut store,
                                creator,
                                &memory,
                                &[AccessRange::write(0, 64)],
                            )
                        {
                            // SAFETY: address 64 lies in the never-mapped first page: the
                            // simulated kernel faults instead of writing.
                            let _ =
                                unsafe { backend.driver().enqueue_fill(scope.stream(), 64, 64, 1) };
                            let _ = scope.close();
                        }
                    }
                });
            }
        });
        creator.retry_releases();
        let pool = creator.stats().pool.unwrap();
        assert!(
            creator.stats().recoveries > 0,
            "{access:?}: faults were made"
        );
        assert!(!backend.device_fenced(D0), "{access:?}: recovered");
        assert_eq!(backend.driver().stats().live_streams, 0, "{access:?}");
        assert_eq!(
            (
                pool.in_use(),
                pool.withdrawn(),
                creator.stats().kept_memories
            ),
            (0, 0, 0),
            "{access:?}: {pool:?}"
        );
        assert_eq!(backend.stats().attached_host_ranges, 0, "{access:?}");
    }
}

/// A wait for a context-isolated tenant's stream that meets a reset of the device's primary
/// context waits it out: the tenant's own context is not reset, its work may still run, and a
/// wait refused as "lost" would have its memories given back (scrubbed, handed on) under that
/// work. (A stream of the primary context is another matter: the reset ends its work.)
#[test]
fn a_wait_on_a_tenants_own_context_outlasts_a_primary_reset() {
    use tensor_wasm_mem_core::{StreamProvider, TenantId, TenantKey};
    let backend = Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
        deferred_streams: true,
        ..MockConfig::default()
    }));
    let own = backend
        .acquire_stream(
            TenantKey::fresh(TenantId(1)),
            IsolationLevel::ContextIsolated,
        )
        .unwrap();
    // Another tenant's kernel faults in the primary context: the device is fenced.
    let shared = backend
        .acquire_stream(
            TenantKey::fresh(TenantId(2)),
            IsolationLevel::StreamIsolated,
        )
        .unwrap();
    // SAFETY: address 64 lies in no allocation: the simulated kernel faults instead of writing.
    unsafe { backend.driver().enqueue_fill(&shared, 64, 64, 1) }.unwrap();
    assert!(backend.synchronize(&shared).is_err());
    assert!(backend.device_fenced(D0));
    // Its context lost to the fault: the release answers so.
    let released = backend.release_stream(shared);
    assert!(
        released
            .as_ref()
            .is_err_and(|e| tensor_wasm_mem_core::BackendError::kind(e)
                == tensor_wasm_mem_core::ErrorKind::ContextLost),
        "{released:?}"
    );
    // A recovery resets the primary context, held in the middle of its reset.
    let held = backend
        .driver()
        .hold_next(tensor_wasm_mem_mock::Call::PrimaryCtxReset);
    let backend_ref = &*backend;
    std::thread::scope(|s| {
        // SAFETY: nothing but this backend uses the device's primary context here.
        let recovering = s.spawn(move || unsafe { backend_ref.recover_device(D0) });
        assert!(
            held.wait(std::time::Duration::from_secs(60)),
            "the reset began"
        );
        let key = own.key();
        let waiting = s.spawn(move || backend_ref.wait_for(key));
        // Let the wait meet the reset under way (were it refused, it would return now).
        std::thread::sleep(std::time::Duration::from_millis(20));
        held.release();
        assert!(recovering.join().unwrap().unwrap().is_some(), "recovered");
        waiting
            .join()
            .unwrap()
            .expect("the wait outlasted the reset, not refused as lost");
    });
    backend.release_stream(own).unwrap();
}
