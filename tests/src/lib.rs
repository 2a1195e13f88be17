//! The conformance suite every tensor-wasm-mem backend must pass.
//!
//! A backend joins by implementing [`Harness`] (how to make a fresh instance, and which of its
//! counters and fault knobs the suite may use), then expanding [`conformance!`] once in a
//! module of `tests/tests/conformance.rs` and adding its cases to that file's `main`:
//!
//! ```ignore
//! mod with_mock {
//!     tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::MockHarness);
//! }
//! // in main: runner::trials("with_mock", with_mock::cases()),
//! ```
//!
//! Each case is one test, `with_<harness>::<case>`, run by [`runner`] (libtest-mimic): a case
//! that needs a control the backend lacks calls [`runner::skip`] and returns, and is reported as
//! ignored with its reason (never as passed). `KnoblessMockHarness` runs the suite as a real
//! driver would, with none of the optional controls.
#![deny(missing_docs)]

pub mod books;
pub mod guests;
pub mod harness;
pub mod kernels;
pub mod races;
pub mod recovery;
pub mod runner;
pub mod sim;
pub mod suite;

pub use harness::Harness;
/// The core, for the macros.
pub use tensor_wasm_mem_core as core;

include!(concat!(env!("OUT_DIR"), "/cases.rs"));

/// Expands to `cases()`: every conformance case (of [`recovery`], [`suite`], [`books`] and
/// [`races`]) on `$harness`, for the [`runner`]: [`cases`](crate::cases), the list `build.rs`
/// derives from the sources.
#[macro_export]
macro_rules! conformance {
    ($harness:ty) => {
        /// Every conformance case on this harness, by name (run by [`runner`]).
        pub fn cases() -> ::std::vec::Vec<$crate::runner::Case> {
            $crate::cases::<$harness>()
        }
    };
}
