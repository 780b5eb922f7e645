#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs the Debian dependencies,
# builds everything, runs every test through ctest. Exits non-zero when any
# test fails. `.ci/run` calls this verbatim.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
build=${BUILD_DIR:-$root/build}
# GNU nproc answers OMP_NUM_THREADS (set below, and perhaps by the caller):
# count the cores without it.
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
# Ranks share the cores: one BLAS thread each.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
cd "$build"
ctest --output-on-failure --timeout 300 -j "$jobs"
