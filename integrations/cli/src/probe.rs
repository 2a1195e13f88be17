//! `twm probe`: what a backend and its device offer.

use serde_json::json;
use tensor_wasm_mem_wasmtime::Backend;

use crate::backend::BackendKind;

/// `twm probe` arguments.
#[derive(Debug, clap::Args)]
pub struct ProbeArgs {
    /// The backend to probe.
    #[arg(long, value_enum, default_value_t = BackendKind::preferred())]
    pub backend: BackendKind,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Describes a backend that started.
pub fn probe<B: Backend>(kind: BackendKind, backend: &B, driver: &str, json_out: bool) {
    let caps = backend.capabilities();
    let rows = [
        ("backend", "backend", json!(kind.name())),
        ("driver", "driver", json!(driver)),
        ("devices", "devices", json!(backend.device_count())),
        ("managed memory", "managed", json!(caps.managed)),
        (
            "host accessible",
            "host_accessible",
            json!(caps.host_accessible),
        ),
        (
            "device accessible",
            "device_accessible",
            json!(caps.device_accessible),
        ),
        ("unified (zero-copy)", "unified", json!(caps.is_uvm())),
        (
            "concurrent managed access",
            "concurrent_managed_access",
            json!(caps.concurrent_managed_access),
        ),
        (
            "pageable memory access",
            "pageable_memory_access",
            json!(caps.pageable_memory_access),
        ),
        ("comes zeroed", "comes_zeroed", json!(caps.comes_zeroed)),
        ("guard pages", "guard_pages", json!(caps.guard_pages)),
    ];
    if json_out {
        let object: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|(_, key, v)| ((*key).to_string(), v.clone()))
            .collect();
        println!("{}", serde_json::Value::Object(object));
    } else {
        for (label, _, v) in rows {
            let shown = v.as_str().map_or_else(|| v.to_string(), str::to_string);
            println!("{label:<27} {shown}");
        }
    }
}
