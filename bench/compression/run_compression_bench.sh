#!/usr/bin/env bash
# Compression benchmark: two "hosts" (network namespaces) joined by a veth
# pair shaped to 1 Gbit/s with tbf (the kernel has no netem), RANKS ranks on
# each. For every model and compressor, cohort's compression_bench and, for
# none / fp16 / PowerSGD, PyTorch DDP with its hooks (torch_peer.py) run on
# the same link; one JSON line per row on stdout. Needs root.
#
#   bench/compression/run_compression_bench.sh [BUILD_DIR] [RANKS] [MODELS] [STEPS] [REPEATS] [BATCH] [ROWS]
#
# ROWS (default: every compressor, cohort and PyTorch alternating) picks rows
# as SIDE:COMPRESSOR words in the order given, e.g.
# "torch:fp16 cohort:fp16 cohort:powersgd_r2 torch:powersgd_r2", so that a
# few rows fit in one short hold of the machine lock.
#
# Bytes per step are read from the veth's tx counter in each namespace (what
# really left the host, TCP/IP headers included). Every process runs under
# `timeout` (ROW_TIMEOUT seconds, default 120), so a peer whose partner died
# cannot spin on. Both sides get the DDP benchmark's fixed glibc malloc
# thresholds (bench/ddp_vs_torch/run_ddp_vs_torch.py, docs/usage.md
# "Performance tips").
set -euo pipefail
build=${1:-build}
ranks=${2:-1}
models=${3:-"cnn transformer"}
steps=${4:-10}
repeats=${5:-1}
batch=${6:-32}
rows=${7:-"cohort:none torch:none cohort:fp16 torch:fp16 cohort:bf16 cohort:int8 cohort:topk
  cohort:powersgd_r1 torch:powersgd_r1 cohort:powersgd_r2 torch:powersgd_r2
  cohort:powersgd_r4 torch:powersgd_r4"}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../netns_pair.sh"
netns_pair_up cohort_comp 10.79.0 tbf
port=29700
world=$((2 * ranks))
limit=(timeout -k 5 "${ROW_TIMEOUT:-120}")
malloc_env=(MALLOC_MMAP_THRESHOLD_=$((64 << 20)) MALLOC_TRIM_THRESHOLD_=$((256 << 20)))

cohort_row() {  # compressor-args...
  port=$((port + 1))
  local run=("$build/tools/cohortrun/cohortrun" -n "$ranks" --nnodes 2 --master-addr 10.79.0.1
             --master-port "$port" --timeout 900 --backend gloo)
  ip netns exec "${ns[1]}" env OPENBLAS_NUM_THREADS=1 "${malloc_env[@]}" \
    COMPRESSION_BENCH_DEV="${veth[1]}" "${limit[@]}" "${run[@]}" --node-rank 1 -- \
    "$build/bench/compression/compression_bench" "$@" > /dev/null &
  ip netns exec "${ns[0]}" env OPENBLAS_NUM_THREADS=1 "${malloc_env[@]}" \
    COMPRESSION_BENCH_DEV="${veth[0]}" "${limit[@]}" "${run[@]}" --node-rank 0 -- \
    "$build/bench/compression/compression_bench" "$@" | grep -o '{.*}' || echo "# cohort row failed: $*"
  wait || true
}

torch_row() {  # torch_peer-args...
  port=$((port + 1))
  local pids=()
  for node in 1 0; do
    for local_rank in $(seq 0 $((ranks - 1))); do
      rank=$((node * ranks + local_rank))
      ip netns exec "${ns[$node]}" env OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "${malloc_env[@]}" RANK=$rank \
        LOCAL_WORLD_SIZE=$ranks COMPRESSION_BENCH_DEV="${veth[$node]}" GLOO_SOCKET_IFNAME="${veth[$node]}" \
        WORLD_SIZE=$world MASTER_ADDR=10.79.0.1 MASTER_PORT=$port \
        "${limit[@]}" /usr/bin/python3 "$here/torch_peer.py" "$@" > "/tmp/torch_peer_$$_$rank.out" 2>&1 &
      pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  if ! grep '^{' "/tmp/torch_peer_$$_0.out"; then
    echo "# torch row failed: $*"
    tail -n 5 /tmp/torch_peer_$$_*.out >&2
  fi
  rm -f /tmp/torch_peer_$$_*.out
}

row() {  # SIDE:COMPRESSOR, then the common arguments
  local side=${1%%:*} kind=${1#*:} args
  shift
  case $kind in
    powersgd_r*) args=(--compression powersgd --powersgd-rank "${kind#powersgd_r}") ;;
    *) args=(--compression "$kind") ;;
  esac
  "${side}_row" "$@" "${args[@]}"
}

for model in $models; do
  for _ in $(seq "$repeats"); do
    # Rows alternate cohort and PyTorch so drift hits both sides alike.
    for r in $rows; do row "$r" --model "$model" --steps "$steps" --batch "$batch"; done
  done
done
