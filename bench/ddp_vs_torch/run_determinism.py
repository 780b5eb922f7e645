#!/usr/bin/env python3
"""What Determinism::WorldSizeInvariant costs cohort DDP: the ddp_vs_torch
transformer at one world size, without the option and with it at each leaf
count, alternating run by run (the order rotates each round, so a drift in
the machine's load reaches every side alike). Per run: the median of rank
0's step times and its bytes on the wire per step; per side: the median over
the rounds, and its ratio to the run without the option.

  /work/shared/tools/exclusive /usr/bin/python3 bench/ddp_vs_torch/run_determinism.py \\
      --binary build/bench/ddp_vs_torch/ddp_vs_torch --world 4 --leaves 4,8 --rounds 5
"""
import argparse
import json
import statistics
import sys

from run_ddp_vs_torch import run_once


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True, help="the ddp_vs_torch executable")
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--batch", type=int, default=2, help="per rank")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--leaves", default="8", help="leaf counts to run with the option, comma separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()

    sides = ["0"] + a.leaves.split(",")
    runs = {side: [] for side in sides}
    for r in range(a.rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            cmd = [a.binary, "--model", a.model, "--batch", str(a.batch), "--steps", str(a.steps),
                   "--warmup", str(a.warmup), "--leaves", side]
            out = run_once(cmd, a.world, a.timeout)
            runs[side].append((statistics.median(out["step_ms"]), out["bytes_sent_per_step"]))
    base_ms = statistics.median(ms for ms, _ in runs["0"])
    base_bytes = statistics.median(b for _, b in runs["0"])
    for side in sides:
        ms = statistics.median(m for m, _ in runs[side])
        sent = statistics.median(b for _, b in runs[side])
        print(json.dumps({"model": a.model, "world": a.world, "batch_per_rank": a.batch,
                          "leaves": int(side), "step_ms": round(ms, 2),
                          "step_ms_runs": [round(m, 2) for m, _ in runs[side]],
                          "time_ratio": round(ms / base_ms, 3),
                          "bytes_sent_per_step": int(sent),
                          "bytes_ratio": round(sent / base_bytes, 4) if base_bytes else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
