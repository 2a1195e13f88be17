#!/usr/bin/env bash
# Instructions per instantiate+call+drop life, by function: a count that noise cannot move.
#
#   scripts/instructions.sh SETUP [BASELINE]
#
# Runs `twm bench --lives-of SETUP --lives N` under valgrind's callgrind for two counts of lives
# and divides the difference by the difference of lives, so what the process does once (the
# engine, the compilation, the pool) cancels out. With BASELINE (another `instantiate_us` key,
# such as `no_memory_floor`), prints what SETUP executes per life beyond it, by function.
# SETUP and BASELINE are the bench's `--json` keys.
#
# It is a complement to the timed rows of `twm bench`, not a substitute: an instruction is not
# a nanosecond (a cache line fetched from the other core costs no instruction, a memset of
# 64 KiB costs bandwidth), but on a machine too noisy to time a change of 5%, it shows whether a
# change took work off the path, and where. valgrind runs `memset`'s `rep stosb` one byte per
# counted instruction: the scrub's line is its bytes, reported apart.
#
# Needs valgrind (Debian: `apt-get install valgrind`), python3 and a release twm
# (`cargo build --release -p tensor-wasm-mem-cli`; TWM overrides the path).
set -euo pipefail
cd "$(dirname "$0")/.."
setup="${1:?usage: scripts/instructions.sh SETUP [BASELINE]}"
baseline="${2:-}"
twm="${TWM:-target/release/twm}"
few="${FEW:-1000}"
many="${MANY:-6000}"
[ -x "$twm" ] || { echo "instructions: no $twm (cargo build --release -p tensor-wasm-mem-cli)" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "instructions: valgrind is not installed" >&2; exit 2; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

count() {
    local key="$1" lives="$2"
    valgrind --tool=callgrind --callgrind-out-file="$out/$key.$lives" \
        "$twm" bench --lives-of "$key" --lives "$lives" >/dev/null 2>"$out/$key.$lives.log" || {
        cat "$out/$key.$lives.log" >&2
        exit 1
    }
    callgrind_annotate --threshold=100 "$out/$key.$lives" >"$out/$key.$lives.txt"
}

for key in "$setup" ${baseline:+"$baseline"}; do
    count "$key" "$few"
    count "$key" "$many"
done

python3 - "$out" "$setup" "$baseline" "$few" "$many" <<'PY'
import collections, re, sys
out, setup, baseline, few, many = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

def load(key, lives):
    counts = collections.Counter()
    for line in open(f"{out}/{key}.{lives}.txt"):
        m = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(.*)", line)
        if not m or "PROGRAM TOTALS" in line:
            continue
        name = re.sub(r" \[[^\]]*\]$", "", m.group(2))
        name = re.sub(r"^(\?\?\?|\.?/\S*?):", "", name, count=1)
        counts[name] += int(m.group(1).replace(",", ""))
    return counts

def per_life(key):
    a, b = load(key, few), load(key, many)
    return {k: (b[k] - a[k]) / (many - few) for k in set(a) | set(b)}

def split(counts):
    scrub = sum(v for k, v in counts.items() if "memset" in k)
    return sum(counts.values()) - scrub, scrub

s = per_life(setup)
work, scrub = split(s)
print(f"{setup}: {work:,.0f} instructions per life, and memset's {abs(scrub):,.0f} (bytes zeroed)")
if baseline:
    b = per_life(baseline)
    bwork, bscrub = split(b)
    print(f"{baseline}: {bwork:,.0f} instructions per life, and memset's {abs(bscrub):,.0f}")
    print(f"{setup} beyond {baseline}: {work - bwork:,.0f} instructions per life (memset apart)")
    rows = sorted(((s.get(k, 0) - b.get(k, 0), k) for k in set(s) | set(b)), reverse=True)
    print(f"{'beyond':>9} {'in all':>9}  function")
    for d, k in rows:
        if abs(d) >= 10 and "memset" not in k:
            print(f"{d:9.0f} {s.get(k, 0):9.0f}  {k[:140]}")
PY
