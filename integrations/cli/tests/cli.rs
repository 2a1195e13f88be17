//! The `twm` binary end to end: outputs, exit statuses, JSON, and no panic on any input file.

use std::path::PathBuf;
use std::process::{Command, Output};

const MODULE: &str = r#"(module
  (import "twm" "advise" (func $advise (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1 4)
  (global $calls (mut i32) (i32.const 0))
  (func (export "add") (param i32 i32) (result i32) (i32.add (local.get 0) (local.get 1)))
  (func (export "two") (result i32 i64) (i32.const 1) (i64.const -2))
  (func (export "half") (param f64) (result f64) (f64.mul (local.get 0) (f64.const 0.5)))
  (func (export "oob") (result i32) (i32.load (i32.const 65536)))
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0)))
  (func (export "advise") (param i32 i32) (result i32)
    (call $advise (local.get 0) (local.get 1) (i32.const 0) (i32.const -1)))
  (func (export "first") (result i32)
    (local $v i32)
    (local.set $v (i32.load (i32.const 0)))
    (i32.store (i32.const 0) (i32.const 77))
    (local.get $v)))"#;

fn twm(args: &[&str]) -> Output {
    output(Command::new(env!("CARGO_BIN_EXE_twm")).args(args))
}

/// `shell -c script` with twm as `$0` and `args` as `$1`...: a twm started the way the script
/// sets up (a lower `ulimit -n`, descriptors inherited, a stream closed), bounded like `twm`.
fn twm_from(shell: &str, script: &str, args: &[&str]) -> Output {
    output(
        Command::new(shell)
            .arg("-c")
            .arg(script)
            .arg(env!("CARGO_BIN_EXE_twm"))
            .args(args),
    )
}

/// The message of the one JSON object `o` printed for its failure.
fn json_error(o: &Output) -> String {
    let v: serde_json::Value = serde_json::from_str(stdout(o).trim()).expect("one object");
    v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// How long any process a test starts may run: a run that hangs (a watchdog that never fires, a
/// guest sleeping 10^5 s) fails its test instead of stalling the suite.
const PROCESS_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// `cmd`'s output (stdout and stderr captured), the process killed (and the test failed) past
/// [`PROCESS_LIMIT`].
fn output(cmd: &mut Command) -> Output {
    bounded(
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped()),
    )
}

/// Runs `cmd` with the streams it was given (a stream not given is inherited), killed (and the
/// test failed) past [`PROCESS_LIMIT`].
fn bounded(cmd: &mut Command) -> Output {
    let child = cmd.spawn().expect("start the process");
    let pid = child.id();
    let (done, waited) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(child.wait_with_output()));
    match waited.recv_timeout(PROCESS_LIMIT) {
        Ok(output) => output.expect("wait for the process"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{cmd:?} ran past {PROCESS_LIMIT:?}: killed");
        }
    }
}

/// Writes `contents` to a file of its own (tests run in parallel: never share a path).
fn module_file(name: &str, contents: &[u8]) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("twm-cli-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{n}-{name}"));
    std::fs::write(&path, contents).unwrap();
    path
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn run(args: &[&str]) -> (i32, String, String) {
    let path = module_file("m.wat", MODULE.as_bytes());
    let mut all = vec!["run", path.to_str().unwrap()];
    all.extend_from_slice(args);
    let o = twm(&all);
    (
        o.status.code().expect("no signal, no panic"),
        stdout(&o),
        stderr(&o),
    )
}

#[test]
fn results_one_per_line() {
    assert_eq!(
        run(&["--invoke", "add", "2", "3"]),
        (0, "5\n".into(), String::new())
    );
    assert_eq!(run(&["--invoke", "two"]).1, "1\n-2\n");
    assert_eq!(run(&["--invoke", "add", "-5", "0x10"]).1, "11\n");
    assert_eq!(
        run(&["--invoke", "add", "4294967295", "1"]).1,
        "0\n",
        "u32 range accepted"
    );
    assert_eq!(run(&["--invoke", "half", "3"]).1, "1.5\n");
    assert_eq!(
        run(&[]),
        (0, String::new(), String::new()),
        "instantiate only"
    );
}

#[test]
fn options_after_the_arguments() {
    let (code, out, err) = run(&["--invoke", "grow", "3", "--tenant-cap", "128KiB", "--stats"]);
    assert_eq!(
        (code, out.as_str()),
        (0, "-1\n"),
        "growth past the cap is -1"
    );
    assert!(err.contains("cli") && err.contains("128KiB"), "{err}");
}

#[test]
fn exit_statuses() {
    assert_eq!(run(&["--invoke", "oob"]).0, 3, "trap");
    assert_eq!(
        run(&["--tenant-cap", "1KiB"]).0,
        4,
        "cap refuses instantiation"
    );
    assert_eq!(
        run(&["--memory-limit", "32KiB"]).0,
        4,
        "minimum above the limit"
    );
    assert_eq!(run(&["--invoke", "add", "1"]).0, 2, "arity");
    assert_eq!(run(&["--invoke", "add", "x", "1"]).0, 2, "not a number");
    assert_eq!(
        run(&["--invoke", "add", "99999999999", "1"]).0,
        2,
        "out of i32 range"
    );
    assert_eq!(run(&["--invoke", "missing"]).0, 2, "no such export");
    assert_eq!(run(&["--memory-limit", "5GiB"]).0, 2, "above the hard cap");
    assert_eq!(run(&["--isolation", "bogus"]).0, 2);
    assert_eq!(run(&["--tenant-cap", "12XB"]).0, 2);
    assert_eq!(run(&["--repeat", "0"]).0, 2);
    assert_eq!(run(&["--pool", "0"]).0, 2);
    assert_eq!(twm(&["run"]).status.code(), Some(2));
    assert_eq!(twm(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(twm(&["run", "/nonexistent/m.wat"]).status.code(), Some(1));
    let refused = run(&["--tenant-cap", "1KiB"]).2;
    assert!(
        refused.contains("\"cli\"") && refused.contains("1024"),
        "{refused}"
    );
}

#[test]
fn json_is_one_object() {
    let (code, out, _) = run(&["--invoke", "two", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(v["runs"], serde_json::json!([[1, -2]]));
    assert_eq!(v["backend"], "mock");
    assert_eq!(v["tenant"]["touched_bytes"], 0);
    assert_eq!(v["tenant"]["touched_peak_bytes"], 65536);
    let (code, out, _) = run(&["--invoke", "oob", "--json"]);
    assert_eq!(code, 3);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["error"]["exit_code"], 3);
}

#[test]
fn repeat_reuses_the_pool_and_scrubs() {
    let (code, out, err) = run(&[
        "--invoke", "first", "--repeat", "3", "--pool", "1", "--stats",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "0\n0\n0\n", "each run sees a zeroed slot");
    assert!(err.contains("pool: 0 in use, 1 free"), "{err}");
    let (_, out, _) = run(&[
        "--invoke", "first", "--repeat", "2", "--pool", "1", "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["runs"], serde_json::json!([[0], [0]]));
    assert_eq!(v["creator"]["pool"]["acquisitions"], 2);
}

/// `--scrub-ahead`: every run still sees a zeroed slot, each slot a run gave back is scrubbed
/// once (by the thread, or by the next acquisition if the thread had not reached it; the last
/// one maybe not yet when the figures are read), and the flag needs a pool.
#[test]
fn scrubbing_ahead_keeps_every_run_zeroed_and_scrubs_each_slot_once() {
    let runs = 200;
    let repeat = runs.to_string();
    let (code, out, err) = run(&[
        "--invoke",
        "first",
        "--repeat",
        &repeat,
        "--pool",
        "1",
        "--scrub-ahead",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["runs"],
        serde_json::json!(vec![[0]; runs]),
        "each run sees a zeroed slot"
    );
    let pool = &v["creator"]["pool"];
    assert_eq!(pool["acquisitions"], runs, "{v}");
    let page = 64 << 10;
    let scrubbed = pool["bytes_scrubbed"].as_u64().unwrap();
    assert!(
        scrubbed == (runs as u64 - 1) * page || scrubbed == runs as u64 * page,
        "one scrub per slot given back: {v}"
    );
    assert!(
        pool["scrubbed_ahead"].as_u64().unwrap() <= runs as u64,
        "{v}"
    );
    let (code, _, err) = run(&["--invoke", "first", "--scrub-ahead"]);
    assert_eq!(
        code, 2,
        "--scrub-ahead without --pool is a usage error: {err}"
    );
    assert!(err.contains("--pool"), "{err}");
}

/// Attack 3 through `twm run`: each run advises its pooled memory; the next run's memory in the
/// same slot has its hints reset first (a run that hints nothing costs no reset).
#[test]
fn a_pooled_runs_hints_are_reset_before_the_next_run() {
    let (code, out, err) = run(&[
        "--invoke", "advise", "0", "16", "--repeat", "3", "--pool", "1", "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["runs"], serde_json::json!([[0], [0], [0]]));
    assert_eq!(v["creator"]["pool"]["hint_resets"], 2, "{v}");
    let (_, out, _) = run(&[
        "--invoke", "first", "--repeat", "3", "--pool", "1", "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["creator"]["pool"]["hint_resets"], 0, "{v}");
    let (_, _, err) = run(&[
        "--invoke", "advise", "0", "16", "--repeat", "2", "--pool", "1", "--stats",
    ]);
    assert!(err.contains("1 hint resets"), "{err}");
}

#[test]
fn host_functions_are_linked() {
    assert_eq!(run(&["--invoke", "advise", "0", "16"]).1, "0\n");
    assert_eq!(run(&["--invoke", "advise", "65536", "1"]).1, "-1\n");
    assert_eq!(run(&["--invoke", "advise", "-1", "2"]).1, "-2\n");
}

#[test]
fn binary_modules_run_too() {
    let wasm = wat::parse_str(MODULE).unwrap();
    let path = module_file("m.wasm", &wasm);
    let o = twm(&["run", path.to_str().unwrap(), "--invoke", "add", "20", "22"]);
    assert_eq!((o.status.code(), stdout(&o)), (Some(0), "42\n".into()));
}

/// Garbage, truncated and hostile files: a clear error and a status, never a panic (101) or a
/// signal.
#[test]
fn no_panic_on_any_input_file() {
    let wasm = wat::parse_str(MODULE).unwrap();
    let mut inputs: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"garbage".to_vec(),
        b"(module".to_vec(),
        b"\0asm".to_vec(),
        vec![0xff; 64],
        b"(module (memory 65536 65536))".to_vec(),
        b"(module (memory i64 281474976710656))".to_vec(),
        b"(module (func $f (call $f)) (start $f))".to_vec(),
        b"(module (import \"env\" \"nothing\" (func)))".to_vec(),
        b"(module (memory 1) (data (i32.const 65535) \"ab\"))".to_vec(),
        b"(module (table 100000000 funcref))".to_vec(),
    ];
    for cut in [8, 20, wasm.len() / 2, wasm.len() - 1] {
        inputs.push(wasm[..cut].to_vec());
    }
    let mut flipped = wasm.clone();
    for i in (8..flipped.len()).step_by(7) {
        flipped[i] ^= 0x5a;
    }
    inputs.push(flipped);
    for (i, input) in inputs.iter().enumerate() {
        let path = module_file(&format!("bad{i}.wasm"), input);
        let o = twm(&["run", path.to_str().unwrap()]);
        let code = o.status.code();
        assert!(
            matches!(code, Some(0 | 1 | 3 | 4)),
            "input {i}: status {code:?}, stderr {}",
            stderr(&o)
        );
        assert!(
            !stderr(&o).contains("panicked"),
            "input {i}: {}",
            stderr(&o)
        );
    }
}

#[test]
fn demo_runs_and_balances() {
    let o = twm(&["demo"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("alice") && out.contains("bob") && out.contains("carol"));
    assert!(!out.contains("WRONG"));
    assert!(
        out.contains("every tenant back to zero once the pools are dropped: true"),
        "{out}"
    );
    assert!(out.contains("in pools"), "{out}");
    assert!(
        out.contains("guest-launched kernel: alice's guest ran saxpy (y = 2x + y) over 1024 floats of its own memory on device 0: 0 wrong; launches 1"),
        "{out}"
    );
    // A tenant's data makes a trusted kernel fault: both guests of the lost context trap,
    // typed; the device recovers when their Stores go, and the next tenant's kernel runs.
    assert!(
        out.contains("mallory's guest pokes index 1048576 of 256 bytes: trapped: twm.launch: the tenant's device state was lost to a kernel fault"),
        "{out}"
    );
    assert!(
        out.contains("trent's guest, sharing the lost context, next call: trapped: twm.launch"),
        "{out}"
    );
    assert!(out.contains("recovered 1 time(s)"), "{out}");
    assert!(
        out.contains("fenced now: false, kept memories 0, charged: mallory 0B trent 0B"),
        "{out}"
    );
    assert!(
        out.contains("the next tenant's kernel on device 0: 0 (ran)"),
        "{out}"
    );
}

#[test]
fn probe_describes_the_backend() {
    let o = twm(&["probe", "--json"]);
    assert_eq!(o.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["backend"], "mock");
    assert_eq!(v["unified"], true);
    assert_eq!(v["guard_pages"], false);
    let o = twm(&["probe"]);
    assert!(stdout(&o).contains("concurrent managed access"));
}

#[test]
fn negative_numbers_after_invoke_are_arguments() {
    let (code, out, err) = run(&["--invoke", "add", "-0x80000000", "-5"]);
    assert_eq!((code, out.as_str()), (0, "2147483643\n"), "{err}");
    let (code, out, err) = run(&["--invoke", "half", "-inf"]);
    assert_eq!((code, out.as_str()), (0, "-inf\n"), "{err}");
    let (code, out, err) = run(&["--invoke", "half", "-1.5e3", "--stats"]);
    assert_eq!((code, out.as_str()), (0, "-750\n"), "{err}");
    assert!(err.contains("cli"), "options still work after them: {err}");
    let (code, _, err) = run(&["--invoke", "add", "-0x80000001", "1"]);
    assert_eq!(code, 2, "out of i32 range: {err}");
    assert!(
        err.contains("\"-0x80000001\""),
        "the argument as typed: {err}"
    );
}

#[test]
fn a_start_functions_growth_past_the_cap_is_minus_one() {
    let path = module_file(
        "start-grow.wat",
        br#"(module
             (memory (export "memory") 0 4)
             (global $grown (mut i32) (i32.const 99))
             (func $start (global.set $grown (memory.grow (i32.const 2))))
             (start $start)
             (func (export "grown") (result i32) (global.get $grown)))"#,
    );
    let o = twm(&[
        "run",
        path.to_str().unwrap(),
        "--tenant-cap",
        "64KiB",
        "--invoke",
        "grown",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), "-1\n");
}

#[test]
fn wasi_entry_points_are_called_or_refused_never_skipped() {
    // A reactor is initialised before the call, as `wasmtime run` does.
    let reactor = module_file(
        "reactor.wat",
        br#"(module
             (memory (export "memory") 1)
             (global $ready (mut i32) (i32.const 0))
             (func (export "_initialize") (global.set $ready (i32.const 41)))
             (func (export "ready") (result i32) (i32.add (global.get $ready) (i32.const 1))))"#,
    );
    let o = twm(&["run", reactor.to_str().unwrap(), "--invoke", "ready"]);
    assert_eq!((o.status.code(), stdout(&o).as_str()), (Some(0), "42\n"));
    // A `_start` that is not `[] -> []` is refused, not skipped.
    let bad = module_file(
        "badstart.wat",
        br#"(module (func (export "_start") (param i32)))"#,
    );
    let o = twm(&["run", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("[] -> []"), "{}", stderr(&o));
    // WASI preview 1 refuses exit statuses of 126 and more: the host call fails the guest's
    // call, a trap (3), with a message (never a status that looks like the guest's own).
    let exit200 = module_file(
        "exit200.wat",
        br#"(module
             (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
             (memory (export "memory") 1)
             (func (export "_start") (call $exit (i32.const 200))))"#,
    );
    let o = twm(&["run", exit200.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("exit status"), "{}", stderr(&o));
}

/// Every command that prints a report answers a stdout it cannot write to (here `/dev/full`;
/// a closed pipe, as in `twm demo | head -1`, the same) with status 1 and a message: `run`
/// always did; `demo`, `probe` and `bench` printed with `println!`, which panicked.
#[test]
fn every_command_answers_an_unwritable_stdout_without_a_panic() {
    let path = module_file("m.wat", MODULE.as_bytes());
    for args in [
        &["run", path.to_str().unwrap(), "--invoke", "add", "1", "2"][..],
        &["demo"],
        &["probe"],
        &["probe", "--json"],
        &["bench", "--smoke"],
        &["bench", "--smoke", "--json"],
    ] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full");
        let o = bounded(
            Command::new(env!("CARGO_BIN_EXE_twm"))
                .args(args)
                .stdout(full)
                .stderr(std::process::Stdio::piped()),
        );
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("cannot write to stdout"),
            "{args:?}: {}",
            stderr(&o)
        );
        assert!(!stderr(&o).contains("panicked"), "{args:?}: {}", stderr(&o));
    }
}

/// `twm bench --smoke`: every row of the full bench, a few lives each (the figures are noise).
/// Each figure is there and a finite number (a time above zero): a bench that loses a row, or a
/// setup that stops working, fails here rather than in the next full run.
#[test]
fn bench_smoke_reaches_every_row() {
    let o = twm(&["bench", "--smoke", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("one object");
    assert_eq!(v["smoke"], true);
    let positive = |path: &str, x: &serde_json::Value| {
        let x = x.as_f64().unwrap_or_else(|| panic!("{path}: {x}"));
        assert!(x.is_finite() && x > 0.0, "{path}: {x}");
    };
    let keys = |path: &str, x: &serde_json::Value, expected: &[&str]| {
        let mut got: Vec<&str> = x
            .as_object()
            .unwrap_or_else(|| panic!("{path}: {x}"))
            .keys()
            .map(String::as_str)
            .collect();
        got.sort_unstable();
        let mut expected = expected.to_vec();
        expected.sort_unstable();
        assert_eq!(got, expected, "{path}");
    };
    let instantiate = [
        "wasmtime_default",
        "no_memory_floor",
        "wasmtime_pooling",
        "twm_fresh",
        "twm_pooled",
        "twm_pooled_wasi",
        "twm_pooled_tenant",
        "twm_pooled_scrub_ahead",
        "twm_device_guarded",
        "twm_device_guarded_pooled",
        "twm_device_guarded_pooled_scrub_ahead",
    ];
    keys("instantiate_us", &v["instantiate_us"], &instantiate);
    for k in instantiate {
        positive(k, &v["instantiate_us"][k]);
    }
    keys("grow_ns", &v["grow_ns"], &["wasmtime_default", "twm"]);
    let loops = [
        "wasmtime_default",
        "twm_checked",
        "twm_guarded",
        "twm_device_guarded",
        "twm_checked_epochs",
        "twm_checked_fuel",
    ];
    for shape in [
        "fixed_scalar",
        "fixed_simd",
        "growable_scalar",
        "growable_simd",
    ] {
        let row = &v["guest_loop_detail_ms"][shape];
        keys(shape, row, &loops);
        for k in loops {
            positive(&format!("{shape}.{k}"), &row[k]);
        }
    }
    for size in ["64KiB", "1MiB", "64MiB"] {
        for k in ["twm_scope", "explicit_copy", "twm_guest_launch"] {
            positive(&format!("{size}.{k}"), &v["kernel_roundtrip_us"][size][k]);
        }
    }
    for k in ["wasmtime_default", "twm"] {
        positive(k, &v["grow_ns"][k]);
        let rss = v["rss_1000_mib"][k].as_f64().expect("rss");
        assert!(rss.is_finite() && rss >= 0.0, "rss {k}: {rss}");
    }
    for k in ["least-held", "round-robin"] {
        positive(k, &v["placement"]["decision_ns"][k]);
    }
    for k in ["guest_launch_fill_4KiB", "guest_launch_noop"] {
        positive(k, &v["launch_us"][k]);
    }
    for setup in ["wasmtime_pooling", "twm_pooled"] {
        keys(
            setup,
            &v["instantiate_threads_cpu_us"][setup],
            &["1", "2", "8", "32"],
        );
        for threads in ["1", "2", "8", "32"] {
            positive(setup, &v["instantiate_threads_cpu_us"][setup][threads]);
        }
    }
    for setup in [
        "twm_pooled",
        "twm_pooled_scrub_ahead",
        "twm_device_guarded_pooled",
        "twm_device_guarded_pooled_scrub_ahead",
    ] {
        positive(setup, &v["instantiate_process_cpu_us"][setup]);
    }
    for k in ["acquire_release_untouched", "acquire_release_scrub_64KiB"] {
        positive(k, &v["pool_steps_us"][k]);
    }
    // The table: every instantiation setup on a row of its own, the targets judged.
    let o = twm(&["bench", "--smoke"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let table = stdout(&o);
    assert!(table.contains("--smoke"), "{table}");
    for k in instantiate {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with("instantiate+call+drop") && l.contains(&format!(" {k} "))),
            "{k}: {table}"
        );
    }
}

#[test]
fn a_many_memory_module_at_cap_zero_is_denied_by_the_held_budget() {
    let memories = "(memory 0) ".repeat(64);
    let path = module_file("many.wat", format!("(module {memories})").as_bytes());
    let o = twm(&["run", path.to_str().unwrap(), "--tenant-cap", "0"]);
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(stderr(&o).contains("held budget"), "{}", stderr(&o));
    // The memories budget, set on the command line, names itself too.
    let o = twm(&[
        "run",
        path.to_str().unwrap(),
        "--tenant-cap",
        "0",
        "--tenant-held",
        "64GiB",
        "--tenant-memories",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(stderr(&o).contains("memories budget"), "{}", stderr(&o));
    // Within the budgets, the same module runs.
    let few = module_file("few.wat", b"(module (memory 0) (memory 0))");
    let o = twm(&[
        "run",
        few.to_str().unwrap(),
        "--tenant-cap",
        "0",
        "--tenant-held",
        "1GiB",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

/// The default held budget is 4x the cap, at least one memory of `--memory-limit` and its
/// tables (as `--help` says), not one of the library's default 256 MiB: a tenant capped at
/// 1 MiB whose memories are at most 1 MiB holds 33 MiB, and a module of 40 such memories is
/// refused by the held budget (a red team held 99 of them, 288 times its cap, before).
#[test]
fn the_default_held_budget_follows_the_memory_limit() {
    let memories = "(memory 0 16) ".repeat(40);
    let path = module_file("forty.wat", format!("(module {memories})").as_bytes());
    let small = ["--tenant-cap", "1MiB", "--memory-limit", "1MiB", "--json"];
    let o = twm(&[&["run", path.to_str().unwrap()][..], &small[..]].concat());
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("held budget")),
        "{v}"
    );
    let few = module_file(
        "three.wat",
        b"(module (memory 0 16) (memory 0 16) (memory 0 16))",
    );
    let o = twm(&[&["run", few.to_str().unwrap()][..], &small[..]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(
        v["tenant"]["held_limit_bytes"],
        (1u64 << 20) + (32 << 20),
        "{v}"
    );
    // Four times the cap where that is more.
    let big = ["--tenant-cap", "64MiB", "--memory-limit", "1MiB", "--json"];
    let o = twm(&[&["run", few.to_str().unwrap()][..], &big[..]].concat());
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["tenant"]["held_limit_bytes"], 256u64 << 20, "{v}");
}

/// Attack 2 through `twm run`: tables are not free. One past the per-table element limit
/// refuses instantiation (exit 4, naming the limit); tables within it are real host memory,
/// charged to the touched budget (the cap: at a cap of 0 there are none) and the held budget,
/// which refuses the third 1M-element table at 16 MiB; growth past a budget is -1.
#[test]
fn tables_are_charged_and_bounded_under_twm_run() {
    let huge = module_file("huge-table.wat", b"(module (table 10000000 funcref))");
    let o = twm(&["run", huge.to_str().unwrap(), "--tenant-cap", "0"]);
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("elements in one table"),
        "{}",
        stderr(&o)
    );
    // At a cap of 0 a tenant holds no table elements at all.
    let ten = module_file("ten-elements.wat", b"(module (table 10 funcref))");
    let o = twm(&["run", ten.to_str().unwrap(), "--tenant-cap", "0"]);
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(stderr(&o).contains("touched budget"), "{}", stderr(&o));
    let tables = "(table 1000000 funcref) ".repeat(3);
    let three = module_file("three-tables.wat", format!("(module {tables})").as_bytes());
    let args = ["--tenant-cap", "64MiB", "--tenant-held", "16MiB"];
    let o = twm(&[&["run", three.to_str().unwrap()][..], &args[..]].concat());
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(stderr(&o).contains("held budget"), "{}", stderr(&o));
    let growing = module_file(
        "grow-table.wat",
        br#"(module (table 10 funcref)
             (func (export "grow") (param i32) (result i32)
               (table.grow (ref.null func) (local.get 0))))"#,
    );
    let path = growing.to_str().unwrap();
    // A cap of 1 MiB is 65536 elements: a growth past it (within the element limit) is
    // refused by the budget.
    let small = ["--tenant-cap", "1MiB"];
    let o = twm(&[&["run", path, "--invoke", "grow", "100"][..], &small[..]].concat());
    assert_eq!(
        (o.status.code(), stdout(&o)),
        (Some(0), "10\n".into()),
        "{}",
        stderr(&o)
    );
    let o = twm(&[&["run", path, "--invoke", "grow", "200000"][..], &small[..]].concat());
    assert_eq!(
        (o.status.code(), stdout(&o)),
        (Some(0), "-1\n".into()),
        "{}",
        stderr(&o)
    );
    // Past the element limit (2^20 per table) it is -1 whatever the budget.
    let o = twm(&[&["run", path, "--invoke", "grow", "2000000"][..], &args[..]].concat());
    assert_eq!(
        (o.status.code(), stdout(&o)),
        (Some(0), "-1\n".into()),
        "{}",
        stderr(&o)
    );
}

/// The device-visible guarded backing through `twm run` and `twm probe`: chosen from what the
/// simulated device reports or forced, named in the output, bounds enforced by guard pages, a
/// pooled slot scrubbed between runs, and a backing the device cannot serve refused clearly.
#[test]
fn guarded_backings_through_twm_run_and_probe() {
    let o = twm(&["probe", "--json", "--simulate-host-access", "pageable"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["default_backing"], "guarded_pageable");
    assert_eq!(v["device_list"][0]["pageable_memory_access"], true);
    assert_eq!(v["device_list"][0]["host_registration"], false);
    let v: serde_json::Value = serde_json::from_str(&stdout(&twm(&["probe", "--json"]))).unwrap();
    assert_eq!(v["default_backing"], "managed");

    for (access, backing) in [
        ("pageable", "guarded_pageable"),
        ("registered", "guarded_registered"),
        ("both", "guarded_registered"),
    ] {
        let host = ["--simulate-host-access", access, "--backing", backing];
        let (code, out, err) = run(&[&["--invoke", "first", "--json"][..], &host].concat());
        assert_eq!(code, 0, "{backing}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["creator"]["backing"], backing);
        // Out of bounds traps (a signal caught by Wasmtime: exit 3, not a crash).
        assert_eq!(
            run(&[&["--invoke", "oob"][..], &host].concat()).0,
            3,
            "{backing}"
        );
        let (code, out, err) = run(&[
            &[
                "--invoke", "first", "--repeat", "3", "--pool", "1", "--stats",
            ][..],
            &host,
        ]
        .concat());
        assert_eq!((code, out.as_str()), (0, "0\n0\n0\n"), "{backing}: {err}");
        assert!(err.contains(&format!("memories ({backing})")), "{err}");
        assert!(err.contains("pool: 0 in use, 1 free"), "{err}");
    }
    // Advice on registered memory is refused, typed, as the guest's error code.
    let (code, out, err) = run(&[
        "--invoke",
        "advise",
        "0",
        "16",
        "--simulate-host-access",
        "registered",
        "--backing",
        "guarded_registered",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "-7\n", "advice on pinned memory: TWM_ERR_UNSUPPORTED");

    let (code, _, err) = run(&["--invoke", "first", "--backing", "guarded_pageable"]);
    assert_eq!(code, 2, "a backing the device lacks: a usage error: {err}");
    assert!(err.contains("not available on device:0"), "{err}");
    let (code, _, err) = run(&["--invoke", "first", "--backing", "guarded"]);
    assert_eq!(code, 2, "a usage error: {err}");
}

/// A guest with `tables` tables of `index` elements whose `attack` grows each by 2^20 - 1 and
/// then by -1 (an overflowing `old + delta` for 64-bit tables, which Wasmtime reports as a
/// failure with no growth announced), printing how many first growths succeeded.
fn table_attack(index: &str, tables: usize) -> PathBuf {
    let declared: String = (0..tables)
        .map(|t| format!("(table $t{t} {index} 0 funcref)"))
        .collect();
    let grows: String = (0..tables)
        .map(|t| {
            format!(
                "(if ({index}.ne (table.grow $t{t} (ref.null func) ({index}.const 1048575)) \
                 ({index}.const -1)) (then (local.set $ok (i32.add (local.get $ok) (i32.const 1))))) \
                 (drop (table.grow $t{t} (ref.null func) ({index}.const -1)))"
            )
        })
        .collect();
    let wat = format!(
        "(module {declared} (func (export \"attack\") (result i32) (local $ok i32) {grows} (local.get $ok)))"
    );
    module_file(&format!("attack-{index}-{tables}.wat"), wat.as_bytes())
}

/// The books under attack through `twm run` (issue 29, findings 1 and 6): an overflowing
/// 64-bit `table.grow` gives back no growth granted before it (two 16 MiB tables fit a 32 MiB
/// cap, not forty), and at a cap of 0 a guest grows no table at all.
#[test]
fn table_growth_attacks_hold_no_more_than_the_cap_under_twm_run() {
    for index in ["i64", "i32"] {
        let attack = table_attack(index, 40);
        let args = ["run", attack.to_str().unwrap(), "--invoke", "attack"];
        let o = twm(&[&args[..], &["--tenant-cap", "32MiB"][..]].concat());
        assert_eq!(
            (o.status.code(), stdout(&o)),
            (Some(0), "2\n".into()),
            "{index}: {}",
            stderr(&o)
        );
    }
    let attack = table_attack("i32", 100);
    let args = ["run", attack.to_str().unwrap(), "--invoke", "attack"];
    let o = twm(&[&args[..], &["--tenant-cap", "0", "--json"][..]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("json");
    assert_eq!(report["runs"][0][0], 0, "{report}");
    assert_eq!(report["tenant"]["touched_peak_bytes"], 0, "{report}");
    assert_eq!(report["tenant"]["held_peak_bytes"], 0, "{report}");
}

const SPIN: &str = r#"(module
  (memory 1)
  (func (export "spin") (loop (br 0)))
  (func (export "_start") (loop (br 0))))"#;

/// A WASI guest that sleeps for 10^5 seconds in `poll_oneoff` (a host call).
const SLEEP: &str = r#"(module
  (import "wasi_snapshot_preview1" "poll_oneoff"
    (func $poll (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (i32.store (i32.const 16) (i32.const 1))
    (i64.store (i32.const 24) (i64.const 100000000000000))
    (drop (call $poll (i32.const 0) (i32.const 64) (i32.const 1) (i32.const 128)))))"#;

#[test]
fn timeout_ends_an_endless_loop_and_a_long_sleep_with_status_124() {
    let spin = module_file("spin.wat", SPIN.as_bytes());
    let sleep = module_file("sleep.wat", SLEEP.as_bytes());
    for args in [
        vec![
            "run",
            spin.to_str().unwrap(),
            "--invoke",
            "spin",
            "--timeout",
            "200ms",
        ],
        vec!["run", spin.to_str().unwrap(), "--timeout", "200ms"],
        vec![
            "run",
            spin.to_str().unwrap(),
            "--timeout",
            "0.2s",
            "--repeat",
            "3",
        ],
        vec!["run", sleep.to_str().unwrap(), "--timeout", "300ms"],
    ] {
        let started = std::time::Instant::now();
        let o = twm(&args);
        let took = started.elapsed();
        assert_eq!(o.status.code(), Some(124), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("timed out"), "{}", stderr(&o));
        assert!(
            took < std::time::Duration::from_secs(10),
            "{args:?} took {took:?}"
        );
    }
    // With --json, one object saying so, whichever way the run ended.
    for module in [&spin, &sleep] {
        let o = twm(&[
            "run",
            module.to_str().unwrap(),
            "--timeout",
            "200ms",
            "--json",
        ]);
        assert_eq!(o.status.code(), Some(124));
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("one object");
        assert_eq!(v["error"]["exit_code"], 124, "{v}");
    }
    // A run within its timeout is untouched.
    assert_eq!(
        run(&["--invoke", "add", "2", "3", "--timeout", "10s"]),
        (0, "5\n".into(), String::new())
    );
}

/// A WASI guest whose first run creates `marker` in its preopened directory and returns; a later
/// run finds it there and sleeps for 10^5 seconds in `poll_oneoff`.
const SLEEP_ON_SECOND_RUN: &str = r#"(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "poll_oneoff"
    (func $poll (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 200) "marker")
  (func (export "_start")
    ;; O_CREAT | O_EXCL: succeeds only when the marker is not there yet.
    (if (i32.eqz (call $open (i32.const 3) (i32.const 0) (i32.const 200) (i32.const 6)
                   (i32.const 5) (i64.const 64) (i64.const 0) (i32.const 0) (i32.const 300)))
      (then (return)))
    (i32.store (i32.const 16) (i32.const 1))
    (i64.store (i32.const 24) (i64.const 100000000000000))
    (drop (call $poll (i32.const 0) (i32.const 64) (i32.const 1) (i32.const 128)))))"#;

/// The watchdog's JSON report keeps the runs completed before the one it ended.
#[test]
fn a_timed_out_repeat_reports_the_runs_before_it() {
    let guest = module_file("sleep2.wat", SLEEP_ON_SECOND_RUN.as_bytes());
    let dir = std::env::temp_dir().join(format!("twm-cli-marker-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let o = twm(&[
        "run",
        guest.to_str().unwrap(),
        "--dir",
        dir.to_str().unwrap(),
        "--repeat",
        "3",
        "--timeout",
        "300ms",
        "--json",
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("one object");
    assert_eq!(v["error"]["exit_code"], 124, "{v}");
    assert_eq!(v["runs"].as_array().map(Vec::len), Some(1), "{v}");
}

#[test]
fn fuel_ends_a_loop_as_a_trap() {
    let spin = module_file("spin.wat", SPIN.as_bytes());
    let o = twm(&[
        "run",
        spin.to_str().unwrap(),
        "--invoke",
        "spin",
        "--fuel",
        "100000",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("ran out of fuel"), "{}", stderr(&o));
    assert_eq!(
        run(&["--invoke", "add", "2", "3", "--fuel", "1000"]).1,
        "5\n"
    );
}

#[test]
fn json_is_one_object_even_when_the_run_fails_before_it_starts() {
    for args in [
        vec!["run", "/nonexistent/module.wat", "--json"],
        vec!["run", "/dev/zero", "--json"],
        vec!["run", "x.wat", "--bogus", "--json"],
        vec!["run", "x.wat", "--json=true"],
    ] {
        let o = twm(&args);
        assert_ne!(o.status.code(), Some(0), "{args:?}");
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim())
            .unwrap_or_else(|e| panic!("{args:?}: {e}: {:?}", stdout(&o)));
        assert_eq!(
            v["error"]["exit_code"].as_i64(),
            o.status.code().map(i64::from),
            "{v}"
        );
    }
    // `--json` among the guest's arguments (after `--`) is the guest's: plain text.
    let o = twm(&["run", "x.wat", "--bogus", "--", "--json"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(stdout(&o), "", "no JSON object asked for");
}

#[test]
fn an_endless_module_file_is_refused_after_a_bounded_read() {
    let o = twm(&["run", "/dev/zero"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the most a module may be"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_closed_stdout_fails_the_run() {
    let path = module_file("m.wat", MODULE.as_bytes());
    // `sh -c '... >&-'`: twm starts with file descriptor 1 closed.
    let o = twm_from(
        "sh",
        "exec \"$0\" run \"$1\" --invoke add 1 2 >&-",
        &[path.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("stdout is closed"), "{}", stderr(&o));
    // Redirected to /dev/null on purpose, it is open: the run succeeds.
    let o = Command::new(env!("CARGO_BIN_EXE_twm"))
        .args(["run", path.to_str().unwrap(), "--invoke", "add", "1", "2"])
        .stdout(std::process::Stdio::null())
        .output()
        .expect("run twm");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn error_text_shows_minus_signs_as_given() {
    let (code, _, err) = run(&["--invoke", "add", "-5", "--bogus", "-7"]);
    assert_eq!(code, 2);
    assert!(!err.contains('\u{2212}'), "{err}");
    let o = twm(&["run", "x.wat", "--repeat", "-3"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!stderr(&o).contains('\u{2212}'), "{}", stderr(&o));
    assert!(stderr(&o).contains("-3"), "{}", stderr(&o));
}

/// Findings of the review of `--timeout`: the watchdog ends the process whatever state its
/// streams are in (a full stderr, a broken stdout), and bounds compilation too.
#[test]
fn the_watchdog_ends_the_run_whatever_its_streams_and_bounds_compilation() {
    let sleep = module_file("sleep.wat", SLEEP.as_bytes());
    let full = |args: &[&str], stdout_full: bool| {
        let file = || std::fs::OpenOptions::new().write(true).open("/dev/full");
        let (Ok(a), Ok(b)) = (file(), file()) else {
            return None;
        };
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_twm"));
        cmd.args(args).stderr(a);
        if stdout_full {
            cmd.stdout(b);
        } else {
            cmd.stdout(std::process::Stdio::piped());
        }
        Some(bounded(&mut cmd))
    };
    let s = sleep.to_str().unwrap();
    for (args, stdout_full) in [
        (vec!["run", s, "--timeout", "300ms"], false),
        (vec!["run", s, "--timeout", "300ms", "--json"], true),
    ] {
        let Some(o) = full(&args, stdout_full) else {
            return;
        };
        assert_eq!(o.status.code(), Some(124), "{args:?}");
    }
    // A module whose compilation takes seconds (one function of 200,000 additions).
    let body = "local.get 0 i32.const 1 i32.add local.set 0 ".repeat(200_000);
    let bomb = module_file(
        "bomb.wat",
        format!("(module (func (export \"f\") (param i32) (result i32) {body} local.get 0))")
            .as_bytes(),
    );
    let started = std::time::Instant::now();
    let o = twm(&["run", bomb.to_str().unwrap(), "--timeout", "300ms"]);
    assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}

/// A WASI guest that opens `f` in its preopen (fd 3) and polls clocks, through `--invoke`.
const WASI_GUEST: &str = r#"(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "poll_oneoff"
    (func $poll (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (data (i32.const 16) "f")
  ;; Opens f with $oflags and $rights until refused or $max opens: opens * 100 + the refusal's
  ;; errno.
  (func (export "open_until") (param $max i32) (param $oflags i32) (param $rights i64)
    (result i32)
    (local $n i32) (local $e i32)
    (block $done
      (loop $again
        (br_if $done (i32.ge_u (local.get $n) (local.get $max)))
        (local.set $e (call $open (i32.const 3) (i32.const 0) (i32.const 16) (i32.const 1)
          (local.get $oflags) (local.get $rights) (local.get $rights) (i32.const 0)
          (i32.const 8)))
        (br_if $done (local.get $e))
        (local.set $n (i32.add (local.get $n) (i32.const 1)))
        (br $again)))
    (i32.add (i32.mul (local.get $n) (i32.const 100)) (local.get $e)))
  ;; One poll of $n monotonic clocks with timeout 0 (at most 1000): the errno.
  (func (export "poll") (param $n i32) (result i32)
    (local $i i32)
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
        (br_if $done (i32.ge_u (local.get $i) (i32.const 1000)))
        (i32.store (i32.add (i32.const 4112) (i32.mul (local.get $i) (i32.const 48)))
          (i32.const 1))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next)))
    (call $poll (i32.const 4096) (i32.const 65536) (local.get $n) (i32.const 12)))
  ;; Sleeps $ms milliseconds in one poll of one monotonic clock: the errno.
  (func (export "sleep") (param $ms i64) (result i32)
    (i32.store (i32.const 8208) (i32.const 1))
    (i64.store (i32.const 8216) (i64.mul (local.get $ms) (i64.const 1000000)))
    (call $poll (i32.const 8192) (i32.const 65536) (i32.const 1) (i32.const 12))))"#;

const EMFILE: i32 = 33;
const EINVAL: i32 = 28;
/// Every right preview 1 defines, and the ones reading a file needs (`fd_read`, `fd_seek`,
/// `fd_tell`, `fd_filestat_get`).
const ALL_RIGHTS: &str = "0x1FFFFFFF";
const READ_RIGHTS: &str = "0x200026";

/// A directory of its own holding `f` ("data"), removed when dropped.
struct GuestDir(PathBuf);

impl GuestDir {
    fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("twm-cli-dir-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("f"), b"data").unwrap();
        Self(dir)
    }

    fn spec(&self) -> String {
        format!("{}::/", self.0.display())
    }
}

impl Drop for GuestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `twm run WASI_GUEST FLAGS --invoke CALL`: the exit status and the number printed.
fn wasi_call(flags: &[&str], call: &[&str]) -> (i32, Option<i32>, String) {
    let guest = module_file("wasi.wat", WASI_GUEST.as_bytes());
    let mut args = vec!["run", guest.to_str().unwrap()];
    args.extend_from_slice(flags);
    args.push("--invoke");
    args.extend_from_slice(call);
    let o = twm(&args);
    (
        o.status.code().expect("no signal"),
        stdout(&o).trim().parse().ok(),
        stderr(&o),
    )
}

#[test]
fn wasi_max_fds_is_emfile_for_the_guest_and_the_default_fits_ulimit() {
    let dir = GuestDir::new();
    let spec = dir.spec();
    // Under the default (256), 100 opens all succeed.
    let (code, result, err) = wasi_call(&["--dir", &spec], &["open_until", "100", "0", ALL_RIGHTS]);
    assert_eq!((code, result), (0, Some(100 * 100)), "{err}");
    // With --wasi-max-fds 8, the opens stop at EMFILE: stdio and the preopen count, from the
    // guest's first call on (its descriptor table is set up by that call).
    let (code, result, err) = wasi_call(
        &["--dir", &spec, "--wasi-max-fds", "8"],
        &["open_until", "100", "0", ALL_RIGHTS],
    );
    assert_eq!((code, result), (0, Some(4 * 100 + EMFILE)), "{err}");
    // At exactly what stdio and the preopen take, the first open is refused, not a trap.
    for flags in [
        ["--wasi-max-fds", "4", "--wasi-max-resources", "4"],
        ["--wasi-max-resources", "8", "--wasi-max-poll", "256"],
    ] {
        let mut all = vec!["--dir", &spec];
        all.extend_from_slice(&flags);
        let (code, result, err) = wasi_call(&all, &["open_until", "100", "0", ALL_RIGHTS]);
        assert_eq!((code, result), (0, Some(EMFILE)), "{flags:?}: {err}");
    }
    // Without the flag, a process limit of 100 lowers the default to 100 - 64: EMFILE, not the
    // host's own descriptors exhausted.
    let guest = module_file("wasi.wat", WASI_GUEST.as_bytes());
    let o = twm_from(
        "sh",
        concat!(
            "ulimit -n 100 && exec \"$0\" run \"$1\" --dir \"$2\" ",
            "--invoke open_until 1000 0 0x1FFFFFFF"
        ),
        &[guest.to_str().unwrap(), &spec],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let result: i32 = stdout(&o).trim().parse().expect("a number");
    assert_eq!(result % 100, EMFILE, "{result}");
    assert!(result / 100 < 36, "{result}");
}

#[test]
fn descriptors_the_process_inherited_leave_the_guest_less() {
    let dir = GuestDir::new();
    let guest = module_file("wasi.wat", WASI_GUEST.as_bytes());
    // 40 descriptors open before twm starts, a limit of 120: 120 - 43 - 64 = 13 for the guest.
    let o = twm_from(
        "bash",
        concat!(
            "ulimit -n 120 && for fd in $(seq 10 49); do eval \"exec $fd</dev/null\"; done && ",
            "exec \"$0\" run \"$1\" --dir \"$2\" --invoke open_until 1000 0 0x1FFFFFFF"
        ),
        &[guest.to_str().unwrap(), &dir.spec()],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let result: i32 = stdout(&o).trim().parse().expect("a number");
    assert_eq!(
        result % 100,
        EMFILE,
        "refused by the limit, not the host: {result}"
    );
    assert!(result / 100 <= 10, "{result}");
    // With 100 preopens where the process has room for few, a usage error (it panicked at the
    // guest's first call when the host ran out of descriptors).
    let many: Vec<String> = (0..100)
        .map(|i| format!("{}::/p{i}", dir.0.display()))
        .collect();
    let mut args = vec![guest.to_str().unwrap(), "--json"];
    for spec in &many {
        args.extend(["--dir-ro", spec]);
    }
    let o = twm_from(
        "bash",
        "ulimit -n 120 && exec \"$0\" run \"$1\" \"${@:2}\" --invoke sleep 1",
        &args,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let message = json_error(&o);
    assert!(message.contains("100 preopened directories"), "{message}");
    // A process with almost no descriptors: WASI's runtime cannot start, a failure with its
    // JSON object (it panicked at the guest's first file call), and a guest without WASI runs.
    let o = twm_from(
        "sh",
        "ulimit -n 5 && exec \"$0\" run \"$1\" --json --invoke poll 1",
        &[guest.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let message = json_error(&o);
    assert!(message.contains("WASI's runtime"), "{message}");
    let plain = module_file("m.wat", MODULE.as_bytes());
    let o = twm_from(
        "sh",
        "ulimit -n 5 && exec \"$0\" run \"$1\" --invoke add 1 2",
        &[plain.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o), "3\n");
}

#[test]
fn contradictory_wasi_limits_are_usage_errors() {
    let dir = GuestDir::new();
    let spec = dir.spec();
    let (code, _, err) = wasi_call(
        &[
            "--dir",
            &spec,
            "--wasi-max-fds",
            "20",
            "--wasi-max-resources",
            "10",
        ],
        &["open_until", "1", "0", READ_RIGHTS],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--wasi-max-resources 10"), "{err}");
}

#[test]
fn wasi_max_poll_is_einval_past_it() {
    let (code, result, err) = wasi_call(&["--wasi-max-poll", "4"], &["poll", "4"]);
    assert_eq!((code, result), (0, Some(0)), "{err}");
    let (code, result, err) = wasi_call(&["--wasi-max-poll", "4"], &["poll", "5"]);
    assert_eq!((code, result), (0, Some(EINVAL)), "{err}");
    // The default is 256.
    let (_, result, _) = wasi_call(&[], &["poll", "256"]);
    assert_eq!(result, Some(0));
    let (_, result, _) = wasi_call(&[], &["poll", "257"]);
    assert_eq!(result, Some(EINVAL));
}

#[test]
fn a_full_wasi_resource_table_is_a_trap() {
    // Each clock a poll waits on is an entry of the table: 50 of them pass 10 entries.
    let (code, _, err) = wasi_call(&["--wasi-max-resources", "10"], &["poll", "50"]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("--wasi-max-resources"), "{err}");
    let (code, result, err) = wasi_call(&["--wasi-max-resources", "100"], &["poll", "50"]);
    assert_eq!((code, result), (0, Some(0)), "{err}");
}

#[test]
fn dir_ro_preopens_are_read_not_changed() {
    const CREATE_TRUNCATE: &str = "9";
    let dir = GuestDir::new();
    let spec = dir.spec();
    // Read-only: opening to read works, creating or truncating is refused, the file stays.
    let (code, result, err) =
        wasi_call(&["--dir-ro", &spec], &["open_until", "1", "0", READ_RIGHTS]);
    assert_eq!((code, result), (0, Some(100)), "{err}");
    let (code, result, err) = wasi_call(
        &["--dir-ro", &spec],
        &["open_until", "1", CREATE_TRUNCATE, ALL_RIGHTS],
    );
    assert_eq!(code, 0, "{err}");
    assert!(result.is_some_and(|r| r > 0 && r < 100), "{result:?}");
    assert_eq!(std::fs::read(dir.0.join("f")).unwrap(), b"data");
    // Writable: the same open truncates it.
    let (code, result, err) = wasi_call(
        &["--dir", &spec],
        &["open_until", "1", CREATE_TRUNCATE, ALL_RIGHTS],
    );
    assert_eq!((code, result), (0, Some(100)), "{err}");
    assert_eq!(std::fs::read(dir.0.join("f")).unwrap(), b"");
}

/// Findings of the operator's review of `--timeout`: reading the module, a run that ends in a
/// host call after its deadline, and results nobody reads are all bounded by it.
#[test]
fn the_timeout_bounds_reading_host_calls_and_writing() {
    // A module file that never ends being written (a FIFO): 124, one JSON object.
    let fifo = std::env::temp_dir().join(format!("twm-cli-fifo-{}.wat", std::process::id()));
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|s| s.success()) {
        let o = twm(&[
            "run",
            fifo.to_str().unwrap(),
            "--timeout",
            "300ms",
            "--json",
        ]);
        let _ = std::fs::remove_file(&fifo);
        assert_eq!(o.status.code(), Some(124), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("one object");
        assert_eq!(v["error"]["exit_code"], 124, "{v}");
    }
    // A host call that returns after the deadline but before the watchdog: still a timeout.
    let (code, _, err) = wasi_call(&["--timeout", "50ms"], &["sleep", "150"]);
    assert_eq!(code, 124, "{err}");
    let (code, result, err) = wasi_call(&["--timeout", "2s"], &["sleep", "10"]);
    assert_eq!((code, result), (0, Some(0)), "{err}");
    // Results written to a pipe nobody reads: ended by the timeout, not blocked for good.
    let path = module_file("m.wat", MODULE.as_bytes());
    let mut results = Command::new(env!("CARGO_BIN_EXE_twm"));
    results
        .args(["run", path.to_str().unwrap(), "--timeout", "300ms"])
        .args(["--repeat", "200000", "--invoke", "add", "1", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    assert_eq!(unread(&mut results), Some(124), "results");
    // A guest that fills an unread stderr and traps: twm's own last words are bounded too.
    let filler = module_file(
        "fill.wat",
        br#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 1024))
    (i32.store (i32.const 4) (i32.const 65536))
    (drop (call $w (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8)))
    unreachable))"#,
    );
    let mut last_words = Command::new(env!("CARGO_BIN_EXE_twm"));
    last_words
        .args(["run", filler.to_str().unwrap(), "--timeout", "300ms"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    assert_eq!(unread(&mut last_words), Some(124), "a message after a trap");
}

/// Runs `cmd`, whose piped streams are never read: its exit status (the test fails if it runs
/// past [`PROCESS_LIMIT`]).
fn unread(cmd: &mut Command) -> Option<i32> {
    let mut child = cmd.spawn().expect("run twm");
    let started = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status.code();
        }
        if started.elapsed() > PROCESS_LIMIT {
            let _ = child.kill();
            panic!("{cmd:?} blocked on an unread stream past {PROCESS_LIMIT:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_pool_the_device_cannot_hold_is_refused() {
    // 65 slots of 256 MiB: more than the simulated device's 16 GiB.
    let (code, _, err) = run(&["--pool", "65"]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("cannot set up memory"), "{err}");
}

#[test]
fn a_hostile_files_error_text_is_cut_not_echoed() {
    let bad = module_file(
        "bad.wat",
        format!("(module {})", "x".repeat(4 << 20)).as_bytes(),
    );
    let o = twm(&["run", bad.to_str().unwrap(), "--json"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(o.stdout.len() < 4096, "{} bytes of JSON", o.stdout.len());
    assert!(o.stderr.len() < 4096, "{} bytes of stderr", o.stderr.len());
    assert!(stderr(&o).contains("(cut)"), "{}", stderr(&o));
}

#[test]
fn more_wasi_descriptors_than_the_process_may_open_is_a_usage_error() {
    let path = module_file("m.wat", MODULE.as_bytes());
    let o = twm_from(
        "sh",
        "ulimit -n 512 && exec \"$0\" run \"$1\" --wasi-max-fds 500",
        &[path.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("ulimit -n"), "{}", stderr(&o));
}

/// The exit status says what happened: a module that does not fit the host (an unknown import)
/// is not a refusal a retry could pass (1); a host call that fails the guest's call (a WASI
/// pointer out of its memory, a device lost to a kernel fault) is a trap (3); a guest's own
/// `proc_exit` status is marked as the guest's in `--json`; after a kernel fault the device
/// recovers when the run's Store goes, so the next run of a `--repeat` is served; a reference
/// result is named by its type, never by a host address, and a NaN is no JSON `null`.
#[test]
fn exit_statuses_say_what_happened() {
    let status = |wat: &str, extra: &[&str]| {
        let path = module_file("status.wat", wat.as_bytes());
        let o = twm(&[&["run", path.to_str().unwrap()][..], extra].concat());
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
        o
    };
    let o = status(r#"(module (import "env" "x" (func)))"#, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot instantiate"), "{}", stderr(&o));

    let random = r#"(module
      (import "wasi_snapshot_preview1" "random_get" (func $r (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func (export "f") (result i32) (call $r (i32.const 0x7fffffff) (i32.const 16))))"#;
    let o = status(random, &["--invoke", "f"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    // The same in a start function: the same status, whichever way the guest runs it.
    let in_start = r#"(module
      (import "wasi_snapshot_preview1" "random_get" (func $r (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func $s (drop (call $r (i32.const 0x7fffffff) (i32.const 16))))
      (start $s))"#;
    let o = status(in_start, &[]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    // A `twm` import of the wrong type does not fit the host: 1, like an unknown one.
    let o = status(
        r#"(module (import "twm" "launch" (func (param i32))))"#,
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));

    // poke(buf = 16 bytes at 2048, index 16, value 0): past the buffer, a device-side assert.
    let poke = r#"(module
      (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func (export "f") (result i32)
        (i64.store (i32.const 1024) (i64.const 2048))
        (i64.store (i32.const 1032) (i64.const 16))
        (i64.store (i32.const 1040) (i64.const 16))
        (i64.store (i32.const 1056) (i64.const 0))
        (call $launch (i32.const 3) (i32.const 1024) (i32.const 3))))"#;
    let o = status(
        poke,
        &["--invoke", "f", "--kernels", "builtin", "--metrics"],
    );
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let metrics = stdout(&o);
    for line in [
        "twm_device_fenced{device=\"0\"} 0",
        "twm_device_recoveries_total{device=\"0\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    assert!(
        metrics.contains("twm_creator_kept_memories 0"),
        "nothing kept: {metrics}"
    );

    let exit = r#"(module
      (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
      (memory (export "memory") 1)
      (func (export "f") (param i32) (call $exit (local.get 0))))"#;
    let o = status(exit, &["--invoke", "f", "4", "--json"]);
    assert_eq!(o.status.code(), Some(4));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["error"]["guest_exit"], true, "{v}");
    let o = status(
        r#"(module (func (export "f")))"#,
        &["--invoke", "f", "--json"],
    );
    assert_eq!(o.status.code(), Some(0));

    let refs = r#"(module
      (table 1 funcref) (elem (i32.const 0) $a) (func $a)
      (func (export "r") (result funcref) (table.get (i32.const 0)))
      (func (export "n") (result funcref) (ref.null func))
      (func (export "nan") (result f64) (f64.div (f64.const 0) (f64.const 0))))"#;
    let o = status(refs, &["--invoke", "r"]);
    assert_eq!(stdout(&o), "funcref\n", "{}", stderr(&o));
    let o = status(refs, &["--invoke", "n", "--json"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(v["runs"][0][0].is_null(), "{v}");
    let o = status(refs, &["--invoke", "nan", "--json"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["runs"][0][0], "NaN", "{v}");
}

/// A wrong `--invoke` is a usage error before any guest code runs (a start function that
/// would exit with its own status included); a guest that exits with 0 before its call returns
/// reports `null` for that run, not the `[]` of a call with no results; the JSON keeps a
/// bounded number of result values over all runs and counts the runs past them.
#[test]
fn the_command_line_is_checked_before_the_guest_runs_and_json_is_bounded() {
    let exits = module_file(
        "start-exits.wat",
        br#"(module
             (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
             (memory (export "memory") 1)
             (global $status (mut i32) (i32.const 9))
             (func $s (call $exit (global.get $status)))
             (start $s)
             (func (export "f") (param i32) (result i32) (local.get 0)))"#,
    );
    let p = exits.to_str().unwrap();
    for bad in [
        &["--invoke", "nosuch"][..],
        &["--invoke", "f"][..],
        &["--invoke", "f", "x"][..],
    ] {
        let o = twm(&[&["run", p][..], bad].concat());
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", stderr(&o));
    }
    let o = twm(&["run", p, "--invoke", "f", "1"]);
    assert_eq!(o.status.code(), Some(9), "the guest's own status");

    let zero = module_file(
        "start-exits-0.wat",
        br#"(module
             (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
             (memory (export "memory") 1)
             (func $s (call $exit (i32.const 0)))
             (start $s)
             (func (export "f") (result i32) (i32.const 42))
             (func (export "nothing")))"#,
    );
    let o = twm(&["run", zero.to_str().unwrap(), "--invoke", "f", "--json"]);
    assert_eq!(o.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["runs"], serde_json::json!([null]), "{v}");

    let results = " i32".repeat(1000);
    let values = "(i32.const 7) ".repeat(1000);
    let wide = module_file(
        "wide.wat",
        format!(r#"(module (func (export "f") (result{results}) {values}))"#).as_bytes(),
    );
    let o = twm(&[
        "run",
        wide.to_str().unwrap(),
        "--invoke",
        "f",
        "--json",
        "--repeat",
        "300",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let kept = v["runs"].as_array().unwrap().len() as u64;
    assert_eq!(kept, 262, "the first runs, up to 262144 values");
    assert_eq!(v["runs_omitted"], 300 - kept, "the rest counted");
}

const LAUNCHER: &str = r#"(module
  (import "twm" "kernel" (func $kernel (param i32 i32) (result i32)))
  (import "twm" "launch" (func $launch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "fill")
  ;; fill(offset, bytes) with 7: the launch's code.
  (func (export "fill") (param $off i64) (param $len i64) (result i32)
    (i64.store (i32.const 64) (local.get $off))
    (i64.store (i32.const 72) (local.get $len))
    (i64.store (i32.const 80) (i64.const 7))
    (i64.store (i32.const 88) (i64.const 0))
    (call $launch (call $kernel (i32.const 0) (i32.const 4)) (i32.const 64) (i32.const 2)))
  (func (export "byte") (param i32) (result i32) (i32.load8_u (local.get 0))))"#;

#[test]
fn hostile_launches_through_twm_run_are_codes_not_crashes() {
    let path = module_file("launch.wat", LAUNCHER.as_bytes());
    let p = path.to_str().unwrap();
    let launch = |off: &str, len: &str| {
        let o = twm(&[
            "run",
            p,
            "--kernels",
            "builtin",
            "--invoke",
            "fill",
            off,
            len,
        ]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        stdout(&o).trim().to_string()
    };
    assert_eq!(launch("4096", "4096"), "0");
    assert_eq!(launch("65000", "4096"), "-1", "past the end");
    assert_eq!(launch("8", "-1"), "-2", "a length that overflows");
    assert_eq!(launch("-4", "8"), "-2", "an offset that wraps");
    // The kernel ran on the guest's bytes.
    let o = twm(&["run", p, "--kernels", "builtin", "--invoke", "byte", "100"]);
    assert_eq!(stdout(&o).trim(), "0", "each run starts from zeros");
    // Without --kernels, or on a backend with no built-in kernels.
    let o = twm(&["run", p, "--invoke", "fill", "0", "8"]);
    assert_eq!(stdout(&o).trim(), "-8");
}

/// A preopen inside a writable one is refused: a guest could replace it with a link to the
/// host's `/`, which twm followed when it opened the preopen again for the next run (a red
/// team read a host file so). Inside a read-only one, and the same directory twice, are fine.
#[test]
fn a_preopen_inside_a_writable_one_is_refused() {
    let guest = module_file("empty.wat", b"(module (func (export \"_start\")))");
    let dir = std::env::temp_dir().join(format!("twm-cli-nested-{}", std::process::id()));
    let sub = dir.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let (outer, inner) = (dir.to_str().unwrap(), sub.to_str().unwrap());
    let inner_spec = format!("{inner}::/sub");
    let outer_twice = format!("{outer}::/again");
    let cases: [(&[&str], i32); 5] = [
        (&["--dir", outer, "--dir-ro", &inner_spec], 2),
        (&["--dir", outer, "--dir", &inner_spec], 2),
        (&["--dir-ro", outer, "--dir", &inner_spec], 0),
        (&["--dir-ro", outer, "--dir-ro", &inner_spec], 0),
        (&["--dir", outer, "--dir", &outer_twice], 0),
    ];
    for (flags, code) in cases {
        let mut args = vec!["run", guest.to_str().unwrap()];
        args.extend_from_slice(flags);
        let o = twm(&args);
        assert_eq!(o.status.code(), Some(code), "{flags:?}: {}", stderr(&o));
        if code == 2 {
            assert!(
                stderr(&o).contains("lies inside the writable preopen"),
                "{flags:?}: {}",
                stderr(&o)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a module names reaches twm's messages only clipped: no control character, no line of
/// its own that could pass for twm's (`twm: ...`), and a bounded length however long the names
/// in a trap's backtrace (a red team forged lines and wrote 4 MB so).
#[test]
fn names_a_module_chose_reach_messages_clipped() {
    let name = format!("\\0a\\1b[31mtwm: run ok\\1b[0m{}", "x".repeat(50_000));
    let wat = format!(
        r#"(module
          (func $"{name}" (export "boom") (call $deep (i32.const 30)))
          (func $deep (param i32)
            (if (i32.eqz (local.get 0)) (then unreachable))
            (call $deep (i32.sub (local.get 0) (i32.const 1)))))"#
    );
    let guest = module_file("names.wat", wat.as_bytes());
    let import = module_file(
        "import.wat",
        "(module (import \"\\0a\\1b[32mtwm: all good\\u{2028}twm: ok\\u{202e}\" \"x\" (func)))"
            .as_bytes(),
    );
    for (path, args) in [(&guest, &["--invoke", "boom"][..]), (&import, &[][..])] {
        for json in [false, true] {
            let mut all = vec!["run", path.to_str().unwrap()];
            all.extend_from_slice(args);
            if json {
                all.push("--json");
            }
            let o = twm(&all);
            let message = if json { json_error(&o) } else { stderr(&o) };
            assert_ne!(o.status.code(), Some(0));
            assert!(
                !message.contains(['\u{1b}', '\u{2028}', '\u{202e}']),
                "{message}"
            );
            assert!(
                message.lines().skip(1).all(|l| l.starts_with(' ')),
                "{message}"
            );
            assert!(message.len() < 4_000, "{} bytes", message.len());
            assert!(stdout(&o).len() < 8_000, "{} bytes", stdout(&o).len());
        }
    }
}

/// With `--metrics` (and no `--json`), the guest's stdout goes to stderr: twm's stdout is its
/// results and the metrics page, which a guest's prints cannot forge (a red team printed metric
/// lines ahead of the real page).
#[test]
fn a_guests_stdout_cannot_forge_the_metrics_page() {
    let guest = module_file(
        "forge.wat",
        br#"(module
          (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 1)
          (data (i32.const 64) "twm_tenant_denials_total 0\n")
          (func (export "_start")
            (i32.store (i32.const 0) (i32.const 64))
            (i32.store (i32.const 4) (i32.const 27))
            (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#,
    );
    let o = twm(&["run", guest.to_str().unwrap(), "--metrics"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("twm_tenant_denials_total 0"),
        "{}",
        stderr(&o)
    );
    assert!(
        !stdout(&o)
            .lines()
            .any(|l| l == "twm_tenant_denials_total 0"),
        "{}",
        stdout(&o)
    );
    assert!(stdout(&o).contains("# HELP"), "{}", stdout(&o));
}

/// A run that completed keeps its results in the watchdog's report when writing the report
/// blocks (a guest filled the stderr pipe the stats go to, and no one reads it): before, the
/// report said `"runs": []` and the result was lost (a red team).
#[test]
fn a_report_that_blocks_keeps_the_completed_runs() {
    let guest = module_file(
        "fill.wat",
        br#"(module
          (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
          (memory (export "memory") 2)
          (func (export "f") (result i32)
            (i32.store (i32.const 0) (i32.const 1024))
            (i32.store (i32.const 4) (i32.const 65500))
            (drop (call $w (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8)))
            (i32.const 42)))"#,
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_twm"))
        .args([
            "run",
            guest.to_str().unwrap(),
            "--invoke",
            "f",
            "--json",
            "--stats",
            "--timeout",
            "1s",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Stderr is not read until the process has ended: its pipe stays full.
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(124), "{out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one object");
    assert_eq!(v["runs"], serde_json::json!([[42]]), "{v}");
}

/// A `random_get` longer than a memory may be (`--memory-limit`) is refused before WASI
/// allocates its bytes (it allocated up to 64 MiB for a guest capped at 64 KiB, and only then
/// found the guest's buffer out of bounds: a red team).
#[test]
fn a_random_get_past_the_memory_limit_is_refused_before_it_allocates() {
    let guest = module_file(
        "random.wat",
        br#"(module
          (import "wasi_snapshot_preview1" "random_get" (func $r (param i32 i32) (result i32)))
          (memory (export "memory") 1 1)
          (func (export "f") (result i32) (call $r (i32.const 0) (i32.const 0x1000000))))"#,
    );
    let o = twm(&[
        "run",
        guest.to_str().unwrap(),
        "--invoke",
        "f",
        "--memory-limit",
        "64KiB",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("exceeds limit 65536"), "{}", stderr(&o));
}
