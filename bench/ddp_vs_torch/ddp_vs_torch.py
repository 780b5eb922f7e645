"""The PyTorch half of the ddp_vs_torch benchmark: one rank of the same
training loop as ddp_vs_torch.cpp, with torch.nn.parallel.DistributedDataParallel
over gloo, or --backend (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the
environment). Rank 0 prints one JSON line: {"engine": "torch", "model",
"device", "world", "batch", "sps", "step_ms"}. --device cuda puts the model
and data on the GPU and ends each step with torch.cuda.synchronize(), as
the cohort side does. Run with /usr/bin/python3 (Debian's python3-torch) or
a pip PyTorch."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class TransformerStack(nn.Module):
    # Same as cohort::bench::TransformerStack: 12 layers, d 256, 4 heads, ff 1024.
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
        self.head = nn.Linear(256, 256)

    def forward(self, x):
        return self.head(self.encoder(x))


def make_model(name):
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                             nn.ReLU(), nn.Linear(1024, 10))
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(),
                             nn.Linear(128, 10))
    return TransformerStack()


def make_batch(name, batch):
    if name == "transformer":
        return torch.randn(16, batch, 256), torch.randn(16, batch, 256)
    return torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bucket-view", type=int, default=0,
                    help="gradient_as_bucket_view (PyTorch's default: 0)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--backend", default="gloo", help="torch.distributed's backend")
    ap.add_argument("--plain", action="store_true",
                    help="plain PyTorch at world 1: the same loop without DDP or a process group")
    a = ap.parse_args()
    torch.set_num_threads(1)
    # Debian 13's PyTorch 2.6 refuses its default libuv TCPStore; 1.13 ignores this.
    os.environ.setdefault("USE_LIBUV", "0")
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if a.plain:
        rank, world = 0, 1
        torch.manual_seed(0)
        ddp = make_model(a.model).to(device)
    else:
        dist.init_process_group(a.backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(rank)
        ddp = nn.parallel.DistributedDataParallel(make_model(a.model).to(device),
                                                  gradient_as_bucket_view=bool(a.bucket_view))
    # One update per parameter, as LibTorch's SGD does (not the foreach kernels).
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, foreach=False)
    x, y = (t.to(device) for t in make_batch(a.model, a.batch))

    def done():  # a CUDA step is queued, not done, when the host returns from it
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step():
        opt.zero_grad()
        out = ddp(x)
        loss = F.mse_loss(out, y) if a.model == "transformer" else F.cross_entropy(out, y)
        loss.backward()
        opt.step()

    def fence():
        if not a.plain:
            dist.barrier()

    for _ in range(a.warmup):
        step()
    done()
    fence()
    step_ms = []
    t0 = time.perf_counter()
    for _ in range(a.steps):
        s0 = time.perf_counter()
        step()
        done()
        step_ms.append(round((time.perf_counter() - s0) * 1e3, 3))
    fence()
    secs = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({"engine": "torch_plain" if a.plain else "torch", "model": a.model,
                          "device": a.device, "world": world, "batch": a.batch,
                          "sps": a.steps * a.batch * world / secs, "step_ms": step_ms}), flush=True)
    if not a.plain:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
