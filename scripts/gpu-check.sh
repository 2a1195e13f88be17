#!/usr/bin/env bash
# The GPU validation kit: the same tests against a real driver, in one short run.
#
#   scripts/gpu-check.sh build            here (cargo): release builds of the conformance suite,
#                                         the guest-launched kernels, twm (cudarc) and gpu-check,
#                                         copied to gpu-kit/
#   scripts/gpu-check.sh run              on the GPU machine (no cargo): runs the kit against the
#                                         real driver and prints one short table; the full log
#                                         goes to $OUT/gpu-check.log (or gpu-kit/out/)
#   scripts/gpu-check.sh run --dry-run    here: the same run against the simulated libcuda
#
# GPU_KIT_PROFILE=dev builds (and dry-runs) the kit from the debug profile instead: CI checks the
# kit that way, reusing the test build instead of compiling Wasmtime once more in release. A kit
# for a GPU machine is built in release (the default).
#
# The kit never contains the simulator, so on the GPU machine only the real driver can load.
set -euo pipefail
cd "$(dirname "$0")/.."
kit=gpu-kit
mode="${1:-}"
profile="${GPU_KIT_PROFILE:-release}"
case "$profile" in
    release) out_dir=release ;;
    dev) out_dir=debug ;;
    *) echo "gpu-check: GPU_KIT_PROFILE is release or dev, not '$profile'" >&2; exit 2 ;;
esac

build() {
    rm -rf "$kit" && mkdir -p "$kit/bin"
    echo "gpu-check: building $profile binaries (this takes a few minutes)"
    cargo build --locked --profile "$profile" -q -p tensor-wasm-mem-tests --bin gpu-check
    # twm takes cudarc (libcuda loaded at run time): linking cust here needs a libcuda at link
    # time, which only the tests crate's build provides (see .cuda-link/lib64/README.md).
    cargo build --locked --profile "$profile" -q -p tensor-wasm-mem-cli --no-default-features \
        --features mock,cudarc
    local exe
    exe=$(cargo test --locked --profile "$profile" -q -p tensor-wasm-mem-tests --test conformance --no-run \
        --message-format=json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
    [ -n "$exe" ] || { echo "gpu-check: no conformance executable found" >&2; exit 1; }
    cp "$exe" "$kit/bin/conformance"
    exe=$(cargo test --locked --profile "$profile" -q -p tensor-wasm-mem-tests --test guest_kernels --no-run \
        --message-format=json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
    [ -n "$exe" ] || { echo "gpu-check: no guest_kernels executable found" >&2; exit 1; }
    cp "$exe" "$kit/bin/guest_kernels"
    cargo build --locked --profile "$profile" -q -p tensor-wasm-mem-tests --example scope_cudarc
    cp target/$out_dir/examples/scope_cudarc "$kit/bin/scope_cudarc"
    # The C guest the guest-launched kernels run (the GPU machine has no compiler): built here.
    mkdir -p "$kit/guests"
    clang --target=wasm32-wasi -O2 -Wall -Werror -I sdk/c -o "$kit/guests/saxpy.wasm" \
        tests/guests/saxpy.c
    cp target/$out_dir/gpu-check "$kit/bin/gpu-check"
    cp target/$out_dir/twm "$kit/bin/twm"
    strip "$kit"/bin/* 2>/dev/null || true
    cp scripts/gpu-check.sh "$kit/gpu-check.sh"
    du -sh "$kit" | sed 's/^/gpu-check: kit size /'
}

run() {
    local dry=0
    [ "${1:-}" = "--dry-run" ] && dry=1
    [ -x "$kit/bin/conformance" ] || { echo "gpu-check: no kit; run '$0 build' first" >&2; exit 1; }
    local out="${OUT:-$kit/out}"
    mkdir -p "$out"
    local log="$out/gpu-check.log"
    : > "$log"
    if [ "$dry" = 1 ]; then
        # The cust-linked binaries need a libcuda.so.1: the simulator that cargo would put on the
        # loader path (only built on machines without a driver; never part of the kit).
        local sim
        sim=$(ls -td target/$out_dir/build/tensor-wasm-mem-tests-*/out/runtime 2>/dev/null | head -n 1 || true)
        [ -n "$sim" ] || { echo "gpu-check: no simulated libcuda built (is there a real driver here?)" >&2; exit 1; }
        export LD_LIBRARY_PATH="$sim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "gpu-check: DRY RUN on the simulated libcuda" | tee -a "$log"
    fi
    local rows=() status=0
    row() { rows+=("$(printf '%-34s %s' "$1" "$2")"); }
    step() { # name, command...
        local name="$1"; shift
        echo "== $name: $*" >>"$log"
        if "$@" >>"$log" 2>&1; then return 0; else status=1; return 1; fi
    }
    if command -v nvidia-smi >/dev/null 2>&1; then
        step "nvidia-smi" nvidia-smi || true
        row "device" "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
    else
        row "device" "no nvidia-smi"
    fi
    for backend in cudarc cust; do
        if step "conformance $backend" "$kit/bin/conformance" "with_$backend::" --test-threads=1; then
            row "conformance ($backend)" "$(grep -E '^test result' "$log" | tail -n 1 | sed 's/test result: //; s/; finished.*//')"
        else
            row "conformance ($backend)" "FAILED (see $log)"
        fi
    done
    export TWM_C_GUESTS_DIR="$PWD/$kit/guests"
    if step "guest-launched kernels" "$kit/bin/guest_kernels" --test-threads=1; then
        row "guest-launched kernels (PTX)" "$(grep -E '^test result' "$log" | tail -n 1 | sed 's/test result: //; s/; finished.*//')"
    else
        row "guest-launched kernels (PTX)" "FAILED (see $log)"
    fi
    if step "cudarc interop" "$kit/bin/scope_cudarc"; then
        row "cudarc's types over a scope" "$(grep -E '^cudarc launched' "$log" | tail -n 1)"
    else
        row "cudarc's types over a scope" "FAILED (see $log)"
    fi
    if step "twm probe" "$kit/bin/twm" probe --backend cudarc; then
        row "twm probe --backend cudarc" "$(grep -E '^driver ' "$log" | tail -n 1 | sed 's/^driver *//')"
    else
        row "twm probe --backend cudarc" "FAILED"
    fi
    if step "twm demo" "$kit/bin/twm" demo --backend cudarc; then
        row "twm demo --backend cudarc" "$(grep -E 'back to zero' "$log" | tail -n 1)"
    else
        row "twm demo --backend cudarc" "FAILED"
    fi
    echo "== gpu-check" >>"$log"
    local checks
    if checks=$("$kit/bin/gpu-check" 2>&1); then :; else status=1; fi
    echo "$checks" >>"$log"
    echo
    printf '%s\n' "${rows[@]}"
    echo "$checks"
    echo
    echo "gpu-check: full log in $log"
    return "$status"
}

case "$mode" in
    build) build ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 build | run [--dry-run]" >&2; exit 2 ;;
esac
