"""The PyTorch half of the compression benchmark: one rank of the same DDP
loop as compression_bench.cpp with PyTorch's fp16_compress_hook or
powerSGD_hook (or none) over gloo. RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
from the environment. Rank 0 prints one JSON line with compressor, model,
world, bytes_per_step (as compression_bench: the link's tx counter per step
and rank), step_ms (median over timed steps of the slowest rank's step).
Run with /usr/bin/python3 (Debian's python3-torch)."""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ddp_vs_torch"))
from ddp_vs_torch import make_batch, make_model  # noqa: E402


def link_tx_bytes():
    """Bytes sent so far by the link COMPRESSION_BENCH_DEV names (as compression_bench)."""
    dev = os.environ.get("COMPRESSION_BENCH_DEV")
    if not dev:
        return None
    with open("/sys/class/net/%s/statistics/tx_bytes" % dev) as f:
        return int(f.read())


class PerBucketPowerSGD:
    """PyTorch's PowerSGD state, one PowerSGDState and one gloo process group
    per DDP bucket. powerSGD_hook issues its P and Q all-reduces from future
    callbacks, which gloo runs on its worker threads when the previous
    all-reduce completes, while autograd's thread launches the next bucket's
    first all-reduce: the two threads' calls take process-group sequence
    numbers in an order that differs between ranks once the link is slow,
    and gloo then pairs collectives of different sizes ("op.preamble.length
    <= op.nbytes"). One group per bucket keeps each group's calls in one
    chain, the same on every rank; the hook's arithmetic is unchanged."""

    def __init__(self, rank):
        self.rank = rank
        self.iter = 0  # steps so far, shared by the buckets' states
        self.states = {}

    def state_for(self, bucket):
        s = self.states.get(bucket.index())
        if s is None:
            # start_powerSGD_iter 2 (the least PyTorch allows with error
            # feedback): the untimed warm-up steps cover it, every timed step
            # is compressed. Buckets are launched in the same order on every
            # rank, so the groups are created in the same order too.
            s = psgd.PowerSGDState(process_group=dist.new_group(),
                                   matrix_approximation_rank=self.rank, start_powerSGD_iter=2)
            self.states[bucket.index()] = s
        s.iter = self.iter
        return s


def per_bucket_powersgd_hook(state, bucket):
    fut = psgd.powerSGD_hook(state.state_for(bucket), bucket)
    if bucket.is_last():
        state.iter += 1
    return fut


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--compression", default="none", choices=["none", "fp16", "powersgd"])
    ap.add_argument("--powersgd-rank", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    # Debian 13's PyTorch 2.6 refuses its default libuv TCPStore; 1.13 ignores this.
    os.environ.setdefault("USE_LIBUV", "0")
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    ddp = nn.parallel.DistributedDataParallel(make_model(a.model))
    name = a.compression
    if a.compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif a.compression == "powersgd":
        ddp.register_comm_hook(PerBucketPowerSGD(a.powersgd_rank), per_bucket_powersgd_hook)
        name = "powersgd_r%d" % a.powersgd_rank
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = make_batch(a.model, a.batch)

    def step():
        opt.zero_grad()
        out = ddp(x)
        loss = F.mse_loss(out, y) if a.model == "transformer" else F.cross_entropy(out, y)
        loss.backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    times = []
    dist.barrier()
    sent0 = link_tx_bytes()
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t = torch.tensor([(time.perf_counter() - t0) * 1000.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    sent1 = link_tx_bytes()
    times.sort()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    per_step = None if sent0 is None else (sent1 - sent0) / a.steps / per_host
    if dist.get_rank() == 0:
        print(json.dumps({"engine": "torch", "compressor": name, "model": a.model,
                          "world": dist.get_world_size(), "bytes_per_step": per_step,
                          "step_ms": round(times[len(times) // 2], 2)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
