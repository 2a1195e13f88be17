//! What an embedder meets in the first hour: every failure through the creator is a typed
//! `TwmError` whose `kind()` tells a denial from a failure, and the defaults fit together (a
//! pool too small for the plan's default maximum, a tenant that would take every slot).

use std::sync::Arc;

use tensor_wasm_mem_mock::Call;
use tensor_wasm_mem_wasmtime::Budget;
use tensor_wasm_mem_wasmtime::core::{ErrorKind, PoolError};
use tensor_wasm_mem_wasmtime::prelude::*;

const PAGE: usize = 64 << 10;

fn store(
    creator: &TensorWasmMemoryCreator<MockBackend>,
    engine: &Engine,
    tenant: &Arc<Tenant>,
) -> Store<TenantStore<MockBackend, ()>> {
    new_store(
        engine,
        TenantStore::new(creator, tenant, ChargeMode::Touched, ()),
    )
}

fn typed(error: &wasmtime::Error) -> &TwmError {
    error
        .downcast_ref::<TwmError>()
        .unwrap_or_else(|| panic!("not a TwmError: {error:#}"))
}

/// The memory `memory` that `wat` exports, instantiated in `store`.
fn exported_memory(
    store: &mut Store<TenantStore<MockBackend, ()>>,
    engine: &Engine,
    wat: &str,
) -> tensor_wasm_mem_wasmtime::wasmtime::Memory {
    let module = Module::new(engine, wat).unwrap();
    let instance = instantiate(&mut *store, &Linker::new(engine), &module).unwrap();
    instance.get_memory(&mut *store, "memory").unwrap()
}

fn pooled(slot_bytes: usize, slots: usize) -> TensorWasmMemoryCreator<MockBackend> {
    TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(slot_bytes, slots)],
        ))
        .build()
        .expect("creator")
}

#[test]
fn an_exhausted_pool_is_a_typed_denial() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 2)]))
        .slots_per_tenant(2)
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let linker = Linker::new(&engine);
    let module = Module::new(&engine, "(module (memory 1 1))").unwrap();
    let tenants: Vec<_> = (1..=3)
        .map(|id| Tenant::new(id, "t", 1 << 20, IsolationLevel::StreamIsolated))
        .collect();
    let mut stores: Vec<_> = tenants
        .iter()
        .map(|t| store(&creator, &engine, t))
        .collect();
    instantiate(&mut stores[0], &linker, &module).unwrap();
    instantiate(&mut stores[1], &linker, &module).unwrap();
    let error = instantiate(&mut stores[2], &linker, &module).unwrap_err();
    let twm = typed(&error);
    assert!(
        matches!(twm, TwmError::PoolExhausted { requested, device: DeviceId(0) } if *requested == PAGE as u64),
        "{twm:?}"
    );
    assert_eq!(twm.kind(), ErrorKind::PoolExhausted);
    assert!(twm.is_denial(), "the pool's size is a limit, not a failure");
    assert_eq!(tenants[2].stats().touched_bytes, 0, "nothing charged");
    // A slot given back serves the next.
    stores.remove(0);
    instantiate(&mut stores[1], &linker, &module).unwrap();
}

#[test]
fn a_memory_larger_than_every_slot_is_a_typed_limit() {
    let creator = pooled(PAGE, 4);
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    let mut store = store(&creator, &engine, &tenant);
    // Its minimum is past every slot: refused, typed, by the limit the pool sets.
    let module = Module::new(&engine, "(module (memory 2 2))").unwrap();
    let error = instantiate(&mut store, &Linker::new(&engine), &module).unwrap_err();
    let twm = typed(&error);
    assert!(
        matches!(
            twm,
            TwmError::Plan(_) | TwmError::Pool(PoolError::TooLarge { .. })
        ),
        "{twm:?}"
    );
    assert_eq!(twm.kind(), ErrorKind::LimitExceeded, "{twm:?}");
    // Only its declared maximum is: it gets the largest slot, and growth past it is refused
    // (-1 in the guest), not the instantiation.
    let memory = exported_memory(
        &mut store,
        &engine,
        "(module (memory (export \"memory\") 1 1024))",
    );
    assert!(
        memory.grow(&mut store, 1).is_err(),
        "no further than the slot"
    );
    assert_eq!(creator.limits().per_memory_limit(), PAGE as u64, "said so");
}

#[test]
fn a_driver_failure_at_allocation_is_a_typed_failure_naming_its_code() {
    let backend = Arc::new(MockBackend::default());
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    let mut store = store(&creator, &engine, &tenant);
    let module = Module::new(&engine, "(module (memory 1 1))").unwrap();
    backend.driver().fail_call(
        Call::AllocManaged,
        1,
        tensor_wasm_mem_mock::code::OUT_OF_MEMORY,
    );
    let error = instantiate(&mut store, &Linker::new(&engine), &module).unwrap_err();
    let twm = typed(&error);
    assert!(matches!(twm, TwmError::Backend { .. }), "{twm:?}");
    assert_eq!(twm.kind(), ErrorKind::OutOfMemory);
    assert!(!twm.is_denial(), "the driver broke: a failure");
    let text = format!("{twm}");
    assert!(text.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{text}");
    // The code and what to do, in one step each.
    assert_eq!(
        twm.driver_code(),
        Some(tensor_wasm_mem_mock::code::OUT_OF_MEMORY)
    );
    let hint = twm.hint().expect("the layer knows this code");
    assert!(hint.contains("out of memory"), "{hint}");
    assert!(text.contains(hint), "the Display says it too: {text}");
    assert_eq!(tenant.stats().touched_bytes, 0, "nothing charged");
}

#[test]
fn a_budget_denial_is_typed_with_its_kind() {
    let creator = pooled(PAGE, 4);
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t", PAGE as u64, IsolationLevel::StreamIsolated);
    let mut store = store(&creator, &engine, &tenant);
    let module = Module::new(&engine, "(module (memory 1 1) (memory 1 1))").unwrap();
    let error = instantiate(&mut store, &Linker::new(&engine), &module).unwrap_err();
    let twm = typed(&error);
    assert!(matches!(twm, TwmError::Denied { .. }), "{twm:?}");
    assert_eq!(twm.kind(), ErrorKind::CapExceeded);
    assert!(twm.is_denial());
    let stats = tenant.stats();
    assert_eq!(
        (
            stats.touched_denials,
            stats.held_denials,
            stats.memory_denials
        ),
        (1, 0, 0),
        "counted per budget"
    );
}

#[test]
fn a_pool_too_small_for_the_default_maximum_is_fitted_to_its_slots() {
    // The plan's default maximum is 256 MiB; the slots hold 1 MiB: a memory that declares no
    // maximum (what clang's C guests declare) gets a slot, not a refusal.
    let creator = pooled(1 << 20, 4);
    assert_eq!(creator.limits().default_maximum(), 1 << 20, "said so");
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    let mut store = store(&creator, &engine, &tenant);
    let memory = exported_memory(
        &mut store,
        &engine,
        "(module (memory (export \"memory\") 1))",
    );
    assert_eq!(memory.grow(&mut store, 15).unwrap(), 1, "grows to the slot");
    assert!(memory.grow(&mut store, 1).is_err(), "and no further");
    // A plan that fits is left alone.
    let fits = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .limits(PlanLimits::new(1 << 20).unwrap())
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 << 20, 2)]))
        .build()
        .unwrap();
    assert_eq!(fits.limits(), PlanLimits::new(1 << 20).unwrap());
}

#[test]
fn a_capped_tenant_cannot_take_every_slot_of_a_shared_pool_by_default() {
    // The first hour's case: four slots of 32 MiB, a tenant capped at 8 MiB (whose default held
    // budget would cover all four), and another tenant.
    let creator = pooled(32 << 20, 4);
    assert_eq!(creator.slots_per_tenant(), Some(2));
    let engine = creator.engine().unwrap();
    let linker = Linker::new(&engine);
    let module = Module::new(&engine, "(module (memory 1))").unwrap();
    let greedy = Tenant::new(1, "greedy", 8 << 20, IsolationLevel::StreamIsolated);
    let other = Tenant::new(2, "other", 8 << 20, IsolationLevel::StreamIsolated);
    let mut greedy_stores = Vec::new();
    let mut refusal = None;
    for _ in 0..4 {
        let mut s = store(&creator, &engine, &greedy);
        match instantiate(&mut s, &linker, &module) {
            Ok(_) => greedy_stores.push(s),
            Err(e) => {
                refusal = Some(typed(&e).to_string());
                assert!(matches!(
                    typed(&e),
                    TwmError::PoolShare {
                        held: 2,
                        share: 2,
                        ..
                    }
                ));
                assert!(typed(&e).is_denial());
                break;
            }
        }
    }
    assert_eq!(greedy_stores.len(), 2, "{refusal:?}");
    assert_eq!(
        creator.stats().share_denials,
        1,
        "the share's denial is counted"
    );
    let mut theirs = store(&creator, &engine, &other);
    instantiate(&mut theirs, &linker, &module).expect("the other tenant is served");
    // Shares go back with the memories.
    drop(greedy_stores);
    for _ in 0..2 {
        let mut s = store(&creator, &engine, &greedy);
        instantiate(&mut s, &linker, &module).unwrap();
    }
}

/// A CPU "kernel" over two float arrays of a guest, through one scope: `y = a * x + y` with
/// typed views of both ranges at once, and an error of the kernel composed with the scope's.
#[test]
fn typed_host_views_of_several_ranges_in_one_scope() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    let mut store = store(&creator, &engine, &tenant);
    let module = Module::new(
        &engine,
        r#"(module (memory (export "memory") 1)
             (func (export "y") (param i32) (result f32)
               (f32.load (i32.add (i32.const 4096) (i32.shl (local.get 0) (i32.const 2))))))"#,
    )
    .unwrap();
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    let ranges = [AccessRange::read(0, 64), AccessRange::read_write(4096, 64)];
    #[derive(Debug)]
    enum KernelError {
        Scope(TwmError),
    }
    impl From<TwmError> for KernelError {
        fn from(e: TwmError) -> Self {
            Self::Scope(e)
        }
    }
    let sum = DeviceAccess::try_run(
        &mut store,
        &creator,
        &memory,
        &ranges,
        ScopeOptions::default(),
        |scope| -> Result<f32, KernelError> {
            let mut views = scope.host_slices_mut::<f32>()?.expect("host-accessible");
            let (x, y) = views.split_at_mut(1);
            for (i, v) in x[0].iter_mut().enumerate() {
                *v = i as f32;
            }
            for (yi, xi) in y[0].iter_mut().zip(x[0].iter()) {
                *yi = 2.0 * xi + 1.0;
            }
            Ok(y[0].iter().sum())
        },
    )
    .unwrap();
    assert_eq!(sum, (0..16).map(|i| 2.0 * i as f32 + 1.0).sum::<f32>());
    let y = instance
        .get_typed_func::<i32, f32>(&mut store, "y")
        .unwrap();
    assert_eq!(
        y.call(&mut store, 5).unwrap(),
        11.0,
        "the guest sees the kernel's writes"
    );

    // Overlapping ranges are refused as mutable views; a misaligned one as f32.
    let overlap = [AccessRange::read(0, 64), AccessRange::read_write(32, 64)];
    let KernelError::Scope(e) = DeviceAccess::try_run(
        &mut store,
        &creator,
        &memory,
        &overlap,
        ScopeOptions::default(),
        |scope| -> Result<(), KernelError> {
            scope.host_slices_mut::<u8>()?;
            Ok(())
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            TwmError::OverlappingRanges {
                first: 0,
                second: 1
            }
        ),
        "{e:?}"
    );
    // An empty range between two that overlap hides nothing (it once stood between them in
    // the check, and two `&mut` views of the same bytes were handed out); empty ranges beside
    // ranges that only touch are fine.
    let hidden = [
        AccessRange::read_write(0, 100),
        AccessRange::read_write(10, 0),
        AccessRange::read_write(50, 10),
    ];
    // The byte views' lengths over `ranges`, or the scope's refusal.
    let mut view_lens = |ranges: &[AccessRange]| {
        DeviceAccess::try_run(
            &mut store,
            &creator,
            &memory,
            ranges,
            ScopeOptions::default(),
            |scope| {
                let views = scope.host_slices_mut::<u8>()?.expect("host-accessible");
                Ok::<_, TwmError>(views.iter().map(|v| v.len()).collect::<Vec<_>>())
            },
        )
    };
    let e = view_lens(&hidden).unwrap_err();
    assert!(
        matches!(
            e,
            TwmError::OverlappingRanges {
                first: 0,
                second: 2
            }
        ),
        "{e:?}"
    );
    let touching = [
        AccessRange::read_write(0, 10),
        AccessRange::read_write(10, 0),
        AccessRange::read_write(10, 0),
        AccessRange::read_write(10, 10),
    ];
    assert_eq!(view_lens(&touching).unwrap(), [10, 0, 0, 10]);
    let odd = [AccessRange::read(2, 8)];
    let e = DeviceAccess::try_run(
        &mut store,
        &creator,
        &memory,
        &odd,
        ScopeOptions::default(),
        |scope| scope.host_slices_mut::<f32>().map(|_| ()),
    )
    .unwrap_err();
    assert!(matches!(e, TwmError::HostView { range: 0, .. }), "{e:?}");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

/// A module whose memory is `(memory LIMITS)` and whose export `grow(pages)` is `memory.grow`.
fn growing_module(engine: &Engine, limits: &str) -> Module {
    let wat = format!(
        "(module (memory {limits}) \
           (func (export \"grow\") (param i32) (result i32) (memory.grow (local.get 0))))"
    );
    Module::new(engine, wat).unwrap()
}

/// A guest that grows its `(memory 1 3)` on request, for a tenant capped at `cap` bytes, with
/// every refused growth the limiter's hook sees logged.
struct Growing {
    store: Store<TenantStore<MockBackend, ()>>,
    grow: wasmtime::TypedFunc<i32, i32>,
    seen: Arc<std::sync::Mutex<Vec<tensor_wasm_mem_wasmtime::RefusedGrowth>>>,
}

impl Growing {
    fn new(backend: Arc<MockBackend>, tenant: &Arc<Tenant>) -> Self {
        use tensor_wasm_mem_wasmtime::TenantLimiter;
        let creator = TensorWasmMemoryCreator::builder(backend).build().unwrap();
        let engine = creator.engine().unwrap();
        let seen: Arc<std::sync::Mutex<Vec<_>>> = Arc::default();
        let log = Arc::clone(&seen);
        let limiter = TenantLimiter::new(Arc::clone(tenant), ChargeMode::Touched, creator.limits())
            .on_refused_growth(move |r| log.lock().unwrap().push(*r));
        let mut store = new_store(&engine, TenantStore::with_limiter(&creator, limiter, ()));
        let module = growing_module(&engine, "(export \"memory\") 1 3");
        let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
        let grow = instance.get_typed_func(&mut store, "grow").unwrap();
        Self { store, grow, seen }
    }

    fn grow(&mut self, pages: i32) -> i32 {
        self.grow.call(&mut self.store, pages).unwrap()
    }

    fn seen(&self) -> Vec<tensor_wasm_mem_wasmtime::RefusedGrowth> {
        self.seen.lock().unwrap().clone()
    }
}

/// The host sees a guest's refused growth as it happens, not only in the figures after.
#[test]
fn a_refused_growth_reaches_the_hosts_hook() {
    let tenant = Tenant::new(1, "t", 2 * PAGE as u64, IsolationLevel::StreamIsolated);
    let mut guest = Growing::new(Arc::new(MockBackend::default()), &tenant);
    assert_eq!(guest.grow(2), -1, "past the cap");
    assert_eq!(guest.grow(5), -1, "past the maximum");
    assert_eq!(guest.grow(1), 1, "within both");
    let seen = guest.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!((seen[0].current, seen[0].desired), (PAGE, 3 * PAGE));
    assert_eq!(seen[0].denial.map(|d| d.budget), Some(Budget::Touched));
    assert!(!seen[0].failed);
    assert_eq!(seen[1].denial, None, "a growth past the capacity");
    assert!(!seen[1].failed);
    assert_eq!(tenant.stats().refused_growths, 2, "counted for the tenant");
    assert_eq!(tenant.stats().touched_denials, 1, "one was a budget's");
    // A size the memory type cannot represent, after a granted growth: reported as itself,
    // never as the earlier growth failing.
    assert_eq!(guest.grow(-1), -1);
    let seen = guest.seen();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(!seen[2].failed, "{:?}", seen[2]);
    assert_ne!((seen[2].current, seen[2].desired), (PAGE, 2 * PAGE));
    assert_eq!(tenant.stats().refused_growths, 3);
}

/// Outside `instantiate`, a guest growing its empty memory is a growth like any other for
/// the host: refused, it reaches the hook and the figures.
#[test]
fn a_refused_growth_of_an_empty_memory_reaches_the_hook() {
    use tensor_wasm_mem_wasmtime::TenantLimiter;
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t", PAGE as u64, IsolationLevel::StreamIsolated);
    let seen: Arc<std::sync::Mutex<Vec<tensor_wasm_mem_wasmtime::RefusedGrowth>>> = Arc::default();
    let log = Arc::clone(&seen);
    let limiter = TenantLimiter::new(Arc::clone(&tenant), ChargeMode::Touched, creator.limits())
        .on_refused_growth(move |r| log.lock().unwrap().push(*r));
    let mut store = new_store(&engine, TenantStore::with_limiter(&creator, limiter, ()));
    let module = growing_module(&engine, "0 4");
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
    let grow = instance
        .get_typed_func::<i32, i32>(&mut store, "grow")
        .unwrap();
    assert_eq!(grow.call(&mut store, 2).unwrap(), -1, "past the cap");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!((seen[0].current, seen[0].desired), (0, 2 * PAGE));
    let stats = tenant.stats();
    assert_eq!((stats.refused_growths, stats.touched_denials), (1, 1));
}

/// A growth the budgets granted and the backend then failed (its zeroing refused) is -1 in the
/// guest, a failure for the hook, counted for the tenant, and charges nothing.
#[test]
fn a_growth_the_backend_fails_reaches_the_hook_as_a_failure() {
    // Fresh allocations that are not zero: a growth zeroes what it makes visible.
    let backend = Arc::new(tensor_wasm_mem_mock::with_config(
        tensor_wasm_mem_mock::MockConfig {
            poison_fresh_allocations: true,
            ..tensor_wasm_mem_mock::MockConfig::default()
        },
    ));
    let tenant = Tenant::new(1, "t", 4 * PAGE as u64, IsolationLevel::StreamIsolated);
    let mut guest = Growing::new(Arc::clone(&backend), &tenant);
    backend.driver().fail_call(Call::Memset, 1, 999);
    assert_eq!(guest.grow(1), -1, "the backend failed it");
    let seen = guest.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].failed && seen[0].denial.is_none(), "{:?}", seen[0]);
    assert_eq!((seen[0].current, seen[0].desired), (PAGE, 2 * PAGE));
    let stats = tenant.stats();
    assert_eq!(stats.refused_growths, 1);
    assert_eq!(
        stats.touched_bytes, PAGE as u64,
        "the failed growth's grant went back"
    );
    assert_eq!(guest.grow(1), 1, "the next one is served");
    assert_eq!(guest.seen().len(), 1);
}

/// A creator bound to one tenant serves Stores without books: its refusals reach the embedder
/// typed through `typed_error`, and its tenant, the pool's only one, may hold every slot.
#[test]
fn a_bound_creators_refusals_are_typed_and_its_tenant_may_use_every_slot() {
    let tenant = Tenant::new(1, "solo", 1 << 20, IsolationLevel::StreamIsolated);
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 2)]))
        .tenant(Arc::clone(&tenant), ChargeMode::Touched)
        .build()
        .unwrap();
    // Other tenants' Stores it serves have a share; its own tenant has no one to share with.
    assert_eq!(creator.slots_per_tenant(), Some(1));
    let engine = creator.engine().unwrap();
    let linker: Linker<()> = Linker::new(&engine);
    let module = Module::new(&engine, "(module (memory 1 1))").unwrap();
    let mut stores: Vec<Store<()>> = Vec::new();
    for _ in 0..2 {
        let mut s = Store::new(&engine, ());
        linker.instantiate(&mut s, &module).expect("a slot each");
        stores.push(s);
    }
    let mut third = Store::new(&engine, ());
    let error = linker.instantiate(&mut third, &module).unwrap_err();
    assert!(
        error.downcast_ref::<TwmError>().is_none(),
        "Wasmtime passes text on"
    );
    let error = creator.typed_error(error);
    let twm = typed(&error);
    assert!(matches!(twm, TwmError::PoolExhausted { .. }), "{twm:?}");
    assert!(twm.is_denial());
    assert_eq!(creator.stats().share_denials, 0);
    // Taken once: an error that is not that refusal comes back as it was.
    let other = creator.typed_error(wasmtime::Error::msg("something else"));
    assert!(other.downcast_ref::<TwmError>().is_none());
    assert_eq!(other.to_string(), "something else");
    // A memory past the slot on a bound creator: typed the same way (the limit the pool sets).
    drop(stores);
    let big = Module::new(&engine, "(module (memory 17 17))").unwrap();
    let error = linker.instantiate(&mut third, &big).unwrap_err();
    let error = creator.typed_error(error);
    assert!(matches!(typed(&error), TwmError::Plan(_)), "{error:?}");
}

/// A growth a bound creator's tenant budget denies is refused in the memory itself: -1 in the
/// guest, and counted for the tenant like a limiter's refusal.
#[test]
fn a_bound_creators_growth_denial_is_counted() {
    let tenant = Tenant::new(1, "solo", 2 * PAGE as u64, IsolationLevel::StreamIsolated);
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .tenant(Arc::clone(&tenant), ChargeMode::Touched)
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let module = growing_module(&engine, "1 4");
    let mut store = Store::new(&engine, ());
    let instance = Linker::new(&engine)
        .instantiate(&mut store, &module)
        .unwrap();
    let grow = instance
        .get_typed_func::<i32, i32>(&mut store, "grow")
        .unwrap();
    assert_eq!(grow.call(&mut store, 2).unwrap(), -1, "past the cap");
    let stats = tenant.stats();
    assert_eq!((stats.refused_growths, stats.touched_denials), (1, 1));
    assert_eq!(grow.call(&mut store, 1).unwrap(), 1, "within it");
    assert_eq!(tenant.stats().refused_growths, 1);
}

#[test]
fn the_c_guest_preset_gives_every_memory_a_slot() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .c_guests_on_pool(4, 8 << 20)
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(creator.limits().default_maximum(), 8 << 20);
    assert_eq!(creator.slots_per_tenant(), Some(2));
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "c", 16 << 20, IsolationLevel::StreamIsolated);
    let mut store = store(&creator, &engine, &tenant);
    // What clang emits for a C program: a memory with no maximum.
    let memory = exported_memory(
        &mut store,
        &engine,
        "(module (memory (export \"memory\") 2))",
    );
    assert_eq!(memory.grow(&mut store, 126).unwrap(), 2, "up to the slot");
    assert!(memory.grow(&mut store, 1).is_err());
    assert!(matches!(
        TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).c_guests_on_pool(4, 0),
        Err(TwmError::Plan(_))
    ));
}

/// A pool whose slots are larger than a default held budget: the denial says what to do, and
/// the creator's own budgets for the same cap fit a slot.
#[test]
fn a_held_budget_smaller_than_a_slot_says_what_to_do() {
    const SLOT: usize = 512 << 20; // past the default held budget of an 8 MiB cap (288 MiB)
    let creator = pooled(SLOT, 1);
    let engine = creator.engine().unwrap();
    let linker = Linker::new(&engine);
    let module = Module::new(&engine, "(module (memory 1))").unwrap();
    let default = Tenant::new(1, "default", 8 << 20, IsolationLevel::StreamIsolated);
    let mut first = store(&creator, &engine, &default);
    let error = instantiate(&mut first, &linker, &module).unwrap_err();
    let twm = typed(&error);
    assert!(
        matches!(twm, TwmError::Denied { denied, .. } if denied.budget == Budget::Held),
        "{twm:?}"
    );
    let hint = twm.hint().expect("a hint");
    assert!(hint.contains("budgets_for_cap"), "{hint}");
    drop(first);
    let budgets = creator.budgets_for_cap(8 << 20);
    assert_eq!(budgets.touched_bytes, 8 << 20, "the cap is the cap");
    let sized = Tenant::with_budgets(2, "sized", budgets, IsolationLevel::StreamIsolated);
    let mut second = store(&creator, &engine, &sized);
    instantiate(&mut second, &linker, &module).expect("one slot fits its held budget");
    assert_eq!(sized.stats().held_bytes, SLOT as u64);
}

/// A builder on the mock whose memories are at most `limit` bytes, `default_maximum` for those
/// that declare none.
fn limited(limit: u64, default_maximum: u64) -> CreatorBuilder<MockBackend> {
    TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).limits(
        PlanLimits::new(limit)
            .and_then(|l| l.with_default_maximum(default_maximum))
            .unwrap(),
    )
}

/// A creator of small memories sizes a small tenant's default held budget to them: four times
/// the cap, at least one of its largest memories and room for tables, not the 256 MiB default
/// memory's room (288 MiB for any cap before).
#[test]
fn budgets_for_cap_follow_a_creator_of_small_memories() {
    let creator = limited(1 << 20, 1 << 20).build().unwrap();
    let room = tensor_wasm_mem_core::TenantBudgets::TABLE_ROOM_BYTES;
    assert_eq!(
        creator.budgets_for_cap(1 << 20).held_bytes,
        (1 << 20) + room
    );
    assert_eq!(creator.budgets_for_cap(64 << 20).held_bytes, 256 << 20);
}

/// A per-memory limit past the largest slot is clamped to it even where the default maximum
/// already fits a slot: a memory declaring more than a slot gets the slot, not a refusal.
#[test]
fn a_per_memory_limit_past_the_slots_is_fitted_whatever_the_default() {
    let creator = limited(64 << 20, 1 << 20)
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 << 20, 2)]))
        .build()
        .unwrap();
    assert_eq!(creator.limits().per_memory_limit(), 4 << 20, "said so");
    assert_eq!(creator.limits().default_maximum(), 1 << 20, "left alone");
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t", 8 << 20, IsolationLevel::StreamIsolated);
    let mut store = store(&creator, &engine, &tenant);
    let memory = exported_memory(
        &mut store,
        &engine,
        "(module (memory (export \"memory\") 1 512))",
    );
    assert_eq!(memory.grow(&mut store, 63).unwrap(), 1, "grows to the slot");
    assert!(memory.grow(&mut store, 1).is_err(), "and no further");
}

/// The share is per size class: memories that declare no maximum all go to the largest class,
/// and one tenant cannot take every slot of it however many small slots the pool has.
#[test]
fn a_tenant_cannot_take_every_slot_of_the_largest_class() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(PAGE, 16), SizeClass::new(4 * PAGE, 2)],
        ))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let linker = Linker::new(&engine);
    // No maximum: the largest slot.
    let module = Module::new(&engine, "(module (memory 1))").unwrap();
    let greedy = Tenant::new(1, "greedy", 1 << 20, IsolationLevel::StreamIsolated);
    let other = Tenant::new(2, "other", 1 << 20, IsolationLevel::StreamIsolated);
    let mut first = store(&creator, &engine, &greedy);
    instantiate(&mut first, &linker, &module).unwrap();
    assert_eq!(greedy.stats().held_bytes, 4 * PAGE as u64, "a large slot");
    let mut second = store(&creator, &engine, &greedy);
    let error = instantiate(&mut second, &linker, &module).unwrap_err();
    assert!(
        matches!(
            typed(&error),
            TwmError::PoolShare {
                held: 1,
                share: 1,
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(
        greedy.stats().held_bytes,
        4 * PAGE as u64,
        "nothing more charged"
    );
    let mut theirs = store(&creator, &engine, &other);
    instantiate(&mut theirs, &linker, &module).expect("the other tenant gets the other one");
    // Small memories draw on the small class's own share.
    let small = Module::new(&engine, "(module (memory 1 1))").unwrap();
    let mut third = store(&creator, &engine, &greedy);
    instantiate(&mut third, &linker, &small).expect("a small slot");
}

/// Classes are counted as the pool lays them out (slot sizes rounded up to 64 KiB), and a
/// tenant at its share of every class that could hold the memory is refused before the pool is
/// asked: it takes no slot, even for a moment.
#[test]
fn a_share_counts_rounded_classes_and_refuses_before_the_pool() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(64 << 10, 4), SizeClass::new(96 << 10, 2)],
        ))
        .build()
        .unwrap();
    let engine = creator.engine().unwrap();
    let linker = Linker::new(&engine);
    // Two pages fit the 96 KiB class (laid out as 128 KiB) and not the 64 KiB one.
    let small = Module::new(&engine, "(module (memory 1 2))").unwrap();
    let greedy = Tenant::new(1, "greedy", 8 << 20, IsolationLevel::StreamIsolated);
    let mut first = store(&creator, &engine, &greedy);
    instantiate(&mut first, &linker, &small).unwrap();
    assert_eq!(greedy.stats().held_bytes, 128 << 10, "a 128 KiB slot");
    let acquisitions = creator.stats().pool.unwrap().acquisitions;
    let mut second = store(&creator, &engine, &greedy);
    let error = instantiate(&mut second, &linker, &small).unwrap_err();
    assert!(
        matches!(
            typed(&error),
            TwmError::PoolShare {
                held: 1,
                share: 1,
                ..
            }
        ),
        "the class's share is its own: {error:?}"
    );
    assert_eq!(
        creator.stats().pool.unwrap().acquisitions,
        acquisitions,
        "refused before the pool was asked"
    );
    // ... and before it was charged: not counted among its memories, nor in its peaks.
    let stats = greedy.stats();
    assert_eq!(stats.memories_created, 1, "only the one it holds");
    assert_eq!(
        stats.held_peak_bytes,
        128 << 10,
        "the refused one never held"
    );
}

/// A guest growing an empty memory past its capacity (outside `instantiate` the limiter takes
/// it for a new memory, which the plan would allow) is refused in the memory, and the limiter's
/// grant goes back: nothing stays charged.
#[test]
fn a_growth_past_an_empty_memorys_capacity_leaves_nothing_charged() {
    let creator = limited(1 << 30, 1 << 20).build().unwrap();
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t", 64 << 20, IsolationLevel::StreamIsolated);
    let mut store = store(&creator, &engine, &tenant);
    // No maximum: a capacity of the default maximum, 1 MiB.
    let module = growing_module(&engine, "0");
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
    let grow = instance
        .get_typed_func::<i32, i32>(&mut store, "grow")
        .unwrap();
    for _ in 0..4 {
        assert_eq!(grow.call(&mut store, 32).unwrap(), -1, "past 1 MiB");
    }
    let stats = tenant.stats();
    assert_eq!(stats.touched_bytes, 0, "no grant left charged");
    assert_eq!(stats.refused_growths, 4);
    assert_eq!(grow.call(&mut store, 16).unwrap(), 0, "within it");
    assert_eq!(tenant.stats().touched_bytes, 1 << 20);
}
