// Shared by the build scripts that need the simulated libcuda (`tests/build.rs`,
// `backends/cust/build.rs`), through `include!`: compiles `src/lib.rs` of this directory with
// rustc into a cdylib whose SONAME is `libcuda.so.1`.

/// Builds the simulator from `sim_src` (the `src` folder of `tests/cuda-sim`) into
/// `out_dir/file_name`, with `cfg` set if given, and returns the library's path.
fn build_cuda_sim(
    sim_src: &std::path::Path,
    out_dir: &std::path::Path,
    file_name: &str,
    cfg: Option<&str>,
) -> std::path::PathBuf {
    for file in ["lib.rs", "abi.rs"] {
        println!("cargo:rerun-if-changed={}", sim_src.join(file).display());
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let path = out_dir.join(file_name);
    let mut cmd = std::process::Command::new(&rustc);
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
    cmd.arg("-o").arg(&path).arg(sim_src.join("lib.rs"));
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running {rustc} to build the simulated libcuda: {e}"));
    assert!(status.success(), "building the simulated libcuda failed: {status}");
    path
}
