#!/usr/bin/env bash
# The driver layer's concurrency tests under ThreadSanitizer, on the nightly toolchain.
#
# What runs: the core's unit tests (ledger, pools, driver) and, on the cudarc backend over the
# simulated libcuda, the conformance suite (its thread cases: context races, the storm,
# device-pool record races) and the two-thread Wasmtime test. The interleaving tests are left
# out: their scheduler parks threads on std's Mutex/Condvar, which TSan cannot see here (below).
#
# Limits (why some reports are expected and suppressed): there is no rust-src on this machine, so
# std is not rebuilt with instrumentation. Synchronisation done inside std (Mutex, Condvar,
# thread::scope joins, the test harness's channels) is invisible to TSan, and data handed over
# through it can be reported as a race. Our own locks are `spin` (instrumented: built from
# source with the flags), so every report whose stacks stay in our code and `spin` is real.
# `scripts/tsan.supp` lists the std-only patterns suppressed; each report left is printed.
#
# Usage: scripts/tsan.sh      (a one-line summary at the end; exit 1 on an unsuppressed report)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "tsan: the nightly toolchain is not installed; skipped" >&2
    exit 0
fi
target="$(rustc -vV | sed -n 's/^host: //p')"
# The precompiled std is not instrumented: the ABI check would refuse to link it.
export RUSTFLAGS="-Zsanitizer=thread -Cunsafe-allow-abi-mismatch=sanitizer"
# As in asan.sh: line tables only, no incremental cache.
export CARGO_PROFILE_DEV_DEBUG=line-tables-only CARGO_PROFILE_DEV_STRIP=none CARGO_INCREMENTAL=0
export TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1 print_suppressions=1 suppressions=$PWD/scripts/tsan.supp"
log="$(mktemp)"
set +e
{
    cargo +nightly test --locked --target "$target" --target-dir target/tsan \
        -p tensor-wasm-mem-core --lib -- --skip interleavings
    cargo +nightly test --locked --target "$target" --target-dir target/tsan \
        -p tensor-wasm-mem-tests --test conformance -- with_cudarc
    cargo +nightly test --locked --target "$target" --target-dir target/tsan \
        -p tensor-wasm-mem-tests --test wasmtime_threads
} 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
passed=$({ grep -E '^test result:' "$log" || true; } | awk '{s += $4} END {print s + 0}')
failed=$({ grep -E '^test result:' "$log" || true; } | awk '{s += $6} END {print s + 0}')
reports=$(grep -c 'WARNING: ThreadSanitizer' "$log" || true)
# What was suppressed, per pattern, summed over the test binaries.
{ grep -E '^\s*[0-9]+ race:' "$log" || true; } | awk '{n[$2] += $1} END {for (p in n) print "tsan: suppressed " n[p] " x " p}' | sort
echo "tsan: $passed passed, $failed failed, $reports unsuppressed reports (exit $status)"
if [ "$status" -ne 0 ] && [ "$passed" -eq 0 ]; then
    # Prefixed, as CI keeps only the lines that start with `tsan:`.
    echo "tsan: the build failed; the first error lines and the machine's room:"
    { grep -E '^error|LLVM ERROR|No space|memory allocation|SIGKILL' "$log" || true; } | head -n 20 | sed 's/^/tsan: /'
    df -h . | tail -n 1 | sed 's/^/tsan: /'
    rm -f "$log"
    exit 1
fi
rm -f "$log"
if [ "$reports" -gt 0 ] || [ "$failed" -gt 0 ]; then
    exit 1
fi
