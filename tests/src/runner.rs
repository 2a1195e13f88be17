//! The conformance suite's runner: every case of every harness is a libtest trial, and a case
//! that cannot run on a backend (it lacks a capability the case needs: fault injection on a real
//! driver, device pools, ...) is reported as ignored, with its reason, never as passed.

use std::cell::RefCell;

use libtest_mimic::{Arguments, Completion, Conclusion, Trial};

/// One case of a suite: its name and its body.
pub type Case = (&'static str, fn());

thread_local! {
    static SKIPPED: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Says that the running case cannot run on this backend, and why: the case returns right
/// after, and the runner reports it as ignored with `why`.
pub fn skip(why: &str) {
    SKIPPED.with(|s| *s.borrow_mut() = Some(why.to_string()));
}

/// Runs `case` on this thread: `Ignored` if it called [`skip`], `Completed` if it returned
/// otherwise (a panic is a failure, caught by the runner).
pub fn run_case(case: fn()) -> Completion {
    SKIPPED.with(|s| s.borrow_mut().take());
    case();
    match SKIPPED.with(|s| s.borrow_mut().take()) {
        Some(reason) => Completion::ignored_with(reason),
        None => Completion::Completed,
    }
}

/// The trials of one suite: `"{suite}::{case}"` each.
pub fn trials(suite: &str, cases: Vec<Case>) -> Vec<Trial> {
    cases
        .into_iter()
        .map(|(name, case)| {
            Trial::ignorable_test(format!("{suite}::{name}"), move || Ok(run_case(case)))
        })
        .collect()
}

/// Runs the trials of every suite with the process's arguments (as `cargo test` passes them).
pub fn run(suites: Vec<Vec<Trial>>, args: &Arguments) -> Conclusion {
    libtest_mimic::run(args, suites.into_iter().flatten().collect())
}
