//! Errors: the [`ErrorKind`] every error maps to, the [`BackendError`] contract a backend's own
//! error type meets, and the core's [`Error`] enum.
//!
//! The pattern follows embedded-hal: each backend keeps its precise error type (reachable through
//! the [`ErrorType`] supertrait of every backend trait) and generic code reads its
//! [`ErrorKind`]. A *denial* (a cap or a configured limit said no) is kept apart from a
//! *failure* (the driver or the allocator broke): see [`ErrorKind::is_denial`].

use core::fmt;

/// The small, stable classification every error of this workspace maps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument is malformed: zero size, min above max, an unknown device, a bad config.
    InvalidArgument,
    /// A range lies (partly) outside the memory it names.
    OutOfRange,
    /// Offset plus length (or a size computation) overflowed.
    Overflow,
    /// A tenant's byte cap said no. A denial, not a failure.
    CapExceeded,
    /// A configured per-memory limit said no. A denial, not a failure.
    LimitExceeded,
    /// Every slot that could hold the request is in use.
    PoolExhausted,
    /// The device or driver ran out of memory.
    OutOfMemory,
    /// The backend or device cannot do this at all.
    Unsupported,
    /// The backend slot exists but is not wired to a driver yet.
    NotYetWired,
    /// The driver library, or an entry point of it, is missing.
    DriverUnavailable,
    /// No (usable) device.
    NoDevice,
    /// The driver reported an error.
    Driver,
    /// A kernel faulted and the driver context it ran in is lost (a sticky error:
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` and its kin): the state that lived there is gone, and its
    /// device is fenced (refusing new work) until it is recovered.
    ContextLost,
    /// An invariant of the caller was broken (for example a handle from another backend).
    Other,
}

impl ErrorKind {
    /// A stable snake_case name for logs and metrics.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::InvalidArgument => "invalid_argument",
            Self::OutOfRange => "out_of_range",
            Self::Overflow => "overflow",
            Self::CapExceeded => "cap_exceeded",
            Self::LimitExceeded => "limit_exceeded",
            Self::PoolExhausted => "pool_exhausted",
            Self::OutOfMemory => "out_of_memory",
            Self::Unsupported => "unsupported",
            Self::NotYetWired => "not_yet_wired",
            Self::DriverUnavailable => "driver_unavailable",
            Self::NoDevice => "no_device",
            Self::Driver => "driver",
            Self::ContextLost => "context_lost",
            Self::Other => "other",
        }
    }

    /// `true` when a policy (a tenant cap, a configured limit, a pool's size: every slot in
    /// use) said no: nothing broke, and the same request can succeed once bytes or slots are
    /// given back or the policy changes. `false` for a failure: bad input, a missing
    /// capability, the driver or the host broke.
    #[must_use]
    pub const fn is_denial(self) -> bool {
        matches!(
            self,
            Self::CapExceeded | Self::LimitExceeded | Self::PoolExhausted
        )
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a backend's error type must offer: a real error that maps to an [`ErrorKind`].
pub trait BackendError: core::error::Error + Send + Sync + 'static {
    /// The kind of this error.
    fn kind(&self) -> ErrorKind;

    /// The driver's own code, where a driver call answered this error (a CUDA `CUresult`);
    /// `None` for a refusal made before any driver call, and by default.
    fn driver_code(&self) -> Option<u32> {
        None
    }

    /// What to do about this error, where the backend knows (the usual cause of a driver code
    /// and its fix); `None` by default.
    fn hint(&self) -> Option<&'static str> {
        None
    }
}

impl BackendError for core::convert::Infallible {
    fn kind(&self) -> ErrorKind {
        match *self {}
    }
}

/// The supertrait of every backend trait: names the backend's error type once, so a type that
/// implements [`ManagedAllocator`](crate::ManagedAllocator), [`Advisor`](crate::Advisor) and
/// [`StreamProvider`](crate::StreamProvider) has one error type for all three.
pub trait ErrorType {
    /// The backend's error type.
    type Error: BackendError;
}

impl<T: ErrorType + ?Sized> ErrorType for &T {
    type Error = T::Error;
}

impl<T: ErrorType + ?Sized> ErrorType for &mut T {
    type Error = T::Error;
}

impl<T: ErrorType + ?Sized> ErrorType for alloc::boxed::Box<T> {
    type Error = T::Error;
}

impl<T: ErrorType + ?Sized> ErrorType for alloc::sync::Arc<T> {
    type Error = T::Error;
}

/// The backend operation an error came from; stable names for logs and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Operation {
    /// `ManagedAllocator::allocate`.
    Allocate,
    /// `ManagedAllocator::free`.
    Free,
    /// `ManagedAllocator::zero`.
    Zero,
    /// `Advisor::advise`.
    Advise,
    /// `Advisor::prefetch`.
    Prefetch,
    /// `Advisor::reset_hints`.
    ResetHints,
    /// `StreamProvider::acquire_stream`.
    AcquireStream,
    /// `StreamProvider::release_stream`.
    ReleaseStream,
    /// `StreamProvider::synchronize`.
    Synchronize,
    /// `DevicePools::create_pool`.
    CreatePool,
    /// `DevicePools::pool_allocate`.
    PoolAllocate,
    /// `DevicePools::pool_free`.
    PoolFree,
    /// `DevicePools::trim_pool`.
    TrimPool,
    /// `DevicePools::destroy_pool`.
    DestroyPool,
    /// `DevicePools::pool_stats`.
    PoolStats,
    /// `HostMemory::attach_host`.
    AttachHost,
    /// `HostMemory::detach_host`.
    DetachHost,
    /// `ManagedAllocator::recover_device`.
    RecoverDevice,
}

impl Operation {
    /// A stable snake_case name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Allocate => "allocate",
            Self::Free => "free",
            Self::Zero => "zero",
            Self::Advise => "advise",
            Self::Prefetch => "prefetch",
            Self::ResetHints => "reset_hints",
            Self::AcquireStream => "acquire_stream",
            Self::ReleaseStream => "release_stream",
            Self::Synchronize => "synchronize",
            Self::CreatePool => "create_pool",
            Self::PoolAllocate => "pool_allocate",
            Self::PoolFree => "pool_free",
            Self::TrimPool => "trim_pool",
            Self::DestroyPool => "destroy_pool",
            Self::PoolStats => "pool_stats",
            Self::AttachHost => "attach_host",
            Self::DetachHost => "detach_host",
            Self::RecoverDevice => "recover_device",
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A byte range that does not fit the memory it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RangeError {
    /// `offset + len` does not fit in the address type.
    #[error("range at offset {offset} of {len} bytes overflows")]
    Overflow {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
    },
    /// The range ends past `bound`.
    #[error("range {offset}..{offset}+{len} lies outside 0..{bound}")]
    OutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// The size of the memory the range must lie in.
        bound: u64,
    },
}

impl RangeError {
    /// The kind of this error.
    #[must_use]
    pub const fn kind(&self) -> ErrorKind {
        match self {
            Self::Overflow { .. } => ErrorKind::Overflow,
            Self::OutOfBounds { .. } => ErrorKind::OutOfRange,
        }
    }
}

/// Checks that `offset..offset + len` lies inside `0..bound`, without overflow, and returns it.
///
/// An empty range (`len == 0`) is valid anywhere in `0..=bound`.
///
/// ```
/// use tensor_wasm_mem_core::{check_range, RangeError};
/// assert_eq!(check_range(4, 4, 8), Ok(4..8));
/// assert!(matches!(check_range(5, 4, 8), Err(RangeError::OutOfBounds { .. })));
/// assert!(matches!(check_range(usize::MAX, 2, 8), Err(RangeError::Overflow { .. })));
/// ```
pub fn check_range(
    offset: usize,
    len: usize,
    bound: usize,
) -> Result<core::ops::Range<usize>, RangeError> {
    let end = offset.checked_add(len).ok_or(RangeError::Overflow {
        offset: offset as u64,
        len: len as u64,
    })?;
    if end > bound {
        return Err(RangeError::OutOfBounds {
            offset: offset as u64,
            len: len as u64,
            bound: bound as u64,
        });
    }
    Ok(offset..end)
}

/// The core's error: a denial, a bad plan or range, an exhausted pool, or a backend failure
/// carrying the backend's own error `E`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error<E> {
    /// A memory type or limit could not be planned.
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
    /// A tenant's cap said no.
    #[error(transparent)]
    Denied(#[from] crate::ledger::Denied),
    /// A range lies outside the memory it names.
    #[error(transparent)]
    Range(#[from] RangeError),
    /// The slot pool could not serve the request.
    #[error(transparent)]
    Pool(#[from] crate::pool::PoolError),
    /// The memory is not accessible from the host, so it cannot be read or written there.
    #[error("memory is not host-accessible on this backend")]
    NotHostAccessible,
    /// A device-pool allocation this pool did not hand out (or already freed).
    #[error("no live allocation at {ptr:#x} in this device pool")]
    UnknownPoolAllocation {
        /// The device pointer.
        ptr: u64,
    },
    /// The driver reported figures for a device pool that no device could hold (reserved
    /// bytes past [`MAX_POOL_BYTES`](crate::MAX_POOL_BYTES)): they cannot be charged,
    /// and are treated as unread (no allocation is asked of the pool until a read is sane).
    #[error(
        "the driver reported {reserved} bytes reserved for a device pool, more than any device \
         holds: figures that cannot be charged"
    )]
    ImplausiblePoolFigures {
        /// The reserved bytes it reported.
        reserved: u64,
    },
    /// The backend failed.
    #[error("backend failed to {op}: {source}")]
    Backend {
        /// What was being done.
        op: Operation,
        /// The backend's own error.
        #[source]
        source: E,
    },
}

impl<E: BackendError> Error<E> {
    /// Wraps a backend error with the operation it came from.
    pub fn backend(op: Operation, source: E) -> Self {
        Self::Backend { op, source }
    }

    /// The kind of this error.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Plan(e) => e.kind(),
            Self::Denied(_) => ErrorKind::CapExceeded,
            Self::Range(e) => e.kind(),
            Self::Pool(e) => e.kind(),
            Self::NotHostAccessible => ErrorKind::Unsupported,
            Self::UnknownPoolAllocation { .. } => ErrorKind::InvalidArgument,
            Self::ImplausiblePoolFigures { .. } => ErrorKind::Driver,
            Self::Backend { source, .. } => source.kind(),
        }
    }

    /// The driver's code, where a driver call answered this error
    /// ([`BackendError::driver_code`]).
    #[must_use]
    pub fn driver_code(&self) -> Option<u32> {
        match self {
            Self::Backend { source, .. } => source.driver_code(),
            _ => None,
        }
    }

    /// What to do about this error, where the backend knows ([`BackendError::hint`]).
    #[must_use]
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            Self::Backend { source, .. } => source.hint(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use rstest::rstest;

    #[rstest]
    #[case(0, 0, 0, Ok(0..0))]
    #[case(0, 8, 8, Ok(0..8))]
    #[case(8, 0, 8, Ok(8..8))]
    #[case(7, 1, 8, Ok(7..8))]
    #[case(7, 2, 8, Err(ErrorKind::OutOfRange))]
    #[case(9, 0, 8, Err(ErrorKind::OutOfRange))]
    #[case(usize::MAX, 1, usize::MAX, Err(ErrorKind::Overflow))]
    #[case(1, usize::MAX, usize::MAX, Err(ErrorKind::Overflow))]
    #[case(usize::MAX, 0, usize::MAX, Ok(usize::MAX..usize::MAX))]
    fn ranges(
        #[case] offset: usize,
        #[case] len: usize,
        #[case] bound: usize,
        #[case] expected: Result<core::ops::Range<usize>, ErrorKind>,
    ) {
        assert_eq!(
            check_range(offset, len, bound).map_err(|e| e.kind()),
            expected
        );
    }

    #[test]
    fn denials_are_not_failures() {
        assert!(ErrorKind::CapExceeded.is_denial());
        assert!(ErrorKind::LimitExceeded.is_denial());
        assert!(ErrorKind::PoolExhausted.is_denial());
        assert!(!ErrorKind::Driver.is_denial());
        assert!(!ErrorKind::OutOfMemory.is_denial());
    }

    #[test]
    fn names_are_stable() {
        assert_eq!(ErrorKind::CapExceeded.to_string(), "cap_exceeded");
        assert_eq!(Operation::Prefetch.to_string(), "prefetch");
    }
}
