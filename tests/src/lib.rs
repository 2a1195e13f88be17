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

/// The folder of the package whose test is running: `CARGO_MANIFEST_DIR` as cargo sets it when
/// it runs a test (this checkout's), else the one this crate was compiled in. Never the
/// compiled-in path alone: two checkouts that share a target directory share compiled test
/// binaries, and a path baked into one names the checkout that built it, which may be gone.
#[must_use]
pub fn package_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")),
        std::path::PathBuf::from,
    )
}

/// The workspace root: the nearest folder at or above [`package_dir`] with a `Cargo.lock`.
///
/// # Panics
/// If there is none (a test run outside its workspace).
#[must_use]
pub fn workspace_root() -> std::path::PathBuf {
    let package = package_dir();
    package
        .ancestors()
        .find(|dir| dir.join("Cargo.lock").is_file())
        .unwrap_or_else(|| panic!("no Cargo.lock at or above {}", package.display()))
        .to_path_buf()
}

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
