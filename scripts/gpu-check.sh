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
#   - the same contract over the NCCL engine (COHORT_BACKEND=nccl) when the
#     build has it: at world 1, and at world 2 on the one GPU where NCCL is
#     2.30 or newer (NCCL_MULTI_RANK_GPU_ENABLE=1; older NCCL refuses two
#     ranks on one GPU, and the JSON says it was skipped);
#   - DDP against one process, models and data on the GPU, worlds 2-4.
# The build tries the NCCL engine first; if the library does not compile
# with that PyTorch's c10d, it is rebuilt without it and the checks go on
# ("nccl_engine" in the JSON says which happened).
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
nccl_engine="not configured yet"
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
    echo "  \"nccl_engine\": \"$nccl_engine\","
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
# A pip PyTorch's NCCL headers come with its nvidia-nccl wheel.
nccl_include=$(python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null |
  while read -r d; do find "$d/nvidia" -name nccl.h -path '*include*' 2>/dev/null; done | head -1)
build=$root/build-gpu
configure() {   # COHORT_WITH_NCCL value
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr;$prefix/usr/lib/x86_64-linux-gnu/cmake" \
    -DCOHORT_WITH_UCX=OFF -DCOHORT_WITH_MPI=OFF -DCOHORT_BUILD_BENCH=OFF \
    -DCOHORT_BUILD_EXAMPLES=OFF -DCOHORT_WITH_NCCL="$1" \
    ${nccl_include:+-DCOHORT_NCCL_INCLUDE_DIR="$(dirname "$nccl_include")"}
}
t=$SECONDS
status=ok
# The library first, with the NCCL engine when CMake finds it: c10d's API
# moves between releases, and a library that does not compile with this
# one is rebuilt without the engine rather than failing the whole check.
if ! configure AUTO >"$log" 2>&1; then
  status=failed
elif ! grep -q "building the NCCL engine" "$log"; then
  nccl_engine="not built: $(grep -o 'cohort: [^;]*; building without the NCCL engine' "$log" | head -1)"
  cmake --build "$build" --target cohort >>"$log" 2>&1 || status=failed
elif cmake --build "$build" --target cohort >>"$log" 2>&1; then
  nccl_engine=built
else
  cp "$log" "$out/build-nccl.log"
  nccl_engine="fell back: the library did not compile with the NCCL engine (log: build-nccl.log)"
  { configure OFF && cmake --build "$build" --target cohort; } >>"$log" 2>&1 || status=failed
fi
# Then only what the checks run; -k 0 reports every compile error in one run.
if [ "$status" = ok ] &&
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
if [ "$nccl_engine" = built ]; then
  nccl_version=$(python3 -c 'import torch; print("%d %d" % torch.cuda.nccl.version()[:2])' 2>/dev/null)
  worlds=(1)
  # Both ranks on the current GPU: NCCL refuses two ranks on one GPU before
  # 2.30, and then only with NCCL_MULTI_RANK_GPU_ENABLE=1.
  if [ -n "$nccl_version" ] && [ "$(echo "$nccl_version" | awk '{ print ($1 > 2 || ($1 == 2 && $2 >= 30)) }')" = 1 ]; then
    worlds+=(2)
    export NCCL_MULTI_RANK_GPU_ENABLE=1
  else
    record "contract_${COHORT_TEST_DEVICE}_nccl_world2" skipped 0 \
      "one GPU and NCCL ${nccl_version:-unknown} (two ranks on one GPU need NCCL 2.30+)"
  fi
  for world in "${worlds[@]}"; do
    check "contract_${COHORT_TEST_DEVICE}_nccl_world$world" 180 "$run" -n "$world" --backend nccl --timeout 150 \
      --quiet-others -- "$build/tests/contract/contract_world" --gtest_filter='Contract/World.Holds/world_*'
  done
else
  record nccl skipped 0 "$nccl_engine"
fi
check "ddp_${COHORT_TEST_DEVICE}_equivalence" 180 "$build/tests/ddp/ddp_tests" --gtest_filter='Ddp/Equivalence.*'
exit $failed
