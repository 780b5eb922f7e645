#!/usr/bin/env bash
# The main job on a fresh machine: installs the Debian dependencies, builds
# everything, and trains the Fashion-MNIST CNN for 2 epochs on 2 local ranks
# through cohortrun (DDP + the Trainer). Prints the time per epoch and the
# final `test accuracy:`; writes metrics.jsonl and curves.png in the current
# directory. Extra arguments go to the example (e.g. --epochs 1).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
build=${BUILD_DIR:-$root/build}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
# glibc keeps large freed tensors instead of returning them to the kernel
# after every step (docs/usage.md, "Performance tips"); the user's values win.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-67108864}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-268435456}
# 2 epochs unless the arguments name --epochs (the example takes it once).
epochs=(--epochs 2)
for a in "$@"; do
  case $a in --epochs | --epochs=*) epochs=() ;; esac
done
exec "$build/tools/cohortrun/cohortrun" -n 2 -- \
  "$build/examples/fashion_mnist/fashion_mnist" "${epochs[@]}" "$@"
