#!/usr/bin/env bash
# The main job on a fresh machine: installs the Debian dependencies, builds
# everything, and trains the Fashion-MNIST CNN on 2 local ranks through
# cohortrun (DDP + the Trainer), printing the test accuracy and writing
# metrics.jsonl and curves.png in the current directory.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
build=${BUILD_DIR:-$root/build}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
exec "$build/tools/cohortrun/cohortrun" -n 2 -- \
  "$build/examples/fashion_mnist/fashion_mnist" --epochs 2 "$@"
