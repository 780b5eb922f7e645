#!/usr/bin/env bash
# Fails when a C++ line changed since the format base is not as the
# checked-in .clang-format wants it (git clang-format on the changed lines
# only; lines nobody touched keep their old layout). The base is the commit
# in scripts/format-base: moving it forward after formatting the whole tree
# shortens the check. Prints the diff that `git clang-format BASE` would
# apply. Run by the test command (ctest: formatting).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# The layout is clang-format 14's (Debian 12): clang-format 19 (Debian 13)
# lays out some lines otherwise (short blocks, lambdas in arguments), so
# another release cannot judge them. CI's first lane checks.
want=14
have=$(clang-format --version | sed -nE 's/.*version ([0-9]+).*/\1/p')
if [ "$have" != "$want" ]; then
  echo "formatting: skipped: this is clang-format $have; the layout is clang-format $want's"
  exit 77
fi
base=$(tr -d '[:space:]' < scripts/format-base)
if ! git cat-file -e "$base^{commit}" 2>/dev/null; then
  echo "formatting: the format base $base is not in this clone (shallow?); checking the last commit"
  base=HEAD~1
fi
diff=$(git clang-format --diff --extensions h,hpp,cpp,c "$base" -- cohort tests tools examples bench 2>&1) || true
case "$diff" in
  "" | "no modified files to format" | *"did not modify any files"*)
    echo "formatting: every line changed since $base is formatted"
    ;;
  *)
    echo "$diff"
    echo "formatting: run 'git clang-format $base' (or clang-format -i on the files above)"
    exit 1
    ;;
esac
