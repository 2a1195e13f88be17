//! How the suite reaches a backend: [`Harness`], and the harnesses of the backends in this
//! workspace.

use std::sync::Arc;

use tensor_wasm_mem_core::{Advisor, ManagedAllocator, Operation, StreamProvider};
use tensor_wasm_mem_mock::{MockBackend, MockConfig};

/// What the suite needs from a backend.
///
/// Counters and fault injection are optional: a backend that has none (a real driver) returns
/// `None`/`false`, and the cases that need them print that they were skipped for it.
pub trait Harness: 'static {
    /// The backend type.
    type Backend: ManagedAllocator
        + Advisor
        + StreamProvider
        + std::fmt::Debug
        + Send
        + Sync
        + 'static;

    /// A fresh backend instance with at least one device.
    fn backend() -> Arc<Self::Backend>;

    /// Allocations alive now, if the backend counts them.
    fn live_allocations(_backend: &Self::Backend) -> Option<u64> {
        None
    }

    /// Streams alive now (the shared default stream not counted), if counted.
    fn live_streams(_backend: &Self::Backend) -> Option<u64> {
        None
    }

    /// Per-tenant contexts alive now, if counted.
    fn live_contexts(_backend: &Self::Backend) -> Option<u64> {
        None
    }

    /// Makes the `n`-th call of `op` from now fail; `false` if the backend cannot inject.
    fn fail_nth(_backend: &Self::Backend, _op: Operation, _n: u64) -> bool {
        false
    }

    /// Removes pending injected failures.
    fn clear_faults(_backend: &Self::Backend) {}

    /// The largest request that must fail with out-of-memory on this backend.
    fn too_much(_backend: &Self::Backend) -> usize {
        usize::MAX / 2
    }
}

/// The mock backend, in its default configuration (memory comes zeroed).
#[derive(Debug)]
pub struct MockHarness;

/// The mock backend with poisoned fresh memory (`comes_zeroed = false`), like a real driver: every
/// zeroing path of the core is exercised.
#[derive(Debug)]
pub struct PoisonedMockHarness;

fn mock_harness_impl(config: MockConfig) -> Arc<MockBackend> {
    Arc::new(MockBackend::new(MockConfig {
        device_memory_bytes: 4 << 30,
        ..config
    }))
}

macro_rules! mock_harness {
    ($name:ty, $config:expr) => {
        impl Harness for $name {
            type Backend = MockBackend;

            fn backend() -> Arc<MockBackend> {
                mock_harness_impl($config)
            }
            fn live_allocations(b: &MockBackend) -> Option<u64> {
                Some(b.stats().live_allocations)
            }
            fn live_streams(b: &MockBackend) -> Option<u64> {
                Some(b.stats().live_streams)
            }
            fn live_contexts(b: &MockBackend) -> Option<u64> {
                Some(b.stats().live_contexts)
            }
            fn fail_nth(b: &MockBackend, op: Operation, n: u64) -> bool {
                b.fail_nth(op, n);
                true
            }
            fn clear_faults(b: &MockBackend) {
                b.clear_faults();
            }
            fn too_much(b: &MockBackend) -> usize {
                usize::try_from(b.config().device_memory_bytes).unwrap_or(usize::MAX) + 1
            }
        }
    };
}

mock_harness!(MockHarness, MockConfig::default());
mock_harness!(
    PoisonedMockHarness,
    MockConfig {
        poison_fresh_allocations: true,
        ..MockConfig::default()
    }
);

/// The cudarc backend: on the real driver where one loads, otherwise on the simulated libcuda
/// (`tests/cuda-sim`). Cases are serialised (the driver is process-wide), and on the simulator
/// each case starts from a fresh simulated machine.
#[derive(Debug)]
pub struct CudarcHarness;

/// Simulated device memory per device for the conformance cases.
pub const SIM_MEMORY: u64 = 4 << 30;

fn sim_entry_point(op: Operation) -> Option<&'static str> {
    Some(match op {
        Operation::Allocate => "cuMemAllocManaged",
        Operation::Free => "cuMemFree_v2",
        Operation::Zero => "cuMemsetD8Async",
        Operation::Advise => "cuMemAdvise_v2",
        Operation::Prefetch => "cuMemPrefetchAsync_v2",
        Operation::AcquireStream => "cuStreamCreate",
        Operation::ReleaseStream => "cuStreamDestroy_v2",
        Operation::Synchronize => "cuStreamSynchronize",
        _ => return None,
    })
}

impl Harness for CudarcHarness {
    type Backend = tensor_wasm_mem_cudarc::CudarcBackend;

    fn backend() -> Arc<Self::Backend> {
        crate::sim::exclusive();
        if let Some(sim) = crate::sim::Sim::get() {
            sim.configure(&crate::sim::SimConfig {
                memory_bytes: SIM_MEMORY,
                ..crate::sim::SimConfig::default()
            });
            sim.reset();
        }
        let source = tensor_wasm_mem_cudarc::DriverSource::SystemOr(crate::sim::SIM_PATH.into());
        Arc::new(
            tensor_wasm_mem_cudarc::start(&source)
                .unwrap_or_else(|e| panic!("the cudarc backend did not start: {e}")),
        )
    }

    fn live_allocations(b: &Self::Backend) -> Option<u64> {
        let ours = b.stats().live_allocations;
        if let Some(sim) = crate::sim::Sim::get() {
            // The driver's own count must agree: nothing leaked below the backend either.
            assert_eq!(
                sim.stats().live_allocations,
                ours,
                "driver and backend disagree"
            );
        }
        Some(ours)
    }

    fn live_streams(b: &Self::Backend) -> Option<u64> {
        let ours = b.stats().live_streams;
        if let Some(sim) = crate::sim::Sim::get() {
            // The simulator also counts the backend's per-device zeroing stream.
            let zeroing = u64::from(b.device_count());
            assert_eq!(
                sim.stats().live_streams,
                ours + zeroing,
                "driver and backend disagree"
            );
        }
        Some(ours)
    }

    fn live_contexts(b: &Self::Backend) -> Option<u64> {
        let ours = b.stats().live_contexts;
        if let Some(sim) = crate::sim::Sim::get() {
            assert_eq!(
                sim.stats().live_contexts,
                ours,
                "driver and backend disagree"
            );
        }
        Some(ours)
    }

    fn fail_nth(_: &Self::Backend, op: Operation, n: u64) -> bool {
        let (Some(sim), Some(entry)) = (crate::sim::Sim::get(), sim_entry_point(op)) else {
            return false;
        };
        let error = if op == Operation::Allocate {
            crate::sim::code::OUT_OF_MEMORY
        } else {
            crate::sim::code::UNKNOWN
        };
        sim.fail_nth(entry, n, error);
        true
    }

    fn clear_faults(_: &Self::Backend) {
        if let Some(sim) = crate::sim::Sim::get() {
            sim.clear_faults();
        }
    }

    fn too_much(_: &Self::Backend) -> usize {
        if crate::sim::Sim::get().is_some() {
            SIM_MEMORY as usize + 1
        } else {
            1 << 50
        }
    }
}
