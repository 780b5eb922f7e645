#!/usr/bin/env bash
# Compression benchmark: two "hosts" (network namespaces) joined by a veth
# pair shaped to 1 Gbit/s with tbf (the kernel has no netem), RANKS ranks on
# each. For every model and compressor, cohort's compression_bench and, for
# none / fp16 / PowerSGD, PyTorch DDP with its hooks (torch_peer.py) run on
# the same link; one JSON line per row on stdout. Needs root.
#
#   bench/compression/run_compression_bench.sh [BUILD_DIR] [RANKS] [MODELS] [STEPS] [REPEATS] [BATCH]
#
# Bytes per step are read from the veth's tx counter in each namespace (what
# really left the host, TCP/IP headers included).
set -euo pipefail
build=${1:-build}
ranks=${2:-1}
models=${3:-"cnn transformer"}
steps=${4:-10}
repeats=${5:-1}
batch=${6:-32}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../netns_pair.sh"
netns_pair_up cohort_comp 10.79.0 tbf
port=29700
world=$((2 * ranks))

cohort_row() {  # compressor-args...
  port=$((port + 1))
  local run=("$build/tools/cohortrun/cohortrun" -n "$ranks" --nnodes 2 --master-addr 10.79.0.1
             --master-port "$port" --timeout 900)
  ip netns exec "${ns[1]}" env OPENBLAS_NUM_THREADS=1 COMPRESSION_BENCH_DEV="${veth[1]}" \
    "${run[@]}" --node-rank 1 -- \
    "$build/bench/compression/compression_bench" "$@" > /dev/null &
  ip netns exec "${ns[0]}" env OPENBLAS_NUM_THREADS=1 COMPRESSION_BENCH_DEV="${veth[0]}" \
    "${run[@]}" --node-rank 0 -- \
    "$build/bench/compression/compression_bench" "$@" | grep -o '{.*}' || echo "# cohort row failed: $*"
  wait || true
}

torch_row() {  # torch_peer-args...
  port=$((port + 1))
  local pids=()
  for node in 1 0; do
    for local_rank in $(seq 0 $((ranks - 1))); do
      rank=$((node * ranks + local_rank))
      ip netns exec "${ns[$node]}" env OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 RANK=$rank \
        LOCAL_WORLD_SIZE=$ranks COMPRESSION_BENCH_DEV="${veth[$node]}" GLOO_SOCKET_IFNAME="${veth[$node]}" \
        WORLD_SIZE=$world MASTER_ADDR=10.79.0.1 MASTER_PORT=$port \
        /usr/bin/python3 "$here/torch_peer.py" "$@" > "/tmp/torch_peer_$$_$rank.out" 2>&1 &
      pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  grep '^{' "/tmp/torch_peer_$$_0.out" || echo "# torch row failed: $*"
  rm -f /tmp/torch_peer_$$_*.out
}

for model in $models; do
  for _ in $(seq "$repeats"); do
    common=(--model "$model" --steps "$steps" --batch "$batch")
    # Alternate cohort and PyTorch rows so drift hits both sides alike.
    cohort_row "${common[@]}" --compression none
    torch_row "${common[@]}" --compression none
    cohort_row "${common[@]}" --compression fp16
    torch_row "${common[@]}" --compression fp16
    cohort_row "${common[@]}" --compression bf16
    cohort_row "${common[@]}" --compression int8
    cohort_row "${common[@]}" --compression topk
    for r in 1 2 4; do
      cohort_row "${common[@]}" --compression powersgd --powersgd-rank "$r"
      torch_row "${common[@]}" --compression powersgd --powersgd-rank "$r"
    done
  done
done
