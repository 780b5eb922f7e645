#!/usr/bin/env python3
"""Medians per side of compare.sh's runs, and new / old.

    python3 bench/p2p/summarize.py runs.jsonl [more.jsonl ...]

A row per (operation, bytes): for the ping-pong the medians over runs of
each run's 10th and 50th percentile one-way time; for an all-reduce the
median over runs of each run's median operation (--per-op-median).
"""
import json
import statistics
import sys
from collections import defaultdict

figures = defaultdict(list)  # (op, bytes, metric, side) -> values
for path in sys.argv[1:]:
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        op = r["op"] if r["op"] == "p2p" else "all_reduce " + r.get("reduce_op", "sum")
        metrics = ["p10_us", "p50_us"] if r["op"] == "p2p" else ["us"]
        for m in metrics:
            figures[(op, r["bytes"], m, r["side"])].append(r[m])

print("| operation | bytes | figure | old us | new us | new / old | runs (old, new) |")
print("|---|---:|---|---:|---:|---:|---|")
keys = sorted({k[:3] for k in figures}, key=lambda k: (k[0], k[1], k[2]))
for op, b, m in keys:
    old, new = figures.get((op, b, m, "old"), []), figures.get((op, b, m, "new"), [])
    if not old or not new:
        continue
    o, n = statistics.median(old), statistics.median(new)
    print(f"| {op} | {b} | {m[:-3]} | {o:.1f} | {n:.1f} | {n / o:.2f} | {len(old)}, {len(new)} |")
