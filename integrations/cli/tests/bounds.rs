//! Operator numbers are checked before anything is allocated: an absurd `--pool` or
//! `--devices` is a usage error (exit 2) that costs the process almost no memory. A test binary
//! of its own: the peak memory read here is over every child this process has waited for.

use std::process::Command;

/// The peak resident memory of the children waited for so far, in bytes.
fn children_peak_bytes() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole `rusage` into the pointer it is given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage");
    // SAFETY: filled by the successful call above.
    let kib = unsafe { usage.assume_init() }.ru_maxrss;
    u64::try_from(kib).expect("a size") * 1024
}

fn twm(args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_twm"))
        .args(args)
        .output()
        .expect("run twm");
    (
        o.status.code().expect("an exit status, no signal"),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn absurd_operator_numbers_are_usage_errors_that_allocate_nothing() {
    let module = std::env::temp_dir().join(format!("twm-bounds-{}.wat", std::process::id()));
    std::fs::write(&module, "(module (memory 1))").expect("module");
    let module = module.to_str().expect("utf-8");
    for args in [
        vec!["run", module, "--pool", "2000000000"],
        vec!["run", module, "--pool", "65537"],
        vec!["run", module, "--devices", "4294967295"],
        vec!["run", module, "--repeat", "4294967295"],
        vec!["demo", "--devices", "4294967295"],
        vec!["probe", "--devices", "100000"],
        vec!["run", module, "--timeout", "100000h"],
        vec!["run", module, "--wasi-max-fds", "0"],
    ] {
        let (code, stderr) = twm(&args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains("invalid value"), "{args:?}: {stderr}");
    }
    let peak = children_peak_bytes();
    assert!(peak < 200 << 20, "a usage error took {peak} bytes");
    // The largest accepted values still run (within bounds, refused or served, never aborted).
    let (code, stderr) = twm(&["probe", "--devices", "64"]);
    assert_eq!(code, 0, "{stderr}");
    let (code, stderr) = twm(&["run", module, "--pool", "65536", "--memory-limit", "64KiB"]);
    assert!(code == 0 || code == 1, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
