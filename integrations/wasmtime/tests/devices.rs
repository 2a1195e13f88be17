//! Many devices: placement, a tenant's memory, stream and pool on its device, a full device or a
//! failed one affecting only the tenants on it. On 1, 2 and 8 simulated devices.

use std::sync::Arc;

use rstest::rstest;
use tensor_wasm_mem_core::{
    DeviceId, ErrorKind, IsolationLevel, Operation, PoolConfig, SizeClass, TenantBudgets,
};
use tensor_wasm_mem_mock::{MockBackend, MockConfig, code, with_config};
use tensor_wasm_mem_wasmtime::wasmtime::{Engine, Linker, Module, Store};
use tensor_wasm_mem_wasmtime::{
    AccessRange, ChargeMode, DeviceAccess, HasGuestContext, Placement, PlacementPolicy,
    TWM_ERR_BACKEND, TWM_ERR_UNKNOWN_DEVICE, TWM_OK, Tenant, TenantStore, TensorWasmMemoryCreator,
    TwmError, add_to_linker, instantiate, new_store,
};

const GUEST: &str = r#"(module
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1 4)
  (func (export "prefetch") (param i32) (result i32)
    (call $prefetch (i32.const 0) (i32.const 4096) (local.get 0)))
  (func (export "accessed_by") (param i32) (result i32)
    (call $advise (i32.const 0) (i32.const 4096) (i32.const 4) (local.get 0))))"#;

fn machine(devices: u32) -> Arc<MockBackend> {
    Arc::new(with_config(MockConfig {
        device_count: devices,
        ..MockConfig::default()
    }))
}

struct Rig {
    backend: Arc<MockBackend>,
    creator: TensorWasmMemoryCreator<MockBackend>,
    engine: Engine,
    module: Module,
    linker: Linker<TenantStore<MockBackend>>,
}

fn rig(devices: u32, pooled: bool) -> Rig {
    let backend = machine(devices);
    let mut builder = TensorWasmMemoryCreator::builder(Arc::clone(&backend)).all_devices();
    if pooled {
        builder = builder.pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 << 16, 2)]));
    }
    let creator = builder.build().unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(&engine, GUEST).unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    Rig {
        backend,
        creator,
        engine,
        module,
        linker,
    }
}

impl Rig {
    fn store(&self, tenant: &Arc<Tenant>) -> Store<TenantStore<MockBackend>> {
        new_store(
            &self.engine,
            TenantStore::new(&self.creator, tenant, ChargeMode::Touched, ()),
        )
    }

    fn instance(
        &self,
        store: &mut Store<TenantStore<MockBackend>>,
    ) -> wasmtime::Result<wasmtime::Instance> {
        instantiate(&mut *store, &self.linker, &self.module)
    }
}

fn call(
    store: &mut Store<TenantStore<MockBackend>>,
    i: &wasmtime::Instance,
    f: &str,
    a: i32,
) -> i32 {
    i.get_typed_func::<i32, i32>(&mut *store, f)
        .unwrap()
        .call(&mut *store, a)
        .unwrap()
}

fn budgets() -> TenantBudgets {
    TenantBudgets::for_cap(1 << 20)
}

#[rstest]
#[case(1)]
#[case(2)]
#[case(8)]
fn round_robin_places_each_device_in_turn(#[case] n: u32) {
    let placement = Placement::for_backend(&*machine(n), PlacementPolicy::RoundRobin).unwrap();
    let tenants: Vec<_> = (0..2 * n as u64)
        .map(|i| {
            placement
                .admit(
                    i,
                    format!("t{i}"),
                    budgets(),
                    IsolationLevel::StreamIsolated,
                )
                .unwrap()
        })
        .collect();
    for (i, t) in tenants.iter().enumerate() {
        assert_eq!(t.device(), DeviceId(i as u32 % n), "tenant {i}");
        assert_eq!(t.devices(), &[t.device()]);
    }
    for d in placement.devices() {
        assert_eq!((d.tenants, d.committed_bytes), (2, 2 << 20), "{d:?}");
    }
}

#[rstest]
#[case(1)]
#[case(2)]
#[case(8)]
fn least_held_places_where_the_ledgers_hold_least(#[case] n: u32) {
    let rig = rig(n, false);
    let placement = Placement::for_backend(&*rig.backend, PlacementPolicy::LeastHeld).unwrap();
    // The first tenant holds a memory; the next goes elsewhere while there is elsewhere.
    let first = placement
        .admit(0, "first", budgets(), IsolationLevel::StreamIsolated)
        .unwrap();
    assert_eq!(first.device(), DeviceId(0), "ties go to the lowest ordinal");
    let mut store = rig.store(&first);
    let _instance = rig.instance(&mut store).unwrap();
    assert!(first.stats().held_bytes > 0);
    let second = placement
        .admit(1, "second", budgets(), IsolationLevel::StreamIsolated)
        .unwrap();
    let expected = if n == 1 { 0 } else { 1 };
    assert_eq!(second.device(), DeviceId(expected));
    // With nothing held anywhere, ties go by committed bytes: device 0 has two tenants' worth
    // when n == 1, else the fewest committed wins.
    drop(store);
    assert_eq!(first.stats().held_bytes, 0);
    let third = placement
        .admit(2, "third", budgets(), IsolationLevel::StreamIsolated)
        .unwrap();
    let expected = if n <= 2 { 0 } else { 2 };
    assert_eq!(
        third.device(),
        DeviceId(expected),
        "{:?}",
        placement.devices()
    );
}

#[rstest]
#[case(1)]
#[case(2)]
#[case(8)]
fn a_tenants_memory_stream_and_pool_are_on_its_device(#[case] n: u32) {
    let rig = rig(n, true);
    let placement = Placement::for_backend(&*rig.backend, PlacementPolicy::RoundRobin).unwrap();
    let mut held = Vec::new();
    for d in 0..n {
        let tenant = placement
            .admit(
                u64::from(d),
                format!("t{d}"),
                budgets(),
                IsolationLevel::ContextIsolated,
            )
            .unwrap();
        assert_eq!(tenant.device(), DeviceId(d));
        let mut store = rig.store(&tenant);
        let instance = rig.instance(&mut store).unwrap();
        // Its own device is allowed; any other device is not the tenant's to use.
        assert_eq!(call(&mut store, &instance, "prefetch", d as i32), TWM_OK);
        assert_eq!(call(&mut store, &instance, "accessed_by", d as i32), TWM_OK);
        assert_eq!(
            call(&mut store, &instance, "prefetch", -1),
            TWM_OK,
            "the host always"
        );
        let other = (d + 1) % n.max(2);
        assert_eq!(
            call(&mut store, &instance, "prefetch", other as i32),
            TWM_ERR_UNKNOWN_DEVICE
        );
        assert_eq!(
            call(&mut store, &instance, "accessed_by", other as i32),
            TWM_ERR_UNKNOWN_DEVICE
        );
        let stream_device = store
            .data_mut()
            .guest_context()
            .stream()
            .unwrap()
            .stream()
            .device();
        assert_eq!(stream_device, DeviceId(d), "the guest stream");
        let memory = instance.get_memory(&mut store, "memory").unwrap();
        let scope = DeviceAccess::open(
            &mut store,
            &rig.creator,
            &memory,
            &[AccessRange::read(0, 64)],
        )
        .unwrap();
        assert_eq!(scope.device(), DeviceId(d), "the memory");
        scope.close().unwrap();
        assert_eq!(
            rig.creator.pool_on(DeviceId(d)).unwrap().stats().in_use(),
            1,
            "the pool slot"
        );
        held.push((tenant, store, instance));
    }
    let stats = rig.creator.stats();
    assert_eq!(stats.devices.len(), n as usize);
    for d in &stats.devices {
        assert_eq!(d.live_memories, 1, "{d:?}");
        assert_eq!(d.pool.as_ref().unwrap().in_use(), 1);
    }
    drop(held);
    assert!(
        rig.creator
            .stats()
            .devices
            .iter()
            .all(|d| d.live_memories == 0)
    );
}

#[rstest]
#[case(1)]
#[case(2)]
#[case(8)]
fn one_full_device_does_not_stop_tenants_on_the_others(#[case] n: u32) {
    // Each device takes 2 MiB of caps; its pool has two slots.
    let rig = rig(n, true);
    let placement = Placement::new(
        (0..n).map(|d| (DeviceId(d), 2 << 20)),
        PlacementPolicy::LeastHeld,
    )
    .unwrap();
    let on0: Vec<_> = (0..2)
        .map(|i| {
            placement
                .admit_on(
                    DeviceId(0),
                    i,
                    format!("full{i}"),
                    budgets(),
                    IsolationLevel::Shared,
                )
                .unwrap()
        })
        .collect();
    let refused = placement
        .admit_on(
            DeviceId(0),
            9,
            "one-too-many",
            budgets(),
            IsolationLevel::Shared,
        )
        .unwrap_err();
    assert!(
        matches!(&refused, TwmError::Unplaceable { cap, .. } if *cap == 1 << 20),
        "{refused}"
    );
    assert_eq!(refused.kind(), ErrorKind::LimitExceeded);
    // The two slots of device 0's pool are taken; a third memory there is refused ...
    let mut stores: Vec<_> = on0.iter().map(|t| rig.store(t)).collect();
    for s in &mut stores {
        rig.instance(s).unwrap();
    }
    let extra = Tenant::with_devices(
        20,
        "extra",
        budgets(),
        IsolationLevel::Shared,
        &[DeviceId(0)],
    )
    .unwrap();
    let mut extra_store = rig.store(&extra);
    assert!(
        rig.instance(&mut extra_store).is_err(),
        "device 0's pool is exhausted"
    );
    // ... and every other device still takes tenants and memories.
    for d in 1..n {
        let t = placement
            .admit(
                100 + u64::from(d),
                format!("d{d}"),
                budgets(),
                IsolationLevel::Shared,
            )
            .unwrap();
        assert_ne!(t.device(), DeviceId(0), "a full device takes no one");
        let mut s = rig.store(&t);
        rig.instance(&mut s).unwrap();
    }
    if n == 1 {
        let none = placement
            .admit(50, "nowhere", budgets(), IsolationLevel::Shared)
            .unwrap_err();
        assert!(matches!(
            none,
            TwmError::Unplaceable {
                available: 1,
                largest_room: 0,
                ..
            }
        ));
    }
    // A tenant gone gives its commitment back.
    drop(stores);
    drop(on0);
    assert_eq!(placement.devices()[0].committed_bytes, 0);
    assert!(placement.refusals() >= 1);
}

#[rstest]
#[case(1)]
#[case(2)]
#[case(8)]
fn a_failed_device_affects_only_the_tenants_on_it(#[case] n: u32) {
    let rig = rig(n, false);
    let placement = Placement::for_backend(&*rig.backend, PlacementPolicy::RoundRobin).unwrap();
    let tenants: Vec<_> = (0..n)
        .map(|d| {
            placement
                .admit(
                    u64::from(d),
                    format!("t{d}"),
                    budgets(),
                    IsolationLevel::StreamIsolated,
                )
                .unwrap()
        })
        .collect();
    // Every tenant has a live memory and a stream before the failure.
    let mut live: Vec<_> = tenants
        .iter()
        .map(|t| {
            let mut s = rig.store(t);
            let i = rig.instance(&mut s).unwrap();
            assert_eq!(call(&mut s, &i, "prefetch", t.device().0 as i32), TWM_OK);
            (s, i)
        })
        .collect();
    let failed = DeviceId(n - 1);
    assert!(rig.backend.driver().fail_device(failed, code::UNKNOWN));
    placement.set_available(failed, false).unwrap();
    for (t, (s, i)) in tenants.iter().zip(&mut live) {
        let answer = call(s, i, "prefetch", t.device().0 as i32);
        let fresh = rig.instance(&mut rig.store(t));
        if t.device() == failed {
            assert_ne!(answer, TWM_OK, "{} is on the failed device", t.name());
            let e = fresh.unwrap_err();
            assert!(format!("{e:#}").contains("999"), "{e:#}");
        } else {
            assert_eq!(answer, TWM_OK, "{} is not", t.name());
            fresh.unwrap();
        }
    }
    // The failed device takes no new tenant; the others still do (none at all with one).
    let next = placement.admit(99, "next", budgets(), IsolationLevel::StreamIsolated);
    match n {
        1 => assert!(matches!(
            next,
            Err(TwmError::Unplaceable { available: 0, .. })
        )),
        _ => assert_ne!(next.unwrap().device(), failed),
    }
    // Teardown still works on the failed device: nothing of anyone's leaks.
    drop(live);
    for t in &tenants {
        assert_eq!(t.stats().held_bytes, 0, "{}", t.name());
    }
    rig.backend.driver().restore_device(failed);
    assert_eq!(rig.backend.stats().live_allocations, 0);
}

#[test]
fn device_sets_and_served_devices_are_checked() {
    assert!(matches!(
        Tenant::with_devices(1, "t", budgets(), IsolationLevel::Shared, &[]),
        Err(TwmError::Devices(_))
    ));
    assert!(matches!(
        Tenant::with_devices(
            1,
            "t",
            budgets(),
            IsolationLevel::Shared,
            &[DeviceId(1), DeviceId(1)]
        ),
        Err(TwmError::Devices(_))
    ));
    let backend = machine(2);
    let unknown = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .devices(&[DeviceId(0), DeviceId(2)])
        .build()
        .unwrap_err();
    assert!(matches!(
        unknown,
        TwmError::UnknownDevice {
            device: DeviceId(2),
            count: 2
        }
    ));
    // A creator serving device 0 only refuses a memory for a tenant on device 1, typed.
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1))").unwrap();
    let tenant =
        Tenant::with_devices(1, "t1", budgets(), IsolationLevel::Shared, &[DeviceId(1)]).unwrap();
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let linker = Linker::new(&engine);
    let e = instantiate(&mut store, &linker, &module).unwrap_err();
    assert!(format!("{e:#}").contains("does not serve"), "{e:#}");
    assert_eq!(
        tenant.stats().touched_bytes,
        0,
        "the refused memory's charge went back"
    );
    // A tenant bound to two devices may use both, and its home is the first.
    let both = Tenant::with_devices(
        2,
        "t2",
        budgets(),
        IsolationLevel::Shared,
        &[DeviceId(1), DeviceId(0)],
    )
    .unwrap();
    assert_eq!(both.device(), DeviceId(1));
    assert!(both.may_use(DeviceId(0)) && both.may_use(DeviceId(1)) && !both.may_use(DeviceId(2)));
    assert!(matches!(
        Placement::new([], PlacementPolicy::LeastHeld),
        Err(TwmError::Devices(_))
    ));
    let p = Placement::new([(DeviceId(0), 1 << 30)], PlacementPolicy::LeastHeld).unwrap();
    assert!(matches!(
        p.admit_on(DeviceId(3), 1, "x", budgets(), IsolationLevel::Shared),
        Err(TwmError::UnknownDevice { .. })
    ));
    assert!(p.set_available(DeviceId(3), false).is_err());
}

#[test]
fn a_commitment_lasts_as_long_as_the_ledger_not_the_tenant() {
    use tensor_wasm_mem_core::{DevicePoolConfig, Stream, TenantDevicePool};
    let backend = machine(2);
    let placement = Placement::for_backend(&*backend, PlacementPolicy::RoundRobin).unwrap();
    let tenant = placement
        .admit(1, "pooled", budgets(), IsolationLevel::Shared)
        .unwrap();
    let device = tenant.device();
    let config = DevicePoolConfig {
        max_bytes: 0,
        release_threshold: 1 << 20,
    };
    let pool = TenantDevicePool::new(
        Arc::clone(&backend),
        Arc::clone(tenant.ledger()),
        device,
        &config,
    )
    .unwrap();
    let shared = Stream::new(
        tensor_wasm_mem_core::DriverStream::DEFAULT,
        tensor_wasm_mem_core::DriverContext::from_raw(0),
        IsolationLevel::Shared,
        tenant.ledger().key(),
    )
    .on_device(device);
    let buffer = pool.allocate(64 << 10, &shared).unwrap();
    drop(tenant);
    // The pool still holds the ledger, and charges on it: the device is still committed.
    let d = placement.devices()[device.0 as usize].clone();
    assert_eq!((d.tenants, d.committed_bytes), (1, 1 << 20), "{d:?}");
    assert!(
        d.held_bytes >= 64 << 10 && d.touched_bytes >= 64 << 10,
        "{d:?}"
    );
    pool.free(buffer, &shared).unwrap();
    drop(pool);
    let d = placement.devices()[device.0 as usize].clone();
    assert_eq!(
        (d.tenants, d.committed_bytes, d.held_bytes),
        (0, 0, 0),
        "{d:?}"
    );
}

#[rstest]
#[case(2)]
#[case(8)]
fn least_held_spreads_a_burst_of_admissions(#[case] n: u32) {
    let placement = Placement::for_backend(&*machine(n), PlacementPolicy::LeastHeld).unwrap();
    let tenants: Vec<_> = (0..n)
        .map(|i| {
            placement
                .admit(u64::from(i), "burst", budgets(), IsolationLevel::Shared)
                .unwrap()
        })
        .collect();
    let mut devices: Vec<u32> = tenants.iter().map(|t| t.device().0).collect();
    devices.sort_unstable();
    assert_eq!(
        devices,
        (0..n).collect::<Vec<_>>(),
        "one each, none holding yet"
    );
}

#[test]
fn a_device_that_cannot_report_its_memory_takes_no_tenant() {
    let backend = machine(2);
    assert!(backend.driver().fail_device(DeviceId(1), code::UNKNOWN));
    let placement = Placement::for_backend(&*backend, PlacementPolicy::RoundRobin).unwrap();
    backend.driver().restore_device(DeviceId(1));
    let d = placement.devices();
    assert!(d[0].available && !d[1].available, "{d:?}");
    assert_eq!(d[1].capacity_bytes, 0);
    for i in 0..3 {
        let t = placement
            .admit(i, "t", budgets(), IsolationLevel::Shared)
            .unwrap();
        assert_eq!(t.device(), DeviceId(0));
    }
}

#[test]
fn a_scope_or_a_prefetch_refuses_a_memory_on_another_device_than_the_guests_stream() {
    use tensor_wasm_mem_wasmtime::GuestContext;
    struct Data(GuestContext<MockBackend>);
    impl HasGuestContext<MockBackend> for Data {
        fn guest_context(&mut self) -> &mut GuestContext<MockBackend> {
            &mut self.0
        }
    }
    let rig = rig(2, false);
    let tenant = Tenant::with_devices(
        1,
        "t",
        budgets(),
        IsolationLevel::StreamIsolated,
        &[DeviceId(1)],
    )
    .unwrap();
    // No limiter: by default no memory is made at all (no tenant pays for it).
    let mut store = Store::new(
        &rig.engine,
        Data(GuestContext::new(rig.creator.clone(), &tenant)),
    );
    let module = Module::new(&rig.engine, "(module (memory (export \"memory\") 1))").unwrap();
    let e = wasmtime::Instance::new(&mut store, &module, &[]).unwrap_err();
    assert!(format!("{e:#}").contains("no tenant pays"), "{e:#}");
    // Where untenanted memories are allowed, the memory goes to the creator's default device
    // 0, the stream to device 1.
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&rig.backend))
        .all_devices()
        .allow_untenanted()
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let mut store = Store::new(&engine, Data(GuestContext::new(creator.clone(), &tenant)));
    let module = Module::new(&engine, "(module (memory (export \"memory\") 1))").unwrap();
    let instance = wasmtime::Instance::new(&mut store, &module, &[]).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    let e =
        DeviceAccess::open(&mut store, &creator, &memory, &[AccessRange::read(0, 64)]).unwrap_err();
    assert!(
        matches!(
            e,
            TwmError::DeviceMismatch {
                memory: DeviceId(0),
                stream: DeviceId(1)
            }
        ),
        "{e}"
    );
    // So does the guest's own prefetch (it was queued on the tenant's stream of device 1).
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let module = Module::new(
        &engine,
        r#"(module
          (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (func (export "prefetch") (param i32) (result i32)
            (call $prefetch (i32.const 0) (i32.const 64) (local.get 0))))"#,
    )
    .unwrap();
    let instance = linker.instantiate(&mut store, &module).unwrap();
    let prefetch = instance
        .get_typed_func::<i32, i32>(&mut store, "prefetch")
        .unwrap();
    let prefetches = rig.backend.driver().stats().calls(Operation::Prefetch);
    for location in [-1, 1] {
        assert_eq!(
            prefetch.call(&mut store, location).unwrap(),
            TWM_ERR_BACKEND,
            "to {location}"
        );
    }
    assert_eq!(
        rig.backend.driver().stats().calls(Operation::Prefetch),
        prefetches,
        "nothing asked of the driver"
    );
}

#[rstest]
#[case(true)]
#[case(false)]
fn accessed_by_a_peer_device_needs_peer_access(#[case] peers: bool) {
    let backend = Arc::new(with_config(MockConfig {
        device_count: 2,
        peer_access: peers,
        ..MockConfig::default()
    }));
    use tensor_wasm_mem_core::ManagedAllocator;
    assert_eq!(backend.can_access_peer(DeviceId(1), DeviceId(0)), peers);
    assert!(
        !backend.can_access_peer(DeviceId(0), DeviceId(0)),
        "not its own peer"
    );
    assert!(
        !backend.can_access_peer(DeviceId(0), DeviceId(7)),
        "no such device"
    );
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .all_devices()
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = Module::new(&engine, GUEST).unwrap();
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).unwrap();
    let tenant = Tenant::with_devices(
        1,
        "both",
        budgets(),
        IsolationLevel::StreamIsolated,
        &[DeviceId(0), DeviceId(1)],
    )
    .unwrap();
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, &linker, &module).unwrap();
    // Its memory is on device 0; device 1 is in its set.
    assert_eq!(call(&mut store, &instance, "accessed_by", 0), TWM_OK);
    assert_eq!(
        call(&mut store, &instance, "prefetch", 1),
        TWM_OK,
        "migration needs no peer"
    );
    let expected = if peers {
        TWM_OK
    } else {
        TWM_ERR_UNKNOWN_DEVICE
    };
    assert_eq!(call(&mut store, &instance, "accessed_by", 1), expected);
}
