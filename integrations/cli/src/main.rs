//! `twm`: run Wasm guests on managed memory, demo, probe and benchmark tensor-wasm-mem.
#![forbid(unsafe_code)]

mod backend;
mod bench;
mod bytes;
mod demo;
mod probe;
mod report;
mod run;

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

#[derive(Debug, Subcommand)]
enum Command {
    /// Several tenants, pooled memories, a host "kernel" on guest data, and the figures.
    Demo(demo::DemoArgs),
    /// Run a .wat or .wasm module (exit 0 ok, 2 bad command line, 3 trap, 4 refused, 1 other;
    /// a WASI guest's own `proc_exit` status otherwise).
    Run(run::RunArgs),
    /// What the backend and device offer.
    Probe(probe::ProbeArgs),
    /// Measure against Wasmtime's own allocators in one run.
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let result = match &cli.command {
        Command::Demo(args) => with_backend!(args.backend, |b| demo::demo(b)),
        Command::Run(args) => with_backend!(args.backend, |b| run::run(b, args)),
        Command::Probe(args) => with_backend!(args.backend, |b| {
            probe::probe(
                args.backend,
                &*b,
                &backend::DescribeDriver::driver(&*b),
                args.json,
            );
            Ok::<(), Failure>(())
        }),
        Command::Bench(args) => bench::bench(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            if !failure.message().is_empty() {
                eprintln!("twm: {}", failure.message());
            }
            ExitCode::from(failure.exit_code())
        }
    }
}
