//! What one linear memory's bytes are: [`Storage`], a managed buffer or a guarded region, with
//! the operations the memory lifecycle needs (grow, resolve, hint, release), and the pools
//! they come from ([`CreatorPool`]).
//!
//! Growth policy is not here: [`TensorWasmLinearMemory`](crate::TensorWasmLinearMemory) decides
//! a growth (capacity, charges) once, over any storage; a storage only makes more of its bytes
//! reachable.

use std::sync::Arc;

use tensor_wasm_mem_core::{
    Advice, Capabilities, DeviceSlice, Location, PoolStats, Refused, SLOT_ALIGN, SlotPool, Stream,
    UnifiedBuffer,
};

use crate::Backend;
use crate::backing::Backing;
use crate::error::TwmError;
use crate::guarded_region::{GuardedPool, GuardedRegion};

/// One memory's storage: a managed buffer (allocation or slot), or a guarded region (own
/// reservation or slot).
pub(crate) enum Storage<B: Backend> {
    Managed(UnifiedBuffer<Arc<B>>),
    Guarded(GuardedRegion<B>),
}

impl<B: Backend> Storage<B> {
    pub(crate) fn capabilities(&self) -> Capabilities {
        match self {
            Self::Managed(b) => b.capabilities(),
            Self::Guarded(r) => {
                Backing::Guarded(r.access()).capabilities(r.backend().capabilities())
            }
        }
    }

    pub(crate) fn allocator(&self) -> &Arc<B> {
        match self {
            Self::Managed(b) => b.allocator(),
            Self::Guarded(r) => r.backend(),
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        match self {
            Self::Managed(b) => b.as_ptr(),
            Self::Guarded(r) => r.base() as *mut u8,
        }
    }

    /// Visible bytes.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Managed(b) => b.len(),
            Self::Guarded(r) => r.len(),
        }
    }

    /// The bytes the storage holds: its pool slot, or its whole allocation or reservation
    /// (rounded up to [`SLOT_ALIGN`], the least a driver allocation holds of a device).
    pub(crate) fn held_bytes(&self) -> usize {
        match self {
            Self::Managed(b) => b
                .slot_bytes()
                .unwrap_or_else(|| b.capacity().max(1).next_multiple_of(SLOT_ALIGN)),
            Self::Guarded(r) => r.held(),
        }
    }

    /// Makes the first `initial` bytes of a storage just acquired reachable (zero), and, for a
    /// guarded slot, closes what its last holder left open. On failure the storage stays its
    /// owner's to release.
    pub(crate) fn open(&mut self, initial: usize) -> Result<(), TwmError> {
        match self {
            Self::Managed(b) => b.grow_to(initial).map_err(TwmError::from_core),
            Self::Guarded(r) => r.open(initial),
        }
    }

    /// Makes the first `new_len` bytes reachable (zero where new), or fails and stays as it was.
    pub(crate) fn grow_to(&mut self, new_len: usize) -> Result<(), TwmError> {
        match self {
            Self::Managed(b) => b.grow_to(new_len).map_err(TwmError::from_core),
            Self::Guarded(r) => r.grow_to(new_len),
        }
    }

    /// A checked device slice of the visible bytes.
    pub(crate) fn device_slice(&self, offset: usize, len: usize) -> Result<DeviceSlice, TwmError> {
        match self {
            Self::Managed(b) => b.device_slice(offset, len),
            Self::Guarded(r) => r.device_slice(offset, len),
        }
        .map_err(TwmError::GuestRange)
    }

    pub(crate) fn advise(&self, offset: usize, len: usize, advice: Advice) -> Result<(), TwmError> {
        match self {
            Self::Managed(b) => b.advise(offset, len, advice).map_err(TwmError::from_core),
            Self::Guarded(r) => r.advise(offset, len, advice),
        }
    }

    pub(crate) fn prefetch(
        &self,
        offset: usize,
        len: usize,
        to: Location,
        stream: &Stream,
    ) -> Result<(), TwmError> {
        match self {
            Self::Managed(b) => b
                .prefetch(offset, len, to, stream)
                .map_err(TwmError::from_core),
            Self::Guarded(r) => r.prefetch(offset, len, to, stream),
        }
    }

    /// Gives the bytes back: the allocation freed, the slot returned, the region detached and
    /// unmapped. A release the backend refuses hands the storage back ([`Refused`]), still
    /// holding what the backend would not take: keep it, with what pays for it, and release it
    /// again later. (Device work on the memory must be over: the memory's record waits for its
    /// Store's streams first.)
    #[expect(
        clippy::result_large_err,
        reason = "a refused release hands the storage back by value, on a rare path"
    )]
    pub(crate) fn release(self) -> Result<(), Refused<Self, TwmError>> {
        match self {
            Self::Managed(buffer) => buffer.release().map_err(|r| Refused {
                error: TwmError::backend(r.error),
                resource: Self::Managed(r.resource),
            }),
            Self::Guarded(region) => region.release().map_err(|r| r.map_resource(Self::Guarded)),
        }
    }
}

impl<B: Backend> Storage<B> {
    /// Gives the storage up without another release, after the backend refused it for good:
    /// what the backend holds stays with it (an allocation it frees when it drops, pages kept
    /// mapped and never reused).
    pub(crate) fn abandon(self) {
        match self {
            Self::Managed(buffer) => buffer.abandon(),
            Self::Guarded(region) => region.abandon(),
        }
    }
}

/// A creator's pool on one device: managed slots, or guarded ones.
pub(crate) enum CreatorPool<B: Backend> {
    Managed(Arc<SlotPool<Arc<B>>>),
    Guarded(Arc<GuardedPool<B>>),
}

impl<B: Backend> CreatorPool<B> {
    pub(crate) fn stats(&self) -> PoolStats {
        match self {
            Self::Managed(p) => p.stats(),
            Self::Guarded(p) => p.stats(),
        }
    }

    pub(crate) fn slot_size_for(&self, capacity: usize) -> Option<usize> {
        match self {
            Self::Managed(p) => p.slot_size_for(capacity),
            Self::Guarded(p) => p.slot_size_for(capacity),
        }
    }
}
