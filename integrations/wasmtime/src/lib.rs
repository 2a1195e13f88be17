#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backends;
mod backing;
mod books;
mod config;
pub mod deadline;
mod error;
mod guarded;
mod guarded_region;
pub mod guest;
mod host_mapping;
pub mod interop;
pub mod kernels;
mod lifecycle;
mod memory;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
mod placement;
pub mod scope;
mod scrub_ahead;
mod shares;
mod storage;
mod tenancy;
#[cfg(feature = "wasi")]
#[cfg_attr(docsrs, doc(cfg(feature = "wasi")))]
pub mod wasi;

use tensor_wasm_mem_core::{Advisor, DevicePools, HostMemory, ManagedAllocator, StreamProvider};

pub use backends::{DefaultBackend, default_backend};
pub use backing::{Backing, ParseBackingError};
pub use config::{BoundsStrategy, GUARDED_GUARD, GUARDED_RESERVATION, configure, engine_config};
pub use error::TwmError;
pub use guarded::{GUARDED_CAPABILITIES, GuardedHostCreator, GuardedHostMemory};
pub use guarded_region::KeptMappings;
pub use guest::{
    GuestContext, HasGuestContext, TWM_ERR_BACKEND, TWM_ERR_NOT_DEVICE_MEMORY,
    TWM_ERR_OUT_OF_RANGE, TWM_ERR_OVERFLOW, TWM_ERR_UNKNOWN_ADVICE, TWM_ERR_UNKNOWN_DEVICE,
    TWM_ERR_UNSUPPORTED, TWM_OK, TenantStore, add_to_linker,
};
pub use lifecycle::TensorWasmLinearMemory;
pub use memory::{
    CreatorBuilder, CreatorDeviceStats, CreatorStats, GuestSlice, HINT_GRANULARITY,
    RecoveryBlocker, TensorWasmMemoryCreator,
};
pub use placement::{DevicePlacement, Placement, PlacementPolicy};
pub use scope::{Access, AccessRange, DeviceAccess, RunScope, ScopeOptions, ScopedSlice};
pub use tenancy::{
    ChargeMode, HasTenantLimiter, LimiterStats, RefusedGrowth, TABLE_ELEMENT_BYTES, Tenant,
    TenantLimiter, TenantStats, install_limiter, instantiate, instantiate_pre, new_store,
};
pub use tensor_wasm_mem_core::{Budget, TenantBudgets};

/// The workspace README's Rust examples, compiled and run as doc tests (they use the simulated
/// backend and WASI, so with features `mock` and `wasi`: a workspace test has both).
#[cfg(all(doctest, feature = "mock", feature = "wasi"))]
#[doc = include_str!("../../../README.md")]
pub struct WorkspaceReadme;

/// Re-exported so embedders use the same versions.
pub use tensor_wasm_mem_core as core;
pub use wasmtime;

/// Everything a first program needs, from this one crate: `use tensor_wasm_mem_wasmtime::prelude::*;`
/// brings the creator and its builder, tenants and their budgets, the Store functions, the
/// device-access scope, the errors, the plan and pool settings, and (with feature `mock`, the
/// default) the simulated backend.
pub mod prelude {
    pub use crate::core::{DeviceId, ErrorKind, IsolationLevel, PlanLimits, PoolConfig, SizeClass};
    #[cfg(feature = "mock")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
    pub use crate::mock::MockBackend;
    pub use crate::{
        Access, AccessRange, Backing, ChargeMode, CreatorBuilder, DeviceAccess, ScopeOptions,
        Tenant, TenantBudgets, TenantStore, TensorWasmMemoryCreator, TwmError, add_to_linker,
        instantiate, new_store,
    };
    pub use wasmtime::{Engine, Linker, Module, Store};
}

/// The simulated backend (feature `mock`, the default), re-exported so a first program needs
/// this crate alone.
#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
pub use tensor_wasm_mem_mock as mock;

/// Everything a backend must implement to back Wasm memories: the three core traits and device
/// pools (which may answer `Unsupported`), on one thread-safe type. Implemented for every such
/// type.
#[diagnostic::on_unimplemented(message = "`{Self}` is not a tensor-wasm-mem backend")]
pub trait Backend:
    ManagedAllocator
    + Advisor
    + StreamProvider
    + DevicePools
    + HostMemory
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<T> Backend for T where
    T: ManagedAllocator
        + Advisor
        + StreamProvider
        + DevicePools
        + HostMemory
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}
