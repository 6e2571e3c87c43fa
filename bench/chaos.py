"""Chaos: the digits example under SIGKILLs of a primary ps, a worker and the chief.

Runs the same job twice in one invocation, fault-free and with faults (each
victim restarted by ``shoal local``'s supervisor), with the same seed. For
each fault it reports the time from the kill to the next finished worker step
(of the first step begun after the kill: it ends with accepted pushes and pulls
on every shard, the killed one included). For the run it
reports whether the exactly-once ledger held, how many acknowledged updates
were lost (batches missing from a shard's ledger: a batch whose push was
acknowledged is never trained again, so a lost one leaves a hole), whether
the backups ended byte-identical to their primaries, and test accuracy next
to the fault-free run's. Prints one JSON object per run, then one per fault.

    .venv/bin/python bench/chaos.py [--mode sync] [--epochs 30] [--seed 0]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.py")
FAULTS = ("ps0", "worker1", "chief")


def steps_after(pattern: str, t: float) -> list[float]:
    """End times of worker steps that began after ``t`` (the worker's previous step ended after it),
    so each pushed to the shards as they were after the fault."""
    ends = []
    for path in glob.glob(pattern):
        with open(path) as f:
            times = [float(x) for x in f.read().splitlines() if x and not x.startswith("#")]
        ends += [b for a, b in zip(times, times[1:]) if a > t]
    return sorted(ends)


def job_steps(run_dir: Path) -> int:
    from shoal.proto import shoal_pb2 as pb
    from shoal.proto import shoal_pb2_grpc as pb_grpc
    from shoal.net.rpc import open_channel

    try:
        ch = open_channel((run_dir / "chief.address").read_text())
    except FileNotFoundError:
        return 0
    try:
        return pb_grpc.ChiefStub(ch).GetJobStats(pb.Empty(), timeout=2).totals.steps
    except Exception:  # noqa: BLE001 - the chief may be down: that is the point
        return -1
    finally:
        ch.close()


def lost_updates(summary: dict) -> int:
    """Batches missing from the most incomplete shard ledger."""
    want = summary.get("batches_per_epoch", 0) * summary.get("epochs", 0)
    worst = 0
    for epochs in summary.get("ledger", {}).values():
        worst = max(worst, want - sum(e.get("batches", 0) for e in epochs))
    return worst


def run(args: argparse.Namespace, faults: bool) -> tuple[dict, list[dict]]:
    tmp = Path(tempfile.mkdtemp(prefix="shoal-chaos-"))
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "shoal.cli", "local", "--ps", "2", "--workers", "2", "--mode", args.mode,
           "--lease-seconds", str(args.lease), "--restart-backoff", "0.3", "--run-dir", str(run_dir),
           "--summary", str(tmp / "summary.json"), DIGITS, "--epochs", str(args.epochs), "--seed", str(args.seed),
           "--step-log", str(tmp / "steps-{pid}.log")]
    t0 = time.time()
    with open(tmp / "local.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        events = []
        try:
            if faults:
                rng = random.Random(args.seed)
                total = 1075 * args.epochs // 25            # ~43 batches an epoch, 2 workers
                marks = sorted(rng.sample(range(total // 10, total // 2), len(FAULTS)))
                order = rng.sample(FAULTS, len(FAULTS))
                for mark, victim in zip(marks, order):
                    while job_steps(run_dir) < mark:
                        if proc.poll() is not None:
                            raise RuntimeError("the job ended before the faults: raise --epochs")
                        time.sleep(0.05)
                    pids = json.loads((run_dir / "pids.json").read_text())
                    t_kill = time.time()
                    os.kill(pids[victim], signal.SIGKILL)
                    deadline = time.monotonic() + 60
                    while not steps_after(str(tmp / "steps-*.log"), t_kill) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    after = steps_after(str(tmp / "steps-*.log"), t_kill)
                    events.append({"case": f"chaos-{args.mode}-kill-{victim}", "fault": victim, "at_step": mark,
                                   "next_step_after_s": round(after[0] - t_kill, 3) if after else None})
                    time.sleep(args.lease + 1.0)            # let the supervisor restart it before the next
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    if rc != 0:
        raise RuntimeError(f"shoal local failed ({rc}); see {tmp / 'local.log'}")
    s = json.loads((tmp / "summary.json").read_text())
    result = {"case": f"chaos-{args.mode}-{'faults' if faults else 'fault-free'}", "mode": args.mode,
              "epochs": args.epochs, "seed": args.seed, "seconds": round(time.time() - t0, 1),
              "faults": [e["fault"] for e in events], "restarts": s.get("restarts", {}),
              "exactly_once": s.get("exactly_once"), "acked_updates_lost": lost_updates(s),
              "replicas_identical": s.get("replicas_identical"), "test_accuracy": s.get("test_accuracy"),
              "log": str(tmp / "local.log")}
    return result, events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="sync", choices=("sync", "async", "ssp"))
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lease", type=float, default=1.5)
    args = p.parse_args()
    clean, _ = run(args, faults=False)
    print(json.dumps(clean), flush=True)
    chaos, events = run(args, faults=True)
    chaos["accuracy_vs_fault_free_points"] = round(100 * (chaos["test_accuracy"] - clean["test_accuracy"]), 2)
    print(json.dumps(chaos), flush=True)
    for e in events:
        print(json.dumps(e), flush=True)


if __name__ == "__main__":
    main()
