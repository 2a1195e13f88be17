#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod backends;
mod backing;
mod books;
mod config;
pub mod deadline;
mod error;
mod guarded;
mod guarded_region;
mod guest;
mod host_mapping;
mod lifecycle;
mod memory;
#[cfg(feature = "metrics")]
pub mod metrics;
mod placement;
mod scope;
mod storage;
mod tenancy;
#[cfg(feature = "wasi")]
pub mod wasi;

use tensor_wasm_mem_core::{Advisor, DevicePools, HostMemory, ManagedAllocator, StreamProvider};

pub use backends::{DefaultBackend, default_backend};
pub use backing::{Backing, ParseBackingError};
pub use config::{BoundsStrategy, GUARDED_GUARD, GUARDED_RESERVATION, configure, engine_config};
pub use error::TwmError;
pub use guarded::{GUARDED_CAPABILITIES, GuardedHostCreator, GuardedHostMemory};
pub use guarded_region::guarded_mappings_kept;
pub use guest::{
    GuestContext, HasGuestContext, TWM_ERR_BACKEND, TWM_ERR_NOT_DEVICE_MEMORY,
    TWM_ERR_OUT_OF_RANGE, TWM_ERR_OVERFLOW, TWM_ERR_UNKNOWN_ADVICE, TWM_ERR_UNKNOWN_DEVICE,
    TWM_ERR_UNSUPPORTED, TWM_OK, TenantStore, add_to_linker,
};
pub use lifecycle::TensorWasmLinearMemory;
pub use memory::{
    CreatorBuilder, CreatorDeviceStats, CreatorStats, GuestSlice, TensorWasmMemoryCreator,
};
pub use placement::{DevicePlacement, Placement, PlacementPolicy};
pub use scope::{Access, AccessRange, DeviceAccess, RunScope, ScopeOptions, ScopedSlice};
pub use tenancy::{
    ChargeMode, HasTenantLimiter, LimiterStats, TABLE_ELEMENT_BYTES, Tenant, TenantLimiter,
    TenantStats, install_limiter, instantiate, instantiate_pre, new_store,
};
pub use tensor_wasm_mem_core::{Budget, TenantBudgets};

/// The workspace README's Rust examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct WorkspaceReadme;

/// Re-exported so embedders use the same versions.
pub use tensor_wasm_mem_core as core;
pub use wasmtime;

/// Everything a backend must implement to back Wasm memories: the three core traits and device
/// pools (which may answer `Unsupported`), on one thread-safe type. Implemented for every such
/// type.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tensor-wasm-mem backend",
    note = "if this is `NoDefaultBackend`, several backend features are on and there is no default: name the backend's type"
)]
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
