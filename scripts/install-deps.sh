#!/usr/bin/env bash
# Installs cohort's build and test dependencies from Debian's archive.
# Idempotent: installs only what is missing and runs `apt-get update` at most once.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  ccache                  # the packaging test's second build of the library hits its cache
  libtorch-dev            # LibTorch 1.13: tensors, autograd, nn, optim, c10d (Gloo, TCPStore)
  libgloo-dev             # Gloo headers that c10d's ProcessGroupGloo.hpp includes
  libopenblas0-pthread    # fast BLAS for LibTorch's matmuls (reference BLAS is ~7x slower)
  libopenmpi-dev openmpi-bin
  libucx-dev              # the UCX engine (shared memory on a host, TCP/RDMA across hosts)
  libgtest-dev googletest libgmock-dev
  libbenchmark-dev
  libcli11-dev
  doxygen                 # the API reference (docs target and its test)
  nlohmann-json3-dev
  zlib1g-dev
  gnuplot-nox
  dataset-fashion-mnist
  fortunes                # plain-text corpus of the gpt example
  python3-torch           # reference peer for tests and benchmarks only
  iproute2                # network namespaces for the multi-host launcher tests
  slurmctld slurmd slurm-client munge   # the Slurm test runs a one-node cluster
  clang-format git        # the formatting check on changed lines (git clang-format)
  debootstrap             # scripts/test-debian13.sh: the Debian 13 lane
)
# Hugging Face's safetensors reader, the peer of dcp's safetensors tests;
# Debian 12 has no package (those tests skip there).
if [ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" != bookworm ]; then
  packages+=(python3-safetensors)
fi

# COHORT_LIBTORCH=cuda (a Debian 13 root with contrib and non-free, for
# scripts/check-cuda-build.sh): LibTorch with CUDA and c10d's NCCL, its
# Gloo built with CUDA, CUDA's compiler and headers, and NCCL's, instead of
# the CPU ones. The Python peer conflicts with that LibTorch and is left out.
if [ "${COHORT_LIBTORCH:-cpu}" = cuda ]; then
  cpu=("${packages[@]}")
  packages=(libtorch-cuda-dev libgloo-cuda-dev libnccl-dev nvidia-cuda-toolkit)
  for p in "${cpu[@]}"; do
    case $p in libtorch-dev | libgloo-dev | python3-torch) ;; *) packages+=("$p") ;; esac
  done
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
