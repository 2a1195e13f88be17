//! How a slot pool is shaped and what it reports: [`SizeClass`], [`PoolConfig`] and its layout,
//! [`PoolError`], [`PoolStats`].

use alloc::vec::Vec;

use crate::device::DeviceId;
use crate::error::ErrorKind;

/// Slot sizes are rounded up to a multiple of this (one Wasm page), so every slot starts on a
/// page boundary and hints never straddle two slots' pages.
pub const SLOT_ALIGN: usize = 1 << 16;

/// The most slots one pool may have, over all its classes: the free lists and per-slot records
/// are host memory allocated when the pool is built, so a pool asked for more is refused before
/// anything is allocated (a million slots of 64 KiB already address 64 GiB).
pub const MAX_POOL_SLOTS: usize = 1 << 20;

/// A size class: `slots` slots of `slot_bytes` bytes each (rounded up to [`SLOT_ALIGN`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeClass {
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Number of slots.
    pub slots: usize,
}

impl SizeClass {
    /// A class of `slots` slots of `slot_bytes` bytes.
    #[must_use]
    pub const fn new(slot_bytes: usize, slots: usize) -> Self {
        Self { slot_bytes, slots }
    }
}

/// How to build a [`SlotPool`](super::SlotPool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// The device the slab is allocated on.
    pub device: DeviceId,
    /// The size classes (any order; slot sizes must be distinct after rounding).
    pub classes: Vec<SizeClass>,
}

impl PoolConfig {
    /// A configuration on `device` with `classes`.
    pub fn new(device: DeviceId, classes: impl IntoIterator<Item = SizeClass>) -> Self {
        Self {
            device,
            classes: classes.into_iter().collect(),
        }
    }

    /// Checks the classes and lays them out one after another, smallest slot first: each slot
    /// size rounded up to [`SLOT_ALIGN`], each slot `stride(slot_bytes)` bytes after the last
    /// (`None`: too large). Returns the classes and the bytes they span. No classes, a class of
    /// zero bytes or zero slots, two classes rounding to one size and any overflow are typed
    /// errors. [`SlotPool`](super::SlotPool) lays its slab out so (a slot's stride is its size); a pool of
    /// guarded slots gives each its guard and reservation.
    pub fn layout(
        &self,
        stride: impl Fn(usize) -> Option<usize>,
    ) -> Result<(Vec<ClassLayout>, usize), PoolError> {
        if self.classes.is_empty() {
            return Err(PoolError::InvalidConfig {
                reason: "no size classes",
            });
        }
        let slots = self
            .classes
            .iter()
            .try_fold(0usize, |sum, c| sum.checked_add(c.slots));
        if slots.is_none_or(|n| n > MAX_POOL_SLOTS) {
            return Err(PoolError::InvalidConfig {
                reason: "more slots than MAX_POOL_SLOTS (1,048,576) in one pool",
            });
        }
        let mut requested = self.classes.clone();
        requested.sort_by_key(|c| c.slot_bytes);
        let mut layout: Vec<ClassLayout> = Vec::with_capacity(requested.len());
        let mut total = 0usize;
        for class in &requested {
            if class.slot_bytes == 0 || class.slots == 0 {
                return Err(PoolError::InvalidConfig {
                    reason: "a size class has zero bytes or zero slots",
                });
            }
            let slots = u32::try_from(class.slots).map_err(|_| PoolError::InvalidConfig {
                reason: "more than u32::MAX slots in a class",
            })?;
            let slot_bytes = class
                .slot_bytes
                .checked_next_multiple_of(SLOT_ALIGN)
                .ok_or(PoolError::SizeOverflow)?;
            if layout.iter().any(|c| c.slot_bytes == slot_bytes) {
                return Err(PoolError::InvalidConfig {
                    reason: "two size classes round to the same slot size",
                });
            }
            let stride = stride(slot_bytes).ok_or(PoolError::SizeOverflow)?;
            let bytes = stride
                .checked_mul(class.slots)
                .ok_or(PoolError::SizeOverflow)?;
            layout.push(ClassLayout {
                slot_bytes,
                slots,
                offset: total,
                stride,
            });
            total = total.checked_add(bytes).ok_or(PoolError::SizeOverflow)?;
        }
        Ok((layout, total))
    }
}

/// One size class as [`PoolConfig::layout`] places it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassLayout {
    /// Bytes a slot holds (rounded up to [`SLOT_ALIGN`]).
    pub slot_bytes: usize,
    /// Slots in the class.
    pub slots: u32,
    /// Where its first slot starts, from the start of the pool.
    pub offset: usize,
    /// Bytes from one slot's start to the next.
    pub stride: usize,
}

/// The pool could not serve a request or be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// Every slot of every class that could hold the request is in use.
    #[error("slot pool exhausted: no free slot of at least {requested} bytes")]
    Exhausted {
        /// Bytes requested.
        requested: u64,
    },
    /// No class is large enough.
    #[error("{requested} bytes exceed the largest slot of {largest} bytes")]
    TooLarge {
        /// Bytes requested.
        requested: u64,
        /// The largest slot size.
        largest: u64,
    },
    /// The initial visible size is larger than the capacity asked for.
    #[error("visible size of {visible} bytes exceeds the capacity of {capacity} bytes")]
    VisibleAboveCapacity {
        /// Visible bytes asked for.
        visible: u64,
        /// Capacity asked for.
        capacity: u64,
    },
    /// The configuration is unusable.
    #[error("invalid pool configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: &'static str,
    },
    /// The slab size does not fit the address space.
    #[error("pool slab size overflows")]
    SizeOverflow,
    /// The pool's device is fenced after a kernel fault in its primary context: the pool hands
    /// out nothing there until the device is recovered (its slab is given up, and made again
    /// after the recovery).
    #[error(
        "{device} is fenced after a kernel fault: the slot pool serves again once it is recovered"
    )]
    DeviceFenced {
        /// The device.
        device: crate::device::DeviceId,
    },
}

impl PoolError {
    /// The kind of this error.
    #[must_use]
    pub const fn kind(&self) -> ErrorKind {
        match self {
            Self::Exhausted { .. } => ErrorKind::PoolExhausted,
            Self::TooLarge { .. } => ErrorKind::LimitExceeded,
            Self::VisibleAboveCapacity { .. } | Self::InvalidConfig { .. } => {
                ErrorKind::InvalidArgument
            }
            Self::SizeOverflow => ErrorKind::Overflow,
            Self::DeviceFenced { .. } => ErrorKind::ContextLost,
        }
    }
}

/// Figures for one size class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassStats {
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// Slots in the class.
    pub slots: usize,
    /// Slots handed out now.
    pub in_use: usize,
    /// Slots free now.
    pub free: usize,
    /// Slots withdrawn for good (a guarded slot's scrub that failed, pages whose state is
    /// unknown, or pages a backend kept): neither free nor handed out, never handed out again
    /// (until a pool that carves its slots from a new slab makes them free again).
    pub withdrawn: usize,
}

/// A snapshot of a pool's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Per class, smallest first.
    pub classes: Vec<ClassStats>,
    /// Slots ever handed out.
    pub acquisitions: u64,
    /// Slots ever given back.
    pub releases: u64,
    /// Bytes zeroed before reuse.
    pub bytes_scrubbed: u64,
    /// Scrubs that failed, zeroing or resetting hints (nothing was handed out: the slot stayed
    /// free and dirty, or was withdrawn for good, [`ClassStats::withdrawn`]).
    pub scrub_failures: u64,
    /// Slots whose hints were reset before reuse (their last holder advised or prefetched).
    pub hint_resets: u64,
    /// Requests refused because every fitting slot was busy.
    pub exhaustions: u64,
    /// Slots scrubbed while free, ahead of their next acquisition
    /// ([`SlotPool::scrub_ahead`](crate::SlotPool::scrub_ahead)): an acquisition that takes one
    /// zeroes nothing. Their bytes count in `bytes_scrubbed` too.
    pub scrubbed_ahead: u64,
    /// The pool has no slab now: it gave it up on a fenced device (a kernel fault in its
    /// primary context), so its free slots hand nothing out until the device is recovered and
    /// an acquisition carves them from a new slab (one that cannot make the new slab, out of
    /// memory say, leaves it so, and the next tries again).
    pub slab_given_up: bool,
}

impl PoolStats {
    /// Slots handed out now, over all classes.
    #[must_use]
    pub fn in_use(&self) -> usize {
        self.classes.iter().map(|c| c.in_use).sum()
    }

    /// Free slots now, over all classes.
    #[must_use]
    pub fn free(&self) -> usize {
        self.classes.iter().map(|c| c.free).sum()
    }

    /// Slots withdrawn for good, over all classes.
    #[must_use]
    pub fn withdrawn(&self) -> usize {
        self.classes.iter().map(|c| c.withdrawn).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeviceId;
    use alloc::vec;

    #[test]
    fn a_pool_of_more_than_the_most_slots_is_refused_before_anything_is_placed() {
        let at_most = PoolConfig::new(DeviceId(0), [SizeClass::new(SLOT_ALIGN, MAX_POOL_SLOTS)]);
        assert!(at_most.layout(Some).is_ok());
        for classes in [
            vec![SizeClass::new(SLOT_ALIGN, MAX_POOL_SLOTS + 1)],
            vec![SizeClass::new(SLOT_ALIGN, 2_000_000_000)],
            vec![
                SizeClass::new(SLOT_ALIGN, MAX_POOL_SLOTS),
                SizeClass::new(2 * SLOT_ALIGN, 1),
            ],
            vec![
                SizeClass::new(SLOT_ALIGN, usize::MAX),
                SizeClass::new(2 * SLOT_ALIGN, 1),
            ],
        ] {
            let config = PoolConfig::new(DeviceId(0), classes);
            assert!(
                matches!(config.layout(Some), Err(PoolError::InvalidConfig { .. })),
                "{config:?}"
            );
        }
    }
}
