#!/usr/bin/env python3
"""Summarizes bench/pipeline/compare.sh's JSON lines: per schedule, v, pp
and m the median step time of each side, new / old, the median bubble, and
how often relabelling the runs at random moves the ratio of medians at
least as far from 1 (a permutation test: p well above 0.05 means the two
sides are not told apart by these runs; with a dozen points one p near 0.05
is what chance gives).

    python3 bench/pipeline/compare.py OUT.jsonl [OUT2.jsonl ...]
"""
import collections
import json
import random
import statistics
import sys


def permutation_p(old, new, trials=4000):
    rng = random.Random(0)
    med = statistics.median
    observed = abs(med(new) / med(old) - 1)
    pooled, hits = old + new, 0
    for _ in range(trials):
        rng.shuffle(pooled)
        if abs(med(pooled[len(old):]) / med(pooled[:len(old)]) - 1) >= observed:
            hits += 1
    return hits / trials


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
    print("| schedule | v | pp | m | old: step ms | new | new / old | p | bubble old / new | runs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for point in sorted({k[:4] for k in runs}):
        old, new = runs[point + ("old",)], runs[point + ("new",)]
        if not old or not new:
            continue
        med = lambda rows, f: statistics.median(r[f] for r in rows)
        o, n = med(old, "step_ms"), med(new, "step_ms")
        p = permutation_p([r["step_ms"] for r in old], [r["step_ms"] for r in new])
        print("| %s | %d | %d | %d | %.1f | %.1f | %.2f | %.2f | %.3f / %.3f | %d |" % (
            *point, o, n, n / o, p, med(old, "bubble_measured"), med(new, "bubble_measured"),
            min(len(old), len(new))))


if __name__ == "__main__":
    main(sys.argv[1:])
