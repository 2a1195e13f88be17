#!/usr/bin/env bash
# Reports Wasmtime releases this workspace has not taken: newer patch releases of the major in
# Cargo.lock (take them: `cargo update -p wasmtime`, then the full tests and `twm bench`), and
# newer majors with the Rust version they need. Run by hand or on a schedule; it is not a CI
# gate (someone else's release day must not turn our CI red). Needs only cargo and the registry.
# Exit status: 0 nothing newer in our major, 10 a newer patch release is out, 11 one is out
# but does not resolve yet (not every crate it pins is published), 1 the registry could not be
# asked.
set -euo pipefail
cd "$(dirname "$0")/.."

locked() { # the version of package $1 in Cargo.lock
    awk -v name="$1" '$0 == "name = \"" name "\"" { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock
}
newest() { # "<newest matching $2> <latest> <rust-version>" of package $1
    local info
    info=$(cd "${TMPDIR:-/tmp}" && cargo info "$1@$2" 2>/dev/null) || return 1
    local version latest rust
    version=$(sed -n 's/^version: \([^ ]*\).*/\1/p' <<<"$info" | head -n 1)
    latest=$(sed -n 's/^version: .*(latest \([^)]*\)).*/\1/p' <<<"$info" | head -n 1)
    rust=$(sed -n 's/^rust-version: //p' <<<"$info" | head -n 1)
    echo "$version ${latest:-$version} ${rust:-unknown}"
}

status=0
for package in wasmtime wasmtime-wasi; do
    ours=$(locked "$package")
    [ -n "$ours" ] || { echo "$package: not in Cargo.lock" >&2; exit 1; }
    major=${ours%%.*}
    read -r patch latest _ < <(newest "$package" "$major") || {
        echo "$package: the registry did not answer" >&2
        exit 1
    }
    if [ "$patch" != "$ours" ]; then
        # A release is published crate by crate: until every crate it pins is on the registry,
        # it does not resolve (48.0.11 on 2026-12-05: wasmtime-internal-wit-bindgen was not).
        if why=$(cargo update --dry-run -p "$package" --precise "$patch" 2>&1); then
            echo "$package: Cargo.lock has $ours; $patch is out (same major): take it"
            status=10
        else
            echo "$package: Cargo.lock has $ours; $patch is out but does not resolve yet: $(grep -m1 '^error' <<<"$why")"
            [ "$status" = 10 ] || status=11
        fi
    else
        echo "$package: Cargo.lock has $ours, the newest $major.x"
    fi
    if [ "$latest" != "$patch" ]; then
        read -r _ _ rust < <(newest "$package" "$latest") || rust=unknown
        echo "$package: newest major $latest needs rustc $rust (ours: $(rustc --version | cut -d' ' -f2))"
    fi
done
if [ -d third_party/wiggle ]; then
    echo "third_party/wiggle is patched until a wasmtime-wasi newer than $(locked wasmtime-wasi) is published (third_party/README.md)"
fi
exit "$status"
