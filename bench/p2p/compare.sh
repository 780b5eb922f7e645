#!/usr/bin/env bash
# Alternated runs of two cohort-bench binaries (the library before a change
# and after it): the point-to-point ping-pong and the all-reduce of min
# (and sum, for reference) at a few sizes, 2 ranks over Gloo, the order of
# the two sides swapped from round to round; one JSON line per row, then
# summarize.py gives medians per side and the ratio new / old.
#   bench/p2p/compare.sh OLD_BIN NEW_BIN OUT.jsonl
# Env: ROUNDS (8), P2P_BYTES (1024,65536,65540,262144,16777216),
#      OPS ("p2p min max sum"), AR_MIN/AR_MAX (all-reduce sizes, 1024 and
#      16777216, doubling), COHORTRUN, BACKEND (gloo).
set -u
[ $# -eq 3 ] || { sed -n 2,10p "$0"; exit 2; }
bins=("$1" "$2") names=(old new) out=$3
run=${COHORTRUN:-build/tools/cohortrun/cohortrun}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
for round in $(seq "${ROUNDS:-8}"); do
  for k in 0 1; do
    i=$(((k + round) % 2))
    for op in ${OPS:-p2p min max sum}; do
      if [ "$op" = p2p ]; then
        args=(p2p --bytes "${P2P_BYTES:-1024,65536,65540,262144,16777216}" --json)
      else
        args=(collectives --op all_reduce --reduce-op "$op" --per-op-median --json
              --min-bytes "${AR_MIN:-1024}" --max-bytes "${AR_MAX:-16777216}")
      fi
      # cohortrun prefixes rank 0's lines with "[0] "; the sed turns each into
      # {"side": ..., "round": ..., <the bench's fields>}.
      timeout 300 "$run" -n 2 --backend "${BACKEND:-gloo}" --timeout 240 -- "${bins[$i]}" "${args[@]}" |
        grep '^\[0\] {' |
        sed "s/^\[0\] //; s/^{/{\"side\": \"${names[$i]}\", \"round\": $round, /" >>"$out"
    done
  done
done
