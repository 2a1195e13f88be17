//! Guest-launched kernels (`kernels`): a guest launches a registered kernel on its own memory,
//! and every hostile launch is refused with a code before anything is queued.

mod common;

use std::sync::{Arc, Barrier};

use tensor_wasm_mem_wasmtime::kernels::{
    self, BufferLength, KernelLauncher, KernelParam, KernelRegistry, KernelSignature, LaunchShape,
    Scalar, TWM_ERR_BAD_ARGUMENTS, TWM_ERR_BUSY, TWM_ERR_KERNEL_FAULT, TWM_ERR_UNKNOWN_KERNEL,
};
use tensor_wasm_mem_wasmtime::prelude::*;
use tensor_wasm_mem_wasmtime::{TWM_ERR_OUT_OF_RANGE, TWM_ERR_OVERFLOW};

const GUEST: &str = r#"(module
  (import "twm" "kernel" (func $kernel (param i32 i32) (result i32)))
  (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 4)
  (func (export "kernel") (param i32 i32) (result i32) (call $kernel (local.get 0) (local.get 1)))
  (func (export "launch") (param i32 i32 i32) (result i32)
    (call $launch (local.get 0) (local.get 1) (local.get 2))))"#;

const X: u64 = 4096;
const Y: u64 = 8192;

use common::kernel_guest::{ARGS, Guest, creator_with, guest_of};

/// A registry with `bad`: an embedder's buggy launcher, which passes a pointer past the guest's
/// memory.
fn faulting_registry() -> KernelRegistry<MockBackend> {
    let mut registry = KernelRegistry::new();
    registry
        .register(
            "bad",
            one_byte_buffer(),
            // SAFETY: deliberately wrong, but only past every allocation (1 TiB beyond the
            // guest's memory): the model finds no allocation there and reports a fault.
            unsafe { kernels::simulated("fill", |l| vec![l.args()[0] + (1 << 40), 16, 1]) },
        )
        .unwrap();
    registry
}

/// One byte buffer written, one block of one thread.
fn one_byte_buffer() -> KernelSignature {
    KernelSignature {
        params: vec![KernelParam::Buffer {
            access: Access::Write,
            element_bytes: 1,
            length: BufferLength::Any,
        }],
        shape: LaunchShape::Fixed {
            grid: [1, 1, 1],
            block: [1, 1, 1],
        },
    }
}

fn guest_on(creator: &TensorWasmMemoryCreator<MockBackend>, tenant: &Arc<Tenant>) -> Guest {
    guest_of(creator, GUEST, tenant)
}

fn guest(creator: &TensorWasmMemoryCreator<MockBackend>) -> Guest {
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    guest_on(creator, &tenant)
}

impl Guest {
    /// Launches `handle` on `args` expecting the guest to trap with the typed loss of its
    /// device ([`TwmError::DeviceLost`] at `launch`); the error.
    fn launch_losing_the_device(&mut self, handle: i32, args: &[(u64, u64)]) -> TwmError {
        let trap = self.try_launch(handle, args).expect_err("the guest traps");
        let err = trap.downcast::<TwmError>().expect("typed");
        assert!(
            matches!(err, TwmError::DeviceLost { op: "launch" }),
            "{err}"
        );
        err
    }

    fn write_floats(&mut self, at: u64, values: &[f32]) {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.memory
            .write(&mut self.store, at as usize, &bytes)
            .unwrap();
    }

    fn floats(&self, at: u64, n: usize) -> Vec<f32> {
        let data = &self.memory.data(&self.store)[at as usize..at as usize + 4 * n];
        data.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// A hostile launch: what it is, the handle, the arguments, the code it must get.
type Case = (&'static str, i32, Vec<(u64, u64)>, i32);

fn saxpy_args(a: f32, x: u64, y: u64, n: u64) -> Vec<(u64, u64)> {
    vec![(u64::from(a.to_bits()), 0), (x, 4 * n), (y, 4 * n), (n, 0)]
}

#[test]
fn a_guest_launches_saxpy_on_its_own_memory() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    let n = 1000;
    let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    g.write_floats(X, &x);
    g.write_floats(Y, &vec![1.0; n]);
    let saxpy = g.kernel("saxpy");
    assert!(saxpy >= 0, "{saxpy}");
    assert_eq!(g.launch(saxpy, &saxpy_args(2.0, X, Y, n as u64)), 0);
    let y = g.floats(Y, n);
    assert!(
        y.iter()
            .enumerate()
            .all(|(i, &v)| v == 2.0 * i as f32 + 1.0)
    );
    let stats = g.tenant.stats();
    assert_eq!(
        (
            stats.launches,
            stats.refused_launches,
            stats.kernel_failures
        ),
        (1, 0, 0)
    );
}

#[test]
fn hostile_launch_arguments_are_refused_before_anything_is_queued() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    let saxpy = g.kernel("saxpy");
    let fill = g.kernel("fill");
    g.write_floats(Y, &[5.0; 16]);
    let page = 65_536;
    let cases: Vec<Case> = vec![
        (
            "past the end",
            fill,
            vec![(page - 8, 16), (1, 0)],
            TWM_ERR_OUT_OF_RANGE,
        ),
        (
            "a length that overflows",
            fill,
            vec![(8, u64::MAX - 4), (1, 0)],
            TWM_ERR_OVERFLOW,
        ),
        (
            "an offset that wraps",
            fill,
            vec![(u64::MAX - 3, 8), (1, 0)],
            TWM_ERR_OVERFLOW,
        ),
        (
            "past 4 GiB in a 32-bit memory",
            fill,
            vec![(0xFFFF_FFFF, 2), (1, 0)],
            TWM_ERR_OVERFLOW,
        ),
        (
            "out of range before overlapping",
            saxpy,
            saxpy_args(1.0, Y, Y, 1 << 20),
            TWM_ERR_OUT_OF_RANGE,
        ),
        (
            "overlapping buffers one writes",
            saxpy,
            saxpy_args(1.0, Y, Y + 16, 16),
            TWM_ERR_BAD_ARGUMENTS,
        ),
        (
            "the same buffer read and written",
            saxpy,
            saxpy_args(1.0, Y, Y, 16),
            TWM_ERR_BAD_ARGUMENTS,
        ),
        (
            "too few arguments",
            saxpy,
            saxpy_args(1.0, X, Y, 16)[..3].to_vec(),
            TWM_ERR_BAD_ARGUMENTS,
        ),
        (
            "a buffer where a scalar goes",
            saxpy,
            vec![(X, 64), (X, 64), (Y, 64), (16, 0)],
            TWM_ERR_BAD_ARGUMENTS,
        ),
        (
            "a length the count does not give",
            saxpy,
            vec![(0, 0), (X, 64), (Y, 60), (16, 0)],
            TWM_ERR_BAD_ARGUMENTS,
        ),
        (
            "a u32 scalar past 32 bits",
            fill,
            vec![(X, 16), (1 << 40, 0)],
            TWM_ERR_BAD_ARGUMENTS,
        ),
        ("an unknown handle", 57, vec![], TWM_ERR_UNKNOWN_KERNEL),
        ("a negative handle", -3, vec![], TWM_ERR_UNKNOWN_KERNEL),
    ];
    for (what, handle, args, code) in &cases {
        assert_eq!(g.launch(*handle, args), *code, "{what}");
    }
    assert_eq!(g.kernel("no such kernel"), TWM_ERR_UNKNOWN_KERNEL);
    let lookup = |g: &mut Guest, ptr: i32, len: i32| {
        g.instance
            .get_typed_func::<(i32, i32), i32>(&mut g.store, "kernel")
            .unwrap()
            .call(&mut g.store, (ptr, len))
            .unwrap()
    };
    assert_eq!(
        lookup(&mut g, 0, -1),
        TWM_ERR_OUT_OF_RANGE,
        "a name past the memory"
    );
    assert_eq!(lookup(&mut g, 65_535, 2), TWM_ERR_OUT_OF_RANGE);
    assert_eq!(
        lookup(&mut g, 0, 4096),
        TWM_ERR_UNKNOWN_KERNEL,
        "longer than any name"
    );
    // More arguments than any kernel takes, and an argument array past the memory.
    let call = |g: &mut Guest, args_ptr: i32, nargs: i32| {
        g.instance
            .get_typed_func::<(i32, i32, i32), i32>(&mut g.store, "launch")
            .unwrap()
            .call(&mut g.store, (fill, args_ptr, nargs))
            .unwrap()
    };
    assert_eq!(call(&mut g, ARGS as i32, 1000), TWM_ERR_BAD_ARGUMENTS);
    assert_eq!(call(&mut g, 65_530, 2), TWM_ERR_OUT_OF_RANGE);
    assert_eq!(call(&mut g, -16, 2), TWM_ERR_OVERFLOW);
    assert_eq!(g.floats(Y, 16), vec![5.0; 16], "nothing ran");
    let stats = g.tenant.stats();
    assert_eq!(stats.launches, 0);
    assert_eq!(stats.refused_launches, cases.len() as u64 + 3);
}

#[test]
fn a_launch_on_a_memory_that_grew_sees_its_new_size() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    let fill = g.kernel("fill");
    let past = 65_536 + 100;
    assert_eq!(g.launch(fill, &[(past, 16), (9, 0)]), TWM_ERR_OUT_OF_RANGE);
    g.memory.grow(&mut g.store, 1).unwrap();
    assert_eq!(g.launch(fill, &[(past, 16), (9, 0)]), 0);
    assert_eq!(g.memory.data(&g.store)[past as usize], 9);
}

/// The wait after a launch refused once with a plain driver error (not a lost context) is
/// tried again: the guest resumes with its kernel done. Before, it resumed with the kernel
/// still queued (answered as a kernel failure), to land later over bytes it had written since.
#[test]
fn a_wait_refused_once_after_a_launch_is_tried_again() {
    let (backend, creator) = queueing_launcher(0x42, || Ok(()));
    let mut g = guest(&creator);
    let queues = g.kernel("queues");
    assert!(
        backend
            .driver()
            .fail_nth(tensor_wasm_mem_core::Operation::Synchronize, 1)
    );
    assert_eq!(g.launch(queues, &[(X, 256)]), 0);
    assert_eq!(backend.driver().pending_work(), 0, "the kernel is done");
    assert!(
        g.memory.data(&g.store)[X as usize..][..256]
            .iter()
            .all(|&b| b == 0x42)
    );
    assert_eq!(g.tenant.stats().launches, 1);
}

/// A wait the driver keeps refusing after a launch (three tries): the kernel may still run, so
/// the guest traps (`TwmError::WorkMayRun`) rather than go on over memory it may write, and its
/// Store's memory is kept when the Store goes.
#[test]
fn a_wait_refused_for_good_after_a_launch_traps_and_keeps_the_memory() {
    let (backend, creator) = queueing_launcher(0x42, || Ok(()));
    let mut g = guest(&creator);
    let queues = g.kernel("queues");
    for n in 1..=3 {
        assert!(
            backend
                .driver()
                .fail_nth(tensor_wasm_mem_core::Operation::Synchronize, n)
        );
    }
    let trap = g
        .try_launch(queues, &[(X, 256)])
        .expect_err("the guest traps");
    assert!(
        matches!(
            trap.downcast_ref::<TwmError>(),
            Some(TwmError::WorkMayRun { op: "launch" })
        ),
        "{trap:#}"
    );
    assert_eq!(g.tenant.stats().kernel_failures, 1);
    drop(g);
    assert_eq!(
        creator.stats().kept_memories,
        1,
        "kept while the kernel may run"
    );
    assert_eq!(backend.driver().stats().frees_over_pending_work, 0);
}

/// A tenant's fault fences the device (a stream-isolated tenant: the primary context); its
/// neighbour's next launch is turned away before its kernel runs. That is a refused launch and
/// a lost device for the neighbour, not a kernel failure nor a fault of its own (a hostile
/// tenant could otherwise make its neighbours' figures read as if their kernels failed).
#[test]
fn a_neighbours_launch_turned_away_by_a_fence_is_not_its_kernel_failure() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .kernels(kernels::builtin())
        .build()
        .unwrap();
    let mut a = guest(&creator);
    let tenant_b = Tenant::new(2, "b", 1 << 20, IsolationLevel::StreamIsolated);
    let mut b = guest_on(&creator, &tenant_b);
    let fill = b.kernel("fill");
    assert_eq!(b.launch(fill, &[(X, 16), (1, 0)]), 0);
    let poke = a.kernel("poke");
    // An index past its 4-byte buffer: the kernel's assert faults the primary context.
    a.launch_losing_the_device(poke, &[(X, 4), (9, 0), (1, 0)]);
    b.launch_losing_the_device(fill, &[(X, 16), (1, 0)]);
    let (sa, sb) = (a.tenant.stats(), b.tenant.stats());
    assert_eq!(
        (sa.kernel_failures, sa.kernel_faults),
        (1, 1),
        "the faulting tenant"
    );
    assert_eq!(
        (
            sb.launches,
            sb.refused_launches,
            sb.kernel_failures,
            sb.kernel_faults
        ),
        (1, 1, 0, 0),
        "the neighbour: one launch ran, one was turned away"
    );
    assert!(sb.device_lost >= 1);
}

#[test]
fn a_launch_whose_kernel_faults_is_a_code_and_a_failure_in_the_figures() {
    let creator = creator_with(faulting_registry());
    let mut g = guest(&creator);
    let bad = g.kernel("bad");
    // The kernel faults: its context is lost for good, so the guest traps, typed.
    let err = g.launch_losing_the_device(bad, &[(0, 16)]);
    assert_eq!(err.kind(), tensor_wasm_mem_core::ErrorKind::ContextLost);
    let stats = g.tenant.stats();
    assert_eq!(
        (stats.launches, stats.kernel_failures, stats.device_lost),
        (0, 1, 1)
    );
    assert_eq!(stats.kernel_faults, 1, "the fault is attributed to it");
    drop(g);
    assert_eq!(creator.stats().live_memories, 0, "teardown after a fault");
    assert_eq!(creator.stats().recoveries, 1, "the device recovered");
}

/// Where nothing of the faulting guest's Store lives in the primary context (guarded pageable
/// memory, a shared tenant on the default stream), its own launch's device work is all that
/// holds the fenced device: the automatic recovery runs when that launch ends, the Store alive.
#[test]
fn a_faulting_launch_that_held_the_device_lets_it_recover_when_it_ends() {
    let backend = common::pageable_mock();
    let builder = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .backing(tensor_wasm_mem_wasmtime::Backing::Guarded(
            tensor_wasm_mem_core::HostAccess::Pageable,
        ))
        .kernels(faulting_registry());
    // SAFETY: nothing but the creator's backend uses the device's primary context here.
    let creator = unsafe { builder.recover_automatically() }.build().unwrap();
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::Shared);
    let mut g = guest_on(&creator, &tenant);
    let bad = g.kernel("bad");
    g.launch_losing_the_device(bad, &[(0, 16)]);
    let device = tensor_wasm_mem_core::DeviceId(0);
    assert!(
        !tensor_wasm_mem_core::ManagedAllocator::device_fenced(&*backend, device),
        "recovered when the launch ended, its Store alive"
    );
    assert_eq!(creator.stats().recoveries, 1);
}

/// A launcher that counts the recoveries it is told of, launching through a simulated one.
struct Counting<L> {
    inner: L,
    recovered: Arc<std::sync::Mutex<Vec<DeviceId>>>,
}

impl<L: KernelLauncher<MockBackend>> KernelLauncher<MockBackend> for Counting<L> {
    fn launch(&self, backend: &MockBackend, launch: &kernels::Launch<'_>) -> Result<(), TwmError> {
        self.inner.launch(backend, launch)
    }

    fn device_recovered(&self, backend: &MockBackend, device: DeviceId) {
        self.recovered.lock().unwrap().push(device);
        self.inner.device_recovered(backend, device);
    }
}

/// The simulated `fill(ptr, len, 7)` over the launch's one buffer, counting the recoveries it
/// is told of in `recovered`.
fn counting_fill(
    recovered: &Arc<std::sync::Mutex<Vec<DeviceId>>>,
) -> Counting<impl KernelLauncher<MockBackend>> {
    Counting {
        // SAFETY: `fill(ptr, len, value)` over the launch's one buffer, its pointer and length.
        inner: unsafe { kernels::simulated("fill", |l| vec![l.args()[0], l.buffers()[0].1, 7]) },
        recovered: Arc::clone(recovered),
    }
}

/// A recovery tells every launcher of the creator once (its modules in the reset context are
/// gone), and the guests after it launch again: the simulated launcher loads its module anew.
#[test]
fn a_recovery_tells_each_launcher_and_launches_work_after_it() {
    let recovered = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut registry = KernelRegistry::new();
    // SAFETY: deliberately wrong, but only past every allocation (as above): a fault.
    let bad = unsafe { kernels::simulated("fill", |l| vec![l.args()[0] + (1 << 40), 16, 1]) };
    registry
        .register("bad", one_byte_buffer(), bad)
        .unwrap()
        .register("fill", one_byte_buffer(), counting_fill(&recovered))
        .unwrap();
    let creator = creator_with(registry);
    let mut g = guest(&creator);
    let fill = g.kernel("fill");
    assert_eq!(
        g.launch(fill, &[(0, 16)]),
        0,
        "loaded in the context, launched"
    );
    let bad = g.kernel("bad");
    g.try_launch(bad, &[(0, 16)]).expect_err("the guest traps");
    drop(g);
    assert_eq!(creator.stats().recoveries, 1, "the device recovered");
    assert_eq!(*recovered.lock().unwrap(), [DeviceId(0)], "told once");
    let mut g = guest(&creator);
    let fill = g.kernel("fill");
    assert_eq!(
        g.launch(fill, &[(0, 16)]),
        0,
        "loaded again after the reset"
    );
    assert_eq!(g.memory.data(&g.store)[..16], [7; 16]);
}

/// A recovery made by another creator on the same backend reaches this creator's launchers too,
/// before its next launch on the device: their modules in the reset context are gone whoever
/// reset it.
#[test]
fn a_recovery_by_another_creator_tells_this_creators_launchers() {
    let backend = Arc::new(MockBackend::default());
    let recovered = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut ours = KernelRegistry::new();
    ours.register("fill", one_byte_buffer(), counting_fill(&recovered))
        .unwrap();
    let mut theirs = KernelRegistry::new();
    // SAFETY: deliberately wrong, but only past every allocation (as above): a fault.
    let bad = unsafe { kernels::simulated("fill", |l| vec![l.args()[0] + (1 << 40), 16, 1]) };
    theirs.register("bad", one_byte_buffer(), bad).unwrap();
    let this = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .kernels(ours)
        .build()
        .unwrap();
    let builder = TensorWasmMemoryCreator::builder(Arc::clone(&backend)).kernels(theirs);
    // SAFETY: nothing but the creators' backend uses the device's primary context here (the
    // simulated launchers load their modules again after a reset).
    let other = unsafe { builder.recover_automatically() }.build().unwrap();
    let mut g = guest(&this);
    let fill = g.kernel("fill");
    assert_eq!(g.launch(fill, &[(0, 16)]), 0, "loaded, launched");
    drop(g);
    let mut culprit = guest(&other);
    let bad = culprit.kernel("bad");
    culprit
        .try_launch(bad, &[(0, 16)])
        .expect_err("the guest traps");
    assert_eq!(
        culprit.tenant.stats().kernel_faults,
        1,
        "its launch faulted"
    );
    drop(culprit);
    assert_eq!(
        other.stats().recoveries,
        1,
        "the other creator recovered it"
    );
    assert!(recovered.lock().unwrap().is_empty(), "not told yet");
    let mut g = guest(&this);
    let fill = g.kernel("fill");
    assert_eq!(
        g.launch(fill, &[(0, 16)]),
        0,
        "loaded again after the reset"
    );
    assert_eq!(
        *recovered.lock().unwrap(),
        [DeviceId(0)],
        "told before it launched"
    );
    assert_eq!(g.memory.data(&g.store)[..16], [7; 16]);
}

/// A launcher whose kernel fails without losing its context (an error the driver reports at
/// the launch, not a fault) is a code, and a failure in the figures.
#[test]
fn a_launch_whose_launcher_fails_is_a_code_and_a_failure_in_the_figures() {
    let mut registry = KernelRegistry::new();
    registry
        .register(
            "broken",
            one_byte_buffer(),
            // SAFETY: the model has no kernel of this name: nothing is ever launched.
            unsafe { kernels::simulated("no_such_kernel", |l| vec![l.args()[0], 16, 1]) },
        )
        .unwrap();
    let creator = creator_with(registry);
    let mut g = guest(&creator);
    let broken = g.kernel("broken");
    assert_eq!(g.launch(broken, &[(0, 16)]), TWM_ERR_KERNEL_FAULT);
    let stats = g.tenant.stats();
    assert_eq!(
        (stats.launches, stats.kernel_failures, stats.device_lost),
        (0, 1, 0)
    );
}

#[test]
fn launches_past_the_tenants_cap_in_flight_are_busy() {
    let gate = Arc::new(Barrier::new(2));
    let release = Arc::new(Barrier::new(2));
    let mut registry = KernelRegistry::new().max_in_flight(1);
    let (g2, r2) = (Arc::clone(&gate), Arc::clone(&release));
    registry
        .register(
            "hold",
            KernelSignature {
                params: vec![],
                shape: LaunchShape::Fixed {
                    grid: [1, 1, 1],
                    block: [1, 1, 1],
                },
            },
            move |_: &MockBackend, _: &kernels::Launch<'_>| {
                g2.wait(); // in flight
                r2.wait(); // until the other launch was refused
                Ok(())
            },
        )
        .unwrap();
    let creator = creator_with(registry);
    let tenant = Tenant::new(1, "t", 1 << 20, IsolationLevel::StreamIsolated);
    let (c1, t1) = (creator.clone(), Arc::clone(&tenant));
    let first = std::thread::spawn(move || {
        let mut g = guest_on(&c1, &t1);
        let hold = g.kernel("hold");
        g.launch(hold, &[])
    });
    gate.wait();
    let mut g = guest_on(&creator, &tenant);
    let hold = g.kernel("hold");
    assert_eq!(g.launch(hold, &[]), TWM_ERR_BUSY);
    release.wait();
    assert_eq!(first.join().unwrap(), 0);
    // In flight again: none, so the next launch runs (and holds until released).
    let again = std::thread::spawn(move || {
        gate.wait();
        release.wait();
    });
    assert_eq!(g.launch(hold, &[]), 0);
    again.join().unwrap();
}

#[test]
fn launch_signatures_that_cannot_be_checked_are_refused_at_registration() {
    let shape = LaunchShape::Fixed {
        grid: [1, 1, 1],
        block: [1, 1, 1],
    };
    let noop = |_: &MockBackend, _: &kernels::Launch<'_>| Ok(());
    let mut registry = KernelRegistry::<MockBackend>::new();
    for params in [
        vec![KernelParam::Buffer {
            access: Access::Read,
            element_bytes: 0,
            length: BufferLength::Any,
        }],
        vec![KernelParam::Buffer {
            access: Access::Read,
            element_bytes: 4,
            length: BufferLength::Arg(3),
        }],
    ] {
        let e = registry
            .register("k", KernelSignature { params, shape }, noop)
            .unwrap_err();
        assert!(matches!(e, TwmError::KernelSignature(_)));
    }
    registry
        .register(
            "k",
            KernelSignature {
                params: vec![KernelParam::Scalar(Scalar::U32)],
                shape,
            },
            noop,
        )
        .unwrap();
    assert!(
        registry
            .register(
                "k",
                KernelSignature {
                    params: vec![],
                    shape
                },
                noop
            )
            .is_err(),
        "a name registered twice"
    );
}

#[test]
fn without_kernels_a_launch_is_unknown() {
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .build()
        .unwrap();
    let mut g = guest(&creator);
    assert_eq!(g.kernel("saxpy"), TWM_ERR_UNKNOWN_KERNEL);
    assert_eq!(g.launch(0, &[]), TWM_ERR_UNKNOWN_KERNEL);
}

/// A creator of `registry` on a pool of one slot, over a machine whose streams complete work
/// only when the device gets to it (a background "device"), as on a GPU.
fn pooled_creator_with(
    registry: KernelRegistry<MockBackend>,
) -> (Arc<MockBackend>, TensorWasmMemoryCreator<MockBackend>) {
    let backend = Arc::new(tensor_wasm_mem_wasmtime::mock::with_config(
        tensor_wasm_mem_wasmtime::mock::MockConfig {
            deferred_streams: true,
            worker_interval: Some(std::time::Duration::from_micros(50)),
            ..tensor_wasm_mem_wasmtime::mock::MockConfig::default()
        },
    ));
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .pool(PoolConfig::new(DeviceId(0), [SizeClass::new(4 << 16, 1)]))
        .kernels(registry)
        .build()
        .unwrap();
    (backend, creator)
}

/// A launch on a memory whose slot was reused: the next tenant in the same slot launches on its
/// own, scrubbed bytes (never the last tenant's), checked against its own size; and the first
/// tenant's launches, dropped with its Store right after, left nothing queued for the scrub or
/// the free to race.
#[test]
fn a_launch_on_a_reused_slot_and_launches_right_before_the_store_drops() {
    let (backend, creator) = pooled_creator_with(kernels::builtin());
    let mut a = guest(&creator);
    let base = a.memory.data_ptr(&a.store) as usize;
    let fill = a.kernel("fill");
    for _ in 0..8 {
        assert_eq!(a.launch(fill, &[(X, 4096), (0xAB, 0)]), 0);
    }
    assert_eq!(a.memory.data(&a.store)[X as usize], 0xAB);
    // The Store goes at once after its last launch: every launch was done before its call
    // returned, so nothing is pending when the memory is scrubbed and handed on.
    drop(a);
    let stats = backend.driver().stats();
    assert_eq!(
        (
            stats.scrubs_over_pending_work,
            stats.frees_over_pending_work
        ),
        (0, 0)
    );
    let b_tenant = Tenant::new(2, "b", 1 << 20, IsolationLevel::StreamIsolated);
    let mut b = guest_on(&creator, &b_tenant);
    assert_eq!(b.memory.data_ptr(&b.store) as usize, base, "the same slot");
    assert!(
        b.memory.data(&b.store)[X as usize..X as usize + 4096]
            .iter()
            .all(|&x| x == 0),
        "scrubbed before the next tenant"
    );
    // B's launches are checked against B's memory (one page), not the slot's capacity.
    let fill = b.kernel("fill");
    assert_eq!(b.launch(fill, &[(65_536, 1), (1, 0)]), TWM_ERR_OUT_OF_RANGE);
    let saxpy = b.kernel("saxpy");
    b.write_floats(Y, &[1.0; 16]);
    assert_eq!(b.launch(saxpy, &saxpy_args(3.0, X, Y, 16)), 0);
    assert_eq!(b.floats(Y, 16), vec![1.0; 16], "x read as zeros: 3 * 0 + 1");
    let stats = b_tenant.stats();
    assert_eq!((stats.launches, stats.refused_launches), (1, 1));
    drop(b);
    assert_eq!(backend.driver().stats().scrubs_over_pending_work, 0);
}

/// A launcher that queues work and then fails: the launch is a failure for the guest, and the
/// stream is waited for all the same, so nothing it queued still runs when the guest resumes
/// (or its memory goes).
/// A creator over a mock whose streams complete work only when waited for, with one kernel,
/// `queues`: its launcher fills the launch's one buffer with `byte` on the launch's stream, then
/// answers what `after` answers (or panics in it).
fn queueing_launcher(
    byte: u8,
    after: fn() -> Result<(), TwmError>,
) -> (Arc<MockBackend>, TensorWasmMemoryCreator<MockBackend>) {
    let backend = Arc::new(tensor_wasm_mem_wasmtime::mock::with_config(
        tensor_wasm_mem_wasmtime::mock::MockConfig {
            deferred_streams: true,
            ..tensor_wasm_mem_wasmtime::mock::MockConfig::default()
        },
    ));
    let mut registry = KernelRegistry::new();
    registry
        .register(
            "queues",
            one_byte_buffer(),
            move |b: &MockBackend, l: &kernels::Launch<'_>| {
                let (ptr, len) = l.buffers()[0];
                // SAFETY: the launch's own checked buffer, written by a fill on its stream.
                unsafe { b.driver().enqueue_fill(l.stream(), ptr, len as usize, byte) }
                    .map_err(TwmError::from_backend)?;
                after()
            },
        )
        .unwrap();
    let creator = TensorWasmMemoryCreator::builder(Arc::clone(&backend))
        .kernels(registry)
        .build()
        .unwrap();
    (backend, creator)
}

#[test]
fn a_launcher_that_queues_work_then_fails_is_waited_for() {
    let (backend, creator) = queueing_launcher(0x42, || {
        Err(TwmError::Launch("failed after queueing".into()))
    });
    let mut g = guest(&creator);
    let k = g.kernel("queues");
    assert_eq!(g.launch(k, &[(X, 256)]), TWM_ERR_KERNEL_FAULT);
    assert_eq!(
        backend.driver().pending_work(),
        0,
        "the stream was waited for"
    );
    assert_eq!(g.memory.data(&g.store)[X as usize + 255], 0x42);
    assert_eq!(g.tenant.stats().kernel_failures, 1);
}

/// A buffer at an offset that is not a whole number of its elements is refused: a misaligned
/// element would make a correct kernel fault, and a fault is sticky for every tenant of the
/// context.
#[test]
fn a_launch_with_a_misaligned_buffer_is_refused() {
    let creator = creator_with(kernels::builtin());
    let mut g = guest(&creator);
    let saxpy = g.kernel("saxpy");
    assert_eq!(
        g.launch(saxpy, &saxpy_args(2.0, X + 1, Y, 16)),
        TWM_ERR_BAD_ARGUMENTS
    );
    assert_eq!(
        g.launch(saxpy, &saxpy_args(2.0, X, Y + 2, 16)),
        TWM_ERR_BAD_ARGUMENTS
    );
    assert_eq!(g.launch(saxpy, &saxpy_args(2.0, X, Y, 16)), 0);
    let stats = g.tenant.stats();
    assert_eq!((stats.launches, stats.refused_launches), (1, 2));
}

/// A launcher that queues work and then panics: the stream is waited for while the panic
/// unwinds, so nothing it queued still runs when the embedder catches it.
#[test]
fn a_launcher_that_panics_after_queueing_is_waited_for() {
    let (backend, creator) = queueing_launcher(0x24, || {
        panic!("the embedder's launcher panics after queueing")
    });
    let mut g = guest(&creator);
    let k = g.kernel("queues");
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| g.launch(k, &[(X, 64)])));
    assert!(caught.is_err(), "the panic reaches the embedder");
    assert_eq!(
        backend.driver().pending_work(),
        0,
        "waited for while unwinding"
    );
    assert_eq!(g.memory.data(&g.store)[X as usize + 63], 0x24);
}

/// A launcher told of a recovery may call back into its creator on the same thread (here it
/// retries the creator's releases, which catches up with recoveries itself, and has a guest
/// launch): the recovery goes on, told once, where before the call waited on the list its own
/// frame held, for ever; and the guest's launch from there is refused (the guest traps, as on
/// a lost device), since a launcher after this one may not have heard yet.
#[test]
fn a_launcher_told_of_a_recovery_may_call_back_into_the_creator() {
    type Slot = Arc<std::sync::Mutex<Option<TensorWasmMemoryCreator<MockBackend>>>>;
    struct CallsBack {
        creator: Slot,
        told: Arc<std::sync::atomic::AtomicUsize>,
        launched_inside: Arc<std::sync::Mutex<Option<bool>>>,
    }
    impl KernelLauncher<MockBackend> for CallsBack {
        fn launch(&self, _: &MockBackend, _: &kernels::Launch<'_>) -> Result<(), TwmError> {
            Ok(())
        }
        fn device_recovered(&self, _: &MockBackend, _: DeviceId) {
            let creator = self.creator.lock().unwrap().clone();
            if let Some(creator) = creator {
                assert_eq!(creator.retry_releases(), 0);
                let mut g = guest(&creator);
                let handle = g.kernel("calls_back");
                let launched = g.try_launch(handle, &[(0, 16)]).is_ok();
                *self.launched_inside.lock().unwrap() = Some(launched);
            }
            self.told.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let slot = Slot::default();
    let told = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let launched_inside = Arc::new(std::sync::Mutex::new(None));
    let mut registry = faulting_registry();
    registry
        .register(
            "calls_back",
            one_byte_buffer(),
            CallsBack {
                creator: Arc::clone(&slot),
                told: Arc::clone(&told),
                launched_inside: Arc::clone(&launched_inside),
            },
        )
        .unwrap();
    let creator = creator_with(registry);
    *slot.lock().unwrap() = Some(creator.clone());
    // Bounded, never timed: a deadlock fails the test instead of hanging the suite.
    let (done, finished) = std::sync::mpsc::channel();
    let faulting = creator.clone();
    std::thread::spawn(move || {
        let mut g = guest(&faulting);
        let bad = g.kernel("bad");
        g.try_launch(bad, &[(0, 16)]).expect_err("the guest traps");
        drop(g); // the device recovers, and the launchers are told
        done.send(()).unwrap();
    });
    finished
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the recovery came back");
    assert_eq!(creator.stats().recoveries, 1);
    assert_eq!(
        told.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "told once"
    );
    assert_eq!(
        *launched_inside.lock().unwrap(),
        Some(false),
        "a launch from inside the telling is refused"
    );
    // Once told, launches go on.
    let mut g = guest(&creator);
    let handle = g.kernel("calls_back");
    assert_eq!(g.launch(handle, &[(0, 16)]), 0);
    drop(g);
    // The launcher's handle on the creator goes (a cycle otherwise).
    slot.lock().unwrap().take();
}

/// A launcher that panics when told of a recovery leaves the recovery to be told again, to
/// every launcher, on the creator's next call: none of them is left with a module of the reset
/// context.
#[test]
fn a_recovery_told_to_a_panicking_launcher_is_told_again() {
    struct PanicsOnce(std::sync::atomic::AtomicUsize);
    impl KernelLauncher<MockBackend> for PanicsOnce {
        fn launch(&self, _: &MockBackend, _: &kernels::Launch<'_>) -> Result<(), TwmError> {
            Ok(())
        }
        fn device_recovered(&self, _: &MockBackend, _: DeviceId) {
            if self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                panic!("a buggy launcher");
            }
        }
    }
    let recovered = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut registry = faulting_registry();
    let panics = Arc::new(PanicsOnce(std::sync::atomic::AtomicUsize::new(0)));
    registry
        .register(
            "panics",
            one_byte_buffer(),
            ArcLauncher(Arc::clone(&panics)),
        )
        .unwrap()
        .register("fill", one_byte_buffer(), counting_fill(&recovered))
        .unwrap();
    let creator = creator_with(registry);
    let mut g = guest(&creator);
    let bad = g.kernel("bad");
    g.try_launch(bad, &[(0, 16)]).expect_err("the guest traps");
    // The Store's end recovers the device and tells the launchers: the first panics.
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(g)));
    assert!(dropped.is_err(), "the launcher's panic reached the caller");
    assert_eq!(creator.stats().recoveries, 1);
    // The next call tells every launcher again.
    creator.retry_releases();
    assert_eq!(panics.0.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(
        *recovered.lock().unwrap(),
        [DeviceId(0)],
        "the one after it heard"
    );
    let mut g = guest(&creator);
    let fill = g.kernel("fill");
    assert_eq!(g.launch(fill, &[(0, 16)]), 0);
    assert_eq!(g.memory.data(&g.store)[..16], [7; 16]);
}

/// A launcher shared through an `Arc`.
struct ArcLauncher<L>(Arc<L>);

impl<L: KernelLauncher<MockBackend>> KernelLauncher<MockBackend> for ArcLauncher<L> {
    fn launch(&self, backend: &MockBackend, launch: &kernels::Launch<'_>) -> Result<(), TwmError> {
        self.0.launch(backend, launch)
    }
    fn device_recovered(&self, backend: &MockBackend, device: DeviceId) {
        self.0.device_recovered(backend, device);
    }
}
