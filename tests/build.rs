//! Builds the simulated libcuda (`cuda-sim/src/lib.rs`) as shared libraries with the SONAME
//! `libcuda.so.1`, in OUT_DIR, and tells the tests where they are (`TWM_CUDA_SIM_PATH`,
//! `TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH`, baked in at compile time: no environment needed at run
//! time). The files are never named `libcuda.so`, so they cannot shadow a real driver.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let sim_dir = manifest.join("cuda-sim").join("src");
    for file in ["lib.rs", "abi.rs"] {
        println!("cargo:rerun-if-changed={}", sim_dir.join(file).display());
    }
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    for (env_name, file, cfg) in [
        ("TWM_CUDA_SIM_PATH", "libtwm_cuda_sim.so", None),
        (
            "TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH",
            "libtwm_cuda_sim_without_prefetch.so",
            Some("twm_sim_without_prefetch"),
        ),
    ] {
        let path = out.join(file);
        let mut cmd = Command::new(&rustc);
        cmd.args([
            "--edition",
            "2024",
            "--crate-type",
            "cdylib",
            "--crate-name",
            "twm_cuda_sim",
            "-C",
            "opt-level=1",
            "-C",
            "debuginfo=0",
            "-C",
            "link-arg=-Wl,-soname,libcuda.so.1",
            "--cap-lints",
            "warn",
        ]);
        if let Some(cfg) = cfg {
            cmd.args(["--cfg", cfg]);
        }
        cmd.arg("-o").arg(&path).arg(sim_dir.join("lib.rs"));
        let status = cmd
            .status()
            .unwrap_or_else(|e| panic!("running {rustc} to build the simulated libcuda: {e}"));
        assert!(
            status.success(),
            "building the simulated libcuda failed: {status}"
        );
        println!("cargo:rustc-env={env_name}={}", path.display());
    }
}
