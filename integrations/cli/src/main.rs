//! `twm`: run Wasm guests on managed memory, demo, probe and benchmark tensor-wasm-mem.
#![forbid(unsafe_code)]

/// `println!` for the commands: a stdout that cannot be written to (a closed pipe, a full
/// disk) is a [`Failure`] with a message, never a panic. For functions that
/// return `Result<_, Failure>`.
macro_rules! outln {
    () => {
        $crate::run::out("")?
    };
    ($($arg:tt)*) => {
        $crate::run::out(&format!($($arg)*))?
    };
}

mod backend;
mod bench;
mod bytes;
mod demo;
mod probe;
mod report;
mod run;
mod watchdog;

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::run::Failure;

/// Wasm guests on CUDA managed memory: demo, run, probe, bench.
#[derive(Debug, Parser)]
#[command(name = "twm", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// `RunArgs` is the largest by far; the command line is parsed once.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Several tenants, pooled memories, a host "kernel" on guest data, and the figures.
    Demo(demo::DemoArgs),
    /// Run a .wat or .wasm module (exit 0 ok, 2 bad command line, 3 trap, 4 refused, 124
    /// timed out, 1 other; a WASI guest's own `proc_exit` status otherwise).
    Run(run::RunArgs),
    /// What the backend and device offer.
    Probe(probe::ProbeArgs),
    /// Measure against Wasmtime's own allocators in one run.
    Bench(bench::BenchArgs),
}

/// Marks a negative number on the command line (see [`negative_numbers_as_values`]).
pub(crate) const NEGATIVE: char = '\u{2212}';

/// The command line with each negative number before a bare `--` (`-5`, `-0x80000000`, `-inf`,
/// `-1.5e3`) marked so that clap takes it for a value and never for an option: its `-` becomes
/// [`NEGATIVE`], which `run` reads back as a minus sign. No option of `twm` looks like a number.
/// Guest arguments after `--` are left exactly as given.
fn negative_numbers_as_values(args: impl Iterator<Item = OsString>) -> Vec<OsString> {
    let mut after_dashes = false;
    args.map(|arg| {
        if after_dashes {
            return arg;
        }
        if arg == "--" {
            after_dashes = true;
            return arg;
        }
        let number = arg
            .to_str()
            .and_then(|a| a.strip_prefix('-'))
            .filter(|rest| {
                let hex = rest
                    .strip_prefix("0x")
                    .is_some_and(|h| u128::from_str_radix(h, 16).is_ok());
                hex || rest.parse::<f64>().is_ok()
            });
        match number {
            Some(rest) => OsString::from(format!("{NEGATIVE}{rest}")),
            None => arg,
        }
    })
    .collect()
}

/// `twm probe`: describes the backend (which may fail to start).
fn probe_command(args: &probe::ProbeArgs) -> Result<(), Failure> {
    let sim = backend::simulated_machine(args.backend, args.devices, args.simulate_host_access)?;
    with_backend!(args.backend, sim, |b| {
        probe::probe(
            args.backend,
            &*b,
            &backend::DescribeDriver::driver(&*b),
            args.json,
        )
    })
}

/// Prints a command-line error (or the help clap answers with), its minus signs as given.
fn print_parse_error(e: &clap::Error) -> ExitCode {
    let text = e.render().to_string().replace(NEGATIVE, "-");
    let (code, written) = if e.use_stderr() {
        (2, write!(std::io::stderr(), "{text}"))
    } else {
        (0, write!(std::io::stdout(), "{text}"))
    };
    ExitCode::from(if written.is_err() { 1 } else { code })
}

/// Whether the process's stdout is open. Rust's runtime gives a process started with its
/// stdout closed (`>&-`) a `/dev/null` opened for reading and writing in its place, which
/// swallows every write: results would vanish while the exit status said they were printed.
/// A shell's `>/dev/null` opens it write-only, so only the runtime's stand-in is taken for a
/// closed stdout (seen through Linux's `/proc`; elsewhere stdout is taken as open).
fn stdout_is_open() -> bool {
    let null = std::fs::read_link("/proc/self/fd/1").is_ok_and(|p| p == Path::new("/dev/null"));
    let read_write = std::fs::read_to_string("/proc/self/fdinfo/1").is_ok_and(|info| {
        info.lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
            .is_some_and(|flags| flags & 0o3 == 0o2)
    });
    !(null && read_write)
}

fn main() -> ExitCode {
    let args = negative_numbers_as_values(std::env::args_os());
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => {
            // twm's own arguments: those after a bare `--` are the guest's.
            let own = args.iter().take_while(|a| *a != "--");
            // `--json=true` is refused by the parser (a flag takes no value), but it asked for
            // JSON all the same.
            let json = own
                .clone()
                .any(|a| a == "--json" || a.to_str().is_some_and(|a| a.starts_with("--json=")));
            let run = own.clone().any(|a| a == "run");
            if json && run && e.use_stderr() {
                let rendered = e.render().to_string().replace(NEGATIVE, "-");
                let first = rendered.lines().next().unwrap_or_default();
                let message = first.strip_prefix("error: ").unwrap_or(first);
                let _ = writeln!(
                    std::io::stdout(),
                    "{}",
                    run::early_report("", "", 2, message)
                );
            }
            return print_parse_error(&e);
        }
    };
    if !stdout_is_open() {
        let _ = writeln!(
            std::io::stderr(),
            "twm: stdout is closed: results would be lost"
        );
        return ExitCode::from(1);
    }
    let result = match &cli.command {
        Command::Demo(args) => backend::simulated_machine(args.backend, args.devices, None)
            .and_then(|sim| with_backend!(args.backend, sim, |b| demo::demo(b))),
        Command::Run(args) => {
            backend::simulated_machine(args.backend, args.devices, args.simulate_host_access)
                .and_then(|sim| with_backend!(args.backend, sim, |b| run::run(b, args)))
        }
        Command::Probe(args) => probe_command(args),
        Command::Bench(args) => bench::bench(args),
    };
    // What twm writes after a failed run (its message, an early JSON report) is bounded by
    // the run's --timeout too: a stream nobody reads (a guest filled its pipe) blocks it.
    let _bounded = match (&cli.command, &result) {
        (Command::Run(args), Err(_)) => args.timeout.and_then(|timeout| {
            let watchdog = watchdog::Watchdog::start(|_| {}).ok()?;
            watchdog.arm(timeout + watchdog::GRACE);
            Some(watchdog)
        }),
        _ => None,
    };
    if let (Command::Run(args), Err(failure)) = (&cli.command, &result)
        && args.json
        && !run::REPORTED.swap(true, std::sync::atomic::Ordering::AcqRel)
    {
        let report = run::early_report(
            &args.file.display().to_string(),
            args.backend.name(),
            failure.exit_code(),
            &failure.message(),
        );
        // A stdout that cannot take it fails below with the failure's own status.
        let _ = writeln!(std::io::stdout(), "{report}");
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let message = failure.message();
            if !message.is_empty() {
                // A stderr that cannot take it changes nothing: the status says what happened.
                let _ = writeln!(std::io::stderr(), "twm: {message}");
            }
            ExitCode::from(failure.exit_code())
        }
    }
}
