#!/usr/bin/env bash
# The GPU check: one command for a machine with an NVIDIA GPU, a pip
# PyTorch, CMake and ninja, and no package manager or network (the device
# machine). Builds cohort against that PyTorch's LibTorch and runs the CUDA
# checks; every result goes to one JSON file.
#
#   scripts/gpu-check.sh --fetch   # here, with apt: the build's other
#                                  # dependencies into .gpu-deps/ (~2 MB)
#   scripts/gpu-check.sh           # there, with .gpu-deps carried along
#
# Writes $OUT/gpu-check.json (./gpu-check-out/ without OUT) and the build's
# log beside it. The checks:
#   - the Communicator contract on CUDA tensors, ranks as processes sharing
#     the GPU, at world 1 and 2 over Gloo (CUDA tensors staged through
#     pinned host memory);
#   - DDP against one process, models and data on the GPU, worlds 2-4.
# Each is run, timed and recorded even when another failed; the exit status
# is 0 only when the build and every check passed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps=$root/.gpu-deps
packages=(libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev zlib1g-dev)

if [ "${1:-}" = --fetch ]; then
  set -e
  mkdir -p "$deps"
  rm -f "$deps"/*.deb
  (cd "$deps" && apt-get download "${packages[@]}")
  ls -la "$deps"
  exit 0
fi

out=${OUT:-$root/gpu-check-out}
mkdir -p "$out"
results=$out/gpu-check.json
log=$out/build.log
started=$SECONDS
declare -a rows=()
record() {   # NAME STATUS SECONDS [DETAIL]
  rows+=("{\"check\": \"$1\", \"status\": \"$2\", \"seconds\": $3, \"detail\": \"${4:-}\"}")
}
write_results() {
  {
    echo "{"
    echo "  \"torch\": \"$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)\","
    echo "  \"cuda\": \"$(python3 -c 'import torch; print(torch.version.cuda)' 2>/dev/null)\","
    echo "  \"gpu\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)\","
    echo "  \"nccl\": \"$(python3 -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))' 2>/dev/null)\","
    echo "  \"seconds\": $((SECONDS - started)),"
    echo "  \"checks\": ["
    local i
    for i in "${!rows[@]}"; do
      echo "    ${rows[$i]}$([ "$i" -lt $((${#rows[@]} - 1)) ] && echo ,)"
    done
    echo "  ]"
    echo "}"
  } >"$results"
  cat "$results"
}
trap write_results EXIT

# The carried packages, unpacked beside the checkout (never over /).
prefix=$deps/root
if [ ! -d "$prefix" ]; then
  for f in "$deps"/*.deb; do
    [ -f "$f" ] || { echo "gpu-check: no packages in $deps (run --fetch here)" >&2; exit 1; }
    dpkg -x "$f" "$prefix"
  done
fi

torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
build=$root/build-gpu
t=$SECONDS
status=ok
# Only what the checks run; -k 0 reports every compile error in one run.
if ! cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr;$prefix/usr/lib/x86_64-linux-gnu/cmake" \
  -DCOHORT_WITH_UCX=OFF -DCOHORT_WITH_MPI=OFF -DCOHORT_BUILD_BENCH=OFF \
  -DCOHORT_BUILD_EXAMPLES=OFF >"$log" 2>&1 ||
  ! cmake --build "$build" -- -k 0 cohortrun contract_world ddp_tests >>"$log" 2>&1; then
  status=failed
fi
record build "$status" $((SECONDS - t)) "log: build.log"
[ "$status" = ok ] || { tail -40 "$log"; exit 1; }

failed=0
check() {   # NAME TIMEOUT COMMAND...
  local name=$1 limit=$2 t=$SECONDS
  shift 2
  if timeout "$limit" "$@" >"$out/$name.log" 2>&1; then
    record "$name" ok $((SECONDS - t)) "$(grep -o 'PASSED  \] [0-9]* tests' "$out/$name.log" | tail -1)"
  else
    record "$name" failed $((SECONDS - t)) "log: $name.log"
    tail -30 "$out/$name.log"
    failed=1
  fi
}
# (COHORT_TEST_DEVICE=cpu runs the same flow on a machine without a GPU.)
export COHORT_TEST_DEVICE=${COHORT_TEST_DEVICE:-cuda} OPENBLAS_NUM_THREADS=1
run=$build/tools/cohortrun/cohortrun
for world in 1 2; do
  check "contract_${COHORT_TEST_DEVICE}_gloo_world$world" 180 "$run" -n "$world" --backend gloo --timeout 150 \
    --quiet-others -- "$build/tests/contract/contract_world" --gtest_filter='Contract/World.Holds/world_*'
done
check "ddp_${COHORT_TEST_DEVICE}_equivalence" 180 "$build/tests/ddp/ddp_tests" --gtest_filter='Ddp/Equivalence.*'
record nccl skipped 0 "cohort has no NCCL engine yet"
exit $failed
