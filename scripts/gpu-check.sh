#!/usr/bin/env bash
# The GPU check: one command for a machine with an NVIDIA GPU, a pip
# PyTorch, CMake and ninja, and no package manager or network (the device
# machine). Builds cohort against that PyTorch's LibTorch and runs the CUDA
# checks; every result goes to one JSON file.
#
#   scripts/gpu-check.sh --fetch   # here, with apt: the build's other
#                                  # dependencies and the main job's data
#                                  # into .gpu-deps/ (~33 MB)
#   scripts/gpu-check.sh           # there, with .gpu-deps carried along
#
# Writes $OUT/gpu-check.json (./gpu-check-out/ without OUT: "checks", one
# row per check, and "figures", the measured numbers) as it goes, and every
# check's log packed into logs.tar.gz beside it, anew after each check (the
# device tool brings back at most 8 files from $OUT). The checks:
#   - the Communicator contract on CUDA tensors, ranks as processes sharing
#     the GPU, at world 1 and 2 over Gloo (CUDA tensors staged through
#     pinned host memory);
#   - the same contract over the NCCL engine (COHORT_BACKEND=nccl) when the
#     build has it: at world 1, and at world 2 on the one GPU where NCCL is
#     2.30 or newer (NCCL_MULTI_RANK_GPU_ENABLE=1; older NCCL refuses two
#     ranks on one GPU, and the JSON says it was skipped);
#   - the golden tests against one process, models and data on the GPU:
#     ranks as threads (the `goldens` list below: ZeRO, FSDP with and
#     without mixed precision, the pipeline, the TP layers, the MoE layer,
#     the GPT's dropout masks, the Trainer's gradient norm; and the TP
#     random streams' CUDA generators made after a restart), and DDP's,
#     FSDP's, the TP layers', the MoE layer's and the GPT's TP replicas
#     under dropout with ranks as processes at world 2;
#   - the main job (Fashion-MNIST, DDP and the Trainer) on 2 ranks sharing
#     the GPU: its test accuracy and epoch times;
#   - cohort's DDP step time against PyTorch's DDP at worlds 1 and 2, and at
#     world 1 each DDP against its frontend without it (plain LibTorch, plain
#     PyTorch): bench/ddp_vs_torch/run_step_time.py, 3 alternated rounds,
#     skipped when the 8 minutes would not hold it.
# The build tries the NCCL engine first; if the library does not compile
# with that PyTorch's c10d, it is rebuilt without it and the checks go on
# ("nccl_engine" in the JSON says which happened).
# Each is run, timed and recorded even when another failed; the exit status
# is 0 only when the build and every check passed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps=$root/.gpu-deps
# dataset-fashion-mnist (31 MB) is the main job's data.
packages=(libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev zlib1g-dev dataset-fashion-mnist)

if [ "${1:-}" = --fetch ]; then
  set -e
  mkdir -p "$deps"
  rm -rf "$deps"/*.deb "$deps/root"   # (root: where an older script unpacked them)
  (cd "$deps" && apt-get download "${packages[@]}")
  # Gloo's headers, which c10d's ProcessGroupGloo.hpp includes and a pip
  # wheel may not ship: Debian 13's (Gloo of 2023-12, nearer a recent
  # wheel's own than Debian 12's of 2022), through package lists of
  # Debian 13's main kept apart from this machine's.
  lists=$(mktemp -d)
  chmod 755 "$lists"   # readable by apt's download user
  trap 'rm -rf "$lists"' EXIT
  mirror=$(apt-get indextargets --format '$(REPO_URI) $(LABEL) $(COMPONENT)' |
    awk '$2 == "Debian" && $3 == "main" && !m { m = $1 } END { print m }')
  echo "deb ${mirror:-http://deb.debian.org/debian/} trixie main" >"$lists/sources.list"
  mkdir -p "$lists/state/partial" "$lists/cache/archives/partial"
  apt13=(-o Dir::Etc::SourceList="$lists/sources.list" -o Dir::Etc::SourceParts=/nonexistent
    -o Dir::State::Lists="$lists/state" -o Dir::Cache="$lists/cache"
    -o Dir::State::status=/dev/null)
  apt-get "${apt13[@]}" update -qq
  (cd "$deps" && apt-get "${apt13[@]}" download libgloo-dev)
  ls -la "$deps"
  exit 0
fi

out=${OUT:-$root/gpu-check-out}
logs=$root/build-gpu/logs
rm -rf "$logs"
mkdir -p "$out" "$logs"
results=$out/gpu-check.json
log=$logs/build.log
started=$SECONDS
nccl_engine="not configured yet"
# One import of torch (seconds with CUDA) for the versions the JSON names.
{ read -r torch_version; read -r cuda_version; read -r nccl_version; } < <(python3 -c '
import torch
print(torch.__version__)
print(torch.version.cuda)
try:
    print(".".join(map(str, torch.cuda.nccl.version())))
except Exception:
    print("")' 2>/dev/null)
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
declare -a rows=() figures=()
record() {   # NAME STATUS SECONDS [DETAIL]: a row, written at once with the logs so far (a run killed at its limit keeps them)
  rows+=("{\"check\": \"$1\", \"status\": \"$2\", \"seconds\": $3, \"detail\": \"${4:-}\"}")
  write_results >/dev/null
  pack_logs
}
pack_logs() { tar -czf "$out/logs.tar.gz" -C "$logs" . 2>/dev/null || true; }
json_list() {   # NAME END ITEMS...: a JSON array named NAME, one item per line, then END
  local name=$1 end=$2 i
  shift 2
  echo "  \"$name\": ["
  for ((i = 1; i <= $#; i++)); do
    echo "    ${!i}$([ "$i" -lt $# ] && echo ,)"
  done
  echo "  ]$end"
}
write_results() {
  {
    echo "{"
    echo "  \"torch\": \"${torch_version:-}\","
    echo "  \"cuda\": \"${cuda_version:-}\","
    echo "  \"gpu\": \"$gpu_name\","
    echo "  \"nccl\": \"${nccl_version:-}\","
    echo "  \"nccl_engine\": \"$nccl_engine\","
    echo "  \"seconds\": $((SECONDS - started)),"
    json_list checks , ${rows[@]+"${rows[@]}"}
    json_list figures "" ${figures[@]+"${figures[@]}"}
    echo "}"
  } >"$results"
  cat "$results"
}
trap 'write_results; pack_logs' EXIT

# The carried packages, unpacked in the build folder (never over /, and
# never into .gpu-deps, which must stay small enough to carry).
# A stamp per package: one fetched since the last run is unpacked too.
prefix=$root/build-gpu/deps
mkdir -p "$prefix/.unpacked"
for f in "$deps"/*.deb; do
  [ -f "$f" ] || { echo "gpu-check: no packages in $deps (run --fetch here)" >&2; exit 1; }
  stamp=$prefix/.unpacked/$(basename "$f")
  [ -f "$stamp" ] || { dpkg -x "$f" "$prefix" && touch "$stamp"; }
done

torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
# A pip PyTorch's NCCL headers come with its nvidia-nccl wheel.
nccl_include=$(python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null |
  while read -r d; do find "$d/nvidia" -name nccl.h -path '*include*' 2>/dev/null; done | head -1)
# The libraries a wheel's libtorch_cuda.so needs (cuDNN, NCCL, cuBLAS...)
# sit in the nvidia-* wheels, found at run time through its $ORIGIN-relative
# RUNPATH; -rpath-link names them to the linker too.
nvidia_libs=$(python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null |
  while read -r d; do find "$d/nvidia" -mindepth 2 -maxdepth 2 -type d -name lib 2>/dev/null; done |
  paste -sd: -)
link_flags=${nvidia_libs:+-Wl,-rpath-link,$nvidia_libs}
# LibTorch's CMake config enables CUDA, which needs nvcc on PATH.
command -v nvcc >/dev/null || [ ! -x /usr/local/cuda/bin/nvcc ] || export PATH=/usr/local/cuda/bin:$PATH
{ command -v nvcc && nvcc --version; cmake --version; c++ --version; } >"$logs/versions.log" 2>&1
build=$root/build-gpu
configure() {   # COHORT_WITH_NCCL value
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr;$prefix/usr/lib/x86_64-linux-gnu/cmake" \
    -DCMAKE_EXE_LINKER_FLAGS="$link_flags" -DCMAKE_SHARED_LINKER_FLAGS="$link_flags" \
    -DCOHORT_WITH_UCX=OFF -DCOHORT_WITH_MPI=OFF -DCOHORT_WITH_NCCL="$1" \
    ${nccl_include:+-DCOHORT_NCCL_INCLUDE_DIR="$(dirname "$nccl_include")"}
}
# The golden tests against one process, on the device, ranks as threads:
# name, test binary, gtest filter. LibTorch runs the CUDA part of every
# thread's backward on one thread per GPU, so where a rank's backward waits
# for a peer (DDP's, ZeRO-2's and FSDP's reductions, the TP layers'
# all-reduces, the MoE exchange) ranks as threads on one GPU would wait for
# each other until their timeout. These run at world 1, or in the pipeline,
# whose exchanges run between backward passes; the world-2 goldens of
# DDP, FSDP, the TP layers and the MoE layer run with ranks as processes
# (below), which share no thread.
goldens=(
  zero_equivalence optim_tests 'Zero/ZeroEquivalence.*world1*'
  fsdp_golden fsdp_tests 'FSDP/Golden.*World1*:FSDP/MixedPrecisionGolden.*World1*:FSDP/MixedPrecisionBytes.*World1'
  pipeline_equivalence pipeline_tests 'AllSchedules/PipelineEquivalence.*:PipelineComposition.*'
  tp_equivalence tensor_parallel_tests '*tp1_pp1_dp1*:*tp1_pp2_dp1*:TensorParallel/Layers.*Matches*/tp1'
  grad_norm cohort_train_test 'ReplicatedGradNorm.*'
  moe_golden tensor_parallel_tests 'Moe/ExpertParallel.MatchesOneProcess/gloo_ep1_*:MoeDigest.*'
  tp_dropout_golden tensor_parallel_tests 'GPTDropout/MatchesOneProcess.*/tp1*'
  tp_rng_restart tensor_parallel_tests 'Meshes/Tracker.*Restart*'
)
test_binaries=()
for ((i = 1; i < ${#goldens[@]}; i += 3)); do test_binaries+=("${goldens[$i]}"); done
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
  cp "$log" "$logs/build-nccl.log"
  nccl_engine="fell back: the library did not compile with the NCCL engine (log: build-nccl.log)"
  { configure OFF && cmake --build "$build" --target cohort; } >>"$log" 2>&1 || status=failed
fi
# Then only what the checks run; -k 0 reports every compile error in one run.
if [ "$status" = ok ] &&
  ! cmake --build "$build" -- -k 0 cohortrun contract_world ddp_world fsdp_world \
    "${test_binaries[@]}" fashion_mnist ddp_vs_torch >>"$log" 2>&1; then
  status=failed
fi
record build "$status" $((SECONDS - t)) "log: build.log"
[ "$status" = ok ] || { tail -40 "$log"; exit 1; }

failed=0
# The tests and the main job run side by side (16 cores, one GPU with room
# for all), so the check fits its time; the step times run alone after them.
pending=()
start() {   # NAME TIMEOUT COMMAND...: runs a check in the background
  local name=$1 limit=$2
  shift 2
  (
    t=$SECONDS
    if timeout "$limit" "$@" >"$logs/$name.log" 2>&1; then s=ok; else s=failed; fi
    echo "$s $((SECONDS - t))" >"$logs/$name.status"
  ) &
  pending+=("$name")
}
finish() {   # waits for the started checks and records each
  wait
  local name status secs
  for name in "${pending[@]}"; do
    status=failed secs=0
    [ -f "$logs/$name.status" ] && read -r status secs <"$logs/$name.status"
    rm -f "$logs/$name.status"
    if [ "$status" = ok ]; then
      # The test count, the main job's accuracy or a step time's ratio.
      record "$name" ok "$secs" "$(grep -o -e 'PASSED  \] [0-9]* tests\?' -e 'test accuracy: [0-9.]*' \
        -e '"ratio": [0-9.]*' "$logs/$name.log" | tail -1 | tr -d '"')"
    else
      record "$name" failed "$secs" "log: $name.log"
      tail -30 "$logs/$name.log"
      failed=1
    fi
  done
  pending=()
}
# (COHORT_TEST_DEVICE=cpu runs the same flow on a machine without a GPU.)
export COHORT_TEST_DEVICE=${COHORT_TEST_DEVICE:-cuda} OPENBLAS_NUM_THREADS=1
dev=$COHORT_TEST_DEVICE
run=$build/tools/cohortrun/cohortrun
contract() {   # ENGINE WORLD
  start "contract_${dev}_$1_world$2" 180 "$run" -n "$2" --backend "$1" --timeout 150 \
    --quiet-others -- "$build/tests/contract/contract_world" --gtest_filter='Contract/World.Holds/world_*'
}
contract gloo 1
contract gloo 2
# Both ranks on the current GPU: NCCL refuses two ranks on one GPU before
# 2.30, and then only with NCCL_MULTI_RANK_GPU_ENABLE=1.
nccl_two_ranks=0
if [ -n "$nccl_version" ] && [ "$(echo "$nccl_version" | awk -F. '{ print ($1 > 2 || ($1 == 2 && $2 >= 30)) }')" = 1 ]; then
  nccl_two_ranks=1
  export NCCL_MULTI_RANK_GPU_ENABLE=1
fi
if [ "$nccl_engine" = built ]; then
  contract nccl 1
  if [ "$nccl_two_ranks" = 1 ]; then
    contract nccl 2
  else
    record "contract_${dev}_nccl_world2" skipped 0 \
      "one GPU and NCCL ${nccl_version:-unknown} (two ranks on one GPU need NCCL 2.30+)"
  fi
else
  record nccl skipped 0 "$nccl_engine"
fi
for ((i = 0; i < ${#goldens[@]}; i += 3)); do
  start "${goldens[$i]}_$dev" 120 "$(find "$build/tests" -type f -name "${goldens[$((i + 1))]}" | head -1)" \
    --gtest_filter="${goldens[$((i + 2))]}"
done
start "ddp_world_${dev}_gloo_world2" 120 "$run" -n 2 --backend gloo --timeout 100 --quiet-others -- \
  "$build/tests/ddp/ddp_world"
start "fsdp_world_${dev}_gloo_world2" 120 "$run" -n 2 --backend gloo --timeout 100 --quiet-others -- \
  "$build/tests/fsdp/fsdp_world" --gtest_filter='FSDPWorldGolden.*'
# Kill-and-restart: a resumed job (dropout on the GPU) ends with the
# uninterrupted one's final loss, so the checkpoint restored the CUDA
# generators too.
start "restart_${dev}_gloo_world2" 120 "$(find "$build/tests" -type f -name cohort_train_test | head -1)" \
  --gtest_filter='KillAndRestart.*'
# The TP layers' and the MoE layer's goldens written for ranks as threads,
# and the GPT's TP replicas under dropout (the tracker's CUDA generators),
# run with ranks as processes (COHORT_TEST_RANKS, tests/support/thread_ranks.h).
start "tp_moe_processes_${dev}_gloo_world2" 120 env COHORT_TEST_RANKS=processes "$run" -n 2 \
  --backend gloo --timeout 100 --quiet-others -- "$(find "$build/tests" -type f -name tensor_parallel_tests | head -1)" \
  --gtest_filter='TensorParallel/Layers.*Matches*/tp2:Moe/ExpertParallel.MatchesOneProcess/gloo_ep2_*:GPTDropout/ReplicasAgree.*/tp2:GPTDropout/ReplicasAgree.*/tp2_sp'
# The main job: the README's Fashion-MNIST CNN, DDP and the Trainer, 2 ranks
# sharing the GPU over Gloo, 2 epochs (COHORT_MAIN_ARGS adds arguments, e.g.
# "--steps 50" for a quick run on a CPU).
start "main_job_$dev" 300 bash -c 'cd "$1" && shift && exec "$@"' _ "$logs" "$run" -n 2 --backend gloo \
  --timeout 280 -- "$build/examples/fashion_mnist/fashion_mnist" --device "$dev" \
  --data "$prefix/usr/share/datasets/fashion-mnist" --plot "" --metrics "$logs/metrics.jsonl" \
  ${COHORT_MAIN_ARGS:-}
finish
if accuracy=$(grep -o 'test accuracy: [0-9.]*' "$logs/main_job_$dev.log" | tail -1 | awk '{ print $3 }') &&
  [ -n "$accuracy" ]; then
  epochs=$(grep -o 'epoch [0-9]*: [0-9.]* s' "$logs/main_job_$dev.log" | awk '{ print $3 }' | paste -sd, -)
  figures+=("{\"figure\": \"main_job\", \"device\": \"$dev\", \"ranks\": 2, \"test_accuracy\": $accuracy, \"epoch_seconds\": [$epochs]}")
fi

# cohort's DDP against PyTorch's (same model, GPU and engine) at worlds 1
# and 2, and at world 1 each against its frontend without DDP (plain
# LibTorch, plain PyTorch): the ddp_vs_torch transformer
# (12 layers, d 256, 9.5M parameters), 32 sequences of 16 tokens per rank.
# NCCL where both sides can run it (world 2 needs two ranks on the GPU),
# else Gloo staging through host memory on both.
# The whole check must end within 8 minutes (COHORT_GPU_CHECK_SECONDS): a
# step-time run that would not fit is recorded as skipped.
limit=${COHORT_GPU_CHECK_SECONDS:-480}
for world in 1 2; do
  left=$((limit - (SECONDS - started)))
  if [ "$left" -lt 120 ]; then
    record "step_time_${dev}_world$world" skipped 0 "$left s of the ${limit} s left"
    continue
  fi
  engine=gloo
  if [ "$nccl_engine" = built ] && { [ "$world" = 1 ] || [ "$nccl_two_ranks" = 1 ]; }; then
    engine=nccl
  fi
  name="step_time_${dev}_world${world}_$engine"
  start "$name" $((world == 1 ? left * 2 / 3 : left - 10)) \
    python3 "$root/bench/ddp_vs_torch/run_step_time.py" --python python3 \
    --binary "$build/bench/ddp_vs_torch/ddp_vs_torch" --model transformer --batch 32 \
    --device "$dev" --backend "$engine" --worlds "$world" --rounds 3 --steps 20 --warmup 5
  finish
  if figure=$(grep '^{' "$logs/$name.log" | tail -1) && [ -n "$figure" ]; then figures+=("$figure"); fi
done
exit $failed
