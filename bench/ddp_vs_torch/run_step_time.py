#!/usr/bin/env python3
"""Step time of cohort's DDP against PyTorch's DDP (same model, device,
engine, bucket views and per-parameter SGD; ranks as processes), and at
world 1 each against its own frontend without DDP: cohort's against plain
LibTorch (`ddp_vs_torch --plain`), PyTorch's against plain PyTorch (the two
frontends' models differ in their kernels, e.g. PyTorch's attention). The
sides alternate run by run (the order rotates each round); per run the
median of rank 0's step times, per side the median over the rounds. One
JSON line per world:

  {"model", "device", "engine", "world", "batch", "cohort_ms", "torch_ms",
   "ratio": cohort_ms / torch_ms, and at world 1 "plain_ms", "overhead":
   cohort_ms / plain_ms - 1, "torch_plain_ms", "torch_overhead":
   torch_ms / torch_plain_ms - 1; each side's runs}

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
        "torch": [a.python, os.path.join(HERE, "ddp_vs_torch.py")] + common +
                 ["--backend", a.backend, "--bucket-view", "1"],
        "plain": [a.binary] + common + ["--plain"],
        "torch_plain": [a.python, os.path.join(HERE, "ddp_vs_torch.py")] + common + ["--plain"],
    }
    for world in [int(w) for w in a.worlds.split(",")]:
        sides = ["cohort", "torch"] + (["plain", "torch_plain"] if world == 1 else [])
        runs = {side: [] for side in sides}
        for r in range(a.rounds):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                out = run_once(commands[side], 1 if "plain" in side else world, a.timeout, a.backend)
                runs[side].append(round(median_ms(out), 3))
        ms = {side: round(statistics.median(v), 3) for side, v in runs.items()}
        row = {"model": a.model, "device": a.device, "engine": a.backend, "world": world,
               "batch": a.batch, "cohort_ms": ms["cohort"], "torch_ms": ms["torch"],
               "ratio": round(ms["cohort"] / ms["torch"], 3), "cohort_runs": runs["cohort"],
               "torch_runs": runs["torch"]}
        if "plain" in ms:
            row.update({"plain_ms": ms["plain"], "overhead": round(ms["cohort"] / ms["plain"] - 1, 4),
                        "torch_plain_ms": ms["torch_plain"],
                        "torch_overhead": round(ms["torch"] / ms["torch_plain"] - 1, 4),
                        "plain_runs": runs["plain"], "torch_plain_runs": runs["torch_plain"]})
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
