//! Memory plans: from a Wasm memory type to the capacity we allocate, with hard limits.
//!
//! All arithmetic is done in `u128` or checked, so no memory type (memory64's
//! `2^64 - 65536`-byte maxima included) can overflow or panic.
//!
//! | declared | capacity |
//! |---|---|
//! | no maximum | `max(default_maximum, minimum)`, clamped to the per-memory limit |
//! | maximum <= limit | the maximum |
//! | maximum > limit | the limit (growth past it fails like any `memory.grow`) |
//! | minimum > limit | [`PlanError::MinimumAboveLimit`], before any allocator is called |
//! | minimum > maximum | [`PlanError::MinimumAboveMaximum`] |
//!
//! ```
//! use tensor_wasm_mem_core::{MemoryPlan, MemoryType, PlanLimits, DEFAULT_MAX_BYTES};
//!
//! // `(memory 1 65536)`: a 4 GiB declared maximum is clamped to the 256 MiB default limit.
//! let plan = MemoryPlan::new(&MemoryType::wasm32(1, Some(65536)), &PlanLimits::default()).unwrap();
//! assert_eq!(plan.initial_bytes(), 65536);
//! assert_eq!(plan.capacity_bytes(), DEFAULT_MAX_BYTES);
//! assert!(plan.is_clamped());
//! ```

use core::fmt;

use crate::error::ErrorKind;

/// The size of a Wasm page with the default page size.
pub const WASM_PAGE_SIZE: u64 = 1 << 16;

/// The capacity given to a memory that declares no maximum, and the default per-memory limit:
/// 256 MiB.
pub const DEFAULT_MAX_BYTES: u64 = 256 << 20;

/// The most bytes any one linear memory may have, whatever the configuration: 4 GiB.
pub const HARD_MAX_LINEAR_MEMORY_BYTES: u64 = 4 << 30;

/// A Wasm memory type as declared by a module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemoryType {
    /// Declared minimum, in pages.
    pub minimum_pages: u64,
    /// Declared maximum, in pages, if any.
    pub maximum_pages: Option<u64>,
    /// log2 of the page size: 16 for 64 KiB pages, 0 for the custom-page-sizes proposal's 1-byte
    /// pages.
    pub page_size_log2: u8,
    /// `true` for a memory64 (`i64`-indexed) memory.
    pub memory64: bool,
}

impl MemoryType {
    /// A 32-bit memory with 64 KiB pages.
    #[must_use]
    pub const fn wasm32(minimum_pages: u64, maximum_pages: Option<u64>) -> Self {
        Self {
            minimum_pages,
            maximum_pages,
            page_size_log2: 16,
            memory64: false,
        }
    }

    /// A memory64 memory with 64 KiB pages.
    #[must_use]
    pub const fn wasm64(minimum_pages: u64, maximum_pages: Option<u64>) -> Self {
        Self {
            memory64: true,
            ..Self::wasm32(minimum_pages, maximum_pages)
        }
    }

    /// The same type with another page size.
    #[must_use]
    pub const fn with_page_size_log2(self, page_size_log2: u8) -> Self {
        Self {
            page_size_log2,
            ..self
        }
    }
}

/// The configurable limits a [`MemoryPlan`] is made under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanLimits {
    per_memory_limit: u64,
    default_maximum: u64,
}

impl Default for PlanLimits {
    /// Both the per-memory limit and the default maximum are [`DEFAULT_MAX_BYTES`].
    fn default() -> Self {
        Self {
            per_memory_limit: DEFAULT_MAX_BYTES,
            default_maximum: DEFAULT_MAX_BYTES,
        }
    }
}

impl PlanLimits {
    /// Limits with a per-memory limit of `bytes` (at most [`HARD_MAX_LINEAR_MEMORY_BYTES`], at
    /// least one byte). The default maximum for memories that declare none stays
    /// [`DEFAULT_MAX_BYTES`] (clamped to the limit).
    pub fn new(per_memory_limit: u64) -> Result<Self, PlanError> {
        Self::default().with_per_memory_limit(per_memory_limit)
    }

    /// Sets the per-memory limit.
    pub fn with_per_memory_limit(self, bytes: u64) -> Result<Self, PlanError> {
        if bytes == 0 || bytes > HARD_MAX_LINEAR_MEMORY_BYTES {
            return Err(PlanError::LimitOutOfRange { limit: bytes });
        }
        Ok(Self {
            per_memory_limit: bytes,
            ..self
        })
    }

    /// Sets the capacity given to memories that declare no maximum (clamped to the per-memory
    /// limit when planning).
    pub fn with_default_maximum(self, bytes: u64) -> Result<Self, PlanError> {
        if bytes == 0 || bytes > HARD_MAX_LINEAR_MEMORY_BYTES {
            return Err(PlanError::LimitOutOfRange { limit: bytes });
        }
        Ok(Self {
            default_maximum: bytes,
            ..self
        })
    }

    /// The per-memory limit in bytes.
    #[must_use]
    pub const fn per_memory_limit(&self) -> u64 {
        self.per_memory_limit
    }

    /// The default maximum in bytes.
    #[must_use]
    pub const fn default_maximum(&self) -> u64 {
        self.default_maximum
    }
}

/// A memory type that cannot be planned, or a limit that cannot be configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The declared minimum is above the declared maximum.
    #[error("memory minimum of {minimum} bytes is above its maximum of {maximum} bytes")]
    MinimumAboveMaximum {
        /// Minimum in bytes (saturated at `u64::MAX`).
        minimum: u64,
        /// Maximum in bytes (saturated at `u64::MAX`).
        maximum: u64,
    },
    /// The declared minimum is above the per-memory limit.
    #[error(
        "memory minimum of {minimum} bytes is above the per-memory limit of {limit} bytes \
         (raise it with PlanLimits::with_per_memory_limit, up to 4 GiB; a pooled creator's \
         limit is its largest slot: add a larger size class to the pool)"
    )]
    MinimumAboveLimit {
        /// Minimum in bytes (saturated at `u64::MAX`).
        minimum: u64,
        /// The limit in force.
        limit: u64,
    },
    /// A configured limit is zero or above [`HARD_MAX_LINEAR_MEMORY_BYTES`].
    #[error("limit of {limit} bytes is outside 1..=4294967296")]
    LimitOutOfRange {
        /// The limit asked for.
        limit: u64,
    },
    /// The page size is not one Wasm allows (1 byte or 64 KiB).
    #[error("page size 2^{log2} is not a Wasm page size (2^0 or 2^16)")]
    InvalidPageSize {
        /// log2 of the page size asked for.
        log2: u8,
    },
    /// A size does not fit this host's `usize`.
    #[error("{bytes} bytes do not fit this host's address space")]
    TooLargeForHost {
        /// The size in bytes.
        bytes: u64,
    },
}

impl PlanError {
    /// The kind of this error.
    #[must_use]
    pub const fn kind(&self) -> ErrorKind {
        match self {
            Self::MinimumAboveLimit { .. } => ErrorKind::LimitExceeded,
            Self::TooLargeForHost { .. } => ErrorKind::Overflow,
            Self::MinimumAboveMaximum { .. }
            | Self::LimitOutOfRange { .. }
            | Self::InvalidPageSize { .. } => ErrorKind::InvalidArgument,
        }
    }
}

/// What to allocate for one linear memory: initial size and fixed capacity, both in bytes,
/// both multiples of the page size, `initial <= capacity <= HARD_MAX_LINEAR_MEMORY_BYTES`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryPlan {
    initial: u64,
    capacity: u64,
    page_size: u64,
    declared_maximum: Option<u128>,
}

impl fmt::Debug for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPlan")
            .field("initial", &self.initial)
            .field("capacity", &self.capacity)
            .field("page_size", &self.page_size)
            .field("declared_maximum", &self.declared_maximum)
            .finish()
    }
}

fn saturate(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

impl MemoryPlan {
    /// Plans a memory of type `ty` under `limits`.
    pub fn new(ty: &MemoryType, limits: &PlanLimits) -> Result<Self, PlanError> {
        if ty.page_size_log2 != 0 && ty.page_size_log2 != 16 {
            return Err(PlanError::InvalidPageSize {
                log2: ty.page_size_log2,
            });
        }
        let page = 1u128 << ty.page_size_log2;
        // u64 pages times a page of at most 2^16 bytes fits in u128 with room to spare.
        let minimum = u128::from(ty.minimum_pages) * page;
        let maximum = ty.maximum_pages.map(|m| u128::from(m) * page);
        Self::from_byte_sizes(minimum, maximum, page as u64, limits)
    }

    /// Plans a memory given in bytes, as Wasmtime's `MemoryCreator` passes it (`maximum` is the
    /// declared maximum; memory64 with none arrives as `2^64 - 65536`).
    pub fn from_bytes(
        minimum: usize,
        maximum: Option<usize>,
        page_size: u64,
        limits: &PlanLimits,
    ) -> Result<Self, PlanError> {
        if page_size != 1 && page_size != WASM_PAGE_SIZE {
            return Err(PlanError::InvalidPageSize {
                log2: page_size.checked_ilog2().map_or(0, |l| l as u8),
            });
        }
        Self::from_byte_sizes(
            minimum as u128,
            maximum.map(|m| m as u128),
            page_size,
            limits,
        )
    }

    fn from_byte_sizes(
        minimum: u128,
        maximum: Option<u128>,
        page: u64,
        limits: &PlanLimits,
    ) -> Result<Self, PlanError> {
        if let Some(max) = maximum
            && minimum > max
        {
            return Err(PlanError::MinimumAboveMaximum {
                minimum: saturate(minimum),
                maximum: saturate(max),
            });
        }
        let limit = u128::from(limits.per_memory_limit.min(HARD_MAX_LINEAR_MEMORY_BYTES));
        if minimum > limit {
            return Err(PlanError::MinimumAboveLimit {
                minimum: saturate(minimum),
                limit: saturate(limit),
            });
        }
        let wanted = maximum.unwrap_or_else(|| u128::from(limits.default_maximum).max(minimum));
        let page = u128::from(page);
        // Round the clamped capacity down to whole pages, never below the minimum (which is
        // <= limit, checked above).
        let capacity = (wanted.min(limit) / page * page).max(minimum);
        Ok(Self {
            initial: saturate(minimum),
            capacity: saturate(capacity),
            page_size: saturate(page),
            declared_maximum: maximum,
        })
    }

    /// Initial size in bytes (the declared minimum).
    #[must_use]
    pub const fn initial_bytes(&self) -> u64 {
        self.initial
    }

    /// Fixed capacity in bytes: what is reserved, and the most the memory can grow to.
    #[must_use]
    pub const fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    /// The page size in bytes.
    #[must_use]
    pub const fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The declared maximum in bytes, if any (memory64 maxima can exceed `u64`).
    #[must_use]
    pub const fn declared_maximum_bytes(&self) -> Option<u128> {
        self.declared_maximum
    }

    /// `true` when the memory could have grown further than the capacity by its own declaration
    /// (no maximum, or a maximum above the limit): growth past the capacity will be refused.
    #[must_use]
    pub fn is_clamped(&self) -> bool {
        self.declared_maximum
            .is_none_or(|m| m > u128::from(self.capacity))
    }

    /// `true` when the memory may grow to `bytes`.
    #[must_use]
    pub const fn can_grow_to(&self, bytes: u64) -> bool {
        bytes <= self.capacity
    }

    /// Initial size as a host `usize`.
    pub fn initial_usize(&self) -> Result<usize, PlanError> {
        usize::try_from(self.initial).map_err(|_| PlanError::TooLargeForHost {
            bytes: self.initial,
        })
    }

    /// Capacity as a host `usize`.
    pub fn capacity_usize(&self) -> Result<usize, PlanError> {
        usize::try_from(self.capacity).map_err(|_| PlanError::TooLargeForHost {
            bytes: self.capacity,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    const P: u64 = WASM_PAGE_SIZE;
    const MEMORY64_NO_MAX: u64 = u64::MAX - 65535; // 2^64 - 65536

    #[rstest]
    #[case::zero_pages(MemoryType::wasm32(0, None), 0, DEFAULT_MAX_BYTES, true)]
    #[case::zero_pages_zero_max(MemoryType::wasm32(0, Some(0)), 0, 0, false)]
    #[case::one_page(MemoryType::wasm32(1, Some(1)), P, P, false)]
    #[case::one_to_sixteen(MemoryType::wasm32(1, Some(16)), P, 16 * P, false)]
    #[case::no_max(MemoryType::wasm32(1, None), P, DEFAULT_MAX_BYTES, true)]
    #[case::max_at_limit(MemoryType::wasm32(1, Some(4096)), P, DEFAULT_MAX_BYTES, false)]
    #[case::max_above_limit(MemoryType::wasm32(1, Some(4097)), P, DEFAULT_MAX_BYTES, true)]
    #[case::max_4gib(MemoryType::wasm32(1, Some(65536)), P, DEFAULT_MAX_BYTES, true)]
    #[case::max_above_hard_cap(MemoryType::wasm64(1, Some(1 << 20)), P, DEFAULT_MAX_BYTES, true)]
    #[case::mem64_huge_max(MemoryType::wasm64(0, Some(1 << 48)), 0, DEFAULT_MAX_BYTES, true)]
    #[case::mem64_u64_max_pages(MemoryType::wasm64(0, Some(u64::MAX)), 0, DEFAULT_MAX_BYTES, true)]
    #[case::mem64_no_max(MemoryType::wasm64(2, None), 2 * P, DEFAULT_MAX_BYTES, true)]
    #[case::min_at_limit(
        MemoryType::wasm32(4096, None),
        DEFAULT_MAX_BYTES,
        DEFAULT_MAX_BYTES,
        true
    )]
    #[case::byte_pages(MemoryType::wasm32(10, Some(100)).with_page_size_log2(0), 10, 100, false)]
    fn plans_default_limits(
        #[case] ty: MemoryType,
        #[case] initial: u64,
        #[case] capacity: u64,
        #[case] clamped: bool,
    ) {
        let plan = MemoryPlan::new(&ty, &PlanLimits::default()).unwrap();
        assert_eq!(plan.initial_bytes(), initial);
        assert_eq!(plan.capacity_bytes(), capacity);
        assert_eq!(plan.is_clamped(), clamped);
        assert!(plan.initial_bytes() <= plan.capacity_bytes());
        assert!(plan.capacity_bytes() <= HARD_MAX_LINEAR_MEMORY_BYTES);
    }

    #[rstest]
    #[case::min_above_max(MemoryType::wasm32(2, Some(1)), ErrorKind::InvalidArgument)]
    #[case::min_above_limit(MemoryType::wasm32(4097, None), ErrorKind::LimitExceeded)]
    #[case::min_above_limit_with_max(
        MemoryType::wasm32(4097, Some(65536)),
        ErrorKind::LimitExceeded
    )]
    #[case::min_4gib(MemoryType::wasm32(65536, Some(65536)), ErrorKind::LimitExceeded)]
    #[case::mem64_min_huge(MemoryType::wasm64(u64::MAX, None), ErrorKind::LimitExceeded)]
    #[case::mem64_min_above_max(MemoryType::wasm64(u64::MAX, Some(u64::MAX - 1)), ErrorKind::InvalidArgument)]
    #[case::bad_page_size(MemoryType::wasm32(1, None).with_page_size_log2(12), ErrorKind::InvalidArgument)]
    #[case::page_size_overflowing(MemoryType::wasm32(1, None).with_page_size_log2(255), ErrorKind::InvalidArgument)]
    fn rejected_plans(#[case] ty: MemoryType, #[case] kind: ErrorKind) {
        assert_eq!(
            MemoryPlan::new(&ty, &PlanLimits::default()).map_err(|e| e.kind()),
            Err(kind)
        );
    }

    #[rstest]
    #[case::usize_max_min(usize::MAX, None, ErrorKind::LimitExceeded)]
    #[case::usize_max_both(usize::MAX, Some(usize::MAX), ErrorKind::LimitExceeded)]
    #[case::inverted_near_max(usize::MAX, Some(usize::MAX - 1), ErrorKind::InvalidArgument)]
    fn rejected_byte_plans(
        #[case] min: usize,
        #[case] max: Option<usize>,
        #[case] kind: ErrorKind,
    ) {
        assert_eq!(
            MemoryPlan::from_bytes(min, max, P, &PlanLimits::default()).map_err(|e| e.kind()),
            Err(kind)
        );
    }

    #[rstest]
    #[case::memory64_no_max(P as usize, Some(MEMORY64_NO_MAX as usize), P, DEFAULT_MAX_BYTES)]
    #[case::usize_max_max(0, Some(usize::MAX), 0, DEFAULT_MAX_BYTES)]
    #[case::exact(2 * P as usize, Some(3 * P as usize), 2 * P, 3 * P)]
    fn byte_plans(
        #[case] min: usize,
        #[case] max: Option<usize>,
        #[case] initial: u64,
        #[case] capacity: u64,
    ) {
        let plan = MemoryPlan::from_bytes(min, max, P, &PlanLimits::default()).unwrap();
        assert_eq!(plan.initial_bytes(), initial);
        assert_eq!(plan.capacity_bytes(), capacity);
    }

    #[test]
    fn configured_limit_clamps_and_rounds_down_to_pages() {
        let limits = PlanLimits::new(GIB + 100).unwrap();
        let plan = MemoryPlan::new(&MemoryType::wasm32(1, Some(65536)), &limits).unwrap();
        assert_eq!(plan.capacity_bytes(), GIB);
        // With no maximum the default maximum applies, not the limit.
        let plan = MemoryPlan::new(&MemoryType::wasm32(1, None), &limits).unwrap();
        assert_eq!(plan.capacity_bytes(), DEFAULT_MAX_BYTES);
        // A minimum above the default maximum but under the limit is honoured.
        let plan = MemoryPlan::new(&MemoryType::wasm32(8192, None), &limits).unwrap();
        assert_eq!(plan.capacity_bytes(), 512 * MIB);
        // A smaller default maximum.
        let limits = limits.with_default_maximum(MIB).unwrap();
        let plan = MemoryPlan::new(&MemoryType::wasm32(1, None), &limits).unwrap();
        assert_eq!(plan.capacity_bytes(), MIB);
        // A small limit clamps the default maximum too.
        let limits = PlanLimits::new(2 * P).unwrap();
        let plan = MemoryPlan::new(&MemoryType::wasm32(0, None), &limits).unwrap();
        assert_eq!(plan.capacity_bytes(), 2 * P);
        assert!(plan.can_grow_to(2 * P));
        assert!(!plan.can_grow_to(2 * P + 1));
    }

    #[rstest]
    #[case(0)]
    #[case(HARD_MAX_LINEAR_MEMORY_BYTES + 1)]
    #[case(u64::MAX)]
    fn limits_above_the_hard_cap_are_refused(#[case] limit: u64) {
        assert_eq!(
            PlanLimits::new(limit),
            Err(PlanError::LimitOutOfRange { limit })
        );
        assert!(PlanLimits::default().with_default_maximum(limit).is_err());
    }

    #[test]
    fn hard_cap_is_reachable_but_not_passable() {
        let limits = PlanLimits::new(HARD_MAX_LINEAR_MEMORY_BYTES).unwrap();
        let plan = MemoryPlan::new(&MemoryType::wasm64(0, Some(u64::MAX)), &limits).unwrap();
        assert_eq!(plan.capacity_bytes(), HARD_MAX_LINEAR_MEMORY_BYTES);
        let plan = MemoryPlan::new(&MemoryType::wasm32(65536, Some(65536)), &limits).unwrap();
        assert_eq!(plan.initial_bytes(), HARD_MAX_LINEAR_MEMORY_BYTES);
        assert!(!plan.is_clamped());
    }

    proptest::proptest! {
        #[test]
        fn never_panics_and_keeps_invariants(
            min in proptest::prelude::any::<u64>(),
            max in proptest::option::of(proptest::prelude::any::<u64>()),
            log2 in proptest::prelude::prop_oneof![proptest::prelude::Just(0u8), proptest::prelude::Just(16u8)],
            limit in 1..=HARD_MAX_LINEAR_MEMORY_BYTES,
        ) {
            let ty = MemoryType::wasm64(min, max).with_page_size_log2(log2);
            let limits = PlanLimits::new(limit).unwrap();
            if let Ok(plan) = MemoryPlan::new(&ty, &limits) {
                proptest::prop_assert!(plan.initial_bytes() <= plan.capacity_bytes());
                proptest::prop_assert!(plan.capacity_bytes() <= limit);
                proptest::prop_assert_eq!(plan.capacity_bytes() % plan.page_size(), 0);
                if let Some(m) = plan.declared_maximum_bytes() {
                    proptest::prop_assert!(u128::from(plan.capacity_bytes()) <= m);
                }
            }
        }
    }
}
