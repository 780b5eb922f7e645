#!/usr/bin/env python3
"""Step time of cohort's DDP against PyTorch's DDP (same model, device and
engine, ranks as processes), and at world 1 against plain LibTorch (the
same loop without cohort, `ddp_vs_torch --plain`). The sides alternate run
by run (the order rotates each round); per run the median of rank 0's step
times, per side the median over the rounds. One JSON line per world:

  {"model", "device", "engine", "world", "batch", "cohort_ms", "torch_ms",
   "ratio": cohort_ms / torch_ms, and at world 1 "plain_ms" and
   "overhead": cohort_ms / plain_ms - 1, each side's runs}

  python3 bench/ddp_vs_torch/run_step_time.py --binary build/bench/ddp_vs_torch/ddp_vs_torch \\
      --python python3 --device cuda --backend nccl --worlds 1 --batch 32 --rounds 5

scripts/gpu-check.sh runs it on the GPU; on the CPU it runs as it is.
"""
import argparse
import json
import os
import statistics
import sys

from run_ddp_vs_torch import run_once

HERE = os.path.dirname(os.path.abspath(__file__))


def median_ms(out):
    return statistics.median(out["step_ms"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True, help="the ddp_vs_torch executable")
    ap.add_argument("--python", default="/usr/bin/python3", help="python with torch")
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--batch", type=int, default=2, help="per rank")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo", help="cohort's engine and PyTorch's backend")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()

    common = ["--model", a.model, "--batch", str(a.batch), "--steps", str(a.steps),
              "--warmup", str(a.warmup), "--device", a.device]
    commands = {
        "cohort": [a.binary] + common,
        "torch": [a.python, os.path.join(HERE, "ddp_vs_torch.py")] + common + ["--backend", a.backend],
        "plain": [a.binary] + common + ["--plain"],
    }
    for world in [int(w) for w in a.worlds.split(",")]:
        sides = ["cohort", "torch"] + (["plain"] if world == 1 else [])
        runs = {side: [] for side in sides}
        for r in range(a.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                out = run_once(commands[side], 1 if side == "plain" else world, a.timeout, a.backend)
                runs[side].append(round(median_ms(out), 3))
        ms = {side: statistics.median(v) for side, v in runs.items()}
        row = {"model": a.model, "device": a.device, "engine": a.backend, "world": world,
               "batch": a.batch, "cohort_ms": ms["cohort"], "torch_ms": ms["torch"],
               "ratio": round(ms["cohort"] / ms["torch"], 3), "cohort_runs": runs["cohort"],
               "torch_runs": runs["torch"]}
        if "plain" in ms:
            row.update({"plain_ms": ms["plain"], "overhead": round(ms["cohort"] / ms["plain"] - 1, 4),
                        "plain_runs": runs["plain"]})
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
