//! The device-access scope on a device whose streams complete work later than the call that
//! queued it (the mock's `deferred_streams`): a kernel's writes reach the guest after the scope
//! closes and never before; bad ranges and other Stores' memories are refused before anything
//! is queued; a scope dropped by a panic still waits; hints set for the scope are undone.

mod common;

use std::sync::Arc;

use common::*;
use tensor_wasm_mem_core::{DeviceId, IsolationLevel, Location, Operation, PoolConfig, SizeClass};
use tensor_wasm_mem_mock::{MockBackend, MockConfig};
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Linker, Memory, Module, Store};
use tensor_wasm_mem_wasmtime::{
    AccessRange, ChargeMode, DeviceAccess, ScopeOptions, Tenant, TenantStore,
    TensorWasmMemoryCreator, TwmError, instantiate, new_store,
};

type Data = TenantStore<MockBackend>;

const GUEST: &str = r#"(module
  (memory (export "memory") 1 4)
  (func (export "load") (param i32) (result i32) (i32.load8_u (local.get 0))))"#;

fn deferred() -> Arc<MockBackend> {
    Arc::new(tensor_wasm_mem_mock::with_config(MockConfig {
        deferred_streams: true,
        ..MockConfig::default()
    }))
}

fn guest(creator: &TensorWasmMemoryCreator<MockBackend>) -> (Store<Data>, Instance, Memory) {
    guest_at(creator, 1, IsolationLevel::StreamIsolated)
}

fn guest_at(
    creator: &TensorWasmMemoryCreator<MockBackend>,
    id: u64,
    isolation: IsolationLevel,
) -> (Store<Data>, Instance, Memory) {
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(id, format!("t{id}"), 4 * PAGE as u64, isolation);
    let mut store = new_store(
        &engine,
        TenantStore::new(creator, &tenant, ChargeMode::Touched, ()),
    );
    let module = Module::new(&engine, GUEST).unwrap();
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    (store, instance, memory)
}

fn load(store: &mut Store<Data>, instance: &Instance, at: i32) -> i32 {
    func::<_, i32, i32>(&mut *store, instance, "load")
        .call(&mut *store, at)
        .unwrap()
}

/// Queues a fill of `byte` over range `i` of `scope` on the scope's stream: a kernel writing
/// the range, done when the stream is waited for.
///
/// # Safety
///
/// Nothing may read or write the range while the fill can run (the scope holds the Store until
/// it waits for its stream: at close, at drop, at the end of `run`).
unsafe fn queue_fill(
    backend: &MockBackend,
    scope: &DeviceAccess<'_, Data, MockBackend>,
    i: usize,
    byte: u8,
) {
    let slice = scope.slice(i).unwrap();
    // SAFETY: the caller's contract.
    unsafe {
        backend
            .driver()
            .enqueue_fill(scope.stream(), slice.device_ptr(), slice.len(), byte)
    }
    .unwrap();
}

#[test]
fn a_kernels_writes_reach_the_guest_after_close_and_never_before() {
    let backend = deferred();
    let creator = fresh(&backend);
    let (mut store, instance, memory) = guest(&creator);
    let scope = DeviceAccess::open(
        &mut store,
        &creator,
        &memory,
        &[AccessRange::read_write(0, PAGE as u64)],
    )
    .unwrap();
    assert_eq!(scope.device(), DeviceId(0));
    let slice = scope.slice(0).unwrap();
    assert_eq!(slice.len(), PAGE);
    // SAFETY: nothing holds a view of the bytes while the kernel can run (the scope,
    // or the Store's teardown, waits for the stream before any access).
    unsafe { queue_fill(&backend, &scope, 0, 0xaa) };
    // The prefetch the scope made and the kernel are queued, not done: and the guest cannot
    // run (the scope holds the Store; `tests/ui/scope_holds_the_store.rs`).
    assert_eq!(backend.driver().pending_work(), 2);
    scope.close().unwrap();
    assert_eq!(backend.driver().pending_work(), 0, "close waited");
    assert_eq!(load(&mut store, &instance, 0), 0xaa);
    assert_eq!(load(&mut store, &instance, PAGE as i32 - 1), 0xaa);
    assert_eq!(backend.driver().stats().calls(Operation::Prefetch), 1);
}

#[test]
fn bad_ranges_and_foreign_memories_are_refused_before_anything_is_queued() {
    let backend = deferred();
    let creator = fresh(&backend);
    let (mut store, _instance, memory) = guest(&creator);
    let (other, _, theirs) = guest(&creator);
    let page = PAGE as u64;
    let cases: [(&[AccessRange], &Memory, &str); 5] = [
        (&[AccessRange::read(page, 1)], &memory, "past the end"),
        (
            &[AccessRange::read(0, 16), AccessRange::write(page - 1, 2)],
            &memory,
            "straddling, after a good one",
        ),
        (&[AccessRange::read(u64::MAX, 2)], &memory, "overflowing"),
        (
            &[AccessRange::read(0, 1)],
            &theirs,
            "another Store's memory",
        ),
        (
            &[AccessRange::read(0, 4 * page)],
            &memory,
            "past the visible size",
        ),
    ];
    for (ranges, mem, what) in cases {
        let err = DeviceAccess::open(&mut store, &creator, mem, ranges).unwrap_err();
        match what {
            "another Store's memory" => assert!(matches!(err, TwmError::ForeignMemory), "{err}"),
            "overflowing" => assert_eq!(err.kind(), tensor_wasm_mem_core::ErrorKind::Overflow),
            _ => assert!(matches!(err, TwmError::GuestRange(_)), "{what}: {err}"),
        }
    }
    let s = backend.driver().stats();
    assert_eq!(
        (
            s.streams_created,
            s.calls(Operation::Prefetch),
            backend.driver().pending_work()
        ),
        (0, 0, 0),
        "nothing was queued, no stream was made"
    );
    // A memory that is not ours (Memory::new bypasses the creator) is refused too.
    let plain = Memory::new(
        &mut store,
        tensor_wasm_mem_wasmtime::wasmtime::MemoryType::new(1, None),
    )
    .unwrap();
    let err =
        DeviceAccess::open(&mut store, &creator, &plain, &[AccessRange::read(0, 1)]).unwrap_err();
    assert!(matches!(err, TwmError::NotOurMemory), "{err}");
    drop(other);
}

#[test]
fn a_scope_dropped_by_a_panic_still_waits() {
    let backend = deferred();
    let creator = fresh(&backend);
    let (mut store, instance, memory) = guest(&creator);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let scope = DeviceAccess::open(&mut store, &creator, &memory, &[AccessRange::write(0, 16)])
            .unwrap();
        // SAFETY: nothing holds a view of the bytes while the kernel can run (the scope,
        // or the Store's teardown, waits for the stream before any access).
        unsafe { queue_fill(&backend, &scope, 0, 0x5a) };
        panic!("the embedder's code fails mid-scope");
    }));
    assert!(panicked.is_err());
    assert_eq!(backend.driver().pending_work(), 0, "the drop waited");
    assert_eq!(load(&mut store, &instance, 15), 0x5a);
    assert_eq!(load(&mut store, &instance, 16), 0);
}

#[test]
fn read_mostly_is_for_the_scope_and_write_back_returns_written_ranges_to_the_host() {
    let backend = deferred();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 * PAGE, 1)]))
        .build()
        .unwrap();
    let (mut store, _instance, memory) = guest(&creator);
    let pool = Arc::clone(creator.pool().unwrap());
    let options = ScopeOptions {
        read_mostly: true,
        write_back: true,
        ..ScopeOptions::default()
    };
    let ranges = [AccessRange::read(0, 4096), AccessRange::write(8192, 4096)];
    let scope = DeviceAccess::open_with(&mut store, &creator, &memory, &ranges, options).unwrap();
    assert_eq!(scope.slices().len(), 2);
    let hints = |offset| {
        pool.with_slab(|slab| backend.driver().hints(slab, offset).unwrap())
            .unwrap()
    };
    let residency = |offset| {
        pool.with_slab(|slab| backend.driver().residency(slab, offset).unwrap())
            .unwrap()
    };
    assert!(hints(0).read_mostly);
    assert!(!hints(8192).read_mostly, "written: not advised");
    scope.close().unwrap();
    assert!(!hints(0).read_mostly, "undone at close");
    let d0 = Location::Device(DeviceId(0));
    assert_eq!(residency(0), Some(d0));
    assert_eq!(residency(8192), Some(Location::Host), "written back");
    drop(store);
    assert_eq!(pool.stats().hint_resets, 0, "nothing reused yet");
}

/// A CPU kernel's view waits for the stream first: it sees what device work queued before it
/// wrote, and the guest sees the CPU kernel's writes after close.
#[test]
fn host_bytes_wait_for_the_stream_and_reach_the_guest() {
    let backend = deferred();
    let creator = fresh(&backend);
    let (mut store, instance, memory) = guest(&creator);
    let ranges = [AccessRange::read_write(100, 8), AccessRange::read(0, 4)];
    let mut scope = DeviceAccess::open(&mut store, &creator, &memory, &ranges).unwrap();
    // SAFETY: nothing holds a view of the bytes while the kernel can run (the scope,
    // or the Store's teardown, waits for the stream before any access).
    unsafe { queue_fill(&backend, &scope, 0, 3) };
    let bytes = scope.host_bytes_mut(0).unwrap().expect("host-accessible");
    assert_eq!(bytes, &[3; 8], "the queued device write is done first");
    bytes[7] = 9;
    assert!(scope.host_bytes_mut(2).unwrap().is_none(), "no third range");
    scope.close().unwrap();
    assert_eq!(load(&mut store, &instance, 107), 9);
    assert_eq!(load(&mut store, &instance, 108), 0, "only the range");
}

/// A wait at close refused once with a plain driver error (not a lost context) is tried again:
/// the kernel's writes are done when the Store is given back. Before, the Store came back with
/// the kernel still queued, to land later over bytes safe code had written since (a review).
#[test]
fn a_wait_refused_once_at_close_is_tried_again() {
    let backend = deferred();
    let creator = fresh(&backend);
    let (mut store, instance, memory) = guest(&creator);
    let scope =
        DeviceAccess::open(&mut store, &creator, &memory, &[AccessRange::write(0, 64)]).unwrap();
    // SAFETY: the scope holds the Store and is closed below, and its close waits for the stream.
    unsafe { queue_fill(&backend, &scope, 0, 7) };
    assert!(backend.driver().fail_nth(Operation::Synchronize, 1));
    scope.close().unwrap();
    assert_eq!(backend.driver().pending_work(), 0, "the kernel is done");
    memory.data_mut(&mut store)[0] = 1;
    DeviceAccess::run(
        &mut store,
        &creator,
        &memory,
        &[AccessRange::read(0, 64)],
        ScopeOptions::default(),
        |_| (),
    )
    .unwrap();
    assert_eq!(
        load(&mut store, &instance, 0),
        1,
        "nothing lands afterwards"
    );
    assert_eq!(load(&mut store, &instance, 1), 7);
}

/// A wait at close that the driver keeps refusing (three tries): close answers the error, and
/// the kernel may still run, so the Store's memory is kept when the Store goes, never scrubbed
/// for the next tenant under it.
#[test]
fn a_wait_refused_for_good_at_close_keeps_the_stores_memory() {
    let backend = deferred();
    let creator = pooled(&backend, 4 * PAGE, 2);
    let (mut store, _, memory) = guest(&creator);
    let scope =
        DeviceAccess::open(&mut store, &creator, &memory, &[AccessRange::write(0, 64)]).unwrap();
    // SAFETY: as above; the Store's memory is kept while the fill may run.
    unsafe { queue_fill(&backend, &scope, 0, 7) };
    for n in 1..=3 {
        assert!(backend.driver().fail_nth(Operation::Synchronize, n));
    }
    let e = scope.close().unwrap_err();
    assert!(matches!(e, TwmError::Backend { .. }), "{e:?}");
    drop(store);
    assert_eq!(creator.stats().kept_memories, 1, "kept, not scrubbed");
    let (next, _, memory) = guest_at(&creator, 2, IsolationLevel::StreamIsolated);
    assert_eq!(backend.driver().stats().scrubs_over_pending_work, 0);
    assert!(memory.data(&next).iter().all(|&b| b == 0));
}

/// A kernel that faults (an illegal address, found by the device after the launch) is a typed
/// error at close; the tenant's next use of the device is refused, clearly, while its context
/// lives; a context-isolated neighbour is unaffected. Stream-isolated and shared tenants share
/// the primary context, so one's fault is every one's (docs/SAFETY.md).
#[test]
fn a_kernel_fault_is_typed_and_stays_with_the_tenants_context() {
    let backend = deferred();
    let creator = fresh(&backend);
    let context = IsolationLevel::ContextIsolated;
    let (mut bad, _, bad_memory) = guest_at(&creator, 1, context);
    let (mut good, good_instance, good_memory) = guest_at(&creator, 2, context);
    let ranges = [AccessRange::write(0, 64)];
    let scope = DeviceAccess::open(&mut bad, &creator, &bad_memory, &ranges).unwrap();
    // Address 64, in the never-mapped first page: outside every allocation. (Just past this
    // memory could be the neighbour's mapping.)
    // SAFETY: writes nothing that exists (an illegal address).
    unsafe { backend.driver().enqueue_fill(scope.stream(), 64, 64, 1) }.unwrap(); // the launch succeeds
    let err = scope.close().unwrap_err();
    assert!(matches!(err, TwmError::Backend { .. }), "{err}");
    assert_eq!(err.kind(), tensor_wasm_mem_core::ErrorKind::ContextLost);
    assert!(
        err.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{err}"
    );
    // Sticky: the context answers every later call with the same error.
    let again = DeviceAccess::open(&mut bad, &creator, &bad_memory, &ranges).unwrap_err();
    assert!(
        again.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{again}"
    );
    // The neighbour's scope works, and its kernel's bytes reach its guest.
    let scope = DeviceAccess::open(&mut good, &creator, &good_memory, &ranges).unwrap();
    // SAFETY: nothing holds a view of the bytes while the kernel can run (the scope,
    // or the Store's teardown, waits for the stream before any access).
    unsafe { queue_fill(&backend, &scope, 0, 4) };
    scope.close().unwrap();
    assert_eq!(load(&mut good, &good_instance, 63), 4);
    assert_eq!(backend.driver().stats().kernel_faults, 1);
}

/// `DeviceAccess::run` opens, runs the closure and closes (the form a `mem::forget` cannot
/// skip); a wait the driver refuses is a typed error from it.
#[test]
fn run_closes_the_scope_and_reports_a_failed_wait() {
    let backend = deferred();
    let creator = fresh(&backend);
    let (mut store, instance, memory) = guest(&creator);
    let ranges = [AccessRange::write(0, 32)];
    let options = ScopeOptions::default();
    let launched = DeviceAccess::run(&mut store, &creator, &memory, &ranges, options, |scope| {
        let slice = scope.slice(0).unwrap();
        // SAFETY: the scope holds the Store: nothing else touches these bytes until it waits.
        unsafe {
            backend
                .driver()
                .enqueue_fill(scope.stream(), slice.device_ptr(), slice.len(), 6)
        }
    })
    .unwrap();
    assert!(launched.is_ok());
    assert_eq!(backend.driver().pending_work(), 0, "run waited");
    assert_eq!(load(&mut store, &instance, 31), 6);
    // A wait the driver keeps refusing (a refusal once is tried again: three tries).
    for n in 1..=3 {
        backend.driver().fail_nth(Operation::Synchronize, n);
    }
    let err =
        DeviceAccess::run(&mut store, &creator, &memory, &ranges, options, |_| ()).unwrap_err();
    assert!(matches!(err, TwmError::Backend { .. }), "{err}");
}

/// `try_run`: an error of the closure wins over one of the wait (a kernel the closure queued
/// faulted, and the closure failed for its own reason: the caller hears the closure's).
#[test]
fn try_run_returns_the_closures_error_over_the_waits() {
    #[derive(Debug, PartialEq)]
    enum Mine {
        Own,
        Scope(String),
    }
    impl From<TwmError> for Mine {
        fn from(e: TwmError) -> Self {
            Self::Scope(e.to_string())
        }
    }
    let backend = deferred();
    let creator = fresh(&backend);
    let (mut store, _, memory) = guest(&creator);
    let result: Result<(), Mine> = DeviceAccess::try_run(
        &mut store,
        &creator,
        &memory,
        &[AccessRange::write(0, 64)],
        ScopeOptions::default(),
        |scope| {
            // SAFETY: address 64 lies in the never-mapped first page: the simulated kernel
            // faults instead of writing, found at the close's wait.
            let _ = unsafe { backend.driver().enqueue_fill(scope.stream(), 64, 64, 1) };
            Err(Mine::Own)
        },
    );
    assert_eq!(result, Err(Mine::Own));
    // The wait did fail (the fault is the close's, and sticky).
    let again = DeviceAccess::open(&mut store, &creator, &memory, &[AccessRange::read(0, 64)]);
    assert!(again.is_err());
}

/// A Store whose guest context uses a creator on another backend than the memory's: the scope
/// is refused (its stream and its device work would be on the wrong driver), typed.
#[test]
fn a_scope_over_another_backends_memory_is_refused() {
    let (ours, theirs) = (deferred(), deferred());
    let creator = fresh(&ours);
    let other = fresh(&theirs);
    let engine = creator.engine().unwrap();
    let tenant = Tenant::new(1, "t1", 4 * PAGE as u64, IsolationLevel::StreamIsolated);
    let mut store = new_store(
        &engine,
        TenantStore::new(&other, &tenant, ChargeMode::Touched, ()),
    );
    let module = Module::new(&engine, GUEST).unwrap();
    let instance = instantiate(&mut store, &Linker::new(&engine), &module).unwrap();
    let memory = instance.get_memory(&mut store, "memory").unwrap();
    let err = DeviceAccess::open(&mut store, &creator, &memory, &[AccessRange::read(0, 1)])
        .expect_err("another backend's guest context");
    assert!(matches!(err, TwmError::ForeignMemory), "{err}");
}
