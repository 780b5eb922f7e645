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

On a shared machine keep each invocation to one short `exclusive` lock hold
(--max-seconds stops starting rounds; each finished round is appended to
--out at once, with every timed step's time) and pool the holds:

  for i in 1 2 3; do /work/shared/tools/exclusive timeout -k 5 270 /usr/bin/python3 \
      bench/ddp_vs_torch/run_trace_overhead.py ... --runs 100 --steps 30 --timeout 60 \
      --max-seconds 200 --out out/trace_overhead.jsonl; done
  /usr/bin/python3 bench/ddp_vs_torch/run_trace_overhead.py --pool out/trace_overhead.jsonl

--pool prints each side's median over every single timed step (a step that
stalls 4-8 ms on a busy host moves a median little) and, per hold, the
ratios of the sides' median steps: their median over holds and their range.
A difference inside that range is noise.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_ddp_vs_torch import BATCH, run_once  # noqa: E402


def quartiles(v):
    v = sorted(v)
    if len(v) < 2:
        return v[0], v[0], v[0]
    q = statistics.quantiles(v, n=4, method="inclusive")
    return q[0], q[1], q[2]


def pool(path):
    """Every round in `path` (one JSON line each), pooled. Per side: the
    median of every single timed step (robust to the few steps that stall).
    Per lock hold: the ratio of the sides' median steps; the figure is the
    median of those ratios over the holds, with their range (the spread
    between holds is the noise floor)."""
    rounds = [json.loads(line) for line in open(path) if line.strip()]
    sides = ("no-hooks", "off", "on")
    holds = {}
    for r in rounds:
        holds.setdefault(r["hold"], []).append(r)
    steps = {k: [x for r in rounds for x in r["step_ms"][k]] for k in sides}
    events = [r["events_rank0"] for r in rounds]
    print(f"pooled {len(rounds)} rounds in {len(holds)} holds from {path}; "
          f"trace events on rank 0 per run: {statistics.median(events):.0f}")
    print(f"  {'side':9s} {'steps':>6s} {'median':>8s} {'q1':>8s} {'q3':>8s} {'run mean':>9s}  ms/step")
    for k in sides:
        q1, med, q3 = quartiles(steps[k])
        run_ms = statistics.median(r["run_ms"][k] for r in rounds)
        print(f"  {k:9s} {len(steps[k]):6d} {med:8.2f} {q1:8.2f} {q3:8.2f} {run_ms:9.2f}")
    for name, a, b in (("on / no-hooks", "on", "no-hooks"), ("off / no-hooks", "off", "no-hooks"),
                       ("on / off", "on", "off")):
        per_hold = []
        for rs in holds.values():
            sa = [x for r in rs for x in r["step_ms"][a]]
            sb = [x for r in rs for x in r["step_ms"][b]]
            per_hold.append(statistics.median(sa) / statistics.median(sb))
        pooled = statistics.median(steps[a]) / statistics.median(steps[b])
        print(f"  {name:15s} pooled median steps {pooled:.4f}; per hold: median {statistics.median(per_hold):.4f}, "
              f"range {min(per_hold):.4f}-{max(per_hold):.4f} ({' '.join(f'{x:.4f}' for x in per_hold)})")


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
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="start no new round after this many seconds (keeps a lock hold short)")
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
    hold = f"{os.getpid()}-{int(time.time())}"
    started = time.monotonic()
    for r in range(a.runs):
        if a.max_seconds and time.monotonic() - started > a.max_seconds:
            break
        round_ms = {}
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
            round_ms[side] = out.get("step_ms", [])
        if a.out:
            # One line per finished round: a hold cut short keeps its rounds.
            with open(a.out, "a") as f:
                f.write(json.dumps({"hold": hold, "round": r,
                                    "run_ms": {k: v[-1] for k, v in step_ms.items()},
                                    "step_ms": round_ms,
                                    "events_rank0": events[-1]}) + "\n")

    if not step_ms["off"]:
        return
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
