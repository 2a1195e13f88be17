//! The figures the memory layer keeps, exported through the [`metrics`] facade (**available
//! with the feature `metrics`**; the facade is `metrics` 0.24): gauges and counters with `tenant`, `device` and `isolation` labels, named as
//! Prometheus names them (`twm_` prefix, `_bytes` for sizes, `_total` for counters), so an
//! embedder plugs in any exporter (`metrics-exporter-prometheus`, OpenTelemetry, statsd...).
//!
//! The layer keeps its figures itself (cheap atomics on every path); these functions publish a
//! snapshot of them, at whatever rate the embedder likes (a scrape, a timer, process exit). A
//! counter is published with [`metrics::Counter::absolute`], so publishing twice never counts
//! twice. [`describe`] registers help text and units once.
//!
//! Tenant series carry `tenant` (its name) and `tenant_id` (its id): names need not be unique,
//! ids should be. A limit that is unlimited (`u64::MAX`) is not published. The creator, pool
//! and placement series carry no instance label: publish one creator and one placement per
//! recorder (or per [`metrics::with_local_recorder`] scope). Series of tenants that are gone stay
//! in the exporter until it forgets them (`metrics-exporter-prometheus`: `idle_timeout`), so a
//! process with many short-lived tenants should set one.
//!
//! | Metric | Kind | Labels | What |
//! |---|---|---|---|
//! | `twm_tenant_touched_limit_bytes` | gauge | tenant, tenant_id, device, isolation | the touched budget |
//! | `twm_tenant_touched_bytes` | gauge | tenant, tenant_id, device, isolation | touched bytes charged now |
//! | `twm_tenant_touched_peak_bytes` | gauge | tenant, tenant_id, device, isolation | the most touched at once |
//! | `twm_tenant_held_limit_bytes` | gauge | tenant, tenant_id, device, isolation | the held budget |
//! | `twm_tenant_held_bytes` | gauge | tenant, tenant_id, device, isolation | capacity held now (slots, allocations, tables, device pools) |
//! | `twm_tenant_held_peak_bytes` | gauge | tenant, tenant_id, device, isolation | the most capacity held at once |
//! | `twm_tenant_device_pool_bytes` | gauge | tenant, tenant_id, device, isolation | of the touched bytes, those in device pools |
//! | `twm_tenant_table_bytes` | gauge | tenant, tenant_id, device, isolation | of the touched and held bytes, those in table elements |
//! | `twm_tenant_stranded_bytes` | gauge | tenant, tenant_id, device, isolation | bytes charged for good: what a backend never gave back after its creator went |
//! | `twm_tenant_live_memories` | gauge | tenant, tenant_id, device, isolation | memories alive now |
//! | `twm_tenant_memories_created_total` | counter | tenant, tenant_id, device, isolation | memories ever charged |
//! | `twm_tenant_denials_total` | counter | tenant, tenant_id, device, isolation, budget | requests refused, by budget (`touched`, `held`, `memories`) |
//! | `twm_tenant_refused_growths_total` | counter | tenant, tenant_id, device, isolation | memory growths its guests were refused (`memory.grow` answered `-1`): denied, past capacity, or failed |
//! | `twm_tenant_device_lost_total` | counter | tenant, tenant_id, device, isolation | host calls that found the tenant's device state lost to a kernel fault (each trapped its guest) |
//! | `twm_tenant_kernel_faults_total` | counter | tenant, tenant_id, device, isolation | kernel faults attributed to the tenant: its launches whose own wait saw the fault first (the suspect) |
//! | `twm_tenant_launches_total` | counter | tenant, tenant_id, device, isolation, outcome | kernels its guests launched ([`kernels`](crate::kernels)), by outcome (`ran`, `refused`, `failed`) |
//! | `twm_creator_live_memories` | gauge | device | memories alive on the device |
//! | `twm_creator_backing` | gauge | backing | 1, labelled with what the creator's memories are made of (`managed`, `guarded_pageable`, `guarded_registered`) |
//! | `twm_creator_memories_created_total` | counter | - | memories ever made |
//! | `twm_creator_memories_refused_total` | counter | - | memories refused (plan, cap, guard, pool, backend) |
//! | `twm_creator_share_denials_total` | counter | - | of those, memories refused at their tenant's share of the pool |
//! | `twm_creator_kept_memories` | gauge | - | memories gone whose release the backend refused: kept with their charges and retried |
//! | `twm_creator_last_recovery_seconds` | gauge | - | how long the last device recovery took (reset and releases) |
//! | `twm_device_fenced` | gauge | device | 1 while the device is fenced after a kernel fault in its primary context |
//! | `twm_device_faults_total` | counter | device | kernel faults that fenced it |
//! | `twm_device_recoveries_total` | counter | device | resets of its primary context after a fault |
//! | `twm_pool_slots` | gauge | device | slots of the device's pool |
//! | `twm_pool_slots_in_use` | gauge | device | of them, in use |
//! | `twm_pool_slots_withdrawn` | gauge | device | of them, withdrawn for good (a guarded slot's failed scrub, pages whose protection is unknown, or pages a backend kept): never handed out again |
//! | `twm_pool_slab_given_up` | gauge | device | 1 while the pool has no slab: given up on the fenced device, renewed at the first acquisition after its recovery |
//! | `twm_pool_exhaustions_total` | counter | device | acquisitions refused for want of a slot |
//! | `twm_pool_scrub_failures_total` | counter | device | scrubs and hint resets that failed (a managed slot stays free and dirty, and is scrubbed again; a guarded slot whose zeroing failed is retired, one whose hint reset was refused waits for its next acquisition's) |
//! | `twm_pool_scrubbed_ahead_total` | counter | device | slots zeroed while free, ahead of their acquisition (`CreatorBuilder::scrub_ahead`) |
//! | `twm_device_memory_total_bytes` | gauge | device | the device's memory (`cuMemGetInfo`) |
//! | `twm_device_memory_free_bytes` | gauge | device | its free memory now |
//! | `twm_device_capacity_bytes` | gauge | device | caps the placement lets it hold |
//! | `twm_device_committed_bytes` | gauge | device | caps of the tenants placed on it |
//! | `twm_device_tenants` | gauge | device | tenants placed on it, alive |
//! | `twm_device_available` | gauge | device | 1 while it takes new tenants |
//! | `twm_device_held_bytes` | gauge | device | bytes its tenants hold |
//! | `twm_device_touched_bytes` | gauge | device | bytes its tenants touched |
//! | `twm_placement_refusals_total` | counter | - | tenants no device could take |
//!
//! # Wiring an exporter
//!
//! With `metrics` 0.24 and `metrics-exporter-prometheus` 0.18 (the versions this crate is built
//! with), a Prometheus text page for one tenant and its creator:
//!
//! ```
//! use std::sync::Arc;
//! use tensor_wasm_mem_wasmtime::prelude::*;
//!
//! let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default())).build()?;
//! let tenant = Tenant::new(1, "alice", 64 << 20, IsolationLevel::StreamIsolated);
//! let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
//! let handle = recorder.handle();
//! // The facade this crate records through, re-exported (no `metrics` dependency of your own
//! // needed). A local recorder for this snapshot; `facade::set_global_recorder` for a whole
//! // process.
//! use tensor_wasm_mem_wasmtime::metrics::facade;
//! facade::with_local_recorder(&recorder, || {
//!     tensor_wasm_mem_wasmtime::metrics::describe();
//!     tensor_wasm_mem_wasmtime::metrics::record_tenant(&tenant);
//!     tensor_wasm_mem_wasmtime::metrics::record_creator(&creator);
//! });
//! let page = handle.render(); // serve it on /metrics
//! assert!(page.contains("twm_tenant_touched_limit_bytes{"));
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```

use metrics::{Unit, counter, describe_counter, describe_gauge, gauge};

/// The `metrics` facade (0.24) these functions record through, re-exported so an embedder
/// installs its recorder with the same version (`facade::set_global_recorder`,
/// `facade::with_local_recorder`) without a dependency of its own.
pub use ::metrics as facade;

use crate::{Backend, Placement, Tenant, TensorWasmMemoryCreator};

/// Gauges in bytes, with their help text.
const BYTE_GAUGES: [(&str, &str); 15] = [
    (
        "twm_tenant_touched_limit_bytes",
        "The tenant's touched budget (its cap).",
    ),
    (
        "twm_tenant_touched_bytes",
        "Touched bytes charged to the tenant now.",
    ),
    (
        "twm_tenant_touched_peak_bytes",
        "The most touched bytes charged at once.",
    ),
    ("twm_tenant_held_limit_bytes", "The tenant's held budget."),
    ("twm_tenant_held_bytes", "Capacity the tenant holds now."),
    (
        "twm_tenant_held_peak_bytes",
        "The most capacity the tenant held at once.",
    ),
    (
        "twm_tenant_device_pool_bytes",
        "Of the touched bytes, those in device pools.",
    ),
    (
        "twm_tenant_table_bytes",
        "Of the touched and held bytes, those in table elements.",
    ),
    (
        "twm_tenant_stranded_bytes",
        "Bytes charged for good: what a backend never gave back.",
    ),
    ("twm_device_memory_total_bytes", "The device's memory."),
    ("twm_device_memory_free_bytes", "The device's free memory."),
    (
        "twm_device_capacity_bytes",
        "Caps the placement lets the device hold.",
    ),
    (
        "twm_device_committed_bytes",
        "Caps of the tenants placed on the device.",
    ),
    ("twm_device_held_bytes", "Bytes the device's tenants hold."),
    (
        "twm_device_touched_bytes",
        "Bytes the device's tenants touched.",
    ),
];

/// Gauges that count, with their help text.
const COUNT_GAUGES: [(&str, &str); 12] = [
    (
        "twm_tenant_live_memories",
        "Memories of the tenant alive now.",
    ),
    (
        "twm_creator_live_memories",
        "Memories of the creator alive on the device.",
    ),
    (
        "twm_creator_kept_memories",
        "Memories gone whose release the backend refused: kept with their charges, retried.",
    ),
    ("twm_pool_slots", "Slots of the device's pool."),
    (
        "twm_creator_backing",
        "1, labelled with what the creator's memories are made of.",
    ),
    (
        "twm_pool_slots_in_use",
        "Slots of the device's pool in use.",
    ),
    (
        "twm_pool_slots_withdrawn",
        "Slots of the device's pool withdrawn for good (never handed out again).",
    ),
    (
        "twm_pool_slab_given_up",
        "1 while the device's pool has no slab (given up on the fenced device).",
    ),
    ("twm_device_tenants", "Tenants placed on the device, alive."),
    (
        "twm_device_available",
        "1 while the device takes new tenants.",
    ),
    (
        "twm_device_fenced",
        "1 while the device is fenced after a kernel fault, until it recovers.",
    ),
    (
        "twm_creator_last_recovery_seconds",
        "How long the creator's last device recovery took.",
    ),
];

/// Counters, with their help text.
const COUNTERS: [(&str, &str); 15] = [
    (
        "twm_tenant_refused_growths_total",
        "Memory growths the tenant's guests were refused (memory.grow answered -1).",
    ),
    (
        "twm_creator_share_denials_total",
        "Memories the creator refused at their tenant's share of the pool.",
    ),
    (
        "twm_tenant_device_lost_total",
        "Host calls that found the tenant's device state lost to a kernel fault (each trapped).",
    ),
    (
        "twm_tenant_kernel_faults_total",
        "Kernel faults attributed to the tenant: its launches whose wait saw the fault first.",
    ),
    (
        "twm_device_faults_total",
        "Kernel faults that fenced the device (its primary context lost).",
    ),
    (
        "twm_device_recoveries_total",
        "Resets of the device's primary context after a fault.",
    ),
    (
        "twm_tenant_memories_created_total",
        "Memories ever charged to the tenant.",
    ),
    (
        "twm_tenant_launches_total",
        "Kernel launches of the tenant's guests, by outcome.",
    ),
    (
        "twm_tenant_denials_total",
        "Requests a budget of the tenant refused.",
    ),
    (
        "twm_creator_memories_created_total",
        "Memories the creator made.",
    ),
    (
        "twm_creator_memories_refused_total",
        "Memories the creator refused.",
    ),
    (
        "twm_pool_exhaustions_total",
        "Pool acquisitions refused for want of a slot.",
    ),
    (
        "twm_pool_scrubbed_ahead_total",
        "Pool slots zeroed while free, ahead of their acquisition.",
    ),
    (
        "twm_pool_scrub_failures_total",
        "Pool scrubs and hint resets that failed (tried again, or the slot retired).",
    ),
    (
        "twm_placement_refusals_total",
        "Tenants no device could take.",
    ),
];

/// Registers help text and units for every metric with the installed recorder (once, after
/// installing it; harmless to repeat).
pub fn describe() {
    for (name, help) in BYTE_GAUGES {
        describe_gauge!(name, Unit::Bytes, help);
    }
    for (name, help) in COUNT_GAUGES {
        describe_gauge!(name, Unit::Count, help);
    }
    for (name, help) in COUNTERS {
        describe_counter!(name, Unit::Count, help);
    }
}

/// Publishes one tenant's figures.
pub fn record_tenant(tenant: &Tenant) {
    let s = tenant.stats();
    let labels = [
        ("tenant", s.name.clone()),
        ("tenant_id", s.id.0.to_string()),
        ("device", s.device.0.to_string()),
        ("isolation", s.isolation.name().to_string()),
    ];
    // An unlimited budget (`u64::MAX`) has no limit to publish.
    if s.touched_limit != u64::MAX {
        gauge!("twm_tenant_touched_limit_bytes", &labels).set(s.touched_limit as f64);
    }
    gauge!("twm_tenant_touched_bytes", &labels).set(s.touched_bytes as f64);
    gauge!("twm_tenant_touched_peak_bytes", &labels).set(s.touched_peak_bytes as f64);
    if s.held_limit != u64::MAX {
        gauge!("twm_tenant_held_limit_bytes", &labels).set(s.held_limit as f64);
    }
    gauge!("twm_tenant_held_bytes", &labels).set(s.held_bytes as f64);
    gauge!("twm_tenant_held_peak_bytes", &labels).set(s.held_peak_bytes as f64);
    gauge!("twm_tenant_device_pool_bytes", &labels).set(s.device_pool_bytes as f64);
    gauge!("twm_tenant_table_bytes", &labels).set(s.table_bytes as f64);
    gauge!("twm_tenant_stranded_bytes", &labels).set(s.stranded_bytes as f64);
    gauge!("twm_tenant_live_memories", &labels).set(s.live_memories as f64);
    counter!("twm_tenant_memories_created_total", &labels).absolute(s.memories_created);
    counter!("twm_tenant_device_lost_total", &labels).absolute(s.device_lost);
    counter!("twm_tenant_kernel_faults_total", &labels).absolute(s.kernel_faults);
    counter!("twm_tenant_refused_growths_total", &labels).absolute(s.refused_growths);
    for (outcome, n) in [
        ("ran", s.launches),
        ("refused", s.refused_launches),
        ("failed", s.kernel_failures),
    ] {
        let [a, b, c, d] = labels.clone();
        let labels = [a, b, c, d, ("outcome", outcome.to_string())];
        counter!("twm_tenant_launches_total", &labels).absolute(n);
    }
    for (budget, n) in [
        ("touched", s.touched_denials),
        ("held", s.held_denials),
        ("memories", s.memory_denials),
    ] {
        let [a, b, c, d] = labels.clone();
        let labels = [a, b, c, d, ("budget", budget.to_string())];
        counter!("twm_tenant_denials_total", &labels).absolute(n);
    }
}

/// Publishes a creator's figures, per device it serves, and each device's memory as the backend
/// reports it.
pub fn record_creator<B: Backend>(creator: &TensorWasmMemoryCreator<B>) {
    let s = creator.stats();
    gauge!("twm_creator_backing", "backing" => s.backing.name()).set(1.0);
    counter!("twm_creator_memories_created_total").absolute(s.created);
    counter!("twm_creator_memories_refused_total").absolute(s.refused);
    counter!("twm_creator_share_denials_total").absolute(s.share_denials);
    gauge!("twm_creator_kept_memories").set(s.kept_memories as f64);
    gauge!("twm_creator_last_recovery_seconds").set(s.last_recovery_us as f64 / 1e6);
    for d in &s.devices {
        let labels = [("device", d.device.0.to_string())];
        gauge!("twm_creator_live_memories", &labels).set(d.live_memories as f64);
        gauge!("twm_device_fenced", &labels).set(if d.health.fenced { 1.0 } else { 0.0 });
        counter!("twm_device_faults_total", &labels).absolute(d.health.faults);
        counter!("twm_device_recoveries_total", &labels).absolute(d.health.recoveries);
        if let Some(pool) = &d.pool {
            let slots = pool.in_use() + pool.free() + pool.withdrawn();
            gauge!("twm_pool_slots", &labels).set(slots as f64);
            gauge!("twm_pool_slots_in_use", &labels).set(pool.in_use() as f64);
            gauge!("twm_pool_slots_withdrawn", &labels).set(pool.withdrawn() as f64);
            gauge!("twm_pool_slab_given_up", &labels).set(f64::from(u8::from(pool.slab_given_up)));
            counter!("twm_pool_exhaustions_total", &labels).absolute(pool.exhaustions);
            counter!("twm_pool_scrub_failures_total", &labels).absolute(pool.scrub_failures);
            counter!("twm_pool_scrubbed_ahead_total", &labels).absolute(pool.scrubbed_ahead);
        }
    }
    record_devices(&**creator.backend());
}

/// Publishes each device's memory (total and free) as the backend reports it.
pub fn record_devices<B: Backend + ?Sized>(backend: &B) {
    for d in 0..backend.device_count() {
        let Some(report) = backend.device_report(tensor_wasm_mem_core::DeviceId(d)) else {
            continue;
        };
        let labels = [("device", d.to_string())];
        if let Some(total) = report.total_bytes {
            gauge!("twm_device_memory_total_bytes", &labels).set(total as f64);
        }
        if let Some(free) = report.free_bytes {
            gauge!("twm_device_memory_free_bytes", &labels).set(free as f64);
        }
    }
}

/// Publishes a placement's figures per device.
pub fn record_placement(placement: &Placement) {
    for d in placement.devices() {
        let labels = [("device", d.device.0.to_string())];
        if d.capacity_bytes != u64::MAX {
            gauge!("twm_device_capacity_bytes", &labels).set(d.capacity_bytes as f64);
        }
        gauge!("twm_device_committed_bytes", &labels).set(d.committed_bytes as f64);
        gauge!("twm_device_tenants", &labels).set(d.tenants as f64);
        gauge!("twm_device_available", &labels).set(if d.available { 1.0 } else { 0.0 });
        gauge!("twm_device_held_bytes", &labels).set(d.held_bytes as f64);
        gauge!("twm_device_touched_bytes", &labels).set(d.touched_bytes as f64);
    }
    counter!("twm_placement_refusals_total").absolute(placement.refusals());
}
