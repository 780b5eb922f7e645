#!/usr/bin/env bash
# cohort vs PyTorch all_reduce on gloo, side by side in one run: the two
# alternate REPS times at each size so both see the same machine noise, and
# the medians and their ratio are printed. OP is sum, min or max; SIZES (in
# the environment) the bytes to time.
#
#   bench/collectives/compare.sh [BUILD_DIR] [WORLD] [REPS] [OP]
set -euo pipefail
build=${1:-build}
world=${2:-2}
reps=${3:-5}
op=${4:-sum}
here=$(cd "$(dirname "$0")" && pwd)
run="$build/tools/cohortrun/cohortrun"
bench="$build/tools/cohort-bench/cohort-bench"
read -r -a sizes <<<"${SIZES:-1048576 16777216}"
export OPENBLAS_NUM_THREADS=1
# cohortrun hands rank 0 a listening socket that PyTorch cannot take: the
# PyTorch side gets a free port of its own.
free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

for ((r = 0; r < reps; r++)); do
  for s in "${sizes[@]}"; do
    "$run" -n "$world" --quiet-others -- "$bench" collectives --backend gloo --json --reduce-op "$op" \
      --min-bytes "$s" --max-bytes "$s" | sed 's/^\[0\] //' >>"$out/cohort.jsonl"
    "$run" -n "$world" --master-port "$(free_port)" --quiet-others -- /usr/bin/python3 "$here/torch_collectives.py" --reduce-op "$op" \
      --min-bytes "$s" --max-bytes "$s" | sed 's/^\[0\] //' >>"$out/torch.jsonl"
  done
done

/usr/bin/python3 - "$out" "$world" "$reps" "$op" <<'PY'
import json, statistics, sys
out, world, reps, op = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
def load(name):
    rows = {}
    for line in open(f"{out}/{name}.jsonl"):
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            rows.setdefault(r["bytes"], []).append(r["busbw_gbs"])
    return rows
c, t = load("cohort"), load("torch")
print(f"all_reduce {op}, gloo, world {world}, median of {reps} alternating runs (busbw GB/s)")
print(f"{'bytes':>10} {'cohort':>8} {'torch':>8} {'ratio':>6}")
for b in sorted(c):
    cm, tm = statistics.median(c[b]), statistics.median(t[b])
    print(f"{b:>10} {cm:8.3f} {tm:8.3f} {cm / tm:6.2f}")
PY
