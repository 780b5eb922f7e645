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
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_ddp_vs_torch import BATCH, run_once  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True, help="ddp_vs_torch of the usual build")
    ap.add_argument("--binary-no-hooks", required=True,
                    help="ddp_vs_torch of a build with -DCOHORT_TRACING=OFF")
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

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
