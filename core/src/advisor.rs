//! The [`Advisor`] trait: memory hints and prefetch on ranges of managed memory.
//!
//! # Implementing it
//!
//! An implementor checks the range against the allocation first (with
//! [`Allocation::range`](crate::Allocation::range)), then the location (an unknown device is an
//! error), then asks the driver. An empty range is accepted and does nothing. A backend without
//! migration (plain host memory) may accept every valid hint and do nothing, as long as
//! [`Capabilities::managed`](crate::Capabilities::managed) says `false`.
//!
//! [`Advisor::reset_hints`] undoes everything `advise` and `prefetch` can leave on a range; the
//! slot pool relies on it so that one tenant's hints never reach the next holder of a slot.

use crate::allocator::Allocation;
use crate::device::{Advice, Location};
use crate::error::ErrorType;
use crate::stream::Stream;

/// `cuMemAdvise` / `cuMemPrefetchAsync`-style operations.
///
/// Implementors guarantee that a range outside the allocation (or one whose end overflows) is
/// rejected with an error of kind `OutOfRange` (or `Overflow`) before any driver call, that an
/// unknown device is rejected with `InvalidArgument`, and that hints never change the contents of
/// memory. Neither call can cause undefined behaviour, so the trait is safe to implement.
pub trait Advisor: ErrorType {
    /// Applies `advice` to `offset..offset + len` of `allocation`.
    fn advise(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
        advice: Advice,
    ) -> Result<(), Self::Error>;

    /// Starts migrating `offset..offset + len` of `allocation` to `to`, ordered on `stream`.
    fn prefetch(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
        to: Location,
        stream: &Stream,
    ) -> Result<(), Self::Error>;

    /// Puts the advice of `offset..offset + len` of `allocation` back the way a fresh allocation
    /// has it, for its next holder: every advice unset (read-mostly, the preferred location,
    /// accessed-by for the host and for every device). The contents are unchanged, and so is
    /// where the pages are: a scrubbed slot's bytes are dead, and moving them over the link (a
    /// prefetch back to the host) would cost the transfer for nothing; the next holder's first
    /// touch places them. The same range and location checks as [`advise`](Self::advise); an
    /// empty range does nothing.
    ///
    /// The slot pool calls it before a slot whose last holder advised any of it reaches the
    /// next holder, so one tenant's advice never steers another's placement.
    fn reset_hints(
        &self,
        allocation: &Allocation,
        offset: usize,
        len: usize,
    ) -> Result<(), Self::Error>;
}

macro_rules! forward_advisor {
    ($($ty:ty),*) => {$(
        impl<T: Advisor + ?Sized> Advisor for $ty {
            fn advise(
                &self,
                allocation: &Allocation,
                offset: usize,
                len: usize,
                advice: Advice,
            ) -> Result<(), Self::Error> {
                T::advise(self, allocation, offset, len, advice)
            }
            fn prefetch(
                &self,
                allocation: &Allocation,
                offset: usize,
                len: usize,
                to: Location,
                stream: &Stream,
            ) -> Result<(), Self::Error> {
                T::prefetch(self, allocation, offset, len, to, stream)
            }
            fn reset_hints(
                &self,
                allocation: &Allocation,
                offset: usize,
                len: usize,
            ) -> Result<(), Self::Error> {
                T::reset_hints(self, allocation, offset, len)
            }
        }
    )*};
}

forward_advisor!(&T, alloc::boxed::Box<T>, alloc::sync::Arc<T>);
