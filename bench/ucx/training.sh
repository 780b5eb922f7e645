#!/usr/bin/env bash
# training.sh: training throughput over cohort's UCX engine against its Gloo
# engine, alternated run by run under plain cohortrun, medians of REPS runs:
#   - the GPT example at tp = 2 (tokens/s, 30 steps, no evaluation);
#   - the DDP transformer of bench/ddp_vs_torch (samples/s, cohort's side),
#     world 2 and 4.
#
#   bench/ucx/training.sh [BUILD_DIR]      (default: build; REPS=3)
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
reps=${REPS:-3}
run=$build/tools/cohortrun/cohortrun
gpt=$build/examples/gpt/gpt
ddp=$build/bench/ddp_vs_torch/ddp_vs_torch
for exe in "$run" "$gpt" "$ddp"; do
  [[ -x $exe ]] || { echo "training.sh: $exe is not built" >&2; exit 2; }
done
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# As bench/ddp_vs_torch/run_ddp_vs_torch.py (docs/usage.md, "Performance tips").
export MALLOC_MMAP_THRESHOLD_=$((64 << 20)) MALLOC_TRIM_THRESHOLD_=$((256 << 20))

rows=$(mktemp)
trap 'rm -f "$rows"' EXIT
for ((rep = 1; rep <= reps; ++rep)); do
  # Alternate which engine goes first.
  engines=(ucx gloo)
  ((rep % 2 == 0)) && engines=(gloo ucx)
  for e in "${engines[@]}"; do
    v=$(timeout 300 "$run" -n 2 --backend "$e" --quiet-others -- "$gpt" --tp 2 --steps 30 --checkpoint-dir "" \
          --eval-every 1000 --sample-chars 0 --plot "" | sed -n 's/.*tokens\/s: \([0-9.]*\).*/\1/p')
    echo "gpt-tp2 $e $v" >>"$rows"
  done
  for world in 2 4; do
    for e in "${engines[@]}"; do
      v=$(timeout 300 "$run" -n "$world" --backend "$e" --quiet-others -- "$ddp" --model transformer \
            --batch 2 --steps 20 --warmup 5 | grep -o '"sps": *[0-9.]*' | tail -1 | grep -o '[0-9.]*$')
      echo "ddp-transformer-w$world $e $v" >>"$rows"
    done
  done
  echo "training.sh: repetition $rep of $reps done" >&2
done

python3 - "$rows" "$reps" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    what, engine, value = line.split()
    runs.setdefault((what, engine), []).append(float(value))
print(f"# UCX against Gloo, medians of {sys.argv[2]} alternated runs")
for what in ("gpt-tp2", "ddp-transformer-w2", "ddp-transformer-w4"):
    u, g = runs[(what, "ucx")], runs[(what, "gloo")]
    mu, mg = statistics.median(u), statistics.median(g)
    print(f"{what:20s} ucx {mu:9.1f} {u}  gloo {mg:9.1f} {g}  ucx/gloo {mu / mg:.2f}")
PY
