"""PyTorch's own DDP as the reference peer for cohort's DDP tests.

Started by tests/ddp/reference_test.cpp as two processes (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment; gloo). Reads the initial
parameters and the data the C++ test wrote as raw little-endian files,
trains with torch.nn.parallel.DistributedDataParallel, and writes each
rank's per-step losses and rank 0's final parameters and buffers.

Files in --dir (float32 unless said otherwise):
  init_<i>.bin          parameter i (registration order) before training
  x.bin                 inputs, [steps, world * rows, *input_shape]
  y.bin                 int64 labels, [steps, world * rows]
  torch_losses_<r>.bin  written: rank r's loss at each step
  torch_param_<i>.bin   written by rank 0: parameter i after training
  torch_buffer_<i>.bin  written by rank 0: buffer i after training
  torch_rank<r>_buffer_<i>.bin  written by rank r: its buffer i at the end
  x_eval.bin            with --eval: inputs [world * rows, *input_shape]
  torch_eval_<r>.bin    with --eval: rank r's output on its eval rows

With --accum K, steps are grouped K at a time: the first K-1 of a group run
under no_sync(), the K-th synchronizes, and the optimizer steps after it.
With --eval, the model is evaluated (ddp.eval()) once after training.
"""
import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def make_model(kind):
    # Same layers, in the same registration order, as the C++ test.
    if kind == "mlp":
        return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10)), (20,)
    if kind == "cnn":
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(36, 10)), (1, 8, 8)
    raise ValueError(kind)


def read(path, dtype, shape):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=dtype).reshape(shape).clone()


def write(path, tensor):
    with open(path, "wb") as f:
        f.write(tensor.detach().contiguous().numpy().tobytes())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--rows", type=int, required=True, help="rows per rank per step")
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--momentum", type=float, required=True)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--eval", action="store_true", help="evaluate once after training")
    args = ap.parse_args()

    torch.set_num_threads(1)
    # Debian 13's PyTorch 2.6 refuses its default libuv TCPStore; 1.13 ignores this.
    os.environ.setdefault("USE_LIBUV", "0")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, in_shape = make_model(args.model)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(read(os.path.join(args.dir, f"init_{i}.bin"), torch.float32, p.shape))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    n = world * args.rows
    x = read(os.path.join(args.dir, "x.bin"), torch.float32, (args.steps, n) + in_shape)
    y = read(os.path.join(args.dir, "y.bin"), torch.int64, (args.steps, n))
    losses = []
    lo = rank * args.rows
    for s in range(args.steps):
        if s % args.accum == 0:
            opt.zero_grad()
        sync = (s + 1) % args.accum == 0
        with contextlib.nullcontext() if sync else ddp.no_sync():
            loss = F.cross_entropy(ddp(x[s, lo:lo + args.rows]), y[s, lo:lo + args.rows])
            loss.backward()
        if sync:
            opt.step()
        losses.append(loss.item())
    write(os.path.join(args.dir, f"torch_losses_{rank}.bin"), torch.tensor(losses, dtype=torch.float32))
    if args.eval:
        xe = read(os.path.join(args.dir, "x_eval.bin"), torch.float32, (n,) + in_shape)
        ddp.eval()
        with torch.no_grad():
            write(os.path.join(args.dir, f"torch_eval_{rank}.bin"), ddp(xe[lo:lo + args.rows]))
    for i, b in enumerate(model.buffers()):
        write(os.path.join(args.dir, f"torch_rank{rank}_buffer_{i}.bin"), b)
    if rank == 0:
        for i, p in enumerate(model.parameters()):
            write(os.path.join(args.dir, f"torch_param_{i}.bin"), p)
        for i, b in enumerate(model.buffers()):
            write(os.path.join(args.dir, f"torch_buffer_{i}.bin"), b)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
