//! Builds the simulated libcuda (`cuda-sim`, a C-ABI shell over the driver model) as shared
//! libraries with the SONAME `libcuda.so.1`, in OUT_DIR, and
//! 1. tells the tests where they are (`TWM_CUDA_SIM_PATH`, `TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH`,
//!    baked in at compile time: no environment needed at run time); the cudarc harness loads
//!    the driver from there where no real one loads;
//! 2. makes `-lcuda` resolve for the binaries that link cust (this crate's tests and the GPU
//!    kit): `.cargo/config.toml` points cust at `.cuda-link/`, whose `lib64/libcuda.so` is a
//!    committed linker script naming `-ltwm_cuda_sim`, found in OUT_DIR/link (so binaries record
//!    the simulator's SONAME, `libcuda.so.1`, as the real driver would give them);
//! 3. when no real driver loads on this machine, puts a copy named `libcuda.so.1` in
//!    OUT_DIR/runtime, on the native search path, which `cargo test` and `cargo run` put on the
//!    loader path. Where a real driver exists no such copy is made (a stale one is removed), so
//!    it can never shadow the real driver; binaries run outside cargo never see the folder.
//!
//! Nothing is written outside OUT_DIR, and no file here is named `libcuda.so`. A copy of this
//! crate outside its workspace (the one `cargo package` verifies) has no simulator to build: the
//! paths then name what is missing, and the tests that load it fail saying so.

use std::path::{Path, PathBuf};
use std::process::Command;

// The simulator is built by a `cargo build` of `tests/cuda-sim`, with the calling cargo, into a
// target directory of its own inside OUT_DIR, then copied out of it. The workspace is found from
// this build's own environment (`CARGO_MANIFEST_DIR`), never from a path baked into a compiled
// library, so two checkouts may share a target directory. The nested build is plain: this build's `RUSTFLAGS` (a sanitizer build's, say) are
// not passed on, so the simulator is the same uninstrumented library under every build.

/// Builds the simulator of the workspace at `workspace` (with the package feature
/// `without-prefetch` when `without_prefetch`) and copies it to `out_dir/file_name`; returns that
/// path. Panics with the build's output if it fails (a build script has no better way to
/// report).
fn build_sim(workspace: &Path, out_dir: &Path, file_name: &str, without_prefetch: bool) -> PathBuf {
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
    // Inside OUT_DIR: a build script writes nowhere else. Both variants share it (built one
    // after the other, each copied out before the next).
    let target = out_dir.join("cuda-sim-target");
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
    // This build's flags, target and profile settings are its own, not the nested build's.
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

fn real_driver_present() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        // SAFETY: loading the driver library runs its initialisers; nothing is called.
        match unsafe { libloading::Library::new(*name) } {
            // SAFETY: only looks a symbol up.
            Ok(lib) => unsafe { lib.get::<unsafe extern "C" fn()>("twm_sim_reset") }.is_err(),
            Err(_) => false,
        }
    })
}

/// Copies `from` to `dir/name` (through a temporary file, so a concurrent build never sees half
/// of it).
fn install(from: &Path, dir: &Path, name: &str) {
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::copy(from, &tmp).unwrap_or_else(|e| panic!("copying {}: {e}", from.display()));
    std::fs::rename(&tmp, dir.join(name)).unwrap_or_else(|e| panic!("installing {name}: {e}"));
}

/// The modules whose cases make the conformance suite, in the order they run.
const CASE_MODULES: [&str; 4] = ["recovery", "suite", "books", "races"];

/// Writes `OUT_DIR/cases.rs`: the function `cases::<H>()`, every conformance case on a harness,
/// derived from the sources. A case is a `pub fn name<H: Harness>()` of one of
/// [`CASE_MODULES`], each on one line; any other `pub fn` there generic over `H` stops the build,
/// so a case can be neither left out nor listed by hand.
fn write_cases(manifest: &Path, out: &Path) {
    let mut entries = String::new();
    for module in CASE_MODULES {
        let path = manifest.join("src").join(format!("{module}.rs"));
        println!("cargo:rerun-if-changed={}", path.display());
        let source = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        for line in source.lines() {
            let Some(rest) = line.strip_prefix("pub fn ") else {
                continue;
            };
            let Some((name, signature)) = rest.split_once('<') else {
                continue;
            };
            if !signature.starts_with("H") {
                continue;
            }
            assert!(
                signature.starts_with("H: Harness>() {"),
                "{}: `{line}`: a conformance case is `pub fn name<H: Harness>()` on one line",
                path.display()
            );
            entries.push_str(&format!(
                "        (\"{name}\", crate::{module}::{name}::<H> as fn()),\n"
            ));
        }
    }
    let cases = format!(
        "/// Every conformance case on `H`, by name: generated by `build.rs` from every\n\
         /// `pub fn name<H: Harness>()` of the suite's modules (`recovery`, `suite`, `books`,\n\
         /// `races`). [`conformance!`] expands to it.\n\
         #[must_use]\n\
         pub fn cases<H: Harness>() -> Vec<runner::Case> {{\n    vec![\n{entries}    ]\n}}\n"
    );
    std::fs::write(out.join("cases.rs"), cases).expect("writing cases.rs");
}

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    write_cases(&manifest, &out);
    let workspace = manifest.join("..");
    if !workspace.join("tests/cuda-sim/Cargo.toml").is_file() {
        println!(
            "cargo:warning=no tensor-wasm-mem workspace around {}: the simulated libcuda is not built",
            manifest.display()
        );
        for env_name in ["TWM_CUDA_SIM_PATH", "TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH"] {
            println!(
                "cargo:rustc-env={env_name}=<no simulated libcuda: built outside the workspace>"
            );
        }
        return;
    }
    let mut sim = PathBuf::new();
    for (env_name, file, without_prefetch) in [
        ("TWM_CUDA_SIM_PATH", "libtwm_cuda_sim.so", false),
        (
            "TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH",
            "libtwm_cuda_sim_without_prefetch.so",
            true,
        ),
    ] {
        let path = build_sim(&workspace, &out, file, without_prefetch);
        println!("cargo:rustc-env={env_name}={}", path.display());
        if !without_prefetch {
            sim = path;
        }
    }
    let link = out.join("link");
    install(&sim, &link, "libtwm_cuda_sim.so");
    println!("cargo:rustc-link-search=native={}", link.display());
    let runtime = out.join("runtime");
    if real_driver_present() {
        let _ = std::fs::remove_file(runtime.join("libcuda.so.1"));
    } else {
        install(&sim, &runtime, "libcuda.so.1");
        println!("cargo:rustc-link-search=native={}", runtime.display());
    }
}
