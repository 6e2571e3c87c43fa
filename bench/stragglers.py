"""Straggler handling in sync mode: one worker of 3 slowed down 3x, with each straggler_detection action.

Cases, each a ``shoal local`` run of the digits example for a fixed training budget with every
worker sleeping ``--delay`` a step (the slow one ``--slowdown`` times that):

- ``without``: the 2 fast workers alone (the rate the job would have without the slow worker);
- ``flag``, ``backup``, ``evict``: the 3 workers, ``straggler_detection: {factor: 2, action: ...}``.

Two rates a case: ``updates_per_s``, shard 0's version over the whole budget (start-up and the time to
find the straggler included), and ``settled_rounds_per_s``, the rounds a second over the later part of
training (from half-way to 90% of the span between the first step and the last; the fastest worker's
steps there: a sync round is one step of each worker it waits for), once the action has taken effect. Prints one JSON object per case, then the
ratios of each action's settled rate to ``without``'s.

    .venv/bin/python bench/stragglers.py [--budget 20] [--delay 0.1] [--mode sync]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from _local import run_local


def settled_rate(logs: Path, share: float) -> float:
    """The fastest worker's steps a second over the training's later part: from ``1 - share`` of the way
    between the first step and the last of any worker to 90% of it (the action has taken effect; the
    workers have not begun to stop at their budget)."""
    times = {}
    for f in logs.glob("*.log"):
        times[f.name] = [float(line) for line in f.read_text().splitlines() if line and not line.startswith("#")]
    starts, ends = [t[0] for t in times.values() if t], [t[-1] for t in times.values() if t]
    if not starts:
        return 0.0
    first, last = min(starts), max(ends)
    lo, hi = first + (1 - share) * (last - first), first + 0.9 * (last - first)
    return max(sum(1 for x in t if lo <= x <= hi) for t in times.values()) / (hi - lo)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=20.0, help="training seconds per case")
    p.add_argument("--delay", type=float, default=0.1, help="per-step delay of every worker (s)")
    p.add_argument("--slowdown", type=float, default=3.0, help="the straggler's step time, as a multiple")
    p.add_argument("--mode", default="sync", choices=("sync", "async", "ssp"))
    p.add_argument("--cases", nargs="+", default=["without", "flag", "backup", "evict"])
    p.add_argument("--share", type=float, default=0.5,
                   help="the settled rate covers from (1 - share) to 0.9 of the training's span")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="shoal-stragglers-") as tmp:
        for case in args.cases:
            logs = Path(tmp) / case
            logs.mkdir()
            script = ["--epochs", "1000", "--time-budget", str(args.budget), "--step-delay", str(args.delay),
                      "--hidden", "64", "--step-log", str(logs / "{pid}.log")]
            local = ["--ps", "1", "--mode", args.mode, "--workers", "2" if case == "without" else "3",
                     "--no-restart"]
            if case != "without":
                script += ["--slow-worker", "2", "--slow-delay", str((args.slowdown - 1.0) * args.delay)]
                job = Path(tmp) / f"{case}.yaml"
                job.write_text(yaml.safe_dump({"straggler_detection": {"factor": 2.0, "action": case}}))
                local += ["--config", str(job)]
            s = run_local(local, script)
            updates = s["shard_versions"]["0"]
            row = {"case": case, "mode": args.mode, "budget_s": args.budget, "updates": updates,
                   "updates_per_s": round(updates / args.budget, 2),
                   "settled_rounds_per_s": round(settled_rate(logs, args.share), 2), "worker_steps": s["steps"],
                   "test_accuracy": round(s["test_accuracy"], 4)}
            results[case] = row
            print(json.dumps(row), flush=True)
    if "without" in results:
        base = results["without"]["settled_rounds_per_s"]
        print(json.dumps({"case": "ratios", **{f"{c}_vs_without": round(r["settled_rounds_per_s"] / base, 2)
                                               for c, r in results.items() if c != "without"}}))


if __name__ == "__main__":
    main()
