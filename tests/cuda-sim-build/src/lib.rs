//! Builds the simulated libcuda (`tests/cuda-sim`, a C-ABI shell over the driver model) from a
//! build script: a `cargo build` of that package, with the calling cargo, into a target
//! directory of its own beside the caller's build (so the tests' and the cust backend's build
//! scripts share one build per profile), then a copy into the caller's `OUT_DIR`.
//!
//! The nested build is plain: the caller's `RUSTFLAGS` (a sanitizer build's, say) are not passed
//! on, so the simulator is the same uninstrumented library under every build of the workspace.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace this crate belongs to.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..")
}

/// Where the nested build goes: `cuda-sim` beside the caller's profile folder (OUT_DIR is
/// `<target>/<profile>/build/<package>-<hash>/out`), so every build script of one build shares
/// it; cargo's lock on it serialises them.
fn target_dir(out_dir: &Path) -> PathBuf {
    out_dir.ancestors().nth(3).map_or_else(
        || out_dir.join("cuda-sim"),
        |profile| profile.join("cuda-sim"),
    )
}

/// Builds the simulator (with the package feature `without-prefetch` when `without_prefetch`)
/// and copies it to `out_dir/file_name`; returns that path. Panics with the build's output if it
/// fails (a build script has no better way to report).
#[must_use]
pub fn build(out_dir: &Path, file_name: &str, without_prefetch: bool) -> PathBuf {
    let workspace = workspace();
    // Everything the simulator is built from: its crates, the workspace's manifest (its
    // `cuda-sim` profile) and lock file.
    for path in [
        "tests/cuda-sim",
        "backends/model",
        "backends/cuda",
        "core",
        "Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={}", workspace.join(path).display());
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = target_dir(out_dir).join(if without_prefetch {
        "without-prefetch"
    } else {
        "full"
    });
    let mut cmd = Command::new(&cargo);
    cmd.arg("build")
        .arg("--manifest-path")
        .arg(workspace.join("Cargo.toml"))
        .args(["-p", "tensor-wasm-mem-cuda-sim", "--profile", "cuda-sim"])
        .arg("--target-dir")
        .arg(&target);
    if without_prefetch {
        cmd.args(["--features", "without-prefetch"]);
    }
    cmd.arg("--locked");
    if std::env::var_os("CARGO_NET_OFFLINE").is_some() {
        cmd.arg("--offline");
    }
    // The caller's flags, target and profile settings are its own build's, not this one's.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTDOCFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_BUILD_TARGET_DIR",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
    ] {
        cmd.env_remove(var);
    }
    for (var, _) in std::env::vars_os() {
        let name = var.to_string_lossy();
        if name.starts_with("CARGO_TARGET_") || name.starts_with("CARGO_PROFILE_") {
            cmd.env_remove(&var);
        }
    }
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cargo} to build the simulated libcuda: {e}"));
    assert!(
        output.status.success(),
        "building the simulated libcuda failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let built = target.join("cuda-sim").join("libtwm_cuda_sim.so");
    let path = out_dir.join(file_name);
    let tmp = out_dir.join(format!("{file_name}.tmp"));
    std::fs::copy(&built, &tmp)
        .unwrap_or_else(|e| panic!("copying {} to {}: {e}", built.display(), tmp.display()));
    std::fs::rename(&tmp, &path).unwrap_or_else(|e| panic!("installing {}: {e}", path.display()));
    path
}
