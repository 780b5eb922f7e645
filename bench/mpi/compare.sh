#!/usr/bin/env bash
# compare.sh: cohort's MPI engine against a plain MPI_Allreduce loop, side by
# side in one run: world 2, float32 sum at 1 KiB, 64 KiB, 1 MiB and 16 MiB.
# Each repetition runs the two programs back to back at every size, so both
# see the same machine load; the table shows medians over the repetitions.
#
#   bench/mpi/compare.sh [BUILD_DIR]      (default: build-mpi; REPS=5)
#
# Targets: cohort busbw >= 0.9x the loop's at 64 KiB, 1 MiB and
# 16 MiB; cohort's 1 KiB time <= 2x the loop's.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-mpi}
reps=${REPS:-5}
loop=$build/bench/mpi/mpi_allreduce_loop
bench=$build/tools/cohort-bench/cohort-bench
for exe in "$loop" "$bench"; do
  [[ -x $exe ]] || { echo "compare.sh: $exe is not built" >&2; exit 2; }
done

mpirun=(mpirun -np 2 --oversubscribe)
[[ $(id -u) == 0 ]] && mpirun+=(--allow-run-as-root)
export OPENBLAS_NUM_THREADS=1
sizes=(1024 65536 1048576 16777216)
iters=(5000 1000 100 20)  # same for both; enough for ~10 ms per measurement

rows=$(mktemp)
trap 'rm -f "$rows"' EXIT
for ((rep = 1; rep <= reps; ++rep)); do
  for i in "${!sizes[@]}"; do
    b=${sizes[$i]}
    n=${iters[$i]}
    timeout 120 "${mpirun[@]}" "$loop" --json --iters "$n" "$b" >>"$rows"
    timeout 120 "${mpirun[@]}" "$bench" collectives --backend mpi --op all_reduce --json \
      --min-bytes "$b" --max-bytes "$b" --iters "$n" --warmup 3 >>"$rows"
  done
  echo "compare.sh: repetition $rep of $reps done" >&2
done

python3 - "$rows" "$reps" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
reps = sys.argv[2]
def med(backend, b, key):
    v = [r[key] for r in rows if r["backend"] == backend and r["bytes"] == b]
    return statistics.median(v), len(v)
print(f"# world 2, float32 sum, medians of {reps} runs; plain = MPI_Allreduce loop, cohort = cohort-bench --backend mpi")
print(f"{'bytes':>10} {'plain us':>10} {'cohort us':>10} {'plain GB/s':>11} {'cohort GB/s':>12} {'busbw ratio':>12} {'time ratio':>11}  target")
ok = True
for b in (1024, 65536, 1048576, 16777216):
    pu, n1 = med("plain-mpi", b, "us"); cu, n2 = med("mpi", b, "us")
    pb, _ = med("plain-mpi", b, "busbw_gbs"); cb, _ = med("mpi", b, "busbw_gbs")
    ratio, tratio = cb / pb, cu / pu
    if b == 1024:
        met = tratio <= 2.0; target = f"time <= 2x: {'met' if met else 'MISSED'}"
    else:
        met = ratio >= 0.9; target = f"busbw >= 0.9x: {'met' if met else 'MISSED'}"
    ok &= met
    print(f"{b:>10} {pu:>10.2f} {cu:>10.2f} {pb:>11.3f} {cb:>12.3f} {ratio:>12.2f} {tratio:>11.2f}  {target}")
sys.exit(0 if ok else 1)
PY
