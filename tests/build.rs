//! Builds the simulated libcuda (`cuda-sim/src/lib.rs`) as shared libraries with the SONAME
//! `libcuda.so.1`, in OUT_DIR, and tells the tests where they are (`TWM_CUDA_SIM_PATH`,
//! `TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH`, baked in at compile time: no environment needed at run
//! time). The files are never named `libcuda.so`, so they cannot shadow a real driver.

include!("cuda-sim/build_sim.rs");

fn main() {
    let manifest = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest"));
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let sim_src = manifest.join("cuda-sim").join("src");
    for (env_name, file, cfg) in [
        ("TWM_CUDA_SIM_PATH", "libtwm_cuda_sim.so", None),
        (
            "TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH",
            "libtwm_cuda_sim_without_prefetch.so",
            Some("twm_sim_without_prefetch"),
        ),
    ] {
        let path = build_cuda_sim(&sim_src, &out, file, cfg);
        println!("cargo:rustc-env={env_name}={}", path.display());
    }
}
