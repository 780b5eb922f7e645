#!/usr/bin/env bash
# The consumer test: runs the README's install commands verbatim (the sh
# block under "Use cohort in your project") on a copy of the checkout, so in
# a build folder that holds nothing else, with only the prefix moved into
# WORK_DIR; checks what was installed, builds tests/packaging/consumer
# against it with find_package and runs it on 2 ranks through the installed
# cohortrun, with a source naming every installed public type through
# cohort.h alone (public_types.py); then configures the consumer with
# add_subdirectory(cohort) and with FetchContent (a git clone of this
# repository's HEAD) and compiles its source each time.
#   consumer_test.sh SOURCE_DIR WORK_DIR [COMPILER_LAUNCHER]
set -euo pipefail
src=$1 work=$2 launcher=${3:-}
consumer=$src/tests/packaging/consumer
rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix

step() { echo "== consumer_test: $*"; }
fail() { echo "consumer_test: FAILED: $*" >&2; exit 1; }

step "the README's install commands in a copy of the checkout"
copy=$work/source
mkdir -p "$copy"
if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$src" ls-files -z --cached --others --exclude-standard |
    tar -C "$src" --null -T - -c | tar -C "$copy" -x
else
  tar -C "$src" --exclude=./build -c . | tar -C "$copy" -x
fi
commands=$(awk '/^## Use cohort in your project/ { f = 1 }
                f && /^```sh$/ { b = 1; next }
                b && /^```$/ { exit }
                b' "$src/README.md")
[ -n "$commands" ] || fail "no install commands in README.md"
echo "$commands"
(cd "$copy" && bash -euo pipefail -c "${commands//\/opt\/cohort/$prefix}") >"$work/install.log" 2>&1 ||
  { tail -40 "$work/install.log"; fail "the README's install commands"; }
if grep -q '^GTest_DIR:' "$copy/build/CMakeCache.txt"; then
  fail "the install configure looked for GoogleTest"
fi

step "installed files"
for f in bin/cohortrun bin/cohort-plot bin/cohort-bench bin/cohort-ckpt bin/cohort-trace \
         include/cohort/cohort.h \
         include/cohort/version.h include/cohort/comm/communicator.h \
         lib/cmake/cohort/cohortConfig.cmake lib/cmake/cohort/cohortConfigVersion.cmake \
         lib/cmake/cohort/cohortTargets.cmake; do
  [ -e "$prefix/$f" ] || fail "$f not installed"
done
ls "$prefix"/lib/libcohort.* >/dev/null 2>&1 || fail "libcohort not installed"
# Internal headers stay out of the installed interface.
for f in include/cohort/pch.h include/cohort/comm/mpi include/cohort/algorithms \
         include/cohort/comm/communicator_internal.h; do
  [ ! -e "$prefix/$f" ] || fail "internal $f installed"
done
if grep -rlE '#include ?[<"](c10d/|torch/csrc/distributed|mpi\.h)' "$prefix/include"; then
  fail "an installed header includes c10d or mpi.h"
fi

step "every public type through the installed cohort.h"
python3 "$src/tests/packaging/public_types.py" "$prefix/include" "$work/public_types.cpp" ||
  fail "the installed headers against cohort.h"

config=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
[ -n "$launcher" ] && config+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher")

step "find_package(cohort) build"
cmake -S "$consumer" -B "$work/find" "${config[@]}" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCOHORT_PUBLIC_TYPES_SOURCE="$work/public_types.cpp" \
  >"$work/find-configure.log" || { cat "$work/find-configure.log"; fail "configure"; }
cmake --build "$work/find" || fail "build against the installed cohort"

step "2 ranks through the installed cohortrun"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
"$prefix/bin/cohortrun" -n 2 -- "$work/find/cohort_consumer" | tee "$work/run.log"
[ "$(grep -c 'consumer ok' "$work/run.log")" -eq 2 ] ||
  fail "expected 'consumer ok' from both ranks"

step "add_subdirectory(cohort) configure and compile"
cmake -S "$consumer" -B "$work/subdir" "${config[@]}" -DCOHORT_SOURCE_DIR="$src" \
  >"$work/subdir-configure.log" || { cat "$work/subdir-configure.log"; fail "configure"; }
grep -q '^COHORT_BUILD_TESTS:BOOL=OFF' "$work/subdir/CMakeCache.txt" ||
  fail "cohort's tests are on inside the consumer"
cmake --build "$work/subdir" --target CMakeFiles/cohort_consumer.dir/consumer.cpp.o ||
  fail "compile through add_subdirectory"
step "FetchContent(cohort) configure and compile"
if [ -n "$(GIT_OPTIONAL_LOCKS=0 git -C "$src" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  echo "skipped: the source tree has uncommitted changes, and FetchContent would fetch HEAD"
elif head=$(git -C "$src" rev-parse HEAD 2>/dev/null); then
  cmake -S "$consumer" -B "$work/fetch" "${config[@]}" -DCOHORT_GIT_REPOSITORY="$src" \
    -DCOHORT_GIT_TAG="$head" >"$work/fetch-configure.log" ||
    { cat "$work/fetch-configure.log"; fail "configure"; }
  cmake --build "$work/fetch" --target CMakeFiles/cohort_consumer.dir/consumer.cpp.o ||
    fail "compile through FetchContent"
else
  echo "skipped: the source tree is not a git repository"
fi
step "passed"
