//! The conformance runner counts a case a backend cannot run as ignored, never as passed; and
//! on the mock, which has every control, no case is ignored.

use libtest_mimic::{Arguments, Completion};
use tensor_wasm_mem_tests::runner;

mod knobless {
    tensor_wasm_mem_tests::conformance!(tensor_wasm_mem_tests::harness::KnoblessMockHarness);
}

mod full {
    // Several devices, so the cases about one device of many run too.
    tensor_wasm_mem_tests::conformance!(
        tensor_wasm_mem_tests::harness::EightDeviceDeferredMockHarness
    );
}

fn only(cases: Vec<runner::Case>, names: &[&str]) -> Vec<runner::Case> {
    let kept: Vec<_> = cases
        .into_iter()
        .filter(|(name, _)| names.contains(name))
        .collect();
    assert_eq!(kept.len(), names.len(), "every named case exists");
    kept
}

#[test]
fn a_case_a_backend_cannot_run_is_reported_ignored_in_the_summary() {
    let cases = only(
        knobless::cases(),
        &[
            // Needs fault injection, which a real driver (and this harness) does not have.
            "injected_allocate_failure_rolls_back",
            // Needs nothing optional.
            "allocate_write_zero_free",
        ],
    );
    // The inner run's report goes to a file, so this binary's own summary is the only one.
    let log = std::env::temp_dir().join(format!("twm-runner-{}.log", std::process::id()));
    let args = Arguments {
        test_threads: Some(1),
        logfile: Some(log.display().to_string()),
        ..Arguments::default()
    };
    let conclusion = runner::run(vec![runner::trials("knobless", cases)], &args);
    let report = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    let line = report
        .lines()
        .find(|l| l.contains("knobless::injected_allocate_failure_rolls_back"))
        .unwrap_or_default();
    assert!(line.ends_with("ignored (no fault injection)"), "{report}");
    assert!(
        report.contains("test result: ok. 1 passed; 0 failed; 1 ignored;"),
        "{report}"
    );
    assert_eq!(
        (
            conclusion.num_passed,
            conclusion.num_ignored,
            conclusion.num_failed
        ),
        (1, 1, 0)
    );
}

#[test]
fn a_skipping_case_completes_as_ignored_with_its_reason() {
    fn needs_a_gpu() {
        runner::skip("no device here");
    }
    fn runs() {}
    match runner::run_case(needs_a_gpu) {
        Completion::Ignored { reason } => assert_eq!(reason.as_deref(), Some("no device here")),
        Completion::Completed => panic!("a skipped case must not complete"),
    }
    // The reason does not leak into the next case on the same thread.
    assert!(matches!(runner::run_case(runs), Completion::Completed));
}

/// The mock has every optional control: on it every case runs, so the suite's figures on the
/// mock are all real passes.
#[test]
fn on_the_mock_no_case_is_ignored() {
    let ignored: Vec<&str> = full::cases()
        .into_iter()
        .filter(|(_, case)| matches!(runner::run_case(*case), Completion::Ignored { .. }))
        .map(|(name, _)| name)
        .collect();
    assert!(ignored.is_empty(), "ignored on the mock: {ignored:?}");
}

/// The case list is derived from the sources (`build.rs`): every `pub fn name<H: Harness>()`
/// of the suite's modules is a case, under its own name, once.
#[test]
fn the_case_list_is_every_case_in_the_sources() {
    let src = tensor_wasm_mem_tests::package_dir().join("src");
    let mut in_sources = Vec::new();
    for module in ["recovery", "suite", "books", "races"] {
        let source = std::fs::read_to_string(src.join(format!("{module}.rs"))).unwrap();
        in_sources.extend(source.lines().filter_map(|line| {
            let name = line
                .strip_prefix("pub fn ")?
                .strip_suffix("<H: Harness>() {")?;
            Some(name.to_string())
        }));
    }
    let mut listed: Vec<String> = full::cases()
        .into_iter()
        .map(|(name, _)| name.to_string())
        .collect();
    assert!(listed.len() > 60, "{} cases", listed.len());
    in_sources.sort();
    listed.sort();
    assert_eq!(listed, in_sources);
    listed.dedup();
    assert_eq!(listed.len(), in_sources.len(), "each case once");
}
