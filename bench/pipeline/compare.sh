#!/usr/bin/env bash
# Alternated step times of two pipeline_bench binaries (say, the runtime
# before a change and after it), every schedule × pp × m, the order of the
# two sides swapped from point to point; one JSON line per run, then
# compare.py summarizes (medians per point, ratio new / old).
#   bench/pipeline/compare.sh OLD_BIN NEW_BIN OUT.jsonl
# Env: ROUNDS (6), SCHEDS ("zbh1 1f1b"), PPS ("2 4"), MS ("4 8 16"),
#      DEADLINE (seconds; stops cleanly when passed), COHORTRUN,
#      BACKEND (gloo: the engine the tables were measured with).
set -u
[ $# -eq 3 ] || { sed -n 2,8p "$0"; exit 2; }
bins=("$1" "$2") names=(old new) out=$3
run=${COHORTRUN:-build/tools/cohortrun/cohortrun}
B="--width 512 --blocks 16 --batch 512 --steps 5 --json"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
t0=$SECONDS
for round in $(seq "${ROUNDS:-6}"); do
  for pp in ${PPS:-2 4}; do
    for m in ${MS:-4 8 16}; do
      for s in ${SCHEDS:-zbh1 1f1b}; do
        for k in 0 1; do
          i=$(((k + round + m / 4) % 2))
          if [ $((SECONDS - t0)) -gt "${DEADLINE:-100000}" ]; then
            echo "compare.sh: deadline reached in round $round"; exit 0
          fi
          # cohortrun prefixes rank 0's JSON line with "[0] "; the sed turns it
          # into {"side": ..., "round": ..., "ranks": ..., <the bench's fields>}.
          timeout 120 "$run" -n "$pp" --backend "${BACKEND:-gloo}" --timeout 100 -- "${bins[$i]}" $B --m "$m" --schedule "$s" |
            sed "s/^\[[0-9]*\] //; s/^{/{\"side\": \"${names[$i]}\", \"round\": $round, \"ranks\": $pp, /" >>"$out"
        done
      done
    done
  done
done
