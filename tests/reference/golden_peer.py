"""What the golden tests' PyTorch peers share (pipelining_reference.py,
tp_reference.py): raw tensor files, the command line, the probe and the
gloo job.

Command line: --probe (exit 77 and the reason on stdout when this PyTorch
lacks the peer's API: 1.13 has neither pipelining nor DTensor TP), or --dir
and the sizes, and --run NAME:...:CONTROL, repeated: each run trains a fresh
model from the same initial weights, the last field naming what its negative
control changes (none for the reference run).
"""
import argparse
import importlib
import os
import sys


def read(torch, path, shape):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.float32).reshape(shape).clone()


def write(path, tensor):
    with open(path, "wb") as f:
        f.write(tensor.detach().contiguous().numpy().tobytes())


def main(needs, train, setup=None):
    """needs: the modules the peer imports (probed); train(args, run, torch,
    dist) runs one --run; setup(torch, dist) once after the job starts."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--dir")
    ap.add_argument("--run", action="append", default=[])
    for size in ("steps", "batch", "width", "hidden"):
        ap.add_argument(f"--{size}", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.0)
    args = ap.parse_args()
    import torch

    if args.probe:
        for module in needs:
            try:
                importlib.import_module(module)
            except ImportError as e:
                print(f"PyTorch {torch.__version__} has no {module} ({e})")
                sys.exit(77)
        return
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Debian 13's PyTorch 2.6 refuses its default libuv TCPStore; 1.13 ignores this.
    os.environ.setdefault("USE_LIBUV", "0")
    dist.init_process_group("gloo")
    if setup:
        setup(torch, dist)
    for run in args.run:
        train(args, run, torch, dist)
        dist.barrier()
    dist.destroy_process_group()
