#!/usr/bin/env python3
"""What splitting a batch into leaves costs the framework itself, with no
distribution and no cohort: PyTorch's (Python, over the same LibTorch)
forward and backward of the ddp_vs_torch model (ddp_vs_torch.py's) on one
batch of `--batch` samples, against the same samples as `--pieces`
forward/backward passes of batch / pieces samples each, gradients
accumulating. One thread. The two sides alternate step by step; per side
the median of the steps. This is the floor under
Determinism::WorldSizeInvariant's cost at L = pieces x world
(run_determinism.py): the matrix products of a smaller batch.

  cd bench/ddp_vs_torch && MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456 \
      OPENBLAS_NUM_THREADS=1 /work/shared/tools/exclusive /usr/bin/python3 split_batch_cost.py --batch 2 --pieces 2 --steps 60

(the allocator settings of run_ddp_vs_torch.py, so fresh gradients come
from the heap and not from page faults)
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ddp_vs_torch import make_batch, make_model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--pieces", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    if a.batch % a.pieces:
        sys.exit(f"--pieces {a.pieces} does not divide --batch {a.batch}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model(a.model)
    x, y = make_batch(a.model, a.batch)
    dim = 1 if a.model == "transformer" else 0  # the transformer's input is sequence-first
    loss_fn = F.mse_loss if a.model == "transformer" else F.cross_entropy
    sides = {"whole": [(x, y)],
             "pieces": list(zip(x.chunk(a.pieces, dim), y.chunk(a.pieces, dim)))}
    # Each piece its own tensor, as a leaf is (not a view into the batch).
    sides["pieces"] = [(px.contiguous(), py.contiguous()) for px, py in sides["pieces"]]

    def step(parts):
        for p in model.parameters():
            p.grad = None
        for px, py in parts:
            loss_fn(model(px), py).backward()

    times = {name: [] for name in sides}
    for i in range(a.warmup + a.steps):
        for name in (["whole", "pieces"] if i % 2 == 0 else ["pieces", "whole"]):
            t = time.perf_counter()
            step(sides[name])
            if i >= a.warmup:
                times[name].append((time.perf_counter() - t) * 1e3)
    whole = statistics.median(times["whole"])
    pieces = statistics.median(times["pieces"])
    print(json.dumps({"model": a.model, "batch": a.batch, "pieces": a.pieces,
                      "torch": torch.__version__, "whole_ms": round(whole, 2),
                      "pieces_ms": round(pieces, 2), "ratio": round(pieces / whole, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
