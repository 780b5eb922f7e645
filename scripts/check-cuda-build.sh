#!/usr/bin/env bash
# Compiles the CUDA build (library, tests, tools, examples, benchmarks) on a
# machine without a GPU: a Debian 13 root (scripts/test-debian13.sh) with
# contrib and non-free, whose LibTorch 2.6 is built with CUDA 12.4 and NCCL.
# A developer's tool, not part of CI: the packages are a 2.4 GB download.
#
#   scripts/check-cuda-build.sh
#
# The root is kept between runs (COHORT_CUDA_ROOT, default
# /var/tmp/cohort-cuda-debian13) with its packages and its build folder
# (build/ in the root's copy of the checkout), so a second run compiles only
# what changed. Exits with the build's status; its warnings are in its
# output.
#
# nvidia-cudnn, which that LibTorch depends on, is a package whose
# installation downloads cuDNN from NVIDIA and fails without that network;
# compiling needs no cuDNN, so an equivs placeholder of that name stands in.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)

if [ "${1:-}" != --in-root ]; then
  export COHORT_DEBIAN13_ROOT=${COHORT_CUDA_ROOT:-/var/tmp/cohort-cuda-debian13}
  exec "$src/scripts/test-debian13.sh" ./scripts/check-cuda-build.sh --in-root
fi

# Inside the root, in the checkout's copy.
export DEBIAN_FRONTEND=noninteractive
sed -i 's/^\(deb .* trixie\) main$/\1 main contrib non-free/' /etc/apt/sources.list
if ! dpkg-query -W -f='${Status}' nvidia-cudnn 2>/dev/null | grep -q "install ok installed"; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends equivs >/dev/null
  placeholder=$(mktemp -d)
  cat >"$placeholder/control" <<'EOF'
Section: non-free/libs
Priority: optional
Standards-Version: 4.6.2
Package: nvidia-cudnn
Version: 9.99~cohort
Description: placeholder for cuDNN (cohort's CUDA compile check needs none)
EOF
  (cd "$placeholder" && equivs-build control >/dev/null)
  dpkg -i "$placeholder"/nvidia-cudnn_*.deb >/dev/null
  rm -rf "$placeholder"
fi
COHORT_LIBTORCH=cuda ./scripts/install-deps.sh
# The placeholder leaves libtorch_cuda's references into cuDNN unresolved:
# the linker ignores unresolved symbols inside shared libraries (cohort's
# own still fail the link), and no test binary runs to list its suites.
ignore=-Wl,--unresolved-symbols=ignore-in-shared-libs
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOHORT_LIST_TESTS=OFF \
  -DCMAKE_EXE_LINKER_FLAGS="$ignore" -DCMAKE_SHARED_LINKER_FLAGS="$ignore" >/dev/null
cmake --build build --parallel "$(nproc)"
