//! The device-visible guarded backing on the simulated driver, over its three configurations
//! (pageable memory access on; host registration only; neither): what each picks, out-of-bounds
//! accesses trapping by signal, growth attaching (and registering) what the guest can reach,
//! reused slots reading as zeros with default hints, and ranges the device cannot see refused
//! by resolution, by the device-access scope, and by the simulated device itself.

mod common;

use std::sync::Arc;

use common::*;
use tensor_wasm_mem_core::{
    Advice, DeviceId, HostAccess, IsolationLevel, Location, ManagedAllocator, PoolConfig,
    SizeClass, StreamProvider, TenantId, TenantKey,
};
use tensor_wasm_mem_mock::{MockBackend, MockConfig};
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Memory, Store};
use tensor_wasm_mem_wasmtime::{
    AccessRange, Backing, BoundsStrategy, DeviceAccess, TenantStore, TensorWasmMemoryCreator,
    TwmError,
};

type Data = TenantStore<MockBackend>;

const PAGEABLE: Backing = Backing::Guarded(HostAccess::Pageable);
const REGISTERED: Backing = Backing::Guarded(HostAccess::Registered);

/// A simulated machine with pageable memory access and host registration as given.
fn machine(pageable: bool, registration: bool) -> Arc<MockBackend> {
    Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
        pageable_memory_access: pageable,
        host_registration: registration,
        deferred_streams: true,
        ..MockConfig::default()
    }))
}

/// Each backing on the machine that offers it.
fn each_backing() -> [(Backing, Arc<MockBackend>); 3] {
    [
        (PAGEABLE, machine(true, false)),
        (REGISTERED, machine(false, true)),
        (Backing::Managed, machine(false, false)),
    ]
}

fn make(backend: &Arc<MockBackend>, backing: Backing) -> TensorWasmMemoryCreator<MockBackend> {
    let builder = TensorWasmMemoryCreator::builder(Arc::clone(backend))
        .backing(backing)
        .allow_untenanted();
    // SAFETY: nothing but the creator's backend uses the device's primary context here.
    unsafe { builder.recover_automatically() }
        .build()
        .expect("creator")
}

fn pooled_creator(
    backend: &Arc<MockBackend>,
    backing: Backing,
) -> TensorWasmMemoryCreator<MockBackend> {
    TensorWasmMemoryCreator::builder(Arc::clone(backend))
        .backing(backing)
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 * PAGE, 1)]))
        .allow_untenanted()
        .build()
        .expect("pooled creator")
}

#[test]
fn the_backing_is_picked_from_what_the_device_reports() {
    let pick = |pageable, registration| {
        let backend = machine(pageable, registration);
        TensorWasmMemoryCreator::builder(backend)
            .build()
            .unwrap()
            .backing()
    };
    assert_eq!(pick(true, true), PAGEABLE);
    assert_eq!(pick(true, false), PAGEABLE);
    // Registration trades a kernel's bandwidth for the guest's speed: never picked unasked.
    assert_eq!(pick(false, true), Backing::Managed);
    assert_eq!(pick(false, false), Backing::Managed);
    assert_eq!(
        fresh(&mock()).backing(),
        Backing::Managed,
        "the default mock"
    );

    // Forcing a backing the device cannot serve is a typed error naming the device.
    let refused = |backend: Arc<MockBackend>, backing| {
        TensorWasmMemoryCreator::builder(backend)
            .backing(backing)
            .build()
            .unwrap_err()
    };
    let e = refused(machine(false, true), PAGEABLE);
    assert!(matches!(
        e,
        TwmError::BackingUnavailable {
            device: DeviceId(0),
            access: HostAccess::Pageable,
            ..
        }
    ));
    assert_eq!(e.kind(), tensor_wasm_mem_core::ErrorKind::Unsupported);
    assert!(matches!(
        refused(machine(true, false), REGISTERED),
        TwmError::BackingUnavailable {
            access: HostAccess::Registered,
            ..
        }
    ));
    // An embedder can always force managed memory.
    assert_eq!(
        make(&machine(true, true), Backing::Managed).backing(),
        Backing::Managed
    );

    // Names parse back.
    for backing in Backing::ALL {
        assert_eq!(backing.name().parse::<Backing>().unwrap(), backing);
    }
    assert!("guarded".parse::<Backing>().is_err());
}

#[test]
fn guarded_backings_get_the_guard_page_config_and_honest_capabilities() {
    for (backing, backend) in each_backing() {
        let creator = make(&backend, backing);
        let caps = creator.capabilities();
        let guarded = backing != Backing::Managed;
        assert_eq!(caps.guard_pages, guarded, "{backing}");
        assert!(caps.device_accessible && caps.host_accessible, "{backing}");
        assert_eq!(caps.managed, backing != REGISTERED, "{backing}: migrates");
        assert_eq!(
            matches!(
                BoundsStrategy::for_capabilities(&caps),
                BoundsStrategy::GuardPages { .. }
            ),
            guarded,
            "{backing}"
        );
        assert_eq!(creator.stats().backing, backing);
    }
}

#[test]
fn every_out_of_bounds_form_traps_on_every_backing() {
    for (backing, backend) in each_backing() {
        let creator = make(&backend, backing);
        let (mut store, instance, memory) = tenant_store(&creator, 1);
        let load8 = func::<_, i32, i32>(&mut store, &instance, "load8");
        let load32 = func::<_, i32, i32>(&mut store, &instance, "load32");
        let load_off = func::<_, i32, i32>(&mut store, &instance, "load_off");
        let store32 = func::<_, (i32, i32), ()>(&mut store, &instance, "store32");
        let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
        let end = PAGE as i32;
        store32.call(&mut store, (end - 4, 5)).unwrap();
        assert_eq!(load32.call(&mut store, end - 4).unwrap(), 5, "{backing}");
        let trap = load8.call(&mut store, end).unwrap_err();
        assert!(is_oob(&trap), "{backing}");
        // A guarded backing traps by signal on a guard page (no bounds check was compiled),
        // managed memory by its explicit check.
        assert_eq!(
            format!("{trap:?}").contains("memory fault at wasm address"),
            backing != Backing::Managed,
            "{backing}: {trap:?}"
        );
        assert!(
            is_oob(&load32.call(&mut store, end - 2).unwrap_err()),
            "{backing}"
        );
        assert!(
            is_oob(&load_off.call(&mut store, 0).unwrap_err()),
            "{backing}"
        );
        for addr in [2 * end, i32::MAX, -1] {
            assert!(
                is_oob(&store32.call(&mut store, (addr, 1)).unwrap_err()),
                "{backing}: store at {addr}"
            );
        }
        let base = memory.data_ptr(&store);
        assert_eq!(grow.call(&mut store, 3).unwrap(), 1, "{backing}");
        assert_eq!(
            memory.data_ptr(&store),
            base,
            "{backing}: growth never moves"
        );
        assert_eq!(load8.call(&mut store, 4 * end - 1).unwrap(), 0, "{backing}");
        assert!(
            is_oob(&load8.call(&mut store, 4 * end).unwrap_err()),
            "{backing}"
        );
        assert_eq!(
            grow.call(&mut store, 1).unwrap(),
            -1,
            "{backing}: past the maximum"
        );
        assert!(
            creator.resolve(&store, &memory, 0, 4 * PAGE as u64).is_ok(),
            "{backing}"
        );
        drop(store);
        assert_eq!(creator.stats().live_memories, 0, "{backing}");
        let stats = backend.stats();
        assert_eq!(stats.attached_host_ranges, 0, "{backing}: all detached");
        assert_eq!(stats.live_allocations, 0, "{backing}");
    }
}

#[test]
fn growth_attaches_and_registers_exactly_what_the_guest_can_reach() {
    // Registration: one registration per growth, each exactly the pages the growth opened.
    let backend = machine(false, true);
    let creator = make(&backend, REGISTERED);
    let (mut store, instance, memory) = tenant_store(&creator, 1);
    let base = memory.data_ptr(&store) as usize;
    let model = backend.driver();
    assert_eq!(model.registered_ranges(), vec![(base, PAGE)]);
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 2).unwrap(), 1);
    assert_eq!(
        model.registered_ranges(),
        vec![(base, PAGE), (base + PAGE, 2 * PAGE)]
    );
    assert_eq!(backend.stats().registered_host_bytes, 3 * PAGE as u64);
    drop(store);
    assert!(
        model.registered_ranges().is_empty(),
        "unregistered before unmap"
    );
    assert_eq!(model.stats().registered_ranges, 0);

    // Pageable access: attached (for advice and the backend's tables) as one range however
    // the memory grew, nothing registered; a guest's advice over all of it is one driver call.
    let backend = machine(true, true);
    let creator = make(&backend, PAGEABLE);
    let (mut store, instance, memory) = tenant_store(&creator, 1);
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    for _ in 0..3 {
        assert!(grow.call(&mut store, 1).unwrap() > 0);
    }
    let stats = backend.stats();
    assert_eq!(stats.attached_host_ranges, 1);
    assert_eq!(stats.attached_host_bytes, 4 * PAGE as u64);
    assert_eq!(stats.registered_host_bytes, 0);
    assert!(backend.driver().registered_ranges().is_empty());
    let advise = tensor_wasm_mem_mock::Call::Advise;
    let before = backend.driver().stats().entry_calls(advise);
    creator
        .advise(&store, &memory, 0, 4 * PAGE as u64, Advice::SetReadMostly)
        .unwrap();
    assert_eq!(backend.driver().stats().entry_calls(advise), before + 1);
    drop(store);
    assert_eq!(backend.stats().attached_host_ranges, 0);
}

/// A kernel may run across the boundary of two registrations (each growth registers its own
/// pages; the device maps each at its own address), as on a GPU (checked on an H200).
#[test]
fn a_kernel_spans_the_registrations_of_a_grown_memory() {
    let backend = machine(false, true);
    let creator = make(&backend, REGISTERED);
    let (mut store, instance, memory) = tenant_store(&creator, 1);
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
    assert_eq!(backend.driver().registered_ranges().len(), 2);
    let scope = DeviceAccess::open(
        &mut store,
        &creator,
        &memory,
        &[AccessRange::read_write(PAGE as u64 - 8, 16)],
    )
    .unwrap();
    let slice = scope.slice(0).unwrap();
    // SAFETY: the scope holds the Store until it closes and waits.
    unsafe {
        backend
            .driver()
            .enqueue_fill(scope.stream(), slice.device_ptr(), slice.len(), 7)
    }
    .unwrap();
    scope.close().unwrap();
    let load8 = func::<_, i32, i32>(&mut store, &instance, "load8");
    assert_eq!(load8.call(&mut store, PAGE as i32 - 8).unwrap(), 7);
    assert_eq!(load8.call(&mut store, PAGE as i32 + 7).unwrap(), 7);
    assert_eq!(backend.driver().stats().kernel_faults, 0);
}

#[test]
fn a_failed_registration_fails_the_growth_and_loses_nothing() {
    let backend = machine(false, true);
    let creator = make(&backend, REGISTERED);
    let (mut store, instance, memory) = tenant_store(&creator, 1);
    let store32 = func::<_, (i32, i32), ()>(&mut store, &instance, "store32");
    let load8 = func::<_, i32, i32>(&mut store, &instance, "load8");
    let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
    store32.call(&mut store, (8, 0x0102_0304)).unwrap();
    // The next registration answers out-of-memory (pinning can fail so on a real machine).
    backend
        .driver()
        .fail_call(tensor_wasm_mem_mock::Call::HostRegister, 1, 2);
    assert_eq!(
        grow.call(&mut store, 1).unwrap(),
        -1,
        "the growth fails, no trap"
    );
    assert_eq!(memory.data_size(&store), PAGE, "the size is unchanged");
    assert!(
        is_oob(&load8.call(&mut store, PAGE as i32).unwrap_err()),
        "the page stayed a guard"
    );
    assert_eq!(load8.call(&mut store, 8).unwrap(), 4, "data kept");
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1, "a later growth works");
    assert_eq!(backend.driver().registered_ranges().len(), 2);
}

#[test]
fn a_reused_slot_reads_as_zeros_with_default_hints() {
    for (backing, backend) in each_backing() {
        let creator = pooled_creator(&backend, backing);
        let (mut store, instance, memory) = tenant_store(&creator, 1);
        let fill = func::<_, (i32, i32, i32), ()>(&mut store, &instance, "fill");
        let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
        assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
        fill.call(&mut store, (0, 0x5a, 2 * PAGE as i32)).unwrap();
        let base = memory.data_ptr(&store);
        let advised = creator.advise(&store, &memory, 0, PAGE as u64, Advice::SetReadMostly);
        if backing == REGISTERED {
            let e = advised.unwrap_err();
            assert_eq!(
                e.kind(),
                tensor_wasm_mem_core::ErrorKind::Unsupported,
                "{e}"
            );
        } else {
            advised.unwrap();
        }
        drop(store);

        let (mut store, instance, memory) = tenant_store(&creator, 2);
        assert_eq!(memory.data_ptr(&store), base, "{backing}: the same slot");
        assert_eq!(
            memory.data_size(&store),
            PAGE,
            "{backing}: the new tenant's size"
        );
        let load8 = func::<_, i32, i32>(&mut store, &instance, "load8");
        let grow = func::<_, i32, i32>(&mut store, &instance, "grow");
        for at in [0, PAGE as i32 - 1] {
            assert_eq!(load8.call(&mut store, at).unwrap(), 0, "{backing}: at {at}");
        }
        assert!(
            is_oob(&load8.call(&mut store, PAGE as i32).unwrap_err()),
            "{backing}: the old tenant's second page is a guard again"
        );
        assert_eq!(grow.call(&mut store, 1).unwrap(), 1);
        assert_eq!(load8.call(&mut store, PAGE as i32).unwrap(), 0, "{backing}");
        if backing == PAGEABLE {
            let slice = creator.resolve(&store, &memory, 0, 1).unwrap();
            let probe = unsafe_probe(slice.device_ptr());
            let hints = backend.driver().hints(&probe, 0).unwrap();
            assert!(!hints.read_mostly, "hints reset before reuse");
        }
        let stats = creator.stats().pool.unwrap();
        assert_eq!(stats.acquisitions, 2, "{backing}");
        assert!(
            stats.bytes_scrubbed >= 2 * PAGE as u64,
            "{backing}: {stats:?}"
        );
        if backing == PAGEABLE {
            assert_eq!(stats.hint_resets, 1);
        }
        drop(store);
        assert_eq!(backend.stats().attached_host_ranges, 0, "{backing}");
    }
}

/// A hint reset refused as a guarded slot goes back (a transient driver error here; a device
/// fenced by another tenant's kernel fault does the same) leaves the slot's hints pending, not
/// the slot withdrawn: its next acquisition resets them before handing it on, and if that is
/// refused too, that acquisition is refused, typed, and the slot waits for the next.
#[test]
fn a_refused_hint_reset_is_made_by_the_slots_next_acquisition() {
    use tensor_wasm_mem_mock::Call;
    let backend = machine(true, false);
    let creator = pooled_creator(&backend, PAGEABLE);
    let (store, _, memory) = tenant_store(&creator, 1);
    let base = memory.data_ptr(&store);
    creator
        .advise(&store, &memory, 0, PAGE as u64, Advice::SetReadMostly)
        .unwrap();
    backend.driver().fail_call(Call::Advise, 1, 999);
    drop(store);
    let figures = |creator: &TensorWasmMemoryCreator<MockBackend>| {
        let s = creator.stats().pool.unwrap();
        (s.in_use(), s.free(), s.withdrawn(), s.hint_resets)
    };
    assert_eq!(figures(&creator), (0, 1, 0, 0), "back, its hints pending");

    // The next acquisition's reset is refused too: refused, typed; the slot waits.
    backend.driver().fail_call(Call::Advise, 1, 999);
    let engine = creator.engine().unwrap();
    let tenant = tensor_wasm_mem_wasmtime::Tenant::new(
        2,
        "t2",
        16 * PAGE as u64,
        IsolationLevel::StreamIsolated,
    );
    let mut store = tensor_wasm_mem_wasmtime::new_store(
        &engine,
        TenantStore::new(
            &creator,
            &tenant,
            tensor_wasm_mem_wasmtime::ChargeMode::Touched,
            (),
        ),
    );
    let module = access_module(&engine, 1, 4);
    let e = tensor_wasm_mem_wasmtime::instantiate(
        &mut store,
        &tensor_wasm_mem_wasmtime::wasmtime::Linker::new(&engine),
        &module,
    )
    .map(drop)
    .unwrap_err();
    let e = e.downcast_ref::<TwmError>().expect("typed");
    assert!(matches!(e, TwmError::Backend { .. }), "{e:?}");
    drop(store);
    assert_eq!(
        figures(&creator),
        (0, 1, 0, 0),
        "still waiting, not withdrawn"
    );
    assert_eq!(
        tenant.stats().held_bytes,
        0,
        "nothing charged for the refusal"
    );

    // The one after resets them and gets the slot, its hints a fresh allocation's.
    let (store, _, memory) = tenant_store(&creator, 3);
    assert_eq!(memory.data_ptr(&store), base, "the same slot");
    let slice = creator.resolve(&store, &memory, 0, 1).unwrap();
    let hints = backend
        .driver()
        .hints(&unsafe_probe(slice.device_ptr()), 0)
        .unwrap();
    assert!(!hints.read_mostly, "hints reset before reuse");
    assert_eq!(figures(&creator), (1, 0, 0, 1));
    drop(store);
    assert_eq!(backend.stats().attached_host_ranges, 0);
}

/// A handle naming one byte of host memory, to read the model's system-memory hints there.
fn unsafe_probe(ptr: u64) -> tensor_wasm_mem_core::Allocation {
    let ptr = std::ptr::NonNull::new(ptr as usize as *mut u8).unwrap();
    // SAFETY: the handle is only passed to the model's `hints`, which reads its address and
    // length; it is never freed or used for access.
    unsafe { tensor_wasm_mem_core::Allocation::from_raw_parts(ptr, 1, DeviceId(0)) }
}

#[test]
fn a_pool_refuses_what_its_slots_cannot_hold() {
    let backend = machine(true, false);
    let creator = pooled_creator(&backend, PAGEABLE);
    let engine = creator.engine().unwrap();
    let mut store = Store::new(&engine, ());
    // A memory whose minimum is larger than the slot: refused (by the limit the pool sets).
    let module = access_module(&engine, 8, 8);
    let e = Instance::new(&mut store, &module, &[]).unwrap_err();
    assert!(
        format!("{e:?}").contains("above the per-memory limit"),
        "{e:?}"
    );
    // One that only declares a larger maximum gets the slot (clamped to it), then exhaustion.
    let module = access_module(&engine, 1, 8);
    let _one = Instance::new(&mut store, &module, &[]).unwrap();
    let module = access_module(&engine, 1, 4);
    let e = Instance::new(&mut store, &module, &[]).unwrap_err();
    assert!(e.to_string().contains("exhausted"), "{e:?}");
    assert_eq!(creator.stats().pool.unwrap().exhaustions, 1);
}

#[test]
fn a_range_the_device_cannot_see_is_refused() {
    for (backing, backend) in each_backing() {
        let creator = make(&backend, backing);
        let (mut store, _instance, memory) = tenant_store(&creator, 1);
        let size = PAGE as u64;
        // Resolution and the scope refuse anything past the visible size before any work.
        assert!(matches!(
            creator.resolve(&store, &memory, size - 1, 2),
            Err(TwmError::GuestRange(_))
        ));
        let opened = DeviceAccess::open(
            &mut store,
            &creator,
            &memory,
            &[AccessRange::read_write(size, 1)],
        );
        assert!(matches!(opened, Err(TwmError::GuestRange(_))), "{backing}");
        assert_eq!(
            backend.driver().pending_work(),
            0,
            "{backing}: nothing queued"
        );
    }

    // The simulated device itself faults on a guard page (pageable access) or on a page that
    // is not registered: a kernel that strays past its slice cannot reach another byte. Grown
    // first or not: a grown memory has a registration per growth, and every one of them is
    // given up to the recovery (a red team found the second one kept the device fenced).
    for (backing, backend, grow) in [
        (PAGEABLE, machine(true, false), 0),
        (REGISTERED, machine(false, true), 0),
        (PAGEABLE, machine(true, false), 1),
        (REGISTERED, machine(false, true), 2),
    ] {
        let creator = make(&backend, backing);
        let (mut store, instance, memory) = tenant_store(&creator, 1);
        if grow > 0 {
            let grown = func::<_, i32, i32>(&mut store, &instance, "grow").call(&mut store, grow);
            assert_eq!(grown.unwrap(), 1, "{backing}");
        }
        let scope = DeviceAccess::open(
            &mut store,
            &creator,
            &memory,
            &[AccessRange::read_write(0, 8)],
        )
        .unwrap();
        let slice = scope.slice(0).unwrap();
        // Just past what the guest can reach (its first page and what it grew).
        let past = slice.device_ptr() + (1 + grow as u64) * PAGE as u64;
        // SAFETY: the scope holds the Store: nothing reads the bytes until it closes.
        unsafe { backend.driver().enqueue_fill(scope.stream(), past, 1, 1) }.unwrap();
        assert!(scope.close().is_err(), "{backing}: the stray kernel faults");
        assert_eq!(backend.driver().stats().kernel_faults, 1, "{backing}");
        // The fault is sticky for the primary context: the device is fenced until nothing of
        // the layer is left there. The tenant's stream dies with the context (its work was
        // abandoned), the pages are the host's (a registration is dropped by the reset), and
        // when the Store goes the device recovers: nothing kept, nothing charged, nothing
        // stranded, no registration left.
        let tenant = Arc::clone(store.data().limiter().tenant());
        let kept_mappings = creator.kept_mappings();
        assert!(backend.device_fenced(DeviceId(0)), "{backing}");
        drop(store);
        assert!(!backend.device_fenced(DeviceId(0)), "{backing}: recovered");
        let stats = creator.stats();
        assert_eq!((stats.kept_memories, stats.recoveries), (0, 1), "{backing}");
        assert_eq!(
            tenant.stats().held_bytes,
            0,
            "{backing}: the charge went back"
        );
        drop(creator);
        assert_eq!(kept_mappings.count(), 0, "{backing}");
        assert_eq!(tenant.stats().stranded_bytes, 0, "{backing}");
        assert_eq!(backend.stats().registered_host_bytes, 0, "{backing}");
        assert_eq!(backend.stats().attached_host_ranges, 0, "{backing}");
    }
}

#[test]
fn a_kernels_writes_reach_the_guest_after_close_on_every_backing() {
    for (backing, backend) in each_backing() {
        let creator = make(&backend, backing);
        let (mut store, instance, memory) = tenant_store(&creator, 1);
        let scope = DeviceAccess::open(
            &mut store,
            &creator,
            &memory,
            &[AccessRange::read_write(0, PAGE as u64)],
        )
        .unwrap();
        let slice = scope.slice(0).unwrap();
        // SAFETY: the scope holds the Store until it closes and waits.
        unsafe {
            backend
                .driver()
                .enqueue_fill(scope.stream(), slice.device_ptr(), slice.len(), 0xab)
        }
        .unwrap();
        // Managed and pageable memory migrate (a prefetch was queued too); registered memory
        // is read where it is.
        let queued = if backing == REGISTERED { 1 } else { 2 };
        assert_eq!(backend.driver().pending_work(), queued, "{backing}");
        scope.close().unwrap();
        let load8 = func::<_, i32, i32>(&mut store, &instance, "load8");
        assert_eq!(
            load8.call(&mut store, PAGE as i32 - 1).unwrap(),
            0xab,
            "{backing}"
        );
        if backing == PAGEABLE {
            let probe = unsafe_probe(slice_ptr(&creator, &store, &memory));
            assert_eq!(
                backend.driver().residency(&probe, 0).unwrap(),
                Some(Location::Device(DeviceId(0))),
                "the prefetch reached the system memory's pages"
            );
        }
    }
}

fn slice_ptr(
    creator: &TensorWasmMemoryCreator<MockBackend>,
    store: &Store<Data>,
    memory: &Memory,
) -> u64 {
    creator.resolve(store, memory, 0, 1).unwrap().device_ptr()
}

#[test]
fn advice_and_prefetch_reach_the_driver_on_pageable_memory_and_not_on_pinned_memory() {
    let backend = machine(true, false);
    let creator = make(&backend, PAGEABLE);
    let (store, _instance, memory) = tenant_store(&creator, 1);
    creator
        .advise(
            &store,
            &memory,
            0,
            PAGE as u64,
            Advice::SetPreferredLocation(Location::Host),
        )
        .unwrap();
    let probe = unsafe_probe(slice_ptr(&creator, &store, &memory));
    assert_eq!(
        backend
            .driver()
            .hints(&probe, 0)
            .unwrap()
            .preferred_location,
        Some(Location::Host)
    );
    let stream = backend
        .acquire_stream(
            TenantKey::fresh(TenantId(9)),
            IsolationLevel::StreamIsolated,
        )
        .unwrap();
    let device = Location::Device(DeviceId(0));
    creator
        .prefetch(&store, &memory, 0, PAGE as u64, device, &stream)
        .unwrap();
    assert_eq!(
        backend.driver().residency(&probe, 0).unwrap(),
        None,
        "queued"
    );
    backend.synchronize(&stream).unwrap();
    assert_eq!(backend.driver().residency(&probe, 0).unwrap(), Some(device));
    backend.release_stream(stream).unwrap();

    // Registered memory on a device without concurrent managed access (where registration is
    // the way to reach host memory): a prefetch has nothing to do and succeeds, no driver call;
    // advice is refused, typed.
    let backend = Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
        host_registration: true,
        concurrent_managed_access: false,
        ..MockConfig::default()
    }));
    let creator = make(&backend, REGISTERED);
    let (store, _instance, memory) = tenant_store(&creator, 1);
    let stream = backend
        .acquire_stream(
            TenantKey::fresh(TenantId(9)),
            IsolationLevel::StreamIsolated,
        )
        .unwrap();
    let prefetches = backend
        .driver()
        .stats()
        .entry_calls(tensor_wasm_mem_mock::Call::Prefetch);
    creator
        .prefetch(&store, &memory, 0, PAGE as u64, device, &stream)
        .unwrap();
    assert_eq!(
        backend
            .driver()
            .stats()
            .entry_calls(tensor_wasm_mem_mock::Call::Prefetch),
        prefetches
    );
    let e = creator
        .advise(&store, &memory, 0, 1, Advice::SetReadMostly)
        .unwrap_err();
    assert_eq!(
        e.kind(),
        tensor_wasm_mem_core::ErrorKind::Unsupported,
        "{e}"
    );
    backend.release_stream(stream).unwrap();
}
