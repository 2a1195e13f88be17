//! Makes the workspace link and run cust with no CUDA installed.
//!
//! cust links `-lcuda` at link time. When `CUDA_LIBRARY_PATH` is the workspace's `.cuda-link`
//! folder (set by `.cargo/config.toml`), this script:
//! 1. builds the simulated libcuda (`tests/cuda-sim`, SONAME `libcuda.so.1`, a C-ABI shell over
//!    the driver model) into OUT_DIR with `tensor-wasm-mem-cuda-sim-build`;
//! 2. copies it to `.cuda-link/lib64/libtwm_cuda_sim.so` and writes `.cuda-link/lib64/libcuda.so`,
//!    a linker script naming that copy, so `-lcuda` resolves and binaries record `libcuda.so.1`
//!    as needed (as the real driver would give them); the copy outlives any target directory;
//! 3. when no real driver loads on this machine, puts a copy named `libcuda.so.1` in
//!    OUT_DIR/runtime and adds that folder to the native search path, which `cargo test` and
//!    `cargo run` put on the loader path. Where a real driver exists no such copy is made (a stale
//!    one is removed), so it can never shadow the real driver; binaries run outside cargo never
//!    see the folder.
//!
//! With any other `CUDA_LIBRARY_PATH` (a real CUDA install), it does nothing.

use std::path::{Path, PathBuf};

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

fn main() {
    println!("cargo:rerun-if-env-changed=CUDA_LIBRARY_PATH");
    println!("cargo:rerun-if-changed=build.rs");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest"));
    let workspace = manifest.join("..").join("..");
    let link_dir = workspace.join(".cuda-link");
    let Ok(configured) = std::env::var("CUDA_LIBRARY_PATH") else {
        return;
    };
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if !same(Path::new(&configured), &link_dir) {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let sim = tensor_wasm_mem_cuda_sim_build::build(&out, "libtwm_cuda_sim.so", false);

    // The linker script: written to a temporary file and renamed, so concurrent builds never
    // see half of it.
    let lib64 = link_dir.join("lib64");
    std::fs::create_dir_all(&lib64).expect("create .cuda-link/lib64");
    // The script names a copy beside it, not this build's OUT_DIR: every target directory
    // (debug, release, the sanitizer builds) shares the one script, and a target directory
    // deleted after its build must not leave the others linking against a missing file.
    let linked = lib64.join("libtwm_cuda_sim.so");
    let tmp = lib64.join(format!("libtwm_cuda_sim.so.{}.tmp", std::process::id()));
    std::fs::copy(&sim, &tmp).expect("copy the simulator beside the linker script");
    std::fs::rename(&tmp, &linked).expect("install the simulator beside the linker script");
    let script = format!(
        "/* Written by backends/cust/build.rs: -lcuda links the simulated libcuda. */\nINPUT({})\n",
        linked.display()
    );
    let tmp = lib64.join(format!("libcuda.so.{}.tmp", std::process::id()));
    std::fs::write(&tmp, script).expect("write the linker script");
    std::fs::rename(&tmp, lib64.join("libcuda.so")).expect("install the linker script");

    let runtime = out.join("runtime");
    let fallback = runtime.join("libcuda.so.1");
    if real_driver_present() {
        let _ = std::fs::remove_file(&fallback);
    } else {
        std::fs::create_dir_all(&runtime).expect("create OUT_DIR/runtime");
        let tmp = runtime.join("libcuda.so.1.tmp");
        std::fs::copy(&sim, &tmp).expect("copy the simulator");
        std::fs::rename(&tmp, &fallback).expect("install the fallback");
        println!("cargo:rustc-link-search=native={}", runtime.display());
    }
}
