#!/usr/bin/env bash
# Soak test (not part of ./scripts/test.sh: it takes one or more epochs):
# trains the Fashion-MNIST job on 2 ranks through cohortrun, samples the
# resident memory (VmRSS) of every rank every SOAK_INTERVAL seconds, and
# fails when memory is not flat: the median of the last quarter of the
# samples may exceed the median of the second quarter (after warm-up) by at
# most SOAK_MAX_GROWTH_PCT percent. Writes the samples to SOAK_CSV.
#   ./scripts/soak.sh                 # 1 epoch
#   ./scripts/soak.sh --epochs 3      # arguments go to the example
# Needs a built tree (./scripts/build.sh); BUILD_DIR overrides build/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
interval=${SOAK_INTERVAL:-2}
max_growth=${SOAK_MAX_GROWTH_PCT:-10}
csv=$(realpath -m "${SOAK_CSV:-soak-rss.csv}")
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-67108864}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-268435456}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--epochs 1)
# In the scratch folder: the example writes its curves to the current one.
(cd "$work" && exec "$build/tools/cohortrun/cohortrun" -n 2 -- \
  "$build/examples/fashion_mnist/fashion_mnist" --metrics "$work/metrics.jsonl" "${args[@]}") \
  >"$work/job.log" 2>&1 &
launcher=$!

# The ranks are the launcher's children; sum their VmRSS (KiB).
rss_of_ranks() {
  local total=0 pid kb
  for pid in $(cat /proc/"$launcher"/task/*/children 2>/dev/null); do
    kb=$(awk '/^VmRSS:/ {print $2}' /proc/"$pid"/status 2>/dev/null || true)
    total=$((total + ${kb:-0}))
  done
  echo "$total"
}

echo "seconds,rss_kib" >"$csv"
start=$(date +%s)
while kill -0 "$launcher" 2>/dev/null; do
  rss=$(rss_of_ranks)
  [ "$rss" -gt 0 ] && echo "$(($(date +%s) - start)),$rss" >>"$csv"
  sleep "$interval"
done
wait "$launcher" && status=0 || status=$?
cat "$work/job.log"
if [ "$status" -ne 0 ]; then
  echo "soak: the job failed (exit $status)" >&2
  exit 1
fi

# Flat memory: compare the medians of the second and the last quarter.
awk -F, -v max="$max_growth" 'NR > 1 { v[n++] = $2 }
  function median(lo, hi,   i, j, t, m, a) {
    m = 0
    for (i = lo; i < hi; i++) a[m++] = v[i]
    for (i = 0; i < m; i++) for (j = i + 1; j < m; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return a[int(m / 2)]
  }
  END {
    if (n < 8) { print "soak: only " n " samples; run longer" > "/dev/stderr"; exit 1 }
    q = int(n / 4)
    early = median(q, 2 * q); late = median(3 * q, n)
    growth = 100.0 * (late - early) / early
    max_seen = 0; for (i = 0; i < n; i++) if (v[i] > max_seen) max_seen = v[i]
    printf "soak: %d samples; rss of both ranks: second-quarter median %.1f MiB, last-quarter median %.1f MiB (%+.1f%%), peak %.1f MiB\n",
           n, early / 1024, late / 1024, growth, max_seen / 1024
    if (growth > max) { printf "soak: memory grew by more than %s%%\n", max > "/dev/stderr"; exit 1 }
    print "soak: memory is flat"
  }' "$csv"
