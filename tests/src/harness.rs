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
