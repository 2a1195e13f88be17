#![doc = include_str!("../README.md")]
#![no_std]
#![deny(missing_docs)]
#![warn(clippy::std_instead_of_core, clippy::alloc_instead_of_core)]

extern crate alloc;
#[cfg(any(test, feature = "mockall"))]
extern crate std;

mod advisor;
mod allocator;
mod buffer;
mod device;
mod driver;
mod error;
mod host;
#[cfg(test)]
mod interleavings;
mod isolation;
mod ledger;
mod plan;
mod pool;
mod pools;
mod stream;

#[doc(hidden)]
pub mod doc_support;
#[cfg(any(test, feature = "mockall"))]
pub mod mocks;

pub use advisor::Advisor;
pub use allocator::{Allocation, IdleHolder, MIN_ALIGN, ManagedAllocator, Refused};
pub use buffer::{DeviceSlice, UnifiedBuffer};
pub use device::{Advice, Capabilities, DeviceId, DeviceReport, Location, ParseNameError};
pub use driver::{
    DeviceFacts, DeviceHealth, DriverApi, DriverBackend, DriverContext, DriverPool, DriverStats,
    DriverStream, DropReport, Recovery, Refusal,
};
pub use error::{BackendError, Error, ErrorKind, ErrorType, Operation, RangeError, check_range};
pub use host::{HostAccess, HostMemory};
pub use isolation::IsolationLevel;
#[allow(deprecated)]
pub use ledger::TenantContext;
pub use ledger::{
    Budget, Denied, LedgerGroup, LedgerStats, Purpose, Reservation, TenantBudgets, TenantId,
    TenantKey, TenantLedger,
};
pub use plan::{
    DEFAULT_MAX_BYTES, HARD_MAX_LINEAR_MEMORY_BYTES, MemoryPlan, MemoryType, PlanError, PlanLimits,
    WASM_PAGE_SIZE,
};
pub use pool::{
    AHEAD_MAX, Ahead, ClassLayout, ClassStats, Gathering, MAX_POOL_SLOTS, PoolConfig, PoolError,
    PoolStats, Returned, SLOT_ALIGN, SizeClass, SlotId, SlotPool, SlotTable, Taken,
};
pub use pools::{
    DevicePoolConfig, DevicePoolStats, DevicePools, MAX_POOL_BYTES, PoolAllocation, PoolHandle,
    TenantDevicePool,
};
pub use stream::{DEFAULT_STREAM, Stream, StreamKey, StreamLease, StreamProvider};
