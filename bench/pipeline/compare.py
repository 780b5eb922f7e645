#!/usr/bin/env python3
"""Summarizes bench/pipeline/compare.sh's JSON lines: per schedule, v, pp
and m the median step time of each side, new / old, and the median bubble.

    python3 bench/pipeline/compare.py OUT.jsonl [OUT2.jsonl ...]
"""
import collections
import json
import statistics
import sys


def main(paths):
    runs = collections.defaultdict(list)
    for path in paths:
        for line in open(path):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "step_ms" in row:
                key = (row["schedule"], row["v"], row["ranks"], row["m"], row["side"])
                runs[key].append(row)
    print("| schedule | v | pp | m | old: step ms | new | new / old | bubble old / new | runs |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for point in sorted({k[:4] for k in runs}):
        old, new = runs[point + ("old",)], runs[point + ("new",)]
        if not old or not new:
            continue
        med = lambda rows, f: statistics.median(r[f] for r in rows)
        o, n = med(old, "step_ms"), med(new, "step_ms")
        print("| %s | %d | %d | %d | %.1f | %.1f | %.2f | %.3f / %.3f | %d |" % (
            *point, o, n, n / o, med(old, "bubble_measured"), med(new, "bubble_measured"),
            min(len(old), len(new))))


if __name__ == "__main__":
    main(sys.argv[1:])
