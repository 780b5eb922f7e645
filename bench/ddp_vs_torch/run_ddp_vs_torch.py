#!/usr/bin/env python3
"""Drives the ddp_vs_torch benchmark: cohort DDP (the C++ binary) and
PyTorch DDP (ddp_vs_torch.py under /usr/bin/python3) side by side, each
world size started as separate processes with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT set, one thread per rank (OPENBLAS_NUM_THREADS=1,
OMP_NUM_THREADS=1). The two engines alternate run by run; the figures are
medians over --runs runs.

  bench/ddp_vs_torch/run_ddp_vs_torch.py --binary build/bench/ddp_vs_torch/ddp_vs_torch [--json]

Prints a table, or with --json one object per (model, world, engine) with
model, world, engine, cohort_sps, torch_sps, ratio, hidden_comm_share.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# glibc's malloc, by default, hands large freed blocks back to the kernel, so
# a C++ training loop page-faults its activations in again every step (the
# cohort CNN at world 1: 261k page faults in 60 steps against PyTorch's 50k,
# ~15% of the step). A Python process happens to avoid most of it. Both
# engines get the same fixed thresholds here, so neither pays it.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
# Per-rank batch. The transformer's is small on purpose: communication
# (~38 MB of gradients per step) must be at least a quarter of PyTorch's step.
BATCH = {"mlp": 32, "cnn": 32, "transformer": 2}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(cmd, world, timeout, backend=None):
    """Starts `world` ranks of `cmd` with torchrun's variables. cohort's engine
    is `backend`, else COHORT_BACKEND, else gloo: the engine these benches'
    tables were measured with and PyTorch's (not init()'s default, auto)."""
    port = free_port()
    backend = backend or os.environ.get("COHORT_BACKEND", "gloo")
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), COHORT_BACKEND=backend,
                   OPENBLAS_NUM_THREADS="1",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **MALLOC_ENV)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} (world {world}) failed: {err.strip()[-2000:]}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return json.loads([l for l in outs[0].splitlines() if l.startswith("{")][-1])


def run_mpi_once(cmd, world, timeout):
    """cohort on its MPI engine: the ranks are started by mpirun, which sets
    the OMPI_COMM_WORLD_* variables cohort::init() recognizes."""
    mpirun = ["mpirun", "-np", str(world), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        mpirun.append("--allow-run-as-root")
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        mpirun += ["-x", f"{var}=1"]
    for var, value in MALLOC_ENV.items():
        mpirun += ["-x", f"{var}={value}"]
    p = subprocess.run(mpirun + cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} (mpi, world {world}) failed: {p.stderr.strip()[-2000:]}")
    return json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True, help="path of the ddp_vs_torch executable")
    ap.add_argument("--python", default="/usr/bin/python3", help="python with torch")
    ap.add_argument("--models", default="mlp,cnn,transformer")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "mpi", "ucx"],
                    help="cohort's engine (PyTorch always runs gloo: Debian's torch has no MPI)")
    ap.add_argument("--cohort-args", default="",
                    help="extra DDP options for cohort, e.g. '--bucket-view 0'")
    ap.add_argument("--torch-args", default="",
                    help="extra DDP options for PyTorch, e.g. '--bucket-view 1'")
    a = ap.parse_args()

    rows = []
    for model in a.models.split(","):
        for world in [int(w) for w in a.worlds.split(",")]:
            args = ["--model", model, "--batch", str(BATCH[model]), "--steps", str(a.steps),
                    "--warmup", str(a.warmup)]
            cohort, torch = [], []
            cohort_cmd = [a.binary] + args + a.cohort_args.split()
            for _ in range(a.runs):
                if a.backend == "mpi":
                    cohort.append(run_mpi_once(cohort_cmd, world, a.timeout))
                else:
                    cohort.append(run_once(cohort_cmd, world, a.timeout, a.backend))
                torch.append(run_once([a.python, os.path.join(HERE, "ddp_vs_torch.py")] + args +
                                      a.torch_args.split(), world, a.timeout))
            c_sps = statistics.median(r["sps"] for r in cohort)
            t_sps = statistics.median(r["sps"] for r in torch)
            row = {"model": model, "world": world, "engine": a.backend, "batch": BATCH[model],
                   "cohort_sps": round(c_sps, 2), "torch_sps": round(t_sps, 2),
                   "ratio": round(c_sps / t_sps, 3),
                   "hidden_comm_share": round(statistics.median(r["hidden_comm_share"] for r in cohort), 3)}
            rows.append(row)
            if a.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{model:12s} {a.backend:4s} world {world}  batch {BATCH[model]:3d}  cohort {c_sps:9.1f}/s  "
                      f"torch {t_sps:9.1f}/s  ratio {row['ratio']:.2f}  hidden {row['hidden_comm_share']:.2f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
