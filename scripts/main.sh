#!/usr/bin/env bash
# The main job on a fresh machine: installs the Debian dependencies, builds
# everything, and runs a 2-rank job through cohortrun. Until the Fashion-MNIST
# training example lands (issue 8), the job is cohort_smoke: each rank
# all-reduces RANK+1 and checks the sum against n(n+1)/2.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
build=${BUILD_DIR:-$root/build}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
exec "$build/tools/cohortrun/cohortrun" -n 2 -- "$build/examples/cohort_smoke" "$@"
