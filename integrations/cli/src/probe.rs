//! `twm probe`: what a backend and its device offer.

use serde_json::json;
use tensor_wasm_mem_core::{DeviceId, HostAccess};
use tensor_wasm_mem_wasmtime::{Backend, Backing};

use crate::backend::BackendKind;
use crate::bytes::approx_bytes;

/// `twm probe` arguments.
#[derive(Debug, clap::Args)]
pub struct ProbeArgs {
    /// The backend to probe.
    #[arg(long, value_enum, default_value_t = BackendKind::preferred())]
    pub backend: BackendKind,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Simulate this many devices (`--backend mock` only; default 1).
    #[arg(long, value_name = "N", value_parser = crate::backend::parse_devices)]
    pub devices: Option<u32>,
    /// How the simulated devices reach host memory (`--backend mock` only; default none).
    #[arg(long, value_enum, value_name = "ACCESS")]
    pub simulate_host_access: Option<crate::backend::SimulatedHostAccess>,
}

/// The devices whose memory `device` can access directly.
fn peers<B: Backend>(backend: &B, device: DeviceId) -> Vec<u32> {
    (0..backend.device_count())
        .filter(|&p| backend.can_access_peer(device, DeviceId(p)))
        .collect()
}

/// `peers` as ranges (`0-2,5`): a line as long as the gaps, not the devices.
fn ranges(peers: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < peers.len() {
        let start = peers[i];
        while i + 1 < peers.len() && peers[i + 1] == peers[i] + 1 {
            i += 1;
        }
        out.push(if peers[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", peers[i])
        });
        i += 1;
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(",")
    }
}

/// Describes a backend that started.
pub fn probe<B: Backend>(
    kind: BackendKind,
    backend: &B,
    driver: &str,
    json_out: bool,
) -> Result<(), crate::run::Failure> {
    let caps = backend.capabilities();
    let all: Vec<DeviceId> = (0..backend.device_count()).map(DeviceId).collect();
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
        (
            "default backing",
            "default_backing",
            json!(Backing::detect(backend, &all).name()),
        ),
    ];
    let reports: Vec<_> = all
        .iter()
        .filter_map(|&d| backend.device_report(d))
        .collect();
    let registration = |d: DeviceId| backend.can_attach_host(d, HostAccess::Registered);
    if json_out {
        let mut object: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|(_, key, v)| ((*key).to_string(), v.clone()))
            .collect();
        let list = reports
            .iter()
            .map(|r| {
                json!({
                    "device": r.device.0,
                    "total_bytes": r.total_bytes,
                    "free_bytes": r.free_bytes,
                    "concurrent_managed_access": r.concurrent_managed_access,
                    "pageable_memory_access": r.pageable_memory_access,
                    "host_registration": registration(r.device),
                    "peers": peers(backend, r.device),
                })
            })
            .collect();
        object.insert("device_list".into(), serde_json::Value::Array(list));
        outln!("{}", serde_json::Value::Object(object));
    } else {
        for (label, _, v) in rows {
            let shown = v.as_str().map_or_else(|| v.to_string(), str::to_string);
            outln!("{label:<27} {shown}");
        }
        let bytes = |b: Option<u64>| b.map_or_else(|| "unknown".to_string(), approx_bytes);
        let yes = |b: bool| if b { "yes" } else { "no" };
        outln!(
            "\n{:<8} {:>10} {:>10} {:>18} {:>16} {:>18}  peers",
            "device",
            "memory",
            "free",
            "concurrent managed",
            "pageable access",
            "host registration"
        );
        for r in &reports {
            outln!(
                "{:<8} {:>10} {:>10} {:>18} {:>16} {:>18}  {}",
                r.device.0,
                bytes(r.total_bytes),
                bytes(r.free_bytes),
                yes(r.concurrent_managed_access),
                yes(r.pageable_memory_access),
                yes(registration(r.device)),
                ranges(&peers(backend, r.device))
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn peers_as_ranges() {
        assert_eq!(super::ranges(&[]), "-");
        assert_eq!(super::ranges(&[3]), "3");
        assert_eq!(super::ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(super::ranges(&(1..64).collect::<Vec<_>>()), "1-63");
    }
}
