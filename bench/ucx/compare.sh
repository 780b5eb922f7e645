#!/usr/bin/env bash
# compare.sh: cohort's UCX engine beside its Gloo and MPI engines and a plain
# MPI_Allreduce loop, in one run: world 2, float32 sum all_reduce at 1 KiB,
# 64 KiB, 1 MiB and 16 MiB. Each repetition runs the four back to back at
# every size, so all see the same machine load; the table shows medians.
#
#   bench/ucx/compare.sh [BUILD_DIR]      (default: build; REPS=5)
#
# ROWS=FILE keeps every run's JSON row in FILE (the table shows medians).
# BASELINE=PATH also runs another cohort-bench binary (a copy of an earlier
# build) right after this build's over each engine, as "mpi-base",
# "ucx-base" and "gloo-base": an A/B of two versions, alternated, in one
# table. SIZES="1024" limits the sizes (bytes; default all four).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
reps=${REPS:-5}
loop=$build/bench/mpi/mpi_allreduce_loop
bench=$build/tools/cohort-bench/cohort-bench
run=$build/tools/cohortrun/cohortrun
for exe in "$loop" "$bench" "$run"; do
  [[ -x $exe ]] || { echo "compare.sh: $exe is not built" >&2; exit 2; }
done

mpirun=(mpirun -np 2 --oversubscribe)
[[ $(id -u) == 0 ]] && mpirun+=(--allow-run-as-root)
export OPENBLAS_NUM_THREADS=1
all_sizes=(1024 65536 1048576 16777216)
all_iters=(5000 1000 100 20)  # same for all; enough for ~10 ms per measurement
sizes=() iters=()
for i in "${!all_sizes[@]}"; do
  [[ " ${SIZES:-${all_sizes[*]}} " == *" ${all_sizes[$i]} "* ]] || continue
  sizes+=("${all_sizes[$i]}")
  iters+=("${all_iters[$i]}")
done

base=${BASELINE:-}
[[ -z $base || -x $base ]] || { echo "compare.sh: $base is not executable" >&2; exit 2; }
if [[ -n ${ROWS:-} ]]; then
  rows=$ROWS
  : >"$rows"
else
  rows=$(mktemp)
  trap 'rm -f "$rows"' EXIT
fi
for ((rep = 1; rep <= reps; ++rep)); do
  for i in "${!sizes[@]}"; do
    b=${sizes[$i]}
    n=${iters[$i]}
    args=(collectives --op all_reduce --json --min-bytes "$b" --max-bytes "$b" --iters "$n"
          --warmup 3)
    timeout 120 "${mpirun[@]}" "$loop" --json --iters "$n" "$b" >>"$rows"
    timeout 120 "${mpirun[@]}" "$bench" "${args[@]}" --backend mpi >>"$rows"
    if [[ -n $base ]]; then
      timeout 120 "${mpirun[@]}" "$base" "${args[@]}" --backend mpi |
        sed 's/"backend":"mpi"/"backend":"mpi-base"/' >>"$rows"
    fi
    for engine in ucx gloo; do
      timeout 120 "$run" -n 2 --quiet-others -- "$bench" "${args[@]}" --backend $engine >>"$rows"
      if [[ -n $base ]]; then
        timeout 120 "$run" -n 2 --quiet-others -- "$base" "${args[@]}" --backend $engine |
          sed "s/\"backend\":\"$engine\"/\"backend\":\"$engine-base\"/" >>"$rows"
      fi
    done
  done
  echo "compare.sh: repetition $rep of $reps done" >&2
done

python3 - "$rows" "$reps" "${sizes[*]}" ${base:+mpi-base ucx-base gloo-base} <<'PY'
import json, statistics, sys
# cohortrun prefixes each line with its rank ("[0] ").
rows = [json.loads(l[l.index("{"):]) for l in open(sys.argv[1]) if "{" in l]
def med(backend, b, key):
    v = [r[key] for r in rows if r["backend"] == backend and r["bytes"] == b]
    return statistics.median(v) if v else float("nan")
names = ("plain-mpi", "mpi", "ucx", "gloo") + tuple(sys.argv[4:])
print(f"# world 2, float32 sum all_reduce, medians of {sys.argv[2]} runs")
print(f"{'bytes':>10} " + " ".join(f"{n + ' us':>12}" for n in names) + " " +
      " ".join(f"{n + ' GB/s':>14}" for n in names))
for b in map(int, sys.argv[3].split()):
    us = [med(n, b, "us") for n in names]
    bw = [med(n, b, "busbw_gbs") for n in names]
    print(f"{b:>10} " + " ".join(f"{u:>12.2f}" for u in us) + " " +
          " ".join(f"{x:>14.3f}" for x in bw))
PY
