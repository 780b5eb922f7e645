#!/usr/bin/env python3
"""What the timeline costs: cohort DDP's step time (ddp_vs_torch's model,
ranks as processes) three ways, alternating run by run:

  off      the usual build, COHORT_TRACE unset (the hooks test a null pointer)
  on       the usual build, COHORT_TRACE=<a fresh folder> (every event kept,
           the files written when the ranks finish, outside the timed steps)
  no-hooks a build configured with -DCOHORT_TRACING=OFF (hooks compiled out)

  /usr/bin/python3 bench/ddp_vs_torch/run_trace_overhead.py \
      --binary build/bench/ddp_vs_torch/ddp_vs_torch \
      --binary-no-hooks build-notrace/bench/ddp_vs_torch/ddp_vs_torch \
      --model transformer --world 2 --runs 7

Prints the median step time of each and the ratios on/off and off/no-hooks,
with every run's figure (the machine is noisy: look at the spread).

On a shared machine keep each invocation short (a few runs, one
`exclusive` lock hold each) and pool them:

  for i in 1 2 3 4; do /work/shared/tools/exclusive /usr/bin/python3 \
      bench/ddp_vs_torch/run_trace_overhead.py ... --runs 3 --out trace_overhead.jsonl; done
  /usr/bin/python3 bench/ddp_vs_torch/run_trace_overhead.py --pool trace_overhead.jsonl

--pool prints each side's median over every run and the ratios of runs paired
within one round (the three sides back to back), with their quartiles: a
difference inside that spread is noise.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_ddp_vs_torch import BATCH, run_once  # noqa: E402


def quartiles(v):
    v = sorted(v)
    if len(v) < 2:
        return v[0], v[0], v[0]
    q = statistics.quantiles(v, n=4, method="inclusive")
    return q[0], q[1], q[2]


def pool(path):
    """Every invocation's runs from the JSON lines in `path`, pooled."""
    step_ms = {"off": [], "on": [], "no-hooks": []}
    events = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                for k in step_ms:
                    step_ms[k] += r["runs_step_ms"][k]
                events.append(r["events_rank0"])
    n = len(step_ms["off"])
    print(f"pooled {n} rounds from {path} (trace events on rank 0 per run: "
          f"{statistics.median(events):.0f})")
    print(f"  {'side':9s} {'median':>8s} {'q1':>8s} {'q3':>8s}  ms/step")
    for k in ("no-hooks", "off", "on"):
        q1, med, q3 = quartiles(step_ms[k])
        print(f"  {k:9s} {med:8.1f} {q1:8.1f} {q3:8.1f}")
    for name, a, b in (("on / off", "on", "off"), ("off / no-hooks", "off", "no-hooks")):
        ratios = [x / y for x, y in zip(step_ms[a], step_ms[b])]
        q1, med, q3 = quartiles(ratios)
        print(f"  {name:15s} ratio of medians {statistics.median(step_ms[a]) / statistics.median(step_ms[b]):.4f}"
              f"; paired per round: median {med:.4f}, quartiles {q1:.4f}-{q3:.4f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", help="print the pooled figures of a --out file and exit")
    ap.add_argument("--out", help="append this invocation's figures (one JSON line) to a file")
    ap.add_argument("--binary", help="ddp_vs_torch of the usual build")
    ap.add_argument("--binary-no-hooks",
                    help="ddp_vs_torch of a build with -DCOHORT_TRACING=OFF")
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.pool:
        pool(a.pool)
        return
    if not a.binary or not a.binary_no_hooks:
        ap.error("--binary and --binary-no-hooks are required (or --pool FILE)")

    args = ["--model", a.model, "--batch", str(BATCH[a.model]), "--steps", str(a.steps),
            "--warmup", str(a.warmup)]
    samples_per_step = BATCH[a.model] * a.world
    step_ms = {"off": [], "on": [], "no-hooks": []}
    events = []
    os.environ.pop("COHORT_TRACE", None)
    for r in range(a.runs):
        # Rotate the order so that no side always runs first after a pause.
        order = ["off", "on", "no-hooks"]
        order = order[r % 3:] + order[:r % 3]
        for side in order:
            binary = a.binary_no_hooks if side == "no-hooks" else a.binary
            if side == "on":
                with tempfile.TemporaryDirectory(prefix="cohort-trace-bench") as d:
                    os.environ["COHORT_TRACE"] = d
                    try:
                        out = run_once([binary] + args, a.world, a.timeout)
                    finally:
                        del os.environ["COHORT_TRACE"]
                    with open(os.path.join(d, "rank-0.json")) as f:
                        events.append(len(json.load(f)["traceEvents"]))
            else:
                out = run_once([binary] + args, a.world, a.timeout)
            step_ms[side].append(1e3 * samples_per_step / out["sps"])

    med = {k: statistics.median(v) for k, v in step_ms.items()}
    result = {"model": a.model, "world": a.world, "runs": a.runs, "steps": a.steps,
              "median_step_ms": med, "runs_step_ms": step_ms,
              "on_over_off": med["on"] / med["off"],
              "off_over_no_hooks": med["off"] / med["no-hooks"],
              "events_rank0": statistics.median(events) if events else 0}
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    if a.json:
        print(json.dumps(result))
        return
    print(f"{a.model}, world {a.world}, {a.runs} runs x {a.steps} steps (medians)")
    for k in ("no-hooks", "off", "on"):
        runs = " ".join(f"{x:.1f}" for x in step_ms[k])
        print(f"  {k:9s} {med[k]:8.2f} ms/step   runs: {runs}")
    print(f"  on / off        {result['on_over_off']:.4f}")
    print(f"  off / no-hooks  {result['off_over_no_hooks']:.4f}")
    print(f"  trace events on rank 0 per run: {result['events_rank0']:.0f}")


if __name__ == "__main__":
    main()
