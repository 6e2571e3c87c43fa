"""Consistency modes against a straggler: 4 workers on digits, one slowed down 3x.

For sync, sync with one backup worker, async and ssp (k=2), all with the
straggler, plus sync without it: updates per second (shard 0's version over
the training budget) and test accuracy after a fixed wall-clock budget. Prints
one JSON object per case, then one with the ratios the issue asks for.

    .venv/bin/python bench/modes.py [--budget 15] [--delay 0.02]
"""
from __future__ import annotations

import argparse
import json

from _local import run_local


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=15.0, help="training seconds per case")
    p.add_argument("--delay", type=float, default=0.02, help="per-step delay of every worker (s)")
    p.add_argument("--slowdown", type=float, default=3.0, help="the straggler's step time, as a multiple")
    args = p.parse_args()
    slow_extra = (args.slowdown - 1.0) * args.delay
    cases = [("sync", [], True), ("sync+backup1", ["--backup-workers", "1"], True), ("async", [], True),
             ("ssp2", ["--staleness", "2"], True), ("sync-no-straggler", [], False)]
    results = {}
    for name, extra, straggler in cases:
        mode = name.split("+")[0].split("-")[0].replace("ssp2", "ssp")
        script = ["--epochs", "1000", "--time-budget", str(args.budget), "--step-delay", str(args.delay)]
        if straggler:
            script += ["--slow-worker", "3", "--slow-delay", str(slow_extra)]
        s = run_local(["--ps", "2", "--workers", "4", "--mode", mode, *extra], script)
        updates = s["shard_versions"]["0"]
        row = {"case": name, "mode": mode, "straggler_slowdown": args.slowdown if straggler else 1.0,
               "budget_s": args.budget, "updates": updates, "updates_per_s": round(updates / args.budget, 2),
               "worker_steps": s["steps"], "test_accuracy": round(s["test_accuracy"], 4),
               "exactly_once_so_far": all(e["max_count"] <= 1 for led in s["ledger"].values() for e in led)}
        results[name] = row
        print(json.dumps(row), flush=True)
    base = results["sync"]["updates_per_s"]
    print(json.dumps({"case": "ratios",
                      "async_vs_sync_straggler": round(results["async"]["updates_per_s"] / base, 2),
                      "ssp2_vs_sync_straggler": round(results["ssp2"]["updates_per_s"] / base, 2),
                      "sync_backup1_vs_sync_no_straggler": round(
                          results["sync+backup1"]["updates_per_s"] / results["sync-no-straggler"]["updates_per_s"], 2)}))


if __name__ == "__main__":
    main()
