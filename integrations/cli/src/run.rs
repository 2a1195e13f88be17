//! `twm run`: instantiate a `.wat` / `.wasm` file on managed memory and invoke an export.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tensor_wasm_mem_core::{DeviceId, IsolationLevel, PlanLimits, PoolConfig, SizeClass};
use tensor_wasm_mem_wasmtime::deadline::{
    EpochTicker, Interruption, call_with_fuel, is_out_of_fuel, is_timeout,
};
use tensor_wasm_mem_wasmtime::wasi::{
    FsPerms, LimitedWasi, WasiCtxBuilder, WasiLimits, add_wasi_to_linker, imports_wasi,
};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module, Store, Trap, Val, ValType};
use tensor_wasm_mem_wasmtime::{
    Backend, ChargeMode, Tenant, TenantBudgets, TenantStore, TensorWasmMemoryCreator, TwmError,
    add_to_linker, instantiate, new_store,
};

use crate::backend::{BackendKind, BuiltinKernels};
use crate::report::{creator_json, stats_table, tenant_json};
use crate::watchdog::{TIMEOUT_EXIT, Watchdog, tick_for, write_fd};

/// The most slots `--pool` takes (each slot's records are host memory made up front).
pub const MAX_POOL: u32 = 65_536;
/// The most runs `--repeat` takes.
pub const MAX_REPEAT: u32 = 1_000_000;
/// The default of `--max-module-size`: the largest module file `twm run` reads (a larger file
/// is refused before it is read, an endless one such as `/dev/zero` after this many bytes).
pub const MAX_MODULE_BYTES: u64 = 64 << 20;
/// The most `--max-module-size` takes.
pub const MAX_MODULE_BYTES_LIMIT: u64 = 1 << 30;
/// The longest error text `twm` repeats from a module's parser or compiler: an error that
/// quotes a whole line of a hostile file is cut, not echoed.
pub const MAX_MESSAGE_CHARS: usize = 1000;

/// Wasmtime-wasi's own bound on one `random_get` (64 MiB), kept where `--memory-limit` is
/// larger.
const DEFAULT_MAX_RANDOM: u64 = 64 << 20;

/// Whether the JSON report (`--json`) has been printed: a failure before it prints an object
/// of its own (see `main`).
pub static REPORTED: AtomicBool = AtomicBool::new(false);

/// The results of the runs completed so far (`--repeat`): the report's `runs`, and the
/// watchdog's (a run that times out in a host call still reports the runs before it). Held only
/// to add a run or read them, never across a guest call.
static COMPLETED: std::sync::Mutex<Completed> = std::sync::Mutex::new(Completed {
    runs: Vec::new(),
    values: 0,
    omitted: 0,
});

/// The most result values the JSON report keeps over all runs: a module chooses how many
/// results its function has (a thousand `v128`s, say) and `--repeat` how often, so the report
/// keeps the first runs' and counts the rest (`runs_omitted`) rather than grow without bound.
const JSON_VALUES_KEPT: usize = 1 << 18;

/// The runs a JSON report shows, and those it leaves out.
struct Completed {
    runs: Vec<Value>,
    /// Result values kept in `runs`.
    values: usize,
    /// Runs completed but not kept (past [`JSON_VALUES_KEPT`]).
    omitted: u64,
}

impl Completed {
    /// Keeps one run's results (`Null`: the guest exited before its call returned), or counts
    /// it left out.
    fn keep(&mut self, run: Value) {
        let values = run.as_array().map_or(1, Vec::len).max(1);
        if self.values + values > JSON_VALUES_KEPT {
            self.omitted += 1;
        } else {
            self.values += values;
            self.runs.push(run);
        }
    }
}

fn completed() -> std::sync::MutexGuard<'static, Completed> {
    COMPLETED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `twm run` arguments.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The module: WebAssembly text (`.wat`) or binary (`.wasm`).
    pub file: PathBuf,
    /// The export to call, followed by its arguments.
    #[arg(long, value_name = "NAME")]
    pub invoke: Option<String>,
    /// Arguments for `--invoke` (integers, decimal or `0x` hex, or floats for f32/f64
    /// parameters); negative ones (`-5`, `-0x80000000`, `-inf`) are arguments, not options.
    #[arg(
        value_name = "ARGS",
        allow_negative_numbers = true,
        requires = "invoke"
    )]
    pub args: Vec<String>,
    /// The backend.
    #[arg(long, value_enum, default_value_t = BackendKind::preferred())]
    pub backend: BackendKind,
    /// The tenant's cap on linear memory (e.g. 64KiB, 16MiB, 1GiB); none by default.
    #[arg(long, value_name = "BYTES", value_parser = crate::bytes::parse_bytes)]
    pub tenant_cap: Option<u64>,
    /// The tenant's held budget: capacity its memories (slots or allocations) and table
    /// elements may occupy. Default: 4x the cap, at least --memory-limit + 32MiB (none without
    /// a cap).
    #[arg(long, value_name = "BYTES", value_parser = crate::bytes::parse_bytes)]
    pub tenant_held: Option<u64>,
    /// The most linear memories the tenant may have alive at once. Default: 1024 (none without
    /// a cap).
    #[arg(long, value_name = "N")]
    pub tenant_memories: Option<u64>,
    /// The tenant's isolation level.
    #[arg(long, value_name = "LEVEL", default_value = "stream_isolated", value_parser = parse_isolation)]
    pub isolation: IsolationLevel,
    /// Take memories from a pool of this many slots (each of --memory-limit bytes; at most
    /// 65536).
    #[arg(long, value_name = "SLOTS", value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_POOL)))]
    pub pool: Option<u32>,
    /// With --pool: a thread zeroes each slot a run gave back while it is free, so the next
    /// run's instantiation does no scrub of its own: lower latency per run for one more busy
    /// core (docs/BENCHMARKS.md, "Scrubbing ahead"). A managed pool's or a guarded pool's.
    #[arg(long, requires = "pool")]
    pub scrub_ahead: bool,
    /// The most bytes one linear memory may have (at most 4GiB); also the capacity of memories
    /// that declare no maximum (what clang's C programs declare).
    #[arg(long, value_name = "BYTES", default_value = "256MiB", value_parser = crate::bytes::parse_bytes)]
    pub memory_limit: u64,
    /// Instantiate and invoke this many times, one after another, reusing the pool (at most
    /// 1000000).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_REPEAT)))]
    pub repeat: u32,
    /// End each run (instantiation and call), and reading and compiling the module and writing
    /// results, that takes longer than DURATION (`500ms`, `10s`, `2m`; 1ms to 24h), with exit
    /// status 124: guest code is interrupted (epoch interruption); a guest blocked in a host
    /// call (a WASI sleep), a compilation or a blocked read or write ends the process.
    #[arg(long, value_name = "DURATION", value_parser = crate::watchdog::parse_duration)]
    pub timeout: Option<Duration>,
    /// Give each run N units of fuel (about one a Wasm instruction, checked at function entries
    /// and loop headers, so straight-line code may run a function body past it; host calls
    /// are not counted: bound wall time with --timeout); a guest that spends it traps (exit
    /// status 3).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub fuel: Option<u64>,
    /// Descriptors a WASI guest may hold open, stdio and preopens included (1 to 65536, at most
    /// --wasi-max-resources and the process's `ulimit -n` less those open and 64; default 256,
    /// lowered to fit the room and half of --wasi-max-resources): past them, opening a file
    /// answers EMFILE. Equal to --wasi-max-resources, a guest that holds them all has no entry
    /// left for anything else (a poll's clocks trap).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub wasi_max_fds: Option<u32>,
    /// Subscriptions one WASI `poll_oneoff` may pass (1 to 65536; default 256): more is EINVAL.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub wasi_max_poll: Option<u32>,
    /// Entries a WASI guest's resource table may hold: descriptors, streams, pollables (1 to
    /// 1000000; default 1024). A call that would pass it traps.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub wasi_max_resources: Option<u32>,
    /// Print the stats table to stderr.
    #[arg(long)]
    pub stats: bool,
    /// At exit, print the layer's metrics in the Prometheus text format (to stdout after the
    /// results, the guest's own stdout going to stderr; with --json, as the object's "metrics"
    /// string). Every metric is listed in docs/SCALING.md.
    #[arg(long)]
    pub metrics: bool,
    /// The device the tenant is placed on (its memories, pool slots and stream).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub device: u32,
    /// Simulate this many devices (`--backend mock` only; 1 to 64, default 1).
    #[arg(long, value_name = "N", value_parser = crate::backend::parse_devices)]
    pub devices: Option<u32>,
    /// How the simulated devices reach host memory (`--backend mock` only; default none).
    #[arg(long, value_enum, value_name = "ACCESS")]
    pub simulate_host_access: Option<crate::backend::SimulatedHostAccess>,
    /// What linear memories are made of: `managed`, `guarded_pageable` or `guarded_registered`
    /// (default: what the device reports, see docs/SAFETY.md).
    #[arg(long, value_name = "BACKING")]
    pub backing: Option<tensor_wasm_mem_wasmtime::Backing>,
    /// Kernels guests may launch (`twm.kernel`, `twm.launch`): `builtin`, the simulated
    /// device's `fill`, `increment`, `saxpy` and `poke` (`--backend mock` only; see the kernels
    /// module of tensor-wasm-mem-wasmtime). `poke(buf, index, value)` asserts `index` is in the
    /// buffer on the device: an index past it faults the tenant's context, as a tenant's data
    /// can make a trusted kernel fault on a GPU; the device then recovers when the run's Store
    /// goes (docs/RELIABILITY.md). None by default.
    #[arg(long, value_name = "SET", value_parser = ["builtin"])]
    pub kernels: Option<String>,
    /// The largest module file to read (default 64MiB, at most 1GiB). Memory use while reading
    /// and compiling grows with it: compilation is bounded in time by --timeout, not in memory.
    #[arg(long, value_name = "BYTES", value_parser = parse_module_size)]
    pub max_module_size: Option<u64>,
    /// Print one JSON object instead of plain results: `runs` has each run's results (`null`
    /// for a run whose guest exited with status 0 before its call returned), up to 262144
    /// values over all runs (`runs_omitted` counts the runs past them).
    #[arg(long)]
    pub json: bool,
    /// An environment variable for a WASI guest (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Preopen a host directory for a WASI guest, at GUEST (default: the same path); the guest
    /// may read, create, change and delete files in it. Repeatable; no other preopen may lie
    /// inside it (the guest could replace it with a link).
    #[arg(long = "dir", value_name = "HOST[::GUEST]")]
    pub dirs: Vec<String>,
    /// Preopen a host directory read-only: the guest may read it, never change it. Repeatable.
    #[arg(long = "dir-ro", value_name = "HOST[::GUEST]")]
    pub dirs_ro: Vec<String>,
    /// Arguments for a WASI guest's `argv` (after `--`; `argv[0]` is the module's file name).
    #[arg(last = true, value_name = "GUEST_ARGS")]
    pub guest_args: Vec<String>,
}

/// What a WASI guest gets: arguments, environment and preopened directories (stdio is
/// inherited). Checked once, before anything runs; each Store gets a context built from it.
#[derive(Debug)]
struct WasiSetup {
    argv: Vec<String>,
    env: Vec<(String, String)>,
    dirs: Vec<Preopen>,
    limits: WasiLimits,
    /// The most random bytes one `random_get` may ask for (WASI allocates them before it looks
    /// at the guest's buffer): no more than a memory may hold (`--memory-limit`).
    max_random: u64,
}

impl WasiSetup {
    fn parse(args: &RunArgs) -> Result<Self, Failure> {
        let mut argv = vec![args.file.display().to_string()];
        argv.extend(args.guest_args.iter().cloned());
        let mut env: Vec<(String, String)> = Vec::new();
        for kv in &args.env {
            let Some((k, v)) = kv.split_once('=').filter(|(k, _)| !k.is_empty()) else {
                return Err(Failure::Usage(format!(
                    "--env {kv:?}: expected NAME=VALUE with a non-empty NAME"
                )));
            };
            // A name given again replaces the earlier value, as in a shell.
            env.retain(|(name, _)| name != k);
            env.push((k.to_owned(), v.to_owned()));
        }
        let writable = args.dirs.iter().map(|d| ("--dir", d, FsPerms::ReadWrite));
        let read_only = args
            .dirs_ro
            .iter()
            .map(|d| ("--dir-ro", d, FsPerms::ReadOnly));
        let dirs: Vec<Preopen> = writable
            .chain(read_only)
            .map(|(flag, spec, perms)| {
                let (host, guest) = spec.split_once("::").unwrap_or((spec, spec));
                if host.is_empty() || guest.is_empty() {
                    return Err(Failure::Usage(format!(
                        "{flag} {spec:?}: expected HOST or HOST::GUEST"
                    )));
                }
                Preopen::open(host, guest, perms)
                    .map_err(|e| Failure::Usage(format!("{flag} {spec:?}: {e}")))
            })
            .collect::<Result<_, _>>()?;
        refuse_nested_in_writable(&dirs)?;
        let limits = wasi_limits(args, descriptor_room())?;
        // Each preopen is a host descriptor and an entry of the table from the start, beside
        // stdio's three: the limit must hold them, or they alone would pass it.
        let needed = dirs.len() + 3;
        if !dirs.is_empty() && (limits.open_files() as usize) < needed {
            return Err(Failure::Usage(format!(
                "{} preopened director{} and stdio need {needed} WASI descriptors; the guest may \
                 hold {} (--wasi-max-fds, --wasi-max-resources, and ulimit -n less the \
                 descriptors open and {KEPT_DESCRIPTORS} twm keeps)",
                dirs.len(),
                if dirs.len() == 1 { "y" } else { "ies" },
                limits.open_files()
            )));
        }
        Ok(Self {
            argv,
            env,
            dirs,
            limits,
            max_random: args.memory_limit,
        })
    }

    /// A fresh WASI context for one Store. With `own_stdout` (`--json` or `--metrics`), the
    /// guest's stdout goes to stderr, so that twm's stdout is its own (the one JSON object, or
    /// the results and the metrics page) and nothing a guest prints can forge it.
    fn context(&self, own_stdout: bool) -> Result<LimitedWasi, Failure> {
        let mut builder = WasiCtxBuilder::new();
        builder
            .inherit_stdio()
            .args(&self.argv)
            .max_random_size(self.max_random.min(DEFAULT_MAX_RANDOM));
        if own_stdout {
            builder.stdout(wasmtime_wasi_stderr());
        }
        for (k, v) in &self.env {
            builder.env(k, v);
        }
        for dir in &self.dirs {
            builder
                .preopened_dir(&dir.open_as, &dir.guest, dir.perms)
                .map_err(|e| {
                    Failure::Other(format!(
                        "cannot open the preopen {} again: {e:#}",
                        dir.resolved.display()
                    ))
                })?;
        }
        Ok(LimitedWasi {
            ctx: builder.build_p1(),
            limits: self.limits,
        })
    }
}

/// A preopened directory, opened once when twm starts and held open: Wasmtime-wasi opens a
/// preopen's host path again (following links) each time a WASI context is made, so each run
/// of a `--repeat` is handed this descriptor's directory (`/proc/self/fd/N`, which names the
/// open directory whatever its path names now), never whatever a guest of an earlier run put
/// at its path: a link to `/` in its place (a red team was handed the host's root so), or the
/// same trick through a second name of a writable directory (a bind mount, a case-folding file
/// system).
#[derive(Debug)]
struct Preopen {
    /// The path as resolved at start (messages, and the nesting check).
    resolved: PathBuf,
    /// What Wasmtime-wasi is given to open: the held directory itself where the system names
    /// open descriptors (`/proc/self/fd/N`), or else `resolved`.
    open_as: PathBuf,
    /// The directory, open (for as long as `open_as` names it).
    _held: std::fs::File,
    guest: String,
    perms: FsPerms,
}

impl Preopen {
    fn open(host: &str, guest: &str, perms: FsPerms) -> Result<Self, String> {
        let resolved = std::fs::canonicalize(host).map_err(|e| format!("{host}: {e}"))?;
        let held = std::fs::File::open(&resolved).map_err(|e| format!("{host}: {e}"))?;
        if !held.metadata().is_ok_and(|m| m.is_dir()) {
            return Err(format!("{host} is not a directory"));
        }
        use std::os::fd::AsRawFd;
        let by_descriptor = PathBuf::from(format!("/proc/self/fd/{}", held.as_raw_fd()));
        let open_as = if by_descriptor.is_dir() {
            by_descriptor
        } else {
            resolved.clone()
        };
        Ok(Self {
            resolved,
            open_as,
            _held: held,
            guest: guest.to_owned(),
            perms,
        })
    }
}

/// Refuses a preopen (resolved) that lies inside a writable one, where a guest could rename it
/// or put a link on its way: what the operator named would no longer be what the guest is
/// given. (Each run is handed the directory held open since the start, [`Preopen`]; this keeps
/// the paths honest as well, and covers systems without `/proc`.) The same directory twice is
/// allowed (a guest cannot replace the root of a preopen), and so is anything inside a
/// read-only one.
fn refuse_nested_in_writable(dirs: &[Preopen]) -> Result<(), Failure> {
    for inner in dirs {
        let outer = dirs.iter().find(|outer| {
            matches!(outer.perms, FsPerms::ReadWrite)
                && inner.resolved != outer.resolved
                && inner.resolved.starts_with(&outer.resolved)
        });
        if let Some(outer) = outer {
            return Err(Failure::Usage(format!(
                "the preopen {} (guest {}) lies inside the writable preopen {}: a guest \
                 could replace it with a link to anywhere on the host; preopen only the outer \
                 directory, or the inner one alone",
                inner.resolved.display(),
                inner.guest,
                outer.resolved.display()
            )));
        }
    }
    Ok(())
}

fn parse_isolation(text: &str) -> Result<IsolationLevel, String> {
    text.parse().map_err(|_| {
        format!("unknown isolation level {text:?} (shared, stream_isolated, context_isolated)")
    })
}

/// How a `twm` command failed; each maps to an exit status.
#[derive(Debug)]
pub enum Failure {
    /// Exit 2: the command line is wrong.
    Usage(String),
    /// Exit 3: the guest trapped, or a host call it made failed its call.
    Trap(String),
    /// Exit 4: the layer refused it (a budget, a limit, the pool, a device out of memory or
    /// fenced).
    Refused(String),
    /// Exit 1: anything else.
    Other(String),
    /// Exit 124: a run passed its `--timeout`.
    Timeout(String),
    /// A WASI guest called `proc_exit` with this status: `twm run` exits with it.
    Exit(i32),
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Other(_) => 1,
            Self::Usage(_) => 2,
            Self::Trap(_) => 3,
            Self::Refused(_) => 4,
            Self::Timeout(_) => TIMEOUT_EXIT,
            // WASI preview 1 passes statuses 0..=125 (it refuses larger ones, an error: 1).
            Self::Exit(code) => u8::try_from(*code).unwrap_or(1),
        }
    }

    /// What `twm` prints to stderr (nothing for a guest's own exit status), [`clip`]ped: a
    /// message may carry what a module named (a function in a trap's backtrace, an import),
    /// which must not reach the terminal raw, forge a line of twm's own, or be megabytes long.
    pub fn message(&self) -> String {
        match self {
            Self::Usage(m)
            | Self::Trap(m)
            | Self::Refused(m)
            | Self::Other(m)
            | Self::Timeout(m) => clip(m),
            Self::Exit(_) => String::new(),
        }
    }

    /// The failure for an error that ended an instantiation (its imports resolved already, so
    /// no link error): what the layer refused (a budget, the pool, the device: 4), a memory or
    /// table the module declares that this host cannot make (shared, custom page sizes: 1), or
    /// what ended its start function, as for any guest call ([`of_call`](Self::of_call)): the
    /// same failure in `(start)` as in `_start`.
    fn of_instantiation(error: &wasmtime::Error) -> Self {
        use tensor_wasm_mem_wasmtime::core::ErrorKind;
        match error.downcast_ref::<TwmError>() {
            // A `twm` call of its start function found its device lost: as in any call.
            Some(twm @ TwmError::DeviceLost { .. }) => {
                Self::Trap(format!("trapped during instantiation: {twm}"))
            }
            Some(twm)
                if twm.is_denial()
                    || matches!(
                        twm.kind(),
                        ErrorKind::OutOfMemory
                            | ErrorKind::ContextLost
                            | ErrorKind::Driver
                            | ErrorKind::NoDevice
                            | ErrorKind::DriverUnavailable
                    ) =>
            {
                Self::Refused(format!("instantiation refused: {twm}"))
            }
            Some(twm) => Self::Other(format!("cannot instantiate: {twm}")),
            None => match Self::of_call("instantiation", error) {
                Self::Trap(_) => Self::Trap(format!("trapped during instantiation: {error:#}")),
                other => other,
            },
        }
    }

    /// The failure for an error that ended a guest call: its `proc_exit` status, a trap, or
    /// anything else.
    fn of_call(what: &str, error: &wasmtime::Error) -> Self {
        if let Some(code) = tensor_wasm_mem_wasmtime::wasi::exit_code(error) {
            Self::Exit(code)
        } else if is_timeout(error) {
            Self::Timeout(format!("{what} timed out (--timeout)"))
        } else if is_out_of_fuel(error) {
            Self::Trap(format!("{what} ran out of fuel (--fuel)"))
        } else if error
            .downcast_ref::<tensor_wasm_mem_wasmtime::wasmtime::component::ResourceTableError>()
            .is_some()
        {
            Self::Trap(format!(
                "{what} trapped: its WASI resource table is full (--wasi-max-resources): {error:#}"
            ))
        } else if let Some(denied) = error.downcast_ref::<TwmError>().filter(|e| e.is_denial()) {
            Self::Refused(format!("{what} refused: {denied}"))
        } else if is_trap(error) {
            Self::Trap(format!("{what} trapped: {error:#}"))
        } else {
            // A host call (WASI's, or the layer's) failed the guest's call: for the guest that
            // is a trap, whatever the host's reason (a pointer out of its memory, a device lost
            // to a kernel fault).
            Self::Trap(format!("{what} trapped in a host call: {error:#}"))
        }
    }
}

/// Writes one line to stdout; a stdout that cannot be written to (a closed pipe, a full disk)
/// is a failure with a message, never a panic.
pub(crate) fn out(line: &str) -> Result<(), Failure> {
    writeln!(std::io::stdout().lock(), "{line}")
        .map_err(|e| Failure::Other(format!("cannot write to stdout: {e}")))
}

/// The host's stderr as a WASI output stream.
fn wasmtime_wasi_stderr() -> tensor_wasm_mem_wasmtime::wasi::wasmtime_wasi::cli::Stderr {
    tensor_wasm_mem_wasmtime::wasi::wasmtime_wasi::cli::stderr()
}

fn is_trap(error: &wasmtime::Error) -> bool {
    error.downcast_ref::<Trap>().is_some()
}

fn parse_arg(text: &str, ty: &ValType) -> Result<Val, Failure> {
    // The command line marks negative numbers (see `main`): read the mark back as a minus.
    let text = &text.replace(crate::NEGATIVE, "-");
    let bad = || Failure::Usage(format!("argument {text:?} is not a valid {ty}"));
    let int = |t: &str| -> Option<i128> {
        let (neg, digits) = t.strip_prefix('-').map_or((false, t), |d| (true, d));
        let v = match digits.strip_prefix("0x") {
            // `from_str_radix` takes a sign: `0x-5` is no number.
            Some(hex) if hex.starts_with(['+', '-']) => return None,
            Some(hex) => i128::from_str_radix(hex, 16).ok()?,
            None => digits.parse::<i128>().ok()?,
        };
        Some(if neg { -v } else { v })
    };
    Ok(match ty {
        // Integers accept the signed and the unsigned range (as Wasm does).
        ValType::I32 => {
            let v = int(text).ok_or_else(bad)?;
            if !(i128::from(i32::MIN)..=i128::from(u32::MAX)).contains(&v) {
                return Err(bad());
            }
            Val::I32(v as i32)
        }
        ValType::I64 => {
            let v = int(text).ok_or_else(bad)?;
            if !(i128::from(i64::MIN)..=i128::from(u64::MAX)).contains(&v) {
                return Err(bad());
            }
            Val::I64(v as i64)
        }
        ValType::F32 => Val::F32(text.parse::<f32>().map_err(|_| bad())?.to_bits()),
        ValType::F64 => Val::F64(text.parse::<f64>().map_err(|_| bad())?.to_bits()),
        other => {
            return Err(Failure::Usage(format!(
                "parameters of type {other} cannot be given on the command line"
            )));
        }
    })
}

fn show(val: &Val) -> (String, Value) {
    match val {
        Val::I32(v) => (v.to_string(), json!(v)),
        Val::I64(v) => (v.to_string(), json!(v)),
        Val::F32(bits) => float(
            f64::from(f32::from_bits(*bits)),
            f32::from_bits(*bits).to_string(),
        ),
        Val::F64(bits) => float(f64::from_bits(*bits), f64::from_bits(*bits).to_string()),
        Val::V128(v) => {
            let s = format!("{:#034x}", v.as_u128());
            (s.clone(), json!(s))
        }
        // A reference is named by its type, never by the host address it holds.
        Val::FuncRef(r) => reference("funcref", r.is_some()),
        Val::ExternRef(r) => reference("externref", r.is_some()),
        Val::AnyRef(r) => reference("anyref", r.is_some()),
        Val::ExnRef(r) => reference("exnref", r.is_some()),
        _ => reference("ref", true),
    }
}

/// A float result: its text, and in JSON a number, or its text where JSON has no number for it
/// (NaN and the infinities).
fn float(value: f64, text: String) -> (String, Value) {
    let json = if value.is_finite() {
        json!(value)
    } else {
        json!(text)
    };
    (text, json)
}

/// A reference result of type `ty`: `null`, or the type's name.
fn reference(ty: &str, non_null: bool) -> (String, Value) {
    if non_null {
        (ty.to_string(), json!(ty))
    } else {
        ("null".to_string(), Value::Null)
    }
}

/// Reads the module file, at most [`MAX_MODULE_BYTES`] of it.
fn read_module(path: &std::path::Path, most: u64) -> Result<Vec<u8>, Failure> {
    let cannot = |e: std::io::Error| Failure::Other(format!("cannot read {}: {e}", path.display()));
    let too_large = || {
        Failure::Usage(format!(
            "{}: larger than {most} bytes, the most a module may be (--max-module-size)",
            path.display()
        ))
    };
    let file = std::fs::File::open(path).map_err(cannot)?;
    // A regular file says its size: refused before a byte is read.
    if file.metadata().is_ok_and(|m| m.is_file() && m.len() > most) {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    file.take(most + 1)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    if bytes.len() as u64 > most {
        return Err(too_large());
    }
    Ok(bytes)
}

fn parse_module_size(text: &str) -> Result<u64, String> {
    let bytes = crate::bytes::parse_bytes(text)?;
    if (1..=MAX_MODULE_BYTES_LIMIT).contains(&bytes) {
        Ok(bytes)
    } else {
        Err(format!("{text:?} is out of range (1 byte to 1GiB)"))
    }
}

/// `message` cut to [`MAX_MESSAGE_CHARS`] characters, its control characters, line separators and
/// bidirectional controls shown as `?` ([`shown_as_unknown`]) and every line after the first
/// indented.
pub fn clip(message: &str) -> String {
    let mut clipped = String::with_capacity(message.len().min(MAX_MESSAGE_CHARS + 16));
    let mut chars = message.chars().peekable();
    let mut taken = 0;
    while let Some(c) = chars.next() {
        if taken == MAX_MESSAGE_CHARS {
            clipped.push_str("... (cut)");
            break;
        }
        taken += 1;
        match c {
            // Every line after the first starts indented: no line of a message can pass for
            // one of twm's own (`twm: ...`). One already indented stays as it is (so a message
            // clipped twice reads as once).
            '\n' => {
                clipped.push('\n');
                if chars.peek().is_none_or(|&next| next != ' ') {
                    clipped.push_str("  ");
                }
            }
            c if shown_as_unknown(c) => clipped.push('?'),
            c => clipped.push(c),
        }
    }
    clipped
}

/// A character a message shows as `?`: a control character, a line or paragraph separator
/// (which log tools and editors break lines at), or a bidirectional control (which reorders
/// what a viewer shows).
fn shown_as_unknown(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{061c}'
        )
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// The process's descriptor limit (its soft `ulimit -n`) and the descriptors it has open now
/// below it (inherited ones included), if known.
fn descriptor_room() -> Option<DescriptorRoom> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let limit = line.split_whitespace().nth(3)?.parse().ok()?;
    let open = std::fs::read_dir("/proc/self/fd")
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok());
    // Less the one reading the folder: the kernel numbered it below the limit.
    let room = DescriptorRoom::among(limit, open);
    Some(DescriptorRoom {
        open: room.open.saturating_sub(1),
        ..room
    })
}

/// How many more descriptors the process may open.
#[derive(Clone, Copy, Debug)]
struct DescriptorRoom {
    /// Its soft limit.
    limit: u64,
    /// Open now.
    open: u64,
}

impl DescriptorRoom {
    /// The room under `limit` with the descriptors numbered `open` open. Only those numbered
    /// below the limit take room: the kernel hands out numbers below it, and a descriptor
    /// inherited above it (from a parent with a higher limit) leaves every number below free.
    fn among(limit: u64, open: impl Iterator<Item = u64>) -> Self {
        let below = open.filter(|&fd| fd < limit).count() as u64;
        Self { limit, open: below }
    }

    /// What a guest may have: the limit less what is open and [`KEPT_DESCRIPTORS`].
    fn for_guests(self) -> u64 {
        self.limit
            .saturating_sub(self.open)
            .saturating_sub(KEPT_DESCRIPTORS)
    }
}

/// Descriptors `twm` keeps for itself out of the process's limit: a guest never gets them.
const KEPT_DESCRIPTORS: u64 = 64;

/// The WASI limits `args` ask for, given the process's descriptors (`ulimit -n` and those open,
/// if known). An explicit `--wasi-max-fds` the process cannot give while keeping
/// [`KEPT_DESCRIPTORS`], or that passes `--wasi-max-resources` (the table whose entries hold the
/// descriptors), is a usage error; the default is lowered to fit the room and half the table.
fn wasi_limits(args: &RunArgs, process: Option<DescriptorRoom>) -> Result<WasiLimits, Failure> {
    let defaults = WasiLimits::DEFAULT;
    let resources = args.wasi_max_resources.unwrap_or(defaults.resources);
    let room = process.map(DescriptorRoom::for_guests);
    let descriptors = match args.wasi_max_fds {
        Some(asked) => {
            if let (Some(room), Some(process)) = (room, process)
                && u64::from(asked) > room
            {
                return Err(Failure::Usage(format!(
                    "--wasi-max-fds {asked}: this process may open {} descriptors, has {} open, \
                     and keeps {KEPT_DESCRIPTORS} of its own (raise the limit with ulimit -n, or \
                     ask for fewer)",
                    process.limit, process.open
                )));
            }
            if asked > resources {
                return Err(Failure::Usage(format!(
                    "--wasi-max-fds {asked} is more than --wasi-max-resources {resources}: the \
                     descriptors are entries of that table (ask for at most {resources})"
                )));
            }
            asked
        }
        None => {
            let room = room.map_or(u32::MAX, |r| u32::try_from(r).unwrap_or(u32::MAX));
            // At most half the table: a guest that holds all its descriptors still has
            // entries for a poll's clocks and its streams.
            defaults.descriptors.min(resources / 2).min(room).max(1)
        }
    };
    Ok(WasiLimits {
        descriptors,
        poll_subscriptions: args.wasi_max_poll.unwrap_or(defaults.poll_subscriptions),
        resources,
    })
}

/// The tenant's budgets from the command line.
fn budgets(args: &RunArgs) -> TenantBudgets {
    let mut budgets = match args.tenant_cap {
        // One memory of the configured limit (a C program's whole capacity, or a pool slot)
        // and its tables always fit the default held budget, and no more than that floor
        // comes with a small cap.
        Some(cap) => TenantBudgets::for_cap_and_limit(cap, args.memory_limit),
        None => TenantBudgets::unlimited(),
    };
    if let Some(held) = args.tenant_held {
        budgets.held_bytes = held;
    }
    if let Some(memories) = args.tenant_memories {
        budgets.memories = memories;
    }
    budgets
}

/// The creator `args` ask for: limits, device, backing, pool, interruption.
fn creator<B: BuiltinKernels>(
    backend: Arc<B>,
    args: &RunArgs,
) -> Result<TensorWasmMemoryCreator<B>, Failure> {
    let limits = PlanLimits::new(args.memory_limit)
        .and_then(|l| l.with_default_maximum(args.memory_limit))
        .map_err(|e| Failure::Usage(e.to_string()))?;
    let count = backend.device_count();
    if args.device >= count {
        return Err(Failure::Usage(format!(
            "--device {}: the {} backend has {count} device(s) (0 to {})",
            args.device,
            args.backend,
            count.saturating_sub(1)
        )));
    }
    let mut builder = TensorWasmMemoryCreator::builder(backend)
        .limits(limits)
        .device(DeviceId(args.device))
        .interruption(Interruption {
            epochs: args.timeout.is_some(),
            fuel: args.fuel.is_some(),
        });
    if let Some(backing) = args.backing {
        builder = builder.backing(backing);
    }
    // A device fenced by a kernel fault recovers when the run's Store goes, where that needs
    // no one's word (the simulated machine, whose kernels load again after a reset), so a
    // --repeat after a fault is served again and the figures go back to zero.
    builder = B::recover_automatically(builder);
    if args.kernels.is_some() {
        let registry = B::builtin_kernels().ok_or_else(|| {
            Failure::Usage(format!(
                "--kernels builtin: the {} backend has no built-in kernels (the simulated \
                 device's are the mock backend's)",
                args.backend
            ))
        })?;
        builder = builder.kernels(registry);
    }
    if let Some(slots) = args.pool {
        let slot_bytes = usize::try_from(limits.per_memory_limit())
            .map_err(|_| Failure::Usage("--memory-limit does not fit this host".into()))?;
        builder = builder.pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(slot_bytes, slots as usize)],
        ));
        if args.scrub_ahead {
            builder = builder.scrub_ahead();
        }
    }
    builder.build().map_err(|e| {
        use tensor_wasm_mem_wasmtime::core::ErrorKind;
        let message = format!("cannot set up memory: {e}");
        match e.kind() {
            // A pool the device cannot hold is refused, as an exhausted budget is (exit 4).
            _ if e.is_denial() => Failure::Refused(message),
            ErrorKind::OutOfMemory => Failure::Refused(message),
            // What the flags ask for and this device cannot do (a backing it lacks): the
            // command line's (exit 2).
            ErrorKind::Unsupported | ErrorKind::InvalidArgument => Failure::Usage(message),
            _ => Failure::Other(message),
        }
    })
}

/// What stops a run: its deadline (the engine's epoch ticker and the process's watchdog) and
/// its fuel.
struct RunLimits {
    timeout: Option<Duration>,
    /// Started first: it bounds reading the module, compiling it and writing results too.
    watchdog: Option<Watchdog>,
    /// Started once the engine exists ([`ticking`](Self::ticking)).
    ticker: Option<EpochTicker>,
    fuel: Option<u64>,
}

impl RunLimits {
    /// The limits `args` ask for; the watchdog starts now, the epoch ticker with the engine.
    fn start(args: &RunArgs) -> Result<Self, Failure> {
        let watchdog = match args.timeout {
            None => None,
            Some(timeout) => {
                let (json, file, backend) = (
                    args.json,
                    args.file.display().to_string(),
                    args.backend.name(),
                );
                let watchdog = Watchdog::start(move |_| {
                    let message = format!(
                        "timed out after {timeout:?} (in a host call, in one long guest \
                         instruction such as a memory.fill or memory.copy over a large range, \
                         reading the module, compiling it or writing results, which cannot be \
                         interrupted: the process ends)"
                    );
                    // One JSON object: none if the report is already out.
                    if json && !REPORTED.swap(true, Ordering::AcqRel) {
                        let mut report = early_report(&file, backend, TIMEOUT_EXIT, &message);
                        let completed = completed();
                        report["runs"] = Value::Array(completed.runs.clone());
                        report["runs_omitted"] = json!(completed.omitted);
                        write_fd(1, &format!("{report}\n"));
                    }
                    write_fd(2, &format!("twm: {message}\n"));
                })
                .map_err(|e| Failure::Other(format!("cannot start the watchdog: {e}")))?;
                Some(watchdog)
            }
        };
        Ok(Self {
            timeout: args.timeout,
            watchdog,
            ticker: None,
            fuel: args.fuel,
        })
    }

    /// Starts the epoch ticker on `engine` (with a timeout).
    fn ticking(&mut self, engine: &wasmtime::Engine) -> Result<(), Failure> {
        if let Some(timeout) = self.timeout {
            self.ticker = Some(
                EpochTicker::start(engine, tick_for(timeout))
                    .map_err(|e| Failure::Other(e.to_string()))?,
            );
        }
        Ok(())
    }

    /// Runs `work`, which nothing can interrupt (reading the module, compiling it, writing
    /// results), with the watchdog armed for the timeout: past it (and a grace), the process
    /// ends with status 124.
    fn bounded<R>(&self, work: impl FnOnce() -> R) -> R {
        let (Some(watchdog), Some(timeout)) = (&self.watchdog, self.timeout) else {
            return work();
        };
        watchdog.arm(timeout + self.grace());
        let result = work();
        watchdog.disarm();
        result
    }

    /// How long past the deadline the watchdog waits for the epoch check to end a run first.
    fn grace(&self) -> Duration {
        self.ticker
            .as_ref()
            .map_or(Duration::ZERO, |t| t.tick() * 2)
            + crate::watchdog::GRACE
    }

    /// Runs `guest` on `store` within the deadline and the fuel. A run that took longer than
    /// the timeout is a timeout, even one that ended in a host call before the watchdog fired.
    fn within<T: 'static, R>(
        &self,
        store: &mut Store<T>,
        guest: impl FnOnce(&mut Store<T>) -> Result<R, Failure>,
    ) -> Result<R, Failure> {
        let started = std::time::Instant::now();
        let timed = |store: &mut Store<T>| match (&self.ticker, self.timeout) {
            (Some(ticker), Some(timeout)) => {
                self.bounded(|| ticker.call_within(store, timeout, |store| Ok(guest(store))))
            }
            _ => Ok(guest(store)),
        };
        let result = match self.fuel {
            Some(fuel) => call_with_fuel(store, fuel, timed),
            None => timed(store),
        }
        .map_err(|e| Failure::Other(format!("{e:#}")))?;
        match self.timeout {
            Some(timeout)
                if started.elapsed() > timeout && !matches!(result, Err(Failure::Timeout(_))) =>
            {
                Err(Failure::Timeout(format!(
                    "the run timed out (--timeout {timeout:?}): it ended in a host call after its \
                     deadline"
                )))
            }
            _ => result,
        }
    }
}

/// The JSON object of a run that failed before its report: what `--json` prints instead.
pub fn early_report(file: &str, backend: &str, exit_code: u8, message: &str) -> Value {
    json!({
        "file": file,
        "backend": backend,
        "runs": [],
        "runs_omitted": 0,
        "error": {"exit_code": exit_code, "message": message, "guest_exit": false},
        "tenant": null,
        "creator": null,
        "metrics": null,
    })
}

/// Runs `args` on `backend`; prints results to stdout (and stats to stderr).
pub fn run<B: BuiltinKernels>(backend: Arc<B>, args: &RunArgs) -> Result<(), Failure> {
    // Every usage check before the module is read or compiled.
    let wasi = WasiSetup::parse(args)?;
    let mut limits = RunLimits::start(args)?;
    // Reading (a FIFO, a slow disk) and compiling cannot be interrupted: the watchdog bounds
    // them by the same timeout.
    let bytes = limits
        .bounded(|| read_module(&args.file, args.max_module_size.unwrap_or(MAX_MODULE_BYTES)))?;
    let creator = creator(backend, args)?;
    let engine = creator
        .engine()
        .map_err(|e| Failure::Other(format!("cannot build the engine: {e:#}")))?;
    limits.ticking(&engine)?;
    let module = limits
        .bounded(|| Module::new(&engine, &bytes))
        .map_err(|e| {
            Failure::Other(format!(
                "{}: {}",
                args.file.display(),
                clip(&format!("{e:#}"))
            ))
        })?;
    drop(bytes);
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).map_err(|e| Failure::Other(format!("{e:#}")))?;
    // Only for a guest that imports WASI: its runtime (threads, descriptors) is started here.
    if imports_wasi(&module) {
        // A runtime that cannot start panics inside Wasmtime-wasi, caught and returned as an
        // error: its panic message would read as twm's own crash, so none is printed.
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let added = add_wasi_to_linker(&mut linker);
        std::panic::set_hook(hook);
        added.map_err(|e| Failure::Other(format!("{e:#}")))?;
    }
    // The command line checked against the module before any guest code runs (a start
    // function's included): a wrong --invoke is a usage error (2), never a run.
    check_invoke(&module, args)?;
    // Its imports resolved once, before any run: a module that does not fit this host (an
    // unknown or wrongly typed import) is not a refusal a retry could pass (1).
    linker
        .instantiate_pre(&module)
        .map_err(|e| Failure::Other(format!("cannot instantiate: {e:#}")))?;
    let tenant = Tenant::with_devices(
        1,
        "cli",
        budgets(args),
        args.isolation,
        &[DeviceId(args.device)],
    )
    .map_err(|e| Failure::Other(e.to_string()))?;
    let setup = RunSetup {
        linker: &linker,
        module: &module,
        creator: &creator,
        tenant: &tenant,
        wasi: &wasi,
        limits: &limits,
    };
    let mut outcome = Ok(());
    for _ in 0..args.repeat {
        match run_once(&engine, &setup, args) {
            Ok(results) => {
                if !args.json {
                    // A stdout nobody reads blocks: bounded by the timeout too.
                    limits.bounded(|| results.iter().try_for_each(|(text, _)| out(text)))?;
                }
                // Kept only for the JSON report (a million plain runs keep nothing).
                if args.json {
                    let run = Value::Array(results.into_iter().map(|(_, v)| v).collect());
                    completed().keep(run);
                }
            }
            // A guest that ends with status 0 ran to completion (its call, if one was asked,
            // returned nothing: `null` in the JSON, where a call that returned no results is
            // `[]`).
            Err(Failure::Exit(0)) => {
                if args.json {
                    completed().keep(Value::Null);
                }
            }
            Err(failure) => {
                outcome = Err(failure);
                break;
            }
        }
    }
    // Copied, not taken: should writing the report block (a guest filled the stderr pipe the
    // stats go to), the watchdog's report still has every completed run.
    let (runs, omitted) = {
        let completed = completed();
        (completed.runs.clone(), completed.omitted)
    };
    limits.bounded(|| report(args, &tenant, &creator, (runs, omitted), outcome))
}

/// Prints what the runs left: the stats (stderr), the metrics and the JSON report.
fn report<B: Backend>(
    args: &RunArgs,
    tenant: &Tenant,
    creator: &TensorWasmMemoryCreator<B>,
    (runs, omitted): (Vec<Value>, u64),
    outcome: Result<(), Failure>,
) -> Result<(), Failure> {
    if args.stats {
        // Stats are a courtesy: a stderr that cannot be written to does not fail the run.
        let _ = write!(
            std::io::stderr(),
            "{}",
            stats_table(&[tenant.stats()], creator)
        );
    }
    let metrics = args.metrics.then(|| prometheus_text(tenant, creator));
    if let Some(text) = metrics.as_ref().filter(|_| !args.json) {
        out(text.trim_end())?;
    }
    if args.json {
        let error = outcome.as_ref().err().map(|f| {
            json!({
                "exit_code": f.exit_code(),
                "message": f.message(),
                // The guest's own `proc_exit` status, not one of twm's.
                "guest_exit": matches!(f, Failure::Exit(_)),
            })
        });
        let report = json!({
            "file": args.file.display().to_string(),
            "backend": args.backend.name(),
            "runs": runs,
            "runs_omitted": omitted,
            "error": error,
            "tenant": tenant_json(&tenant.stats()),
            "creator": creator_json(&creator.stats()),
            "metrics": metrics,
        });
        // One JSON object: none if the watchdog's is already out (it then ends the process).
        if !REPORTED.swap(true, Ordering::AcqRel) {
            out(&report.to_string())?;
        }
    }
    outcome
}

/// The tenant's and the creator's figures, published through the `metrics` facade to a
/// Prometheus recorder of this call's own (no global recorder is installed), rendered as text.
fn prometheus_text<B: Backend>(tenant: &Tenant, creator: &TensorWasmMemoryCreator<B>) -> String {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        tensor_wasm_mem_wasmtime::metrics::describe();
        tensor_wasm_mem_wasmtime::metrics::record_tenant(tenant);
        tensor_wasm_mem_wasmtime::metrics::record_creator(creator);
    });
    handle.render()
}

/// The exported function `name` of type `[] -> []` (`_start`, `_initialize`), if exported; an
/// export of that name of another kind or type is an error, never silently skipped.
fn nullary<T>(
    store: &mut wasmtime::Store<T>,
    instance: &wasmtime::Instance,
    name: &str,
) -> Result<Option<wasmtime::TypedFunc<(), ()>>, Failure> {
    let Some(export) = instance.get_export(&mut *store, name) else {
        return Ok(None);
    };
    export
        .into_func()
        .and_then(|f| f.typed::<(), ()>(&*store).ok())
        .map(Some)
        .ok_or_else(|| {
            // The module does not fit what it claims to be (as a link error): not a refusal.
            Failure::Other(format!(
                "the module exports {name:?}, but not as a function of type [] -> []"
            ))
        })
}

/// `--invoke`'s function and arguments against the module's export, before anything runs.
fn check_invoke(module: &Module, args: &RunArgs) -> Result<(), Failure> {
    let Some(name) = &args.invoke else {
        return Ok(());
    };
    let Some(wasmtime::ExternType::Func(ty)) = module.get_export(name) else {
        return Err(Failure::Usage(format!(
            "the module exports no function named {name:?}"
        )));
    };
    invoke_args(name, ty.params(), &args.args).map(drop)
}

/// `--invoke`'s arguments as the values of a function `name` with `params`; a usage error for
/// a wrong count or a value that is not of its parameter's type.
fn invoke_args(
    name: &str,
    params: impl ExactSizeIterator<Item = ValType>,
    args: &[String],
) -> Result<Vec<Val>, Failure> {
    if params.len() != args.len() {
        return Err(Failure::Usage(format!(
            "{name} takes {} argument(s), {} given",
            params.len(),
            args.len()
        )));
    }
    args.iter()
        .zip(params)
        .map(|(a, t)| parse_arg(a, &t))
        .collect()
}

/// What every run of one `twm run` shares.
struct RunSetup<'a, B: Backend> {
    linker: &'a Linker<TenantStore<B, Option<LimitedWasi>>>,
    module: &'a Module,
    creator: &'a TensorWasmMemoryCreator<B>,
    tenant: &'a Arc<Tenant>,
    wasi: &'a WasiSetup,
    limits: &'a RunLimits,
}

fn run_once<B: Backend>(
    engine: &wasmtime::Engine,
    setup: &RunSetup<'_, B>,
    args: &RunArgs,
) -> Result<Vec<(String, Value)>, Failure> {
    // WASI state is made for guests that import WASI; others pay nothing for it.
    let wasi = if imports_wasi(setup.module) {
        Some(setup.wasi.context(args.json || args.metrics)?)
    } else {
        None
    };
    let mut store = new_store(
        engine,
        TenantStore::new(setup.creator, setup.tenant, ChargeMode::Touched, wasi),
    );
    setup
        .limits
        .within(&mut store, |store| guest_calls(store, setup, args))
}

/// Instantiates the module in `store` and makes the calls `args` ask for.
fn guest_calls<B: Backend>(
    mut store: &mut Store<TenantStore<B, Option<LimitedWasi>>>,
    setup: &RunSetup<'_, B>,
    args: &RunArgs,
) -> Result<Vec<(String, Value)>, Failure> {
    let instance = instantiate(&mut store, setup.linker, setup.module)
        .map_err(|e| Failure::of_instantiation(&e))?;
    // A reactor module (`-mexec-model=reactor`) is initialised before anything is called, as
    // `wasmtime run` does.
    if let Some(init) = nullary(store, &instance, "_initialize")? {
        init.call(&mut store, ())
            .map_err(|e| Failure::of_call("_initialize", &e))?;
    }
    let Some(name) = &args.invoke else {
        // A command module (clang, wasm32-wasip1) runs its `_start`; anything else was only
        // to be instantiated.
        return match nullary(store, &instance, "_start")? {
            Some(start) => start
                .call(&mut store, ())
                .map(|()| Vec::new())
                .map_err(|e| Failure::of_call("_start", &e)),
            None => Ok(Vec::new()),
        };
    };
    let func = instance
        .get_func(&mut store, name)
        .ok_or_else(|| Failure::Usage(format!("the module exports no function named {name:?}")))?;
    let ty = func.ty(&store);
    let values = invoke_args(name, ty.params(), &args.args)?;
    let mut results = vec![Val::I32(0); ty.results().len()];
    func.call(&mut store, &values, &mut results)
        .map_err(|e| Failure::of_call(name, &e))?;
    Ok(results.iter().map(show).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only descriptors numbered below the limit take room: one inherited above it leaves
    /// every number below free.
    #[test]
    fn descriptors_above_the_limit_take_no_room() {
        let room = DescriptorRoom::among(1024, [0, 1, 2, 5000, 70_000].into_iter());
        assert_eq!((room.limit, room.open), (1024, 3));
        assert_eq!(room.for_guests(), 1024 - 3 - KEPT_DESCRIPTORS);
        let full = DescriptorRoom::among(64, 0..100);
        assert_eq!((full.open, full.for_guests()), (64, 0));
    }

    /// A preopen is the directory twm opened at start, whatever its path names later: a
    /// directory put in its place (through a second name of a writable preopen, a bind mount
    /// say, a guest could put a link to `/` there) is not what the next run is handed.
    #[test]
    fn a_preopen_is_the_directory_opened_at_start() {
        let base = std::env::temp_dir().join(format!("twm-preopen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (dir, elsewhere) = (base.join("dir"), base.join("elsewhere"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::fs::write(dir.join("mark"), "first").unwrap();
        let preopen = Preopen::open(dir.to_str().unwrap(), "/dir", FsPerms::ReadOnly).unwrap();
        // The path now names another directory.
        std::fs::rename(&dir, base.join("moved")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &dir).unwrap();
        let mark = std::fs::read_to_string(preopen.open_as.join("mark"));
        let _ = std::fs::remove_dir_all(&base);
        assert_eq!(mark.unwrap(), "first");
        assert!(
            Preopen::open("/no/such/dir/here", "/x", FsPerms::ReadOnly)
                .unwrap_err()
                .contains("No such file")
        );
    }
}
