//! The [`HostMemory`] trait: device access to host memory that no driver allocated.
//!
//! Guard pages need host virtual memory: a `PROT_NONE` page traps a stray access, so compiled
//! Wasm can run with no explicit bounds checks. Managed memory from `cuMemAllocManaged` cannot
//! carry such guards. The other way round works: make host virtual memory the thing the device
//! sees. A driver offers two ways ([`HostAccess`]):
//!
//! - **pageable memory access** (HMM on x86 with the open kernel modules and CUDA 12.2+, ATS on
//!   Grace Hopper): any host memory is device-accessible at its own address, through the host's
//!   page tables (so a `PROT_NONE` guard faults on the device too); advice and prefetch apply to
//!   it as to managed memory;
//! - **host registration** (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_DEVICEMAP`, where the
//!   device can use the host pointer as its device pointer): the registered pages are pinned and
//!   read by the device over the link, zero-copy, never migrated. Advice does not apply to them,
//!   and a prefetch has nothing to do.
//!
//! A backend that implements [`HostMemory`] hands out an [`Allocation`] handle for an attached
//! host range; [`Advisor`](crate::Advisor) calls and [`ManagedAllocator::zero`] accept that
//! handle as they accept a managed allocation, and [`ManagedAllocator::free`] refuses it: the
//! memory stays its owner's, and goes back with [`HostMemory::detach_host`].
//!
//! [`ManagedAllocator::zero`]: crate::ManagedAllocator::zero
//! [`ManagedAllocator::free`]: crate::ManagedAllocator::free

use core::fmt;
use core::ptr::NonNull;

use crate::allocator::Allocation;
use crate::device::DeviceId;
use crate::error::ErrorType;

/// How a device reaches host memory that its driver did not allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostAccess {
    /// Pageable memory access (`CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS`): any host memory,
    /// at its own address, through the host's page tables; advice and prefetch apply.
    Pageable,
    /// Registration (`cuMemHostRegister`, device-mapped; `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_
    /// SUPPORTED` and `..._CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`): registered pages, pinned,
    /// at their own address, over the link; no advice, nothing to prefetch.
    Registered,
}

impl HostAccess {
    /// A stable name for spans, metrics and the CLI: `pageable` or `registered`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Pageable => "pageable",
            Self::Registered => "registered",
        }
    }
}

impl fmt::Display for HostAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Lets a device use host memory that its driver did not allocate.
///
/// # Safety
///
/// Implementors guarantee that:
/// - [`can_attach_host`](Self::can_attach_host) is honest: where it answers `true`, memory
///   attached that way is accessible from `device` at its own address (the host pointer is the
///   device pointer);
/// - [`attach_host`](Self::attach_host) returns a handle for exactly the range given, and what it
///   registers with the driver is exactly that range;
/// - after [`detach_host`](Self::detach_host) returns `Ok`, the driver holds nothing of the range
///   (its owner may unmap it).
pub unsafe trait HostMemory: ErrorType {
    /// Whether `device` can reach host memory attached with `access`. `false` for a device the
    /// backend does not have.
    fn can_attach_host(&self, device: DeviceId, access: HostAccess) -> bool;

    /// Makes `ptr..ptr + len` of host memory usable by `device` as `access` says (with
    /// [`HostAccess::Registered`], registers it with the driver), and returns a handle for it
    /// that the backend's advice, prefetch and zeroing accept. An access the device lacks, an
    /// empty range or a range attached already at the same base is an error, never a panic
    /// (overlapping registrations are the driver's to refuse).
    ///
    /// With [`HostAccess::Pageable`] the driver is asked nothing here nor in
    /// [`detach_host`](Self::detach_host) (the device reaches host memory through the host's
    /// page tables, attached or not): replacing an attached range by a larger one as memory
    /// grows (detach, then attach) is allowed while device work uses it.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be host memory mapped readable and writable, aligned to the host
    /// page size (both ends), owned by the caller, and stay mapped until
    /// [`detach_host`](Self::detach_host) has returned `Ok` for the handle.
    unsafe fn attach_host(
        &self,
        device: DeviceId,
        access: HostAccess,
        ptr: NonNull<u8>,
        len: usize,
    ) -> Result<Allocation, Self::Error>;

    /// Gives an attached range back (unregistering it). A refusal hands the handle back
    /// ([`Refused`](crate::Refused)): the range stays attached (the caller may detach it again
    /// later; a driver backend also tries again when it drops).
    ///
    /// # Safety
    ///
    /// `allocation` must have come from this backend's `attach_host`, and no device work may
    /// use the range any more (with [`HostAccess::Pageable`], see
    /// [`attach_host`](Self::attach_host)).
    unsafe fn detach_host(
        &self,
        allocation: Allocation,
    ) -> Result<(), crate::Refused<Allocation, Self::Error>>;
}

macro_rules! forward_host_memory {
    ($($ty:ty),*) => {$(
        // SAFETY: forwards every call unchanged to `T`, which upholds the contract.
        unsafe impl<T: HostMemory + ?Sized> HostMemory for $ty {
            fn can_attach_host(&self, device: DeviceId, access: HostAccess) -> bool {
                T::can_attach_host(self, device, access)
            }
            unsafe fn attach_host(
                &self,
                device: DeviceId,
                access: HostAccess,
                ptr: NonNull<u8>,
                len: usize,
            ) -> Result<Allocation, Self::Error> {
                // SAFETY: the caller upholds `attach_host`'s contract, which is `T`'s.
                unsafe { T::attach_host(self, device, access, ptr, len) }
            }
            unsafe fn detach_host(
                &self,
                allocation: Allocation,
            ) -> Result<(), crate::Refused<Allocation, Self::Error>> {
                // SAFETY: the caller upholds `detach_host`'s contract, which is `T`'s.
                unsafe { T::detach_host(self, allocation) }
            }
        }
    )*};
}

forward_host_memory!(&T, alloc::boxed::Box<T>, alloc::sync::Arc<T>);
