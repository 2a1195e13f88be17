//! A plain host-heap allocator used by this crate's examples and unit tests. Not part of the
//! supported API: use the `tensor-wasm-mem-mock` backend for a simulated device.

use core::ptr::NonNull;
use core::sync::atomic::{AtomicUsize, Ordering};

use alloc::alloc::{alloc_zeroed, dealloc};
use core::alloc::Layout;

use crate::{
    Advice, Advisor, Allocation, BackendError, Capabilities, DeviceId, ErrorKind, ErrorType,
    Location, ManagedAllocator, Refused, Stream,
};

/// Alignment of every [`HeapAllocator`] allocation.
const ALIGN: usize = 4096;

/// Zeroed host memory from the global allocator; host-accessible only, and honest about it.
#[derive(Debug, Default)]
pub struct HeapAllocator {
    live: AtomicUsize,
}

impl HeapAllocator {
    /// A new allocator.
    pub const fn new() -> Self {
        Self {
            live: AtomicUsize::new(0),
        }
    }

    /// Allocations not yet freed.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

/// The error of [`HeapAllocator`].
#[derive(Debug, thiserror::Error)]
#[error("heap allocator: {kind}")]
pub struct HeapError {
    /// The kind.
    pub kind: ErrorKind,
}

impl BackendError for HeapError {
    fn kind(&self) -> ErrorKind {
        self.kind
    }
}

impl ErrorType for HeapAllocator {
    type Error = HeapError;
}

fn err(kind: ErrorKind) -> HeapError {
    HeapError { kind }
}

// SAFETY: `allocate` returns fresh zeroed heap memory of exactly `bytes` bytes aligned to 4096;
// `zero` checks its range against the allocation before writing; capabilities say host-only.
unsafe impl ManagedAllocator for HeapAllocator {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            host_accessible: true,
            comes_zeroed: true,
            ..Capabilities::NONE
        }
    }

    fn device_count(&self) -> u32 {
        1
    }

    fn allocate(&self, device: DeviceId, bytes: usize) -> Result<Allocation, HeapError> {
        if bytes == 0 || device.0 != 0 {
            return Err(err(ErrorKind::InvalidArgument));
        }
        let layout = Layout::from_size_align(bytes, ALIGN).map_err(|_| err(ErrorKind::Overflow))?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(err(ErrorKind::OutOfMemory))?;
        self.live.fetch_add(1, Ordering::AcqRel);
        // SAFETY: `ptr` is a fresh allocation of `bytes` bytes, aligned to 4096, owned by no one.
        Ok(unsafe { Allocation::from_raw_parts(ptr, bytes, device) })
    }

    unsafe fn free(&self, allocation: Allocation) -> Result<(), Refused<Allocation, HeapError>> {
        let Ok(layout) = Layout::from_size_align(allocation.len(), ALIGN) else {
            return Err(Refused {
                resource: allocation,
                error: err(ErrorKind::Other),
            });
        };
        let (ptr, _, _) = allocation.into_raw_parts();
        // SAFETY: the caller guarantees the allocation came from `allocate`, which used `layout`.
        unsafe { dealloc(ptr.as_ptr(), layout) };
        self.live.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }

    unsafe fn zero(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), HeapError> {
        let range = allocation.range(offset, len).map_err(|e| err(e.kind()))?;
        // SAFETY: `range` lies inside the live allocation (checked); the caller guarantees no
        // concurrent access.
        unsafe {
            allocation
                .as_ptr()
                .wrapping_add(range.start)
                .write_bytes(0, range.len())
        };
        Ok(())
    }
}

impl Advisor for HeapAllocator {
    fn advise(
        &self,
        a: &Allocation,
        offset: usize,
        len: usize,
        _: Advice,
    ) -> Result<(), HeapError> {
        a.range(offset, len).map(drop).map_err(|e| err(e.kind()))
    }

    fn prefetch(
        &self,
        a: &Allocation,
        offset: usize,
        len: usize,
        _: Location,
        _: &Stream,
    ) -> Result<(), HeapError> {
        a.range(offset, len).map(drop).map_err(|e| err(e.kind()))
    }

    /// Plain host memory keeps no hints: nothing to reset.
    fn reset_hints(&self, a: &Allocation, offset: usize, len: usize) -> Result<(), HeapError> {
        a.range(offset, len).map(drop).map_err(|e| err(e.kind()))
    }
}
