//! Real guests: the C programs under `tests/guests/`, built at test time with clang for
//! `wasm32-wasi` against wasi-libc and the SDK header `sdk/c/twm.h`.
//!
//! The toolchain is Debian's `clang`, `lld`, `wasi-libc` and `libclang-rt-14-dev-wasm32`
//! (`.ci/run` installs them). Where it is missing, [`c_guest`] says so loudly on stderr and
//! returns `None`, so `cargo test` still passes on a machine with only Rust; with
//! `TWM_REQUIRE_C_GUESTS=1` (set by `.ci/run`) a missing toolchain fails the test instead.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock, PoisonError};

/// The compiler: `$TWM_CLANG`, or `clang` on the path.
fn clang() -> String {
    std::env::var("TWM_CLANG").unwrap_or_else(|_| "clang".to_owned())
}

/// The source of a guest.
#[must_use]
pub fn source(name: &str) -> PathBuf {
    crate::workspace_root()
        .join("tests")
        .join("guests")
        .join(format!("{name}.c"))
}

fn unavailable(why: &str) -> Option<PathBuf> {
    let message = format!(
        "C guests need clang with a wasm32-wasi sysroot (Debian: apt-get install clang lld \
         wasi-libc libclang-rt-14-dev-wasm32): {why}"
    );
    if std::env::var_os("TWM_REQUIRE_C_GUESTS").is_some_and(|v| v == "1") {
        panic!("{message}");
    }
    eprintln!("SKIPPED (no C toolchain for wasm32-wasi): {message}");
    None
}

/// Builds `tests/guests/<name>.c` (once per process) and returns the `.wasm` path, or `None`
/// (after saying why on stderr) where the toolchain is missing. Where `$TWM_C_GUESTS_DIR` is
/// set (the GPU kit, which carries guests built beforehand and no compiler), the guest is
/// `$TWM_C_GUESTS_DIR/<name>.wasm`, and a missing one is a failure.
pub fn c_guest(name: &str) -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("TWM_C_GUESTS_DIR") {
        let wasm = Path::new(&dir).join(format!("{name}.wasm"));
        assert!(wasm.is_file(), "no prebuilt guest {}", wasm.display());
        return Some(wasm);
    }
    static BUILT: OnceLock<Mutex<HashMap<String, Option<PathBuf>>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(path) = built.get(name) {
        return path.clone();
    }
    let path = build(name);
    built.insert(name.to_owned(), path.clone());
    path
}

/// Whether clang can build a wasi-libc program here (checked once, on a probe program), or
/// why not.
fn toolchain() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let dir = Path::new(env!("OUT_DIR")).join("c-guests");
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            let probe = dir.join("probe.c");
            std::fs::write(
                &probe,
                "#include <stdio.h>\nint main(void) { puts(\"ok\"); }\n",
            )
            .map_err(|e| format!("{}: {e}", probe.display()))?;
            let output = Command::new(clang())
                .args(["--target=wasm32-wasi", "-o"])
                .arg(dir.join("probe.wasm"))
                .arg(&probe)
                .output()
                .map_err(|e| format!("cannot run {}: {e}", clang()))?;
            if output.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "{} cannot build a wasi-libc program: {}",
                    clang(),
                    String::from_utf8_lossy(&output.stderr)
                ))
            }
        })
        .clone()
}

fn build(name: &str) -> Option<PathBuf> {
    if let Err(why) = toolchain() {
        return unavailable(&why);
    }
    let wasm = Path::new(env!("OUT_DIR"))
        .join("c-guests")
        .join(format!("{name}.wasm"));
    let output = Command::new(clang())
        .args(["--target=wasm32-wasi", "-O2", "-Wall", "-Werror", "-I"])
        .arg(crate::workspace_root().join("sdk").join("c"))
        .arg("-o")
        .arg(&wasm)
        .arg(source(name))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", clang()));
    assert!(
        output.status.success(),
        "building {name}.c failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(wasm)
}

/// Runs the WASI command `wasm` (its `_start`) for `tenant` on `creator`, with the `twm` and
/// WASI imports, `argv`, `env` and its stdout captured: its exit status and stdout. A trap that
/// is not an exit panics.
pub fn run_command<B: tensor_wasm_mem_wasmtime::Backend>(
    creator: &tensor_wasm_mem_wasmtime::TensorWasmMemoryCreator<B>,
    wasm: &Path,
    tenant: &std::sync::Arc<tensor_wasm_mem_wasmtime::Tenant>,
    argv: &[&str],
    env: &[(&str, &str)],
) -> (i32, String) {
    use tensor_wasm_mem_wasmtime::wasi::wasmtime_wasi::p2::pipe::MemoryOutputPipe;
    use tensor_wasm_mem_wasmtime::wasi::{WasiCtxBuilder, add_wasi_to_linker, exit_code};
    use tensor_wasm_mem_wasmtime::wasmtime::{Linker, Module};
    use tensor_wasm_mem_wasmtime::{
        ChargeMode, TenantStore, add_to_linker, instantiate, new_store,
    };
    let engine = creator.engine().expect("engine");
    let mut linker = Linker::new(&engine);
    add_to_linker(&mut linker).expect("twm");
    add_wasi_to_linker(&mut linker).expect("wasi");
    let module = Module::from_file(&engine, wasm).expect("module");
    let stdout = MemoryOutputPipe::new(1 << 20);
    let mut wasi = WasiCtxBuilder::new();
    wasi.args(argv).stdout(stdout.clone());
    for (key, value) in env {
        wasi.env(key, value);
    }
    let mut store = new_store(
        &engine,
        TenantStore::new(creator, tenant, ChargeMode::Touched, wasi.build_p1()),
    );
    let instance = instantiate(&mut store, &linker, &module).expect("instance");
    let start = instance
        .get_typed_func::<(), ()>(&mut store, "_start")
        .expect("a command module");
    let status = match start.call(&mut store, ()) {
        Ok(()) => 0,
        Err(e) => exit_code(&e).unwrap_or_else(|| panic!("{} trapped: {e:#}", wasm.display())),
    };
    drop(store);
    (
        status,
        String::from_utf8_lossy(&stdout.contents()).into_owned(),
    )
}
