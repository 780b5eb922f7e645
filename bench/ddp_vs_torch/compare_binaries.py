#!/usr/bin/env python3
"""Two builds of the ddp_vs_torch binary (say, before and after a change)
side by side, with PyTorch DDP as the common reference: at every model and
world size, each round runs the old binary, the new one and PyTorch once,
in an order that rotates round by round, so that a drift in the machine's
load reaches all three alike. Figures are medians over the rounds.

  bench/ddp_vs_torch/compare_binaries.py --old OLD/ddp_vs_torch --new build/bench/ddp_vs_torch/ddp_vs_torch

Prints one line per point, or with --json one object per point holding
every run.
"""
import argparse
import json
import os
import statistics
import sys

from run_ddp_vs_torch import BATCH, HERE, run_once


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the ddp_vs_torch executable before the change")
    ap.add_argument("--new", required=True, help="the ddp_vs_torch executable after the change")
    ap.add_argument("--python", default="/usr/bin/python3", help="python with torch")
    ap.add_argument("--models", default="mlp,cnn,transformer")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--no-torch", action="store_true", help="leave PyTorch out (old against new only)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    for model in a.models.split(","):
        for world in [int(w) for w in a.worlds.split(",")]:
            args = ["--model", model, "--batch", str(BATCH[model]), "--steps", str(a.steps),
                    "--warmup", str(a.warmup)]
            cmds = {"old": [a.old] + args, "new": [a.new] + args,
                    "torch": [a.python, os.path.join(HERE, "ddp_vs_torch.py")] + args}
            if a.no_torch:
                del cmds["torch"]
            sides = list(cmds)
            runs = {side: [] for side in sides}
            for r in range(a.rounds):
                for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                    runs[side].append(run_once(cmds[side], world, a.timeout)["sps"])
            med = {side: statistics.median(v) for side, v in runs.items()}
            med.setdefault("torch", float("nan"))
            row = {"model": model, "world": world, "batch": BATCH[model],
                   **{f"{side}_sps": round(med[side], 2) for side in med},
                   "new_over_old": round(med["new"] / med["old"], 3),
                   "old_over_torch": round(med["old"] / med["torch"], 3),
                   "new_over_torch": round(med["new"] / med["torch"], 3),
                   "runs": {side: [round(x, 2) for x in v] for side, v in runs.items()}}
            if a.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{model:12s} world {world}  old {med['old']:9.1f}/s  new {med['new']:9.1f}/s  "
                      f"new/old {row['new_over_old']:.3f}  torch {med['torch']:9.1f}/s  "
                      f"old/torch {row['old_over_torch']:.2f}  new/torch {row['new_over_torch']:.2f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
