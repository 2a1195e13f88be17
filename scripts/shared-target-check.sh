#!/usr/bin/env bash
# Two checkouts that share a target directory (CI caches, sccache-style setups, a
# CARGO_TARGET_DIR set for every clone) share compiled artifacts: cargo gives a workspace
# member the same artifact wherever its checkout is, and takes it as fresh by its files' times.
# So nothing compiled may name the checkout that built it (a build script's inputs, a test's
# files), or the other checkout's build breaks once the first is gone. This builds and runs the
# tests that read the workspace's files from a second clone (of the committed tree) into the
# same target directory, removes that clone, and runs them again here: they must pass both
# times. Run by .ci/run; needs git and cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git clone -q --local "$root" "$scratch/second"
# The tests that find files of the workspace (sources, C guests, the SDK header), through the
# tests crate whose build script builds the simulated libcuda.
tests=(--workspace --test style --test c_guests --test sdk --test runner)
# Runs the tests in folder $1, showing their summary lines (all output if they fail).
run_tests() {
    local log="$scratch/log"
    if ! (cd "$1" && cargo test --locked -q "${tests[@]}") >"$log" 2>&1; then
        cat "$log" >&2
        echo "the tests failed in $1" >&2
        exit 1
    fi
    grep -E '^test result:' "$log"
}
echo "-- in a second checkout ($scratch/second), target $CARGO_TARGET_DIR"
run_tests "$scratch/second"
rm -rf "$scratch/second"
echo "-- here, the second checkout gone"
run_tests "$root"
echo "two checkouts shared $CARGO_TARGET_DIR"
