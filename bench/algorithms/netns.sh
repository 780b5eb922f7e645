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
ns=(cohort_bench_a$$ cohort_bench_b$$)
veth=(cbva$$ cbvb$$)
cleanup() { for n in "${ns[@]}"; do ip netns delete "$n" 2>/dev/null || true; done; }
trap cleanup EXIT
for i in 0 1; do ip netns add "${ns[$i]}"; done
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for i in 0 1; do
  ip link set "${veth[$i]}" netns "${ns[$i]}"
  ip -n "${ns[$i]}" addr add "10.78.0.$((i + 1))/24" dev "${veth[$i]}"
  ip -n "${ns[$i]}" link set "${veth[$i]}" up
  ip -n "${ns[$i]}" link set lo up
  if ! ip netns exec "${ns[$i]}" tc qdisc add dev "${veth[$i]}" root netem rate 1gbit delay 0.5ms 2>/dev/null; then
    ip netns exec "${ns[$i]}" tc qdisc add dev "${veth[$i]}" root tbf rate 1gbit burst 128kb latency 50ms
    [ "$i" = 0 ] && echo "# netem unavailable: tbf 1 Gbit/s, no added delay"
  fi
done
run_node() {
  ip netns exec "${ns[$1]}" env OPENBLAS_NUM_THREADS=1 "$build/tools/cohortrun/cohortrun" -n 2 \
    --nnodes 2 --node-rank "$1" --master-addr 10.78.0.1 --master-port 29591 --timeout 1500 -- \
    "$build/tools/cohort-bench/cohort-bench" collectives --algo all --rounds "$rounds" \
    --min-bytes "$min" --max-bytes "$max"
}
run_node 1 > /dev/null &
run_node 0
wait
