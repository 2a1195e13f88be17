//! Real C programs (tests/guests/*.c, built with clang for wasm32-wasi) under `twm run`: WASI
//! arguments, environment, preopened directories, exit statuses, a tenant cap turning into the
//! program's own error path, and identical output across `--pool` and `--repeat`.
//!
//! Without the C toolchain each test says so on stderr and checks nothing more (see
//! `tensor_wasm_mem_tests::guests`); CI installs it and sets `TWM_REQUIRE_C_GUESTS=1`.

use std::path::Path;
use std::process::Command;

use tensor_wasm_mem_tests::guests::c_guest;

/// Runs `twm run <wasm> <args>`: (exit status, stdout, stderr).
fn twm_run(wasm: &Path, args: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_twm"))
        .arg("run")
        .arg(wasm)
        .args(args)
        .output()
        .expect("run twm");
    (
        output.status.code().expect("no signal, no panic"),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn arguments_environment_preopens_and_the_exit_status_reach_the_guest() {
    let Some(hello) = c_guest("hello") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("twm-c-guest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("in.txt"), "from the host\n").unwrap();
    let preopen = format!("{}::/data", dir.display());
    let (code, out, err) = twm_run(
        &hello,
        &[
            "--env",
            "TWM_GREETING=hello there",
            "--dir",
            &preopen,
            "--",
            "-5",
            "two words",
            "exit=7",
        ],
    );
    assert_eq!(code, 7, "the guest's proc_exit status; stderr: {err}");
    assert_eq!(
        out,
        format!(
            "argc=4\nargv[1]=-5\nargv[2]=two words\nargv[3]=exit=7\n\
             TWM_GREETING=hello there\nin.txt=from the host\n"
        )
    );
    assert!(
        err.is_empty(),
        "a guest's own exit says nothing more: {err:?}"
    );
    // No preopen, no variable: the guest sees neither; status 0 from main.
    let (code, out, _) = twm_run(&hello, &[]);
    assert_eq!(code, 0);
    assert_eq!(out, "argc=1\nTWM_GREETING=(unset)\n");
}

#[test]
fn bad_wasi_options_are_usage_errors() {
    let Some(hello) = c_guest("hello") else {
        return;
    };
    for (args, needle) in [
        (&["--env", "NOVALUE"][..], "NAME=VALUE"),
        (&["--env", "=x"][..], "NAME=VALUE"),
        (
            &["--dir", "/no/such/folder/here"][..],
            "No such file or directory",
        ),
        // The guest's own module: a file.
        (
            &["--dir", &hello.display().to_string()][..],
            "not a directory",
        ),
        (&["--dir", "::/data"][..], "HOST::GUEST"),
    ] {
        let (code, out, err) = twm_run(&hello, args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(out.is_empty(), "nothing ran: {out}");
    }
}

#[test]
fn a_tenant_cap_is_the_programs_own_malloc_failure() {
    let Some(grow) = c_guest("grow") else {
        return;
    };
    let (code, out, err) = twm_run(&grow, &["--", "20"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("allocated 20 of 20 MiB"), "{out}");
    let (code, out, err) = twm_run(&grow, &["--tenant-cap", "4MiB", "--", "20"]);
    assert_eq!(
        code, 12,
        "malloc returned NULL and the program chose its status: {err}"
    );
    assert!(err.contains("grow: malloc failed after"), "{err}");
    assert!(out.starts_with("allocated "), "{out}");
    assert!(
        !err.contains("trap"),
        "a failed memory.grow is not a trap: {err}"
    );
}

#[test]
fn pooled_and_repeated_runs_print_the_same_each_time() {
    let (Some(grow), Some(hints)) = (c_guest("grow"), c_guest("hints")) else {
        return;
    };
    let (code, once, err) = twm_run(&grow, &["--", "6"]);
    assert_eq!(code, 0, "{err}");
    let (code, three, err) = twm_run(
        &grow,
        &[
            "--pool",
            "2",
            "--memory-limit",
            "64MiB",
            "--repeat",
            "3",
            "--",
            "6",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(three, once.repeat(3), "three pooled lives, the same output");
    let (code, once, err) = twm_run(&hints, &[]);
    assert_eq!(code, 0, "{once}{err}");
    assert!(once.ends_with("all as expected\n"), "{once}");
    let (code, three, _) = twm_run(&hints, &["--pool", "1", "--repeat", "3"]);
    assert_eq!(code, 0);
    assert_eq!(three, once.repeat(3));
}

#[test]
fn json_stays_one_object_whatever_the_guest_prints() {
    let Some(hello) = c_guest("hello") else {
        return;
    };
    let (code, out, err) = twm_run(&hello, &["--json", "--", "{\"forged\": true}", "exit=5"]);
    assert_eq!(code, 5, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON object");
    assert!(report.get("forged").is_none(), "{out}");
    assert!(
        err.contains("argc=3"),
        "the guest's stdout went to stderr: {err}"
    );
}

#[test]
fn environment_last_value_wins_and_memory_limit_sizes_undeclared_maxima() {
    let (Some(hello), Some(grow)) = (c_guest("hello"), c_guest("grow")) else {
        return;
    };
    let (code, out, _) = twm_run(
        &hello,
        &[
            "--env",
            "TWM_GREETING=first",
            "--env",
            "TWM_GREETING=second",
        ],
    );
    assert_eq!(code, 0);
    assert!(out.contains("TWM_GREETING=second\n"), "{out}");
    // clang declares no maximum: --memory-limit is its capacity (the default is 256 MiB).
    let (code, out, err) = twm_run(&grow, &["--memory-limit", "320MiB", "--", "270"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("allocated 270 of 270 MiB"), "{out}");
}

/// A C guest launches the simulated device's `saxpy` on its own arrays (`--kernels builtin`),
/// checks the result, and sees an aliased launch refused; the figures count both.
#[test]
fn a_c_guest_launches_saxpy_on_its_own_memory() {
    let Some(saxpy) = c_guest("saxpy") else {
        return;
    };
    let (code, out, err) = twm_run(&saxpy, &["--kernels", "builtin"]);
    assert_eq!(code, 0, "stdout: {out}; stderr: {err}");
    assert_eq!(
        out,
        "saxpy over 100000 floats: 0 wrong; an aliased launch: arguments do not match the kernel\n"
    );
    let (code, out, _) = twm_run(&saxpy, &["--kernels", "builtin", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(v["tenant"]["launches"], 1, "{v}");
    assert_eq!(v["tenant"]["refused_launches"], 1, "{v}");
    // Without kernels the guest's lookup is refused, and it says so.
    let (code, out, _) = twm_run(&saxpy, &[]);
    assert_eq!(code, 108, "100 - TWM_ERR_UNKNOWN_KERNEL; {out}");
    assert_eq!(out, "saxpy: unknown kernel\n");
}
