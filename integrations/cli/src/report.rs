//! Stats tables and JSON for tenants and creators.

use serde_json::{Value, json};
use tensor_wasm_mem_wasmtime::core::DeviceId;
use tensor_wasm_mem_wasmtime::{
    Backend, CreatorStats, Placement, TenantStats, TensorWasmMemoryCreator,
};

use crate::bytes::{approx_bytes, format_bytes};

pub fn tenant_json(s: &TenantStats) -> Value {
    json!({
        "id": s.id.0,
        "name": s.name,
        "isolation": s.isolation.name(),
        "touched_limit_bytes": s.touched_limit,
        "touched_bytes": s.touched_bytes,
        "touched_peak_bytes": s.touched_peak_bytes,
        "held_limit_bytes": s.held_limit,
        "held_bytes": s.held_bytes,
        "held_peak_bytes": s.held_peak_bytes,
        "memories_limit": s.memories_limit,
        "live_memories": s.live_memories,
        "memories_created": s.memories_created,
        "denials": s.denials,
        "held_denials": s.held_denials,
        "memory_denials": s.memory_denials,
        "device_pool_bytes": s.device_pool_bytes,
        "device": s.device.0,
        "touched_denials": s.touched_denials,
        "launches": s.launches,
        "refused_launches": s.refused_launches,
        "kernel_failures": s.kernel_failures,
    })
}

pub fn creator_json(s: &CreatorStats) -> Value {
    let pool = s.pool.as_ref().map(|p| {
        json!({
            "in_use": p.in_use(),
            "free": p.free(),
            "withdrawn": p.withdrawn(),
            "acquisitions": p.acquisitions,
            "releases": p.releases,
            "bytes_scrubbed": p.bytes_scrubbed,
            "hint_resets": p.hint_resets,
            "exhaustions": p.exhaustions,
            "scrubbed_ahead": p.scrubbed_ahead,
            "slab_given_up": p.slab_given_up,
        })
    });
    let devices: Vec<Value> = s
        .devices
        .iter()
        .map(|d| {
            json!({
                "device": d.device.0,
                "live_memories": d.live_memories,
                "pool_in_use": d.pool.as_ref().map(|p| p.in_use()),
                "pool_withdrawn": d.pool.as_ref().map(|p| p.withdrawn()),
            })
        })
        .collect();
    json!({
        "backing": s.backing.name(),
        "live_memories": s.live_memories,
        "created": s.created,
        "dropped": s.dropped,
        "refused": s.refused,
        "pool": pool,
        "devices": devices,
    })
}

/// One line per device: the tenants placed there and what they committed, hold and touched,
/// the creator's memories and pool slots there (in use, of those usable: a slot withdrawn for
/// good is neither, and the stats line counts it), and the device's free memory.
pub fn occupancy_table<B: Backend>(
    placement: &Placement,
    creator: &TensorWasmMemoryCreator<B>,
) -> String {
    let mut out = format!(
        "{:<7} {:>8} {:>10} {:>10} {:>10} {:>9} {:>11} {:>10}\n",
        "device", "tenants", "committed", "held", "touched", "memories", "pool slots", "free"
    );
    let creator_stats = creator.stats();
    for d in placement.devices() {
        let on = creator_stats.devices.iter().find(|c| c.device == d.device);
        let memories = on.map_or(0, |c| c.live_memories);
        let slots = on.and_then(|c| c.pool.as_ref()).map_or_else(
            || "-".into(),
            |p| format!("{}/{}", p.in_use(), p.in_use() + p.free()),
        );
        let free = creator
            .backend()
            .device_report(DeviceId(d.device.0))
            .and_then(|r| r.free_bytes)
            .map_or_else(|| "unknown".into(), approx_bytes);
        out += &format!(
            "{:<7} {:>8} {:>10} {:>10} {:>10} {:>9} {:>11} {:>10}\n",
            d.device.0,
            d.tenants,
            format_bytes(d.committed_bytes),
            format_bytes(d.held_bytes),
            format_bytes(d.touched_bytes),
            memories,
            slots,
            free
        );
    }
    out
}

/// The per-tenant table and the creator / pool line.
pub fn stats_table<B: Backend>(
    tenants: &[TenantStats],
    creator: &TensorWasmMemoryCreator<B>,
) -> String {
    let mut out = format!(
        "{:<10} {:<17} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}\n",
        "tenant",
        "isolation",
        "device",
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
            "{:<10} {:<17} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}\n",
            s.name,
            s.isolation.name(),
            s.device.0,
            limit(s.touched_limit),
            format_bytes(s.touched_bytes),
            format_bytes(s.touched_peak_bytes),
            limit(s.held_limit),
            format_bytes(s.held_peak_bytes),
            format_bytes(s.device_pool_bytes),
            s.memories_created,
            s.denials
        );
    }
    let c = creator.stats();
    out += &format!(
        "memories ({}): {} created, {} dropped, {} refused",
        c.backing, c.created, c.dropped, c.refused
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
        if p.withdrawn() > 0 {
            out += &format!(", {} withdrawn", p.withdrawn());
        }
        if p.slab_given_up {
            out += " (slab given up on the fenced device)";
        }
    }
    out.push('\n');
    out
}
