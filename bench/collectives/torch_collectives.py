"""PyTorch's own torch.distributed collective on gloo, timed the way
cohort-bench times cohort's, printing the same JSON rows. One process per
rank; RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment (started
by bench/collectives/compare.sh through cohortrun).

Run with Debian's interpreter: /usr/bin/python3 (python3-torch)."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="all_reduce", choices=["all_reduce"])
    p.add_argument("--reduce-op", default="sum", choices=["sum", "min", "max"])
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    # Debian 13's PyTorch 2.6 refuses its default libuv TCPStore; 1.13 ignores this.
    os.environ.setdefault("USE_LIBUV", "0")
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[a.reduce_op]
    nbytes = a.min_bytes
    while nbytes <= a.max_bytes:
        n = max(nbytes // 4, world)
        t = torch.ones(n, dtype=torch.float32)
        iters = a.iters or min(max((64 << 20) // nbytes, 5), 200)
        for _ in range(a.warmup):
            dist.all_reduce(t, op=op)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t, op=op)
        local_us = (time.perf_counter() - start) / iters * 1e6
        slowest = torch.tensor([local_us], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        us = slowest.item()
        algbw = n * 4 / us / 1e3
        busbw = algbw * 2 * (world - 1) / world if world > 1 else 0.0
        if rank == 0:
            print(json.dumps({"op": a.op, "backend": "torch-gloo", "algo": "torch", "world": world,
                              "bytes": n * 4, "us": us, "algbw_gbs": algbw, "busbw_gbs": busbw}),
                  flush=True)
        nbytes *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
