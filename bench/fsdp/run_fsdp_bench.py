#!/usr/bin/env python3
"""Drives the fsdp benchmark: for each world size, the modes run alternately
(ddp, zero2, fsdp, fsdp_bf16, ddp, ...) as separate processes per rank on
Gloo, one thread per rank; step_ms is the median over --runs runs of each
run's median step. It checks the bars of fully sharded data parallelism:

  memory  peak_pgs_bytes <= (P + G + S) / N + the two largest units
          unsharded (in the mode's param dtype), + 5%
  speed   step_ms <= 1.15 x ddp's step_ms

  bench/fsdp/run_fsdp_bench.py --binary build/bench/fsdp/fsdp_bench [--json]
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ddp_vs_torch"))
from run_ddp_vs_torch import run_once  # noqa: E402  (one launcher for every multi-rank bench)

# The transformer's parameters: 12 layers of 789,760 and a head of 65,792.
LAYER, HEAD = 789760, 65792
PARAMS = 12 * LAYER + HEAD


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True, help="path of the fsdp_bench executable")
    ap.add_argument("--modes", default="ddp,zero2,fsdp,fsdp_bf16")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reshard-after-forward", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    modes = a.modes.split(",")
    for world in [int(w) for w in a.worlds.split(",")]:
        results = {m: [] for m in modes}
        for _ in range(a.runs):
            for m in modes:
                args = ["--mode", m, "--steps", str(a.steps), "--warmup", str(a.warmup),
                        "--batch", str(a.batch),
                        "--reshard-after-forward", str(a.reshard_after_forward)]
                results[m].append(run_once([a.binary] + args, world, a.timeout))
        rows = {}
        for m in modes:
            rs = results[m]
            row = {"mode": m, "world": world}
            for k in ("params", "held_bytes", "peak_bytes", "act_peak_bytes", "peak_pgs_bytes",
                      "wire_bytes"):
                row[k] = max(r[k] for r in rs)
            for k in ("ag_flight_ms", "ag_wait_ms", "step_ms"):
                row[k] = round(statistics.median(r[k] for r in rs), 3)
            row["step_ms_runs"] = [round(r["step_ms"], 2) for r in rs]
            row["step_ms_min"] = round(min(r["step_ms_min"] for r in rs), 2)
            rows[m] = row
        base = rows.get("ddp")
        for m in modes:
            row = rows[m]
            if row["params"] != PARAMS:
                raise RuntimeError(f"the model has {row['params']} parameters, expected {PARAMS}")
            # P + G + S in float32 (AdamW: two moments), over N, plus the two
            # largest units unsharded in the all-gather's dtype.
            unit = 2 if m == "fsdp_bf16" else 4
            bar = (4 * PARAMS * 4) / world + 2 * LAYER * unit
            row["memory_bar_bytes"] = int(bar * 1.05)
            row["memory_ok"] = row["peak_pgs_bytes"] <= row["memory_bar_bytes"]
            if base:
                row["step_vs_ddp"] = round(row["step_ms"] / base["step_ms"], 3)
                row["step_min_vs_ddp"] = round(row["step_ms_min"] / base["step_ms_min"], 3)
                row["wire_vs_ddp"] = round(row["wire_bytes"] / base["wire_bytes"], 3)
            if a.json:
                print(json.dumps(row), flush=True)
            else:
                mb = 1024 * 1024
                print(f"{m:9s} world {world}  held {row['held_bytes'] / mb:7.2f} MiB  "
                      f"peak P+G+S {row['peak_pgs_bytes'] / mb:7.2f} MiB (bar {row['memory_bar_bytes'] / mb:7.2f})  "
                      f"wire {row['wire_bytes'] / mb:7.2f} MiB/step  "
                      f"all-gather {row['ag_flight_ms']:.1f} ms in flight, {row['ag_wait_ms']:.1f} ms waited  "
                      f"step median {row['step_ms']:8.2f} ms, min {row['step_ms_min']:8.2f} ms"
                      + (f"  x{row['step_vs_ddp']:.2f} / x{row['step_min_vs_ddp']:.2f} of ddp"
                         if base else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
