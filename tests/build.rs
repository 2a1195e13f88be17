//! Builds the simulated libcuda (`cuda-sim`, a C-ABI shell over the driver model) as shared
//! libraries with the SONAME `libcuda.so.1`, in OUT_DIR, and tells the tests where they are
//! (`TWM_CUDA_SIM_PATH`, `TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH`, baked in at compile time: no
//! environment needed at run time). The files are never named `libcuda.so`, so they cannot
//! shadow a real driver.

fn main() {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    for (env_name, file, without_prefetch) in [
        ("TWM_CUDA_SIM_PATH", "libtwm_cuda_sim.so", false),
        (
            "TWM_CUDA_SIM_WITHOUT_PREFETCH_PATH",
            "libtwm_cuda_sim_without_prefetch.so",
            true,
        ),
    ] {
        let path = tensor_wasm_mem_cuda_sim_build::build(&out, file, without_prefetch);
        println!("cargo:rustc-env={env_name}={}", path.display());
    }
}
