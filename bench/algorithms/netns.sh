#!/usr/bin/env bash
# Two "hosts" of two ranks each: network namespaces joined by a veth pair
# whose both ends are slowed to 1 Gbit/s (tc netem with 0.5 ms delay where
# the kernel has netem, else tbf). Runs `cohort-bench collectives --algo all`
# across the 4 ranks and prints rank 0's table: flat ring against
# hierarchical, and what adaptive picks. Needs root.
#
#   bench/algorithms/netns.sh [BUILD_DIR] [MIN_BYTES] [MAX_BYTES] [ROUNDS]
set -euo pipefail
build=${1:-build}
min=${2:-1048576}
max=${3:-16777216}
rounds=${4:-3}
source "$(dirname "$0")/../netns_pair.sh"
netns_pair_up cohort_bench 10.78.0 netem
run_node() {
  ip netns exec "${ns[$1]}" env OPENBLAS_NUM_THREADS=1 "$build/tools/cohortrun/cohortrun" -n 2 \
    --nnodes 2 --node-rank "$1" --master-addr 10.78.0.1 --master-port 29591 --timeout 1500 \
    --backend gloo -- \
    "$build/tools/cohort-bench/cohort-bench" collectives --algo all --rounds "$rounds" \
    --min-bytes "$min" --max-bytes "$max"
}
run_node 1 > /dev/null &
run_node 0
wait
