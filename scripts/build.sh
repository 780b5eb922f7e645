#!/usr/bin/env bash
# Configures and builds everything (library, tools, examples, tests,
# benchmarks) into BUILD_DIR (default: build). Idempotent and incremental.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# Configure every time (seconds): a module folder added since the last
# build is only found by a new configure.
if [ -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" >/dev/null
else
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release
fi
# (nproc without OMP_NUM_THREADS, which it would answer instead.)
cmake --build "$build" --parallel "$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
