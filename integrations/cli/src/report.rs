//! Stats tables and JSON for tenants and creators.

use serde_json::{Value, json};
use tensor_wasm_mem_wasmtime::{Backend, CreatorStats, TenantStats, TensorWasmMemoryCreator};

use crate::bytes::format_bytes;

pub fn tenant_json(s: &TenantStats) -> Value {
    json!({
        "id": s.id.0,
        "name": s.name,
        "isolation": s.isolation.name(),
        "cap_bytes": s.cap,
        "live_bytes": s.live_bytes,
        "peak_bytes": s.peak_bytes,
        "held_limit_bytes": s.held_limit,
        "held_bytes": s.held_bytes,
        "held_peak_bytes": s.held_peak_bytes,
        "memory_limit": s.memory_limit,
        "live_memories": s.live_memories,
        "memories_created": s.memories_created,
        "denials": s.denials,
        "held_denials": s.held_denials,
        "memory_denials": s.memory_denials,
        "device_pool_bytes": s.device_pool_bytes,
    })
}

pub fn creator_json(s: &CreatorStats) -> Value {
    let pool = s.pool.as_ref().map(|p| {
        json!({
            "in_use": p.in_use(),
            "free": p.free(),
            "acquisitions": p.acquisitions,
            "releases": p.releases,
            "bytes_scrubbed": p.bytes_scrubbed,
            "hint_resets": p.hint_resets,
            "exhaustions": p.exhaustions,
        })
    });
    json!({
        "live_memories": s.live_memories,
        "created": s.created,
        "dropped": s.dropped,
        "refused": s.refused,
        "pool": pool,
    })
}

/// The per-tenant table and the creator / pool line.
pub fn stats_table<B: Backend>(
    tenants: &[TenantStats],
    creator: &TensorWasmMemoryCreator<B>,
) -> String {
    let mut out = format!(
        "{:<10} {:<17} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}\n",
        "tenant",
        "isolation",
        "cap",
        "live",
        "peak",
        "held max",
        "held peak",
        "in pools",
        "memories",
        "denials"
    );
    let limit = |bytes: u64| {
        if bytes == u64::MAX {
            "none".to_string()
        } else {
            format_bytes(bytes)
        }
    };
    for s in tenants {
        out += &format!(
            "{:<10} {:<17} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}\n",
            s.name,
            s.isolation.name(),
            limit(s.cap),
            format_bytes(s.live_bytes),
            format_bytes(s.peak_bytes),
            limit(s.held_limit),
            format_bytes(s.held_peak_bytes),
            format_bytes(s.device_pool_bytes),
            s.memories_created,
            s.denials
        );
    }
    let c = creator.stats();
    out += &format!(
        "memories: {} created, {} dropped, {} refused",
        c.created, c.dropped, c.refused
    );
    if let Some(p) = &c.pool {
        out += &format!(
            "; pool: {} in use, {} free, {} scrubbed, {} hint resets, {} exhausted",
            p.in_use(),
            p.free(),
            format_bytes(p.bytes_scrubbed),
            p.hint_resets,
            p.exhaustions
        );
    }
    out.push('\n');
    out
}
