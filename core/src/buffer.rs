//! [`UnifiedBuffer`]: the RAII owner of one managed allocation (or one pool slot), with a visible
//! window inside a fixed capacity.
//!
//! Growth only moves the end of the window: the base address never changes, which is what lets
//! a Wasm linear memory keep its base for its whole life and lets a device keep a pointer into it.

use core::fmt;

use crate::advisor::Advisor;
use crate::allocator::{Allocation, ManagedAllocator, Refused};
use crate::device::{Advice, Capabilities, DeviceId, Location};
use crate::error::{Error, Operation, RangeError, check_range};
use crate::pool::PoolSlot;
use crate::stream::Stream;

/// A checked window of device-visible memory: a device pointer and a length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceSlice {
    /// The device address of the first byte.
    pub device_ptr: u64,
    /// The length in bytes.
    pub len: usize,
}

/// Where a buffer's bytes come from: an allocation of its own, or a pool's slot.
enum Source<A: ManagedAllocator> {
    Owned {
        allocator: A,
        allocation: Option<Allocation>,
    },
    Slot(PoolSlot<A>),
}

/// Owns one allocation of managed memory (or one slot of a [`SlotPool`](crate::SlotPool)):
/// `len()` bytes visible inside `capacity()` bytes, growth a size bump that never moves the base,
/// freed (or given back to its pool) on drop.
///
/// Every byte of the visible window reads as zero until written, whether or not the backend
/// hands out zeroed memory.
///
/// ```
/// # use tensor_wasm_mem_core::doc_support::HeapAllocator;
/// use tensor_wasm_mem_core::{DeviceId, UnifiedBuffer};
///
/// let mut buf = UnifiedBuffer::new(HeapAllocator::default(), DeviceId(0), 1 << 20, 4096).unwrap();
/// let base = buf.as_ptr();
/// buf.grow_to(1 << 20).unwrap();
/// assert_eq!(buf.as_ptr(), base); // growth never moves the base
/// assert!(buf.grow_to((1 << 20) + 1).is_err()); // nor passes the capacity
/// ```
pub struct UnifiedBuffer<A: ManagedAllocator> {
    source: Source<A>,
    len: usize,
    capacity: usize,
    /// Bytes from the base known to be zero or written through the window.
    zeroed: usize,
}

impl<A: ManagedAllocator> fmt::Debug for UnifiedBuffer<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnifiedBuffer")
            .field("base", &self.as_ptr())
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .field("pooled", &self.is_pooled())
            .finish()
    }
}

impl<A: ManagedAllocator> UnifiedBuffer<A> {
    /// Allocates `capacity` bytes on `device` with the first `len` visible (and zero).
    pub fn new(
        allocator: A,
        device: DeviceId,
        capacity: usize,
        len: usize,
    ) -> Result<Self, Error<A::Error>> {
        check_range(0, len, capacity)?;
        let allocation = allocator
            .allocate(device, capacity)
            .map_err(|e| Error::backend(Operation::Allocate, e))?;
        let zeroed = if allocator.capabilities().comes_zeroed {
            capacity
        } else {
            0
        };
        let mut buffer = Self {
            source: Source::Owned {
                allocator,
                allocation: Some(allocation),
            },
            len: 0,
            capacity,
            zeroed,
        };
        // On failure `buffer` drops here and frees the allocation.
        buffer.grow_to(len)?;
        Ok(buffer)
    }

    pub(crate) fn from_slot(slot: PoolSlot<A>, capacity: usize, len: usize) -> Self {
        // A slot comes out of the pool scrubbed: all of it is zero.
        Self {
            source: Source::Slot(slot),
            len,
            capacity,
            zeroed: capacity,
        }
    }

    fn parts(&self) -> (&A, &Allocation, usize) {
        match &self.source {
            Source::Owned {
                allocator,
                allocation,
            } => (
                allocator,
                // `Some` from construction until drop.
                allocation.as_ref().unwrap_or_else(|| unreachable!()),
                0,
            ),
            Source::Slot(slot) => (slot.pool().allocator(), slot.slab(), slot.offset()),
        }
    }

    /// The allocator behind this buffer.
    pub fn allocator(&self) -> &A {
        self.parts().0
    }

    /// The backend's capabilities.
    pub fn capabilities(&self) -> Capabilities {
        self.allocator().capabilities()
    }

    /// `true` when the memory is unified memory a device can use with no copy.
    pub fn is_uvm_backed(&self) -> bool {
        self.capabilities().is_uvm()
    }

    /// `true` when the memory is a pool slot.
    pub fn is_pooled(&self) -> bool {
        matches!(self.source, Source::Slot(_))
    }

    /// For a pool slot, the slot's size (at least `capacity()`).
    pub fn slot_bytes(&self) -> Option<usize> {
        match &self.source {
            Source::Slot(slot) => Some(slot.slot_bytes()),
            Source::Owned { .. } => None,
        }
    }

    /// The device the memory was allocated on.
    pub fn device(&self) -> DeviceId {
        self.parts().1.device()
    }

    /// The base address (host and device alike for managed memory). It never changes.
    pub fn as_ptr(&self) -> *mut u8 {
        let (_, allocation, offset) = self.parts();
        // `offset` is a slot's start inside the slab, so the result stays inside the allocation.
        allocation.as_ptr().wrapping_add(offset)
    }

    /// The base address as a device pointer.
    pub fn device_ptr(&self) -> u64 {
        // A device pointer handed out: device work may touch the slot (scrubbed on the device).
        self.device_touched();
        self.as_ptr() as usize as u64
    }

    /// Visible bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` when nothing is visible.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Fixed capacity: the most the window can grow to.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Makes the first `new_len` bytes visible, zeroing newly visible bytes where the backend
    /// does not hand out zeroed memory. Never moves the base; never shrinks (a smaller `new_len`
    /// changes nothing). Past the capacity it fails and the window stays as it was.
    pub fn grow_to(&mut self, new_len: usize) -> Result<(), Error<A::Error>> {
        check_range(0, new_len, self.capacity)?;
        if new_len <= self.len {
            return Ok(());
        }
        if new_len > self.zeroed {
            let (allocator, allocation, offset) = self.parts();
            let len = new_len - self.zeroed;
            // SAFETY: `allocation` is live (owned by this buffer); `offset + zeroed..offset +
            // new_len` lies inside this buffer's window capacity (checked above), which no one
            // else can reach; `&mut self` excludes host readers through this buffer.
            unsafe { allocator.zero(allocation, offset + self.zeroed, len) }
                .map_err(|e| Error::backend(Operation::Zero, e))?;
            self.zeroed = new_len;
        }
        if let Source::Slot(slot) = &mut self.source {
            slot.touch(new_len);
        }
        self.len = new_len;
        Ok(())
    }

    /// A checked device slice of the visible window: `offset..offset + len` must lie inside
    /// `0..self.len()` without overflow.
    pub fn device_slice(&self, offset: usize, len: usize) -> Result<DeviceSlice, RangeError> {
        let range = check_range(offset, len, self.len)?;
        // `device_ptr` marks the slot as device-touched.
        Ok(DeviceSlice {
            device_ptr: self.device_ptr() + range.start as u64,
            len,
        })
    }

    fn host_range(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<core::ops::Range<usize>, Error<A::Error>> {
        if !self.capabilities().host_accessible {
            return Err(Error::NotHostAccessible);
        }
        Ok(check_range(offset, len, self.len)?)
    }

    /// Copies visible bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), Error<A::Error>> {
        let range = self.host_range(offset, out.len())?;
        // SAFETY: the backend is host-accessible, `range` lies inside the visible window of a live
        // allocation (checked), and `out` is a distinct Rust buffer. Writers through this buffer
        // need `&mut self`, so none runs concurrently on the host.
        unsafe {
            core::ptr::copy_nonoverlapping(
                self.as_ptr().wrapping_add(range.start),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    /// Copies `data` into the visible window at `offset`.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Result<(), Error<A::Error>> {
        let range = self.host_range(offset, data.len())?;
        // SAFETY: as in `read`, and `&mut self` excludes every other access through this buffer.
        unsafe {
            core::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.as_ptr().wrapping_add(range.start),
                data.len(),
            );
        }
        Ok(())
    }
}

impl<A: ManagedAllocator + Advisor> UnifiedBuffer<A> {
    /// Applies `advice` to `offset..offset + len` of the visible window.
    pub fn advise(&self, offset: usize, len: usize, advice: Advice) -> Result<(), Error<A::Error>> {
        let range = check_range(offset, len, self.len)?;
        self.hinted();
        let (allocator, allocation, base) = self.parts();
        allocator
            .advise(allocation, base + range.start, len, advice)
            .map_err(|e| Error::backend(Operation::Advise, e))
    }

    /// Prefetches `offset..offset + len` of the visible window to `to` on `stream`.
    pub fn prefetch(
        &self,
        offset: usize,
        len: usize,
        to: Location,
        stream: &Stream,
    ) -> Result<(), Error<A::Error>> {
        let range = check_range(offset, len, self.len)?;
        if matches!(to, Location::Device(_)) {
            self.device_touched();
        }
        let (allocator, allocation, base) = self.parts();
        allocator
            .prefetch(allocation, base + range.start, len, to, stream)
            .map_err(|e| Error::backend(Operation::Prefetch, e))
    }

    /// A pool slot about to be advised has its advice reset before its next holder gets it (a
    /// fresh allocation's advice goes with it when it is freed). A prefetch leaves only
    /// residency, which a scrub never moves (see [`device_slice`](Self::device_slice)).
    fn hinted(&self) {
        if let Source::Slot(slot) = &self.source {
            slot.hinted(|allocator, allocation, offset, len| {
                allocator.reset_hints(allocation, offset, len)
            });
        }
    }
}

impl<A: ManagedAllocator> UnifiedBuffer<A> {
    /// Device work may touch a pool slot: its scrub runs on the device, where its pages may be.
    fn device_touched(&self) {
        if let Source::Slot(slot) = &self.source {
            slot.device_touched();
        }
    }

    /// Frees the allocation now (a pool slot goes back to its pool, which always takes it). A
    /// free the backend refuses hands the buffer back, still owning its allocation
    /// ([`Refused`]): whoever pays for the memory keeps it (and its charge) and releases it
    /// again later, since the backend still holds the memory. Like dropping the buffer, this
    /// ends every use of the memory: its owner orders device work that uses it before.
    pub fn release(mut self) -> Result<(), Refused<Self, A::Error>> {
        let Source::Owned {
            allocator,
            allocation,
        } = &mut self.source
        else {
            return Ok(());
        };
        let Some(taken) = allocation.take() else {
            return Ok(());
        };
        // SAFETY: the allocation came from `allocator` and this buffer owns it; nothing derived
        // from it outlives the buffer, which is given up (as in `drop`).
        match unsafe { allocator.free(taken) } {
            Ok(()) => Ok(()),
            Err(Refused { resource, error }) => {
                *allocation = Some(resource);
                Err(Refused {
                    resource: self,
                    error,
                })
            }
        }
    }
}

impl<A: ManagedAllocator> UnifiedBuffer<A> {
    /// Gives the buffer up without freeing its allocation, for an owner that could not release
    /// it (the backend refused) or cannot prove no device work still uses it: the allocation
    /// stays with the backend (a driver backend frees it when it drops), and a pool slot is
    /// withdrawn from its pool for good, never handed out again: its pool then forgets its slab
    /// instead of freeing it when it lets the slab go, so the slab too stays with the backend.
    pub fn abandon(mut self) {
        match &mut self.source {
            Source::Owned {
                allocator,
                allocation,
            } => {
                // Taken out of the buffer, nothing frees it: the backend keeps the memory, and
                // is told that no free will come.
                if let Some(allocation) = allocation.take() {
                    allocator.forget(allocation);
                }
            }
            Source::Slot(slot) => slot.withdraw(),
        }
    }
}

impl<A: ManagedAllocator> Drop for UnifiedBuffer<A> {
    /// Frees the allocation (a slot goes back to its pool when its `PoolSlot` drops). A free
    /// the backend refuses here leaves the allocation to the backend, forgotten
    /// ([`ManagedAllocator::forget`]: a driver backend frees it when it drops): owners that pay for the memory release it with
    /// [`release`](UnifiedBuffer::release) instead, which hands a refused buffer back.
    fn drop(&mut self) {
        if let Source::Owned {
            allocator,
            allocation,
        } = &mut self.source
            && let Some(allocation) = allocation.take()
        {
            // SAFETY: the allocation came from `allocator` and this buffer owned it; nothing
            // derived from it outlives the buffer.
            if let Err(refused) = unsafe { allocator.free(allocation) } {
                // No owner is left to try again.
                allocator.forget(refused.resource);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doc_support::HeapAllocator;
    use crate::mocks::{MockBackend, MockError};
    use crate::{ErrorKind, IsolationLevel, PoolConfig, SizeClass, SlotPool, TenantId};
    use alloc::sync::Arc;

    static HEAP: HeapAllocator = HeapAllocator::new();
    const PAGE: usize = 1 << 16;

    fn heap_backed(mock: &mut MockBackend, caps: Capabilities) {
        mock.expect_capabilities().return_const(caps);
        mock.expect_allocate()
            .returning(|d, b| HEAP.allocate(d, b).map_err(|e| MockError(e.kind)));
        mock.expect_free().times(1).returning(|a| {
            // SAFETY: every allocation of this mock came from `HEAP`.
            unsafe { HEAP.free(a) }.map_err(|r| r.map_error(|e| MockError(e.kind)))
        });
    }

    fn host_caps(comes_zeroed: bool) -> Capabilities {
        Capabilities {
            host_accessible: true,
            comes_zeroed,
            ..Capabilities::NONE
        }
    }

    #[test]
    fn growth_never_moves_and_never_passes_capacity() {
        let heap = HeapAllocator::new();
        let mut buf = UnifiedBuffer::new(&heap, DeviceId(0), 4 * PAGE, PAGE).unwrap();
        let base = buf.as_ptr();
        for len in [PAGE, 2 * PAGE, 3 * PAGE + 1, 4 * PAGE] {
            buf.grow_to(len).unwrap();
            assert_eq!(buf.as_ptr(), base);
            assert_eq!(buf.len(), len);
        }
        let err = buf.grow_to(4 * PAGE + 1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfRange);
        assert_eq!(buf.len(), 4 * PAGE, "a failed growth changes nothing");
        assert!(buf.grow_to(usize::MAX).is_err());
        buf.grow_to(0).unwrap();
        assert_eq!(buf.len(), 4 * PAGE, "never shrinks");
        assert!(!buf.is_uvm_backed());
        drop(buf);
        assert_eq!(heap.live(), 0);
    }

    #[test]
    fn visible_window_is_zeroed_when_the_backend_does_not_zero() {
        let mut mock = MockBackend::new();
        heap_backed(&mut mock, host_caps(false));
        let mut seq = mockall::Sequence::new();
        for (offset, len) in [(0, 100), (100, PAGE - 100)] {
            mock.expect_zero()
                .withf(move |_, o, l| (*o, *l) == (offset, len))
                .times(1)
                .in_sequence(&mut seq)
                .returning(|_, _, _| Ok(()));
        }
        let mut buf = UnifiedBuffer::new(mock, DeviceId(0), 2 * PAGE, 100).unwrap();
        buf.grow_to(50).unwrap(); // nothing new to zero
        buf.grow_to(PAGE).unwrap(); // zeroes exactly the newly visible bytes
    }

    #[test]
    fn failed_zero_at_construction_frees_the_allocation() {
        let mut mock = MockBackend::new();
        heap_backed(&mut mock, host_caps(false));
        mock.expect_zero()
            .returning(|_, _, _| Err(MockError(ErrorKind::Driver)));
        let err = UnifiedBuffer::new(mock, DeviceId(0), PAGE, PAGE).unwrap_err();
        assert!(matches!(
            err,
            Error::Backend {
                op: Operation::Zero,
                ..
            }
        ));
        // `expect_free().times(1)` is verified when the mock drops.
    }

    #[test]
    fn failed_allocation_is_a_typed_error() {
        let mut mock = MockBackend::new();
        mock.expect_allocate()
            .returning(|_, _| Err(MockError(ErrorKind::OutOfMemory)));
        let err = UnifiedBuffer::new(mock, DeviceId(0), PAGE, 0).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfMemory);
        let heap = HeapAllocator::new();
        let err = UnifiedBuffer::new(&heap, DeviceId(0), PAGE, PAGE + 1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfRange);
        assert_eq!(heap.live(), 0, "refused before allocating");
    }

    #[test]
    fn read_write_are_bounded_by_the_window() {
        let heap = HeapAllocator::new();
        let mut buf = UnifiedBuffer::new(&heap, DeviceId(0), 2 * PAGE, PAGE).unwrap();
        buf.write(PAGE - 4, &[1, 2, 3, 4]).unwrap();
        let mut out = [0u8; 4];
        buf.read(PAGE - 4, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4]);
        assert_eq!(
            buf.write(PAGE - 3, &[0; 4]).unwrap_err().kind(),
            ErrorKind::OutOfRange
        );
        assert_eq!(
            buf.read(usize::MAX, &mut out).unwrap_err().kind(),
            ErrorKind::Overflow
        );
        buf.grow_to(2 * PAGE).unwrap();
        buf.read(PAGE, &mut out).unwrap();
        assert_eq!(out, [0; 4], "newly visible bytes read as zero");
    }

    #[test]
    fn device_only_memory_is_not_read_on_the_host() {
        let mut mock = MockBackend::new();
        heap_backed(
            &mut mock,
            Capabilities {
                device_accessible: true,
                comes_zeroed: true,
                ..Capabilities::NONE
            },
        );
        let buf = UnifiedBuffer::new(mock, DeviceId(0), PAGE, PAGE).unwrap();
        let mut out = [0u8; 1];
        assert!(matches!(
            buf.read(0, &mut out),
            Err(Error::NotHostAccessible)
        ));
    }

    #[test]
    fn device_slices_are_checked() {
        let heap = HeapAllocator::new();
        let buf = UnifiedBuffer::new(&heap, DeviceId(0), 2 * PAGE, PAGE).unwrap();
        let s = buf.device_slice(16, 32).unwrap();
        assert_eq!(s.device_ptr, buf.device_ptr() + 16);
        assert_eq!(s.len, 32);
        assert!(buf.device_slice(PAGE, 0).is_ok());
        assert!(
            buf.device_slice(PAGE, 1).is_err(),
            "capacity is not visible"
        );
        assert!(buf.device_slice(1, usize::MAX).is_err());
    }

    #[test]
    fn hints_on_a_slot_are_translated_and_bounded() {
        let mut mock = MockBackend::new();
        heap_backed(&mut mock, host_caps(true));
        // Two slots: the second starts one page into the slab.
        mock.expect_advise()
            .withf(|_, o, l, a| (*o, *l, *a) == (PAGE + 8, 16, Advice::SetReadMostly))
            .times(1)
            .returning(|_, _, _, _| Ok(()));
        mock.expect_prefetch()
            .withf(|_, o, l, to, _| (*o, *l, *to) == (PAGE, PAGE, Location::Host))
            .times(1)
            .returning(|_, _, _, _, _| Ok(()));
        let pool = Arc::new(
            SlotPool::new(
                mock,
                PoolConfig::new(DeviceId(0), [SizeClass::new(PAGE, 2)]),
            )
            .unwrap(),
        );
        let first = pool.acquire(PAGE, PAGE).unwrap();
        let second = pool.acquire(PAGE, PAGE).unwrap();
        second.advise(8, 16, Advice::SetReadMostly).unwrap();
        let stream = Stream::new(
            crate::DriverStream::DEFAULT,
            crate::DriverContext::from_raw(0),
            IsolationLevel::Shared,
            crate::TenantKey::fresh(TenantId(0)),
        );
        second.prefetch(0, PAGE, Location::Host, &stream).unwrap();
        // Out of the window: refused before the backend is asked (`times(1)` above).
        assert_eq!(
            second
                .advise(PAGE - 8, 16, Advice::SetReadMostly)
                .unwrap_err()
                .kind(),
            ErrorKind::OutOfRange
        );
        assert_eq!(
            second
                .prefetch(8, usize::MAX, Location::Host, &stream)
                .unwrap_err()
                .kind(),
            ErrorKind::Overflow
        );
        drop((first, second));
    }

    #[test]
    fn backend_hint_errors_carry_the_operation() {
        let mut mock = MockBackend::new();
        heap_backed(&mut mock, host_caps(true));
        mock.expect_advise()
            .returning(|_, _, _, _| Err(MockError(ErrorKind::InvalidArgument)));
        let buf = UnifiedBuffer::new(mock, DeviceId(0), PAGE, PAGE).unwrap();
        let err = buf
            .advise(
                0,
                1,
                Advice::SetPreferredLocation(Location::Device(DeviceId(9))),
            )
            .unwrap_err();
        assert!(matches!(
            err,
            Error::Backend {
                op: Operation::Advise,
                ..
            }
        ));
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    }
}
