#!/usr/bin/env python3
"""Drives the zero_memory benchmark: for each world size, the modes run
alternately (ddp, zero1, zero2, fused, ddp, ...) as separate processes per
rank on one engine (Gloo by default), one thread per rank; step_ms is the
median over --runs runs of each run's median step.

  bench/zero_memory/run_zero_memory.py --binary build/bench/zero_memory/zero_memory [--json]

Prints a table, or with --json one object per (mode, world) with mode,
world, state_bytes_per_rank, grad_bytes_per_rank, grad_bytes_after_backward,
staging_bytes_per_rank (ZeRO-2's staging buffers, lazily freed between
uses), grad_peak_bytes (ZeRO-2: shard + most staging alive at once),
held_grad_peak_bytes (ZeRO-2: most .grad bytes kept waiting for their bucket),
bucket_bytes (ZeRO's largest bucket), step_ms, and the ratios to DDP at the same world size.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ddp_vs_torch"))
from run_ddp_vs_torch import run_once  # noqa: E402  (one launcher for every multi-rank bench)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True, help="path of the zero_memory executable")
    ap.add_argument("--modes", default="ddp,zero1,zero2,zero2_ddp,fused")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=25, help="ZeRO's and fused's bucket cap")
    ap.add_argument("--staged-buckets", type=int, default=1,
                    help="ZeRO-2's max_staged_buckets (1: shard + one bucket; 2: overlapped)")
    ap.add_argument("--gather-algo", default="default", help="ZeRO's parameter all-gather")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    modes = a.modes.split(",")
    for world in [int(w) for w in a.worlds.split(",")]:
        results = {m: [] for m in modes}
        for _ in range(a.runs):
            for m in modes:
                args = ["--mode", m, "--steps", str(a.steps), "--warmup", str(a.warmup),
                        "--batch", str(a.batch), "--bucket-mb", str(a.bucket_mb),
                        "--gather-algo", a.gather_algo,
                        "--staged-buckets", str(a.staged_buckets)]
                results[m].append(run_once([a.binary] + args, world, a.timeout))
        rows = {}
        for m in modes:
            rs = results[m]
            rows[m] = {"mode": m, "world": world,
                       "state_bytes_per_rank": max(r["state_bytes_per_rank"] for r in rs),
                       "grad_bytes_per_rank": max(r["grad_bytes_per_rank"] for r in rs),
                       "grad_bytes_after_backward": max(r["grad_bytes_after_backward"] for r in rs),
                       "staging_bytes_per_rank": max(r["staging_bytes_per_rank"] for r in rs),
                       "grad_peak_bytes": max(r["grad_peak_bytes"] for r in rs),
                       "held_grad_peak_bytes": max(r["held_grad_peak_bytes"] for r in rs),
                       "bucket_bytes": max(r["bucket_bytes"] for r in rs),
                       "step_ms": round(statistics.median(r["step_ms"] for r in rs), 2),
                       "step_ms_runs": [round(r["step_ms"], 2) for r in rs],
                       # Other load only adds time: the fastest step is the
                       # steadiest figure on a shared machine.
                       "step_ms_min": round(min(r["step_ms_min"] for r in rs), 2)}
        base = rows.get("ddp")
        for m in modes:
            row = rows[m]
            if base:
                row["state_vs_ddp"] = round(row["state_bytes_per_rank"] / base["state_bytes_per_rank"], 4)
                row["grad_vs_ddp"] = round(row["grad_bytes_per_rank"] / base["grad_bytes_per_rank"], 4)
                row["step_vs_ddp"] = round(row["step_ms"] / base["step_ms"], 3)
                row["step_min_vs_ddp"] = round(row["step_ms_min"] / base["step_ms_min"], 3)
            if a.json:
                print(json.dumps(row), flush=True)
            else:
                mb = 1024 * 1024
                print(f"{m:9s} world {world}  state {row['state_bytes_per_rank'] / mb:7.2f} MiB  "
                      f"grads {row['grad_bytes_per_rank'] / mb:7.2f} MiB  "
                      f"(after backward {row['grad_bytes_after_backward'] / mb:7.2f} MiB, "
                      f"staging {row['staging_bytes_per_rank'] / mb:6.2f} MiB lazily freed, "
                      f"peak {row['grad_peak_bytes'] / mb:7.2f} MiB, held {row['held_grad_peak_bytes'] / mb:6.2f} MiB, bucket {row['bucket_bytes'] / mb:6.2f} MiB)  "
                      f"step median {row['step_ms']:8.2f} ms, min {row['step_ms_min']:8.2f} ms"
                      + (f"  x{row['step_vs_ddp']:.2f} / x{row['step_min_vs_ddp']:.2f} of ddp"
                         if base else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
