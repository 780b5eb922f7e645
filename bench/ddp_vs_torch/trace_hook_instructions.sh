#!/bin/bash
# User-space instructions per DDP step for the tracing sides (off, on, no-hooks):
# instruction counts do not move with the host's scheduling noise, which
# hides a 1% difference in step times on a shared machine. Each side runs
# the transformer at world 2 (Gloo, ranks as processes) for SHORT and LONG
# timed steps under `perf stat -e instructions:u`; per-step instructions are
# (I(LONG) - I(SHORT)) / (LONG - SHORT), which cancels start-up and exit.
# Usage: trace_hook_instructions.sh BUILD NOTRACE_BUILD [REPS] [SHORT] [LONG]
set -euo pipefail
build=$1 notrace=$2 reps=${3:-2} short=${4:-10} long=${5:-40}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() { # side steps rep -> prints rank 0's and rank 1's instructions
  local side=$1 steps=$2 rep=$3 bin=$build/bench/ddp_vs_torch/ddp_vs_torch
  [ "$side" = no-hooks ] && bin=$notrace/bench/ddp_vs_torch/ddp_vs_torch
  local port=$((20000 + RANDOM % 20000)) pids=() tdir=""
  if [ "$side" = on ]; then tdir=$(mktemp -d -p "$out"); fi
  for rank in 0 1; do
    env RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=$((64 << 20)) \
      MALLOC_TRIM_THRESHOLD_=$((256 << 20)) ${tdir:+COHORT_TRACE=$tdir} \
      timeout -k 5 120 perf stat -x, -e instructions:u -o "$out/$side-$steps-$rep-$rank" \
      "$bin" --model transformer --batch 2 --steps "$steps" --warmup 3 > /dev/null &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for rank in 0 1; do grep instructions "$out/$side-$steps-$rep-$rank" | cut -d, -f1; done
}
for rep in $(seq 1 "$reps"); do
  for side in off on no-hooks; do
    s=($(run $side "$short" "$rep")) l=($(run $side "$long" "$rep"))
    for rank in 0 1; do
      echo "$side rep $rep rank $rank per_step $(( (l[rank] - s[rank]) / (long - short) ))"
    done
  done
done
