//! `twm` on many simulated devices, and `twm run --metrics` read back as Prometheus text.

use std::collections::HashMap;
use std::process::{Command, Output};

const MODULE: &str = r#"(module
  (import "twm" "prefetch" (func $prefetch (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1 8)
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0)))
  (func (export "prefetch") (param i32) (result i32)
    (call $prefetch (i32.const 0) (i32.const 4096) (local.get 0))))"#;

fn twm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_twm"))
        .args(args)
        .output()
        .expect("run twm")
}

fn module() -> String {
    let dir = std::env::temp_dir().join(format!("twm-cli-devices-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.wat");
    std::fs::write(&path, MODULE).unwrap();
    path.to_str().unwrap().to_string()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every sample of a Prometheus text exposition: `name{labels}` -> (kind, value).
fn samples(text: &str) -> Vec<(String, HashMap<String, String>, &'static str, f64)> {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text");
    assert!(!scrape.samples.is_empty(), "{text}");
    scrape
        .samples
        .into_iter()
        .map(|s| {
            let (kind, value) = match s.value {
                prometheus_parse::Value::Counter(v) => ("counter", v),
                prometheus_parse::Value::Gauge(v) => ("gauge", v),
                other => panic!("{}: unexpected {other:?}", s.metric),
            };
            let labels = s
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            (s.metric, labels, kind, value)
        })
        .collect()
}

fn value(
    samples: &[(String, HashMap<String, String>, &'static str, f64)],
    name: &str,
    want: &[(&str, &str)],
) -> (&'static str, f64) {
    let found: Vec<_> = samples
        .iter()
        .filter(|(n, labels, _, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(v))
        })
        .collect();
    assert_eq!(found.len(), 1, "{name} {want:?} in {samples:?}");
    (found[0].2, found[0].3)
}

#[test]
fn run_metrics_are_prometheus_text_matching_the_stats() {
    let path = module();
    // Two runs on device 1 of 2, each growth past the 128KiB cap refused.
    let o = twm(&[
        "run",
        &path,
        "--invoke",
        "grow",
        "3",
        "--tenant-cap",
        "128KiB",
        "--repeat",
        "2",
        "--devices",
        "2",
        "--device",
        "1",
        "--json",
        "--metrics",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let report: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let text = report["metrics"]
        .as_str()
        .expect("metrics in the JSON object");
    let samples = samples(text);
    let tenant = &report["tenant"];
    assert_eq!(tenant["device"], 1);
    let labels = [
        ("tenant", "cli"),
        ("device", "1"),
        ("isolation", "stream_isolated"),
    ];
    for (metric, key) in [
        ("twm_tenant_touched_bytes", "touched_bytes"),
        ("twm_tenant_touched_peak_bytes", "touched_peak_bytes"),
        ("twm_tenant_held_bytes", "held_bytes"),
        ("twm_tenant_held_peak_bytes", "held_peak_bytes"),
        ("twm_tenant_touched_limit_bytes", "touched_limit_bytes"),
        ("twm_tenant_live_memories", "live_memories"),
    ] {
        let (kind, v) = value(&samples, metric, &labels);
        assert_eq!(kind, "gauge", "{metric}");
        assert_eq!(v, tenant[key].as_u64().unwrap() as f64, "{metric} vs {key}");
    }
    assert!(tenant["touched_peak_bytes"].as_u64().unwrap() > 0);
    assert!(tenant["held_peak_bytes"].as_u64().unwrap() > 0);
    let (kind, created) = value(&samples, "twm_tenant_memories_created_total", &labels);
    assert_eq!((kind, created), ("counter", 2.0));
    let denials: f64 = ["touched", "held", "memories"]
        .iter()
        .map(|b| {
            let mut l = labels.to_vec();
            l.push(("budget", b));
            value(&samples, "twm_tenant_denials_total", &l).1
        })
        .sum();
    assert_eq!(denials, tenant["denials"].as_u64().unwrap() as f64);
    assert_eq!(denials, 2.0, "one refused growth per run");
    let by_touched = value(
        &samples,
        "twm_tenant_denials_total",
        &[("tenant", "cli"), ("budget", "touched")],
    );
    assert_eq!(by_touched.1, 2.0);
    // Per device: both devices' memory reported; the creator serves the tenant's device only.
    for d in ["0", "1"] {
        let total = value(&samples, "twm_device_memory_total_bytes", &[("device", d)]).1;
        assert!(total > 0.0);
    }
    assert_eq!(
        value(&samples, "twm_creator_live_memories", &[("device", "1")]).1,
        0.0
    );
    assert!(
        !samples
            .iter()
            .any(|(n, l, _, _)| n == "twm_creator_live_memories" && l["device"] == "0")
    );
    assert_eq!(
        value(&samples, "twm_creator_memories_created_total", &[]).1,
        report["creator"]["created"].as_u64().unwrap() as f64
    );
    assert_eq!(
        value(&samples, "twm_creator_backing", &[("backing", "managed")]).1,
        1.0
    );
    assert_eq!(report["creator"]["backing"], "managed");
    assert!(text.contains("# HELP twm_tenant_held_bytes"), "{text}");
}

#[test]
fn plain_metrics_follow_the_results_and_match_the_stats_table() {
    let path = module();
    let o = twm(&[
        "run",
        &path,
        "--invoke",
        "grow",
        "3",
        "--tenant-cap",
        "128KiB",
        "--metrics",
        "--stats",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let stdout = out(&o);
    let (result, text) = stdout.split_once('\n').unwrap();
    assert_eq!(result, "-1");
    let samples = samples(text);
    // The stats table's row for the tenant: name, isolation, device, cap, live, peak, held
    // max, held peak, in pools, memories, denials.
    let stderr = err(&o);
    let row: Vec<&str> = stderr
        .lines()
        .find(|l| l.starts_with("cli "))
        .expect("the tenant's row")
        .split_whitespace()
        .collect();
    assert_eq!(row[2], "0", "device column");
    let labels = [("tenant", "cli"), ("device", "0")];
    let memories = value(&samples, "twm_tenant_memories_created_total", &labels).1;
    assert_eq!(memories.to_string(), row[9]);
    let denials: f64 = samples
        .iter()
        .filter(|(n, l, _, _)| n == "twm_tenant_denials_total" && l["tenant"] == "cli")
        .map(|s| s.3)
        .sum();
    assert_eq!(denials.to_string(), row[10]);
    assert_eq!(row[5], "64KiB", "peak column");
    assert_eq!(
        value(&samples, "twm_tenant_touched_peak_bytes", &labels).1,
        65536.0
    );
}

#[test]
fn a_refused_run_still_reports_its_denial_by_budget() {
    let path = module();
    let o = twm(&[
        "run",
        &path,
        "--tenant-cap",
        "1MiB",
        "--tenant-memories",
        "0",
        "--metrics",
    ]);
    assert_eq!(o.status.code(), Some(4), "{}", err(&o));
    let samples = samples(&out(&o));
    let l = [("tenant", "cli"), ("budget", "memories")];
    assert_eq!(value(&samples, "twm_tenant_denials_total", &l).1, 1.0);
}

#[test]
fn probe_lists_every_simulated_device() {
    let o = twm(&["probe", "--devices", "4"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let text = out(&o);
    let rows: Vec<_> = text
        .lines()
        .skip_while(|l| !(l.starts_with("device ") && l.contains("free")))
        .skip(1)
        .collect();
    assert_eq!(rows.len(), 4, "{text}");
    for (i, row) in rows.iter().enumerate() {
        assert!(row.starts_with(&i.to_string()), "{row}");
        assert!(row.contains("16.0GiB"), "{row}");
    }
    let o = twm(&["probe", "--devices", "4", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["devices"], 4);
    let list = v["device_list"].as_array().unwrap();
    assert_eq!(list.len(), 4);
    assert_eq!(list[3]["device"], 3);
    assert_eq!(list[3]["free_bytes"], 16u64 << 30);
    assert_eq!(list[3]["concurrent_managed_access"], true);
}

#[test]
fn demo_spreads_tenants_over_four_devices() {
    let o = twm(&["demo", "--devices", "4"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let text = out(&o);
    assert!(!text.contains("WRONG"), "{text}");
    assert!(text.contains("over 4 device(s)"), "{text}");
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip_while(|l| !l.starts_with("device "))
        .skip(1)
        .take_while(|l| !l.is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 4, "{text}");
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row[0], i.to_string());
        assert_eq!(row[1], "1", "one tenant per device: {row:?}");
        assert_eq!(row[3], "64KiB", "its kernel scratch is held: {row:?}");
        assert_eq!(
            row[6], "0/6",
            "every slot back in the device's pool: {row:?}"
        );
    }
    assert!(text.contains("every tenant back to zero once the pools are dropped: true"));
}

#[test]
fn run_on_a_device_and_refusals_of_bad_device_options() {
    let path = module();
    // The guest may prefetch to its own device, not to another.
    let own = twm(&[
        "run",
        &path,
        "--devices",
        "3",
        "--device",
        "2",
        "--invoke",
        "prefetch",
        "2",
    ]);
    assert_eq!(
        (own.status.code(), out(&own).trim()),
        (Some(0), "0"),
        "{}",
        err(&own)
    );
    let other = twm(&[
        "run",
        &path,
        "--devices",
        "3",
        "--device",
        "2",
        "--invoke",
        "prefetch",
        "1",
    ]);
    assert_eq!(out(&other).trim(), "-4", "TWM_ERR_UNKNOWN_DEVICE");
    let o = twm(&["run", &path, "--devices", "3", "--device", "3"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(err(&o).contains("has 3 device(s)"), "{}", err(&o));
    let o = twm(&["demo", "--devices", "0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err(&o).contains("is not a device count from 1 to 64"),
        "{}",
        err(&o)
    );
}

#[test]
fn a_pooled_run_on_a_device_reports_that_devices_pool() {
    let path = module();
    let o = twm(&[
        "run",
        &path,
        "--devices",
        "4",
        "--device",
        "2",
        "--pool",
        "1",
        "--repeat",
        "2",
        "--invoke",
        "grow",
        "1",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let devices = v["creator"]["devices"].as_array().unwrap();
    assert_eq!(
        devices.len(),
        1,
        "only the tenant's device is served: {devices:?}"
    );
    assert_eq!(devices[0]["device"], 2);
    assert_eq!(v["creator"]["pool"]["free"], 1);
    assert_eq!(v["creator"]["created"], 2);
}
