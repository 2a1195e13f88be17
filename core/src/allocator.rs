//! The [`ManagedAllocator`] trait and the [`Allocation`] handle it hands out.
//!
//! # Implementing a backend
//!
//! ```
//! use core::ptr::NonNull;
//! use tensor_wasm_mem_core::{
//!     Allocation, BackendError, Capabilities, DeviceId, ErrorKind, ErrorType, ManagedAllocator,
//!     Refused, check_range,
//! };
//!
//! /// Host memory from the global allocator: not device-accessible, and honest about it.
//! struct HeapAllocator;
//!
//! #[derive(Debug, thiserror::Error)]
//! #[error("heap allocator: {0}")]
//! struct HeapError(&'static str, ErrorKind);
//! impl BackendError for HeapError {
//!     fn kind(&self) -> ErrorKind { self.1 }
//! }
//!
//! impl ErrorType for HeapAllocator {
//!     type Error = HeapError;
//! }
//!
//! // SAFETY: `allocate` returns fresh, exclusively owned, zeroed heap memory of the requested
//! // size (aligned to 4096 >= MIN_ALIGN); `free` and `zero` stay inside the allocation.
//! unsafe impl ManagedAllocator for HeapAllocator {
//!     fn capabilities(&self) -> Capabilities {
//!         Capabilities { host_accessible: true, comes_zeroed: true, ..Capabilities::NONE }
//!     }
//!     fn device_count(&self) -> u32 { 1 }
//!     fn allocate(&self, device: DeviceId, bytes: usize) -> Result<Allocation, HeapError> {
//!         if bytes == 0 {
//!             return Err(HeapError("size 0", ErrorKind::InvalidArgument));
//!         }
//!         let layout = std::alloc::Layout::from_size_align(bytes, 4096)
//!             .map_err(|_| HeapError("size", ErrorKind::Overflow))?;
//!         // SAFETY: the layout has a non-zero size.
//!         let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
//!         let ptr = NonNull::new(ptr).ok_or(HeapError("oom", ErrorKind::OutOfMemory))?;
//!         // SAFETY: `ptr` is valid for `bytes` bytes and owned by nobody else.
//!         Ok(unsafe { Allocation::from_raw_parts(ptr, bytes, device) })
//!     }
//!     unsafe fn free(&self, allocation: Allocation) -> Result<(), Refused<Allocation, HeapError>> {
//!         let (ptr, len, _) = allocation.into_raw_parts();
//!         let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
//!         // SAFETY: the caller guarantees `allocation` came from `allocate` with this layout.
//!         unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
//!         Ok(())
//!     }
//!     unsafe fn zero(&self, a: &Allocation, offset: usize, len: usize) -> Result<(), HeapError> {
//!         let r = check_range(offset, len, a.len())
//!             .map_err(|_| HeapError("range", ErrorKind::OutOfRange))?;
//!         // SAFETY: `r` lies inside the live allocation (checked above); the caller
//!         // guarantees nothing else accesses it meanwhile.
//!         unsafe { a.as_ptr().wrapping_add(r.start).write_bytes(0, r.len()) };
//!         Ok(())
//!     }
//! }
//!
//! let heap = HeapAllocator;
//! let a = heap.allocate(DeviceId(0), 8192).unwrap();
//! assert_eq!(a.len(), 8192);
//! // SAFETY: `a` came from `heap` and is not used afterwards.
//! unsafe { heap.free(a).unwrap() };
//! ```

use core::fmt;
use core::ptr::NonNull;

use crate::device::{Capabilities, DeviceId};
use crate::error::{BackendError, ErrorKind, ErrorType, RangeError, check_range};

/// The least alignment every [`ManagedAllocator`] guarantees for an allocation's base.
pub const MIN_ALIGN: usize = 256;

/// A release the backend refused: the resource comes back to its owner with the backend's error.
///
/// What the backend would not take back is still held by it (memory still allocated, host
/// pages still registered), so whoever pays for the resource keeps paying: the owner keeps the
/// returned resource (and its charge) and releases it again later. Dropping the resource
/// instead leaves it to the backend (a driver backend retries at its own drop).
#[derive(Debug)]
pub struct Refused<R, E> {
    /// What was to be released: still live, still the caller's.
    pub resource: R,
    /// Why the backend refused.
    pub error: E,
}

impl<R, E: BackendError> Refused<R, E> {
    /// The kind of the backend's error.
    pub fn kind(&self) -> ErrorKind {
        self.error.kind()
    }

    /// The backend's error, the resource given up (left to the backend).
    pub fn into_error(self) -> E {
        self.error
    }
}

impl<R, E> Refused<R, E> {
    /// The same refusal with the error converted by `f` (for wrappers of a backend).
    pub fn map_error<F>(self, f: impl FnOnce(E) -> F) -> Refused<R, F> {
        Refused {
            resource: self.resource,
            error: f(self.error),
        }
    }

    /// The same refusal with the resource wrapped by `f` (for owners of a resource).
    pub fn map_resource<S>(self, f: impl FnOnce(R) -> S) -> Refused<S, E> {
        Refused {
            resource: f(self.resource),
            error: self.error,
        }
    }
}

impl<R, E: fmt::Display> fmt::Display for Refused<R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "release refused: {}", self.error)
    }
}

impl<R: fmt::Debug, E: core::error::Error + 'static> core::error::Error for Refused<R, E> {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// One live allocation of managed memory: base address, length and device.
///
/// A handle only: it owns nothing by itself (dropping it leaks the memory; give it back with
/// [`ManagedAllocator::free`], or use [`UnifiedBuffer`](crate::UnifiedBuffer) which does). It is
/// deliberately neither `Clone` nor `Copy`, so a handle cannot be freed twice by safe code.
#[derive(Debug, PartialEq, Eq)]
pub struct Allocation {
    ptr: NonNull<u8>,
    len: usize,
    device: DeviceId,
    /// The [`DriverBackend`](crate::DriverBackend) recovery generation it was made in (0
    /// elsewhere): an address a reset gave back and the driver handed out again is never taken
    /// for the old allocation.
    generation: u64,
}

// SAFETY: an `Allocation` is an address and a length; it grants no access by itself (every
// access through it goes through `unsafe` code whose caller upholds the aliasing rules), so moving
// or sharing the handle between threads cannot cause a data race.
unsafe impl Send for Allocation {}
// SAFETY: as for `Send`: `&Allocation` only reads the address, length and device.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// Wraps memory a backend allocated.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes (from the host if the allocator
    /// reports `host_accessible`), aligned to at least [`MIN_ALIGN`], owned by nobody else, and
    /// stay so until the allocation is freed by the allocator that made it. `len` must be
    /// non-zero.
    #[must_use]
    pub const unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize, device: DeviceId) -> Self {
        Self {
            ptr,
            len,
            device,
            generation: 0,
        }
    }

    /// [`from_raw_parts`](Self::from_raw_parts) in a driver backend's recovery `generation`.
    ///
    /// # Safety
    ///
    /// As for [`from_raw_parts`](Self::from_raw_parts).
    pub(crate) const unsafe fn from_raw_parts_in(
        ptr: NonNull<u8>,
        len: usize,
        device: DeviceId,
        generation: u64,
    ) -> Self {
        Self {
            ptr,
            len,
            device,
            generation,
        }
    }

    /// The recovery generation it was made in.
    pub(crate) const fn generation(&self) -> u64 {
        self.generation
    }

    /// Takes the handle apart (for `free` implementations).
    #[must_use]
    pub const fn into_raw_parts(self) -> (NonNull<u8>, usize, DeviceId) {
        (self.ptr, self.len, self.device)
    }

    /// The base address. With managed memory the host and device addresses are the same.
    #[must_use]
    pub const fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The base address as a device pointer (`CUdeviceptr`-sized).
    #[must_use]
    pub fn device_ptr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// The length in bytes.
    #[must_use]
    pub const fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: allocations are never empty. Present for API symmetry.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the allocation was made on.
    #[must_use]
    pub const fn device(&self) -> DeviceId {
        self.device
    }

    /// Checks that `offset..offset + len` lies inside this allocation.
    pub fn range(&self, offset: usize, len: usize) -> Result<core::ops::Range<usize>, RangeError> {
        check_range(offset, len, self.len)
    }
}

/// Allocates, frees and zeroes managed (unified) memory.
///
/// # Safety
///
/// Implementors guarantee that:
/// - every `Allocation` returned by [`allocate`](Self::allocate) satisfies the requirements of
///   [`Allocation::from_raw_parts`] for exactly the requested number of bytes, and does not overlap
///   any other live allocation;
/// - [`capabilities`](Self::capabilities) is honest (in particular `host_accessible`,
///   `comes_zeroed` and `guard_pages`: safety decisions rest on them);
/// - [`zero`](Self::zero) writes zeros to exactly the requested range and nothing else, and
///   rejects a range outside the allocation with an error instead of writing.
///
/// A size of zero, an unknown device and exhausted memory are errors, never a panic.
pub unsafe trait ManagedAllocator: ErrorType {
    /// What the memory of this backend offers.
    fn capabilities(&self) -> Capabilities;

    /// How many devices this backend can allocate on (ids `0..device_count()`).
    fn device_count(&self) -> u32;

    /// What `device` offers and holds now; `None` for a device this backend does not have. By
    /// default the capabilities with no memory figures; driver backends ask the driver
    /// (`cuMemGetInfo` in the device's primary context).
    fn device_report(&self, device: DeviceId) -> Option<crate::DeviceReport> {
        (device.0 < self.device_count())
            .then(|| crate::DeviceReport::from_capabilities(device, &self.capabilities()))
    }

    /// `device`'s fault record: whether it is fenced after a kernel fault in its primary
    /// context, and its faults and recoveries so far. A backend without driver contexts never
    /// fences (the default: healthy, nothing counted).
    fn device_health(&self, device: DeviceId) -> crate::DeviceHealth {
        let _ = device;
        crate::DeviceHealth::default()
    }

    /// Starts device work the caller queues itself on `device` (an embedder's or a guest's
    /// kernel launch through its own driver calls): until
    /// [`end_device_work`](Self::end_device_work), no recovery resets the device's primary
    /// context under it. Refused (typed [`ErrorKind::ContextLost`](crate::ErrorKind::ContextLost))
    /// on a fenced device and while a reset runs: the work must not start. Every `Ok` must be
    /// matched by one `end_device_work`. The default answers `Ok` (a backend that never
    /// resets).
    fn begin_device_work(&self, device: DeviceId) -> Result<(), Self::Error> {
        let _ = device;
        Ok(())
    }

    /// Ends device work [`begin_device_work`](Self::begin_device_work) started on `device`.
    fn end_device_work(&self, device: DeviceId) {
        let _ = device;
    }

    /// Registers `holder`, which keeps memory of this backend idle (a slot pool's slab, with
    /// every slot free), to be asked to let it go ([`IdleHolder::let_go_if_fenced`]) when a
    /// recovery of a fenced device counts what is still in use: so a device is recovered
    /// without waiting for an idle holder's own next call. Held weakly (a holder that is gone
    /// is skipped, and dropped from the list). The default keeps nothing (a backend that never
    /// recovers). The holder is called from inside the recovery, on the recovering thread: it
    /// must not recover (nor drop what recovers) itself, and a recovery must not be started
    /// while the holder's own lock is held (a slot pool's [`with_slab`](crate::SlotPool::with_slab)
    /// closure), or that thread waits for itself.
    fn watch_idle(&self, holder: alloc::sync::Weak<dyn IdleHolder>) {
        let _ = holder;
    }

    /// Claims `device`'s fault number `fault` (its [`DeviceHealth::faults`](crate::DeviceHealth)
    /// after a fault that a caller's wait saw) for that caller: `true` for the first claim of
    /// that fault on this backend, whoever claims it (every creator on the backend asks here),
    /// so one fault names at most one suspect. The default answers `true` (a backend that never
    /// faults keeps no record).
    fn claim_fault(&self, device: DeviceId, fault: u64) -> bool {
        let _ = (device, fault);
        true
    }

    /// Recoveries so far, all devices together ([`DeviceHealth::recoveries`](crate::DeviceHealth)
    /// summed): a cheap read (no lock) that tells a caller whether any device was recovered
    /// since it last looked, whoever recovered it. `0` for a backend that never fences (the
    /// default).
    fn recoveries(&self) -> u64 {
        0
    }

    /// Whether `device` is fenced: it refuses new work (typed
    /// [`ErrorKind::ContextLost`](crate::ErrorKind::ContextLost)) until
    /// [`recover_device`](Self::recover_device) succeeds.
    fn device_fenced(&self, device: DeviceId) -> bool {
        self.device_health(device).fenced
    }

    /// Recovers a fenced `device` (a driver backend resets its primary context: see
    /// [`DriverBackend::recover`](crate::DriverBackend::recover)); `Ok(None)` where there was
    /// nothing to recover (the default).
    ///
    /// # Safety
    ///
    /// The reset destroys everything made in the device's primary context, not only what this
    /// backend made: nothing else in the process may use what it made there afterwards (an
    /// embedder's modules, functions, events and streams loaded through cudarc or another
    /// binding, a kernel launcher's cached modules, another backend's allocations on the
    /// device), or it must make them again. What this backend made is handled.
    unsafe fn recover_device(
        &self,
        device: DeviceId,
    ) -> Result<Option<crate::Recovery>, Self::Error> {
        let _ = device;
        Ok(None)
    }

    /// Whether `device` can access memory resident on another device, `peer`, directly (peer
    /// access over NVLink or PCIe: `cuDeviceCanAccessPeer`). `false` for the same device, an
    /// unknown one, or a backend that cannot say (the default).
    fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> bool {
        let _ = (device, peer);
        false
    }

    /// Allocates `bytes` bytes of managed memory attached globally, on `device`.
    fn allocate(&self, device: DeviceId, bytes: usize) -> Result<crate::Allocation, Self::Error>;

    /// Frees an allocation. A free the backend refuses hands the allocation back ([`Refused`]):
    /// it is still allocated, and the caller may free it again later.
    ///
    /// # Safety
    ///
    /// `allocation` must have come from this allocator's `allocate`, and no pointer derived from
    /// it may be used afterwards (by the host or by device work still in flight).
    unsafe fn free(
        &self,
        allocation: crate::Allocation,
    ) -> Result<(), Refused<crate::Allocation, Self::Error>>;

    /// Gives up, for good, an allocation (or attached host range) whose release the backend
    /// refused: the caller will never free it again, and the backend keeps it (a driver backend
    /// frees it when it drops). A driver backend keeps nothing for it past a recovery: where
    /// the device's reset destroyed it, or destroys it later, no record waits for a free that
    /// never comes. The default drops the handle (a backend with no such records).
    fn forget(&self, allocation: crate::Allocation) {
        let _ = allocation;
    }

    /// Writes zeros to `offset..offset + len` of `allocation`, and returns once the zeros are
    /// visible to the host and to later device work.
    ///
    /// # Safety
    ///
    /// `allocation` must be a live allocation of this allocator, and nothing else may access the
    /// range while it is being zeroed (no live Rust reference to it, no device work on it).
    unsafe fn zero(
        &self,
        allocation: &crate::Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), Self::Error>;

    /// [`zero`](Self::zero) for a range only the host has touched since device work last did
    /// (the slot pool's scrub of a slot no device work reached): its pages are on the host, and
    /// a device memset would move them over the link to write zeros the next host touch moves
    /// back. A backend whose memory the host may write while devices work writes the zeros from
    /// the host; the default is [`zero`](Self::zero).
    ///
    /// # Safety
    ///
    /// As [`zero`](Self::zero), and no device work may be using the range.
    unsafe fn zero_on_host(
        &self,
        allocation: &crate::Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), Self::Error> {
        // SAFETY: the caller upholds `zero`'s contract.
        unsafe { self.zero(allocation, offset, len) }
    }
}

/// Something that holds memory of a backend idle in a device's primary context (a slot pool's
/// slab while no slot is held) and lets it go when that device is fenced, so nothing idle keeps
/// the device from being recovered. Registered with [`ManagedAllocator::watch_idle`];
/// [`SlotPool::shared`](crate::SlotPool::shared) registers its pool.
pub trait IdleHolder: Send + Sync {
    /// Lets go what it holds idle on any fenced device of its backend (freed, or given up with
    /// [`ManagedAllocator::forget`] where the free is refused); nothing where no device is
    /// fenced, or where what it holds is in use. Called without any lock of the backend held,
    /// from the thread that recovers (inside its recovery: it must not recover itself).
    fn let_go_if_fenced(&self);
}

macro_rules! forward_allocator {
    ($($ty:ty),*) => {$(
        // SAFETY: forwards every call unchanged to `T`, which upholds the contract.
        unsafe impl<T: ManagedAllocator + ?Sized> ManagedAllocator for $ty {
            fn capabilities(&self) -> Capabilities {
                T::capabilities(self)
            }
            fn device_count(&self) -> u32 {
                T::device_count(self)
            }
            fn device_report(&self, device: DeviceId) -> Option<crate::DeviceReport> {
                T::device_report(self, device)
            }
            fn can_access_peer(&self, device: DeviceId, peer: DeviceId) -> bool {
                T::can_access_peer(self, device, peer)
            }
            fn device_health(&self, device: DeviceId) -> crate::DeviceHealth {
                T::device_health(self, device)
            }
            fn device_fenced(&self, device: DeviceId) -> bool {
                T::device_fenced(self, device)
            }
            fn recoveries(&self) -> u64 {
                T::recoveries(self)
            }
            fn claim_fault(&self, device: DeviceId, fault: u64) -> bool {
                T::claim_fault(self, device, fault)
            }
            fn begin_device_work(&self, device: DeviceId) -> Result<(), Self::Error> {
                T::begin_device_work(self, device)
            }
            fn watch_idle(&self, holder: alloc::sync::Weak<dyn IdleHolder>) {
                T::watch_idle(self, holder);
            }
            fn end_device_work(&self, device: DeviceId) {
                T::end_device_work(self, device);
            }
            unsafe fn recover_device(
                &self,
                device: DeviceId,
            ) -> Result<Option<crate::Recovery>, Self::Error> {
                // SAFETY: the caller upholds the contract, which is `T::recover_device`'s.
                unsafe { T::recover_device(self, device) }
            }
            fn allocate(&self, device: DeviceId, bytes: usize) -> Result<Allocation, Self::Error> {
                T::allocate(self, device, bytes)
            }
            unsafe fn free(
                &self,
                allocation: Allocation,
            ) -> Result<(), Refused<Allocation, Self::Error>> {
                // SAFETY: the caller upholds `free`'s contract, which is `T::free`'s.
                unsafe { T::free(self, allocation) }
            }
            fn forget(&self, allocation: Allocation) {
                T::forget(self, allocation);
            }
            unsafe fn zero(
                &self,
                allocation: &Allocation,
                offset: usize,
                len: usize,
            ) -> Result<(), Self::Error> {
                // SAFETY: the caller upholds `zero`'s contract, which is `T::zero`'s.
                unsafe { T::zero(self, allocation, offset, len) }
            }
            unsafe fn zero_on_host(
                &self,
                allocation: &Allocation,
                offset: usize,
                len: usize,
            ) -> Result<(), Self::Error> {
                // SAFETY: the caller upholds the contract, which is `T::zero_on_host`'s.
                unsafe { T::zero_on_host(self, allocation, offset, len) }
            }
        }
    )*};
}

forward_allocator!(&T, alloc::boxed::Box<T>, alloc::sync::Arc<T>);
