//! `twm run`: instantiate a `.wat` / `.wasm` file on managed memory and invoke an export.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};
use tensor_wasm_mem_core::{DeviceId, IsolationLevel, PlanLimits, PoolConfig, SizeClass};
use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module, Trap, Val, ValType};
use tensor_wasm_mem_wasmtime::{
    Backend, ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, TwmError, add_to_linker,
    instantiate, new_store,
};

use crate::backend::BackendKind;
use crate::report::{creator_json, stats_table, tenant_json};

/// `twm run` arguments.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The module: WebAssembly text (`.wat`) or binary (`.wasm`).
    pub file: PathBuf,
    /// The export to call, followed by its arguments.
    #[arg(long, value_name = "NAME")]
    pub invoke: Option<String>,
    /// Arguments for `--invoke` (integers, or floats for f32/f64 parameters).
    #[arg(
        value_name = "ARGS",
        allow_negative_numbers = true,
        requires = "invoke"
    )]
    pub args: Vec<String>,
    /// The backend.
    #[arg(long, value_enum, default_value_t = BackendKind::DEFAULT)]
    pub backend: BackendKind,
    /// The tenant's cap on linear memory (e.g. 64KiB, 16MiB, 1GiB); none by default.
    #[arg(long, value_name = "BYTES", value_parser = crate::bytes::parse_bytes)]
    pub tenant_cap: Option<u64>,
    /// The tenant's isolation level.
    #[arg(long, value_name = "LEVEL", default_value = "stream_isolated", value_parser = parse_isolation)]
    pub isolation: IsolationLevel,
    /// Take memories from a pool of this many slots (each of --memory-limit bytes).
    #[arg(long, value_name = "SLOTS")]
    pub pool: Option<usize>,
    /// The most bytes one linear memory may have (at most 4GiB).
    #[arg(long, value_name = "BYTES", default_value = "256MiB", value_parser = crate::bytes::parse_bytes)]
    pub memory_limit: u64,
    /// Instantiate and invoke this many times, one after another, reusing the pool.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub repeat: u32,
    /// Print the stats table to stderr.
    #[arg(long)]
    pub stats: bool,
    /// Print one JSON object instead of plain results.
    #[arg(long)]
    pub json: bool,
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
    /// Exit 3: the guest trapped.
    Trap(String),
    /// Exit 4: instantiation was refused (a cap, a limit, a link error).
    Refused(String),
    /// Exit 1: anything else.
    Other(String),
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Other(_) => 1,
            Self::Usage(_) => 2,
            Self::Trap(_) => 3,
            Self::Refused(_) => 4,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Self::Usage(m) | Self::Trap(m) | Self::Refused(m) | Self::Other(m) => m,
        }
    }
}

fn is_trap(error: &wasmtime::Error) -> bool {
    error.downcast_ref::<Trap>().is_some()
}

fn parse_arg(text: &str, ty: &ValType) -> Result<Val, Failure> {
    let bad = || Failure::Usage(format!("argument {text:?} is not a valid {ty}"));
    let int = |t: &str| -> Option<i128> {
        let (neg, digits) = t.strip_prefix('-').map_or((false, t), |d| (true, d));
        let v = match digits.strip_prefix("0x") {
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
        Val::F32(bits) => {
            let f = f32::from_bits(*bits);
            (f.to_string(), json!(f))
        }
        Val::F64(bits) => {
            let f = f64::from_bits(*bits);
            (f.to_string(), json!(f))
        }
        Val::V128(v) => {
            let s = format!("{:#034x}", v.as_u128());
            (s.clone(), json!(s))
        }
        other => {
            let s = format!("{other:?}");
            (s.clone(), json!(s))
        }
    }
}

/// Runs `args` on `backend`; prints results to stdout (and stats to stderr).
pub fn run<B: Backend>(backend: Arc<B>, args: &RunArgs) -> Result<(), Failure> {
    let limits = PlanLimits::new(args.memory_limit).map_err(|e| Failure::Usage(e.to_string()))?;
    if args.repeat == 0 {
        return Err(Failure::Usage("--repeat must be at least 1".into()));
    }
    let bytes = std::fs::read(&args.file)
        .map_err(|e| Failure::Other(format!("cannot read {}: {e}", args.file.display())))?;
    let mut builder = TensorWasmMemoryCreator::builder(backend).limits(limits);
    if let Some(slots) = args.pool {
        if slots == 0 {
            return Err(Failure::Usage("--pool needs at least one slot".into()));
        }
        let slot_bytes = usize::try_from(limits.per_memory_limit())
            .map_err(|_| Failure::Usage("--memory-limit does not fit this host".into()))?;
        builder = builder.pool(PoolConfig::new(
            DeviceId(0),
            [SizeClass::new(slot_bytes, slots)],
        ));
    }
    let creator = builder
        .build()
        .map_err(|e| Failure::Other(format!("cannot set up memory: {e}")))?;
    let engine = creator
        .engine()
        .map_err(|e| Failure::Other(format!("cannot build the engine: {e:#}")))?;
    let module = Module::new(&engine, &bytes)
        .map_err(|e| Failure::Other(format!("{}: {e:#}", args.file.display())))?;
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).map_err(|e| Failure::Other(format!("{e:#}")))?;
    let tenant = Tenant::new(
        1,
        "cli",
        args.tenant_cap.unwrap_or(u64::MAX),
        args.isolation,
    );

    let mut runs = Vec::new();
    let mut outcome = Ok(());
    for _ in 0..args.repeat {
        match run_once(&engine, &linker, &module, &creator, &tenant, args) {
            Ok(results) => {
                if !args.json {
                    for (text, _) in &results {
                        println!("{text}");
                    }
                }
                runs.push(Value::Array(results.into_iter().map(|(_, v)| v).collect()));
            }
            Err(failure) => {
                outcome = Err(failure);
                break;
            }
        }
    }
    if args.stats {
        eprint!("{}", stats_table(&[tenant.stats()], &creator));
    }
    if args.json {
        let error = outcome
            .as_ref()
            .err()
            .map(|f| json!({"exit_code": f.exit_code(), "message": f.message()}));
        let report = json!({
            "file": args.file.display().to_string(),
            "backend": args.backend.name(),
            "runs": runs,
            "error": error,
            "tenant": tenant_json(&tenant.stats()),
            "creator": creator_json(&creator.stats()),
        });
        println!("{report}");
    }
    outcome
}

fn run_once<B: Backend>(
    engine: &wasmtime::Engine,
    linker: &Linker<TenantStore<B>>,
    module: &Module,
    creator: &TensorWasmMemoryCreator<B>,
    tenant: &Arc<Tenant>,
    args: &RunArgs,
) -> Result<Vec<(String, Value)>, Failure> {
    let mut store = new_store(
        engine,
        TenantStore::new(creator, tenant, ChargeMode::Touched, ()),
    );
    let instance = instantiate(&mut store, linker, module).map_err(|e| {
        if is_trap(&e) {
            Failure::Trap(format!("trapped during instantiation: {e:#}"))
        } else if let Some(twm) = e.downcast_ref::<TwmError>() {
            Failure::Refused(format!("instantiation refused: {twm}"))
        } else {
            Failure::Refused(format!("instantiation refused: {e:#}"))
        }
    })?;
    let Some(name) = &args.invoke else {
        return Ok(Vec::new());
    };
    let func = instance
        .get_func(&mut store, name)
        .ok_or_else(|| Failure::Usage(format!("the module exports no function named {name:?}")))?;
    let ty = func.ty(&store);
    let params: Vec<ValType> = ty.params().collect();
    if params.len() != args.args.len() {
        return Err(Failure::Usage(format!(
            "{name} takes {} argument(s), {} given",
            params.len(),
            args.args.len()
        )));
    }
    let values = args
        .args
        .iter()
        .zip(&params)
        .map(|(a, t)| parse_arg(a, t))
        .collect::<Result<Vec<_>, _>>()?;
    let mut results = vec![Val::I32(0); ty.results().len()];
    func.call(&mut store, &values, &mut results).map_err(|e| {
        if is_trap(&e) {
            Failure::Trap(format!("{name} trapped: {e:#}"))
        } else {
            Failure::Other(format!("{name} failed: {e:#}"))
        }
    })?;
    Ok(results.iter().map(show).collect())
}
