#!/usr/bin/env bash
# The core, mock and Wasmtime-integration test suites under AddressSanitizer (with LeakSanitizer),
# on the nightly toolchain (no rust-src needed: std itself is not instrumented, our code and every
# dependency are). `--target` keeps build scripts and proc-macros uninstrumented, as
# -Zsanitizer requires. Doc tests are left out (rustdoc would need the flags too), and so is the
# compile-fail test (its expected messages are the stable compiler's, not nightly's).
#
# Usage: scripts/asan.sh            (prints a one-line summary at the end)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "asan: the nightly toolchain is not installed; skipped" >&2
    exit 0
fi
target="$(rustc -vV | sed -n 's/^host: //p')"
export RUSTFLAGS="-Zsanitizer=address"
# Line tables are enough for the reports' stacks, and keep the instrumented build's disk and link
# memory small (full debug info made CI's ASan build of one test run out of room once); no
# incremental cache for a one-off build.
export CARGO_PROFILE_DEV_DEBUG=line-tables-only CARGO_PROFILE_DEV_STRIP=none CARGO_INCREMENTAL=0
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
log="$(mktemp)"
set +e
cargo +nightly test --locked --target "$target" --target-dir target/asan \
    -p tensor-wasm-mem-core -p tensor-wasm-mem-mock -p tensor-wasm-mem-wasmtime \
    --lib --tests -- --skip device_slices_cannot_outlive_their_store 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
passed=$({ grep -E '^test result:' "$log" || true; } | awk '{s += $4} END {print s + 0}')
failed=$({ grep -E '^test result:' "$log" || true; } | awk '{s += $6} END {print s + 0}')
reports=$(grep -c 'ERROR: AddressSanitizer\|ERROR: LeakSanitizer' "$log" || true)
if [ "$status" -ne 0 ]; then
    # What went wrong, where a caller keeps only the last lines of this output.
    echo "asan: failed; the first error lines and the machine's room:"
    { grep -E '^error|LLVM ERROR|No space|memory allocation|SIGKILL|panicked' "$log" || true; } | head -n 20
    df -h . | tail -n 1
    grep MemAvailable /proc/meminfo || true
fi
echo "asan: $passed passed, $failed failed, $reports sanitizer reports (exit $status)"
rm -f "$log"
exit "$status"
