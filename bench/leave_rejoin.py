"""Chaos: a parameter server told to leave mid-training (a ``Leave`` naming it, as any caller of a job
without a token can send, or a server that leaves and rejoins within a lease) rejoins under a new id;
the job must end, every time. ``--runs`` jobs of the digits example under ``shoal local``, each with one
``Leave(ps-1)`` once training is under way, against one fault-free run in the same invocation; a run
that does not end within ``--hang-after`` seconds is a hang (killed). One JSON object per run, then the
totals.

    .venv/bin/python bench/leave_rejoin.py [--runs 20] [--mode sync] [--epochs 2] [--hang-after 240]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chaos import DIGITS, job_steps

ROOT = Path(__file__).resolve().parent.parent


def leave(run_dir: Path, member: str) -> None:
    from shoal.proto import shoal_pb2 as pb
    from shoal.proto import shoal_pb2_grpc as pb_grpc
    from shoal.net.rpc import open_channel

    ch = open_channel((run_dir / "chief.address").read_text())
    try:
        pb_grpc.ChiefStub(ch).Leave(pb.LeaveRequest(member_id=member), timeout=5)
    finally:
        ch.close()


def run(args: argparse.Namespace, i: int, fault: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="shoal-leave-"))
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "shoal.cli", "local", "--ps", "2", "--workers", "2", "--mode", args.mode,
           "--lease-seconds", str(args.lease), "--run-dir", str(run_dir), "--summary", str(tmp / "summary.json"),
           DIGITS, "--epochs", str(args.epochs), "--seed", str(i)]
    t0 = time.monotonic()
    left_at = None
    with open(tmp / "local.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            if fault:
                while job_steps(run_dir) < args.at_step and proc.poll() is None:
                    time.sleep(0.05)
                if proc.poll() is None:
                    leave(run_dir, "ps-1")
                    left_at = round(time.monotonic() - t0, 2)
            try:
                rc = proc.wait(timeout=max(1.0, args.hang_after - (time.monotonic() - t0)))
                hung = False
            except subprocess.TimeoutExpired:
                rc, hung = None, True
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    s = json.loads((tmp / "summary.json").read_text()) if (tmp / "summary.json").exists() else {}
    return {"case": f"leave-rejoin-{args.mode}-{'leave' if fault else 'fault-free'}", "run": i, "rc": rc,
            "hung": hung, "left_at_s": left_at, "seconds": round(time.monotonic() - t0, 1),
            "exactly_once": s.get("exactly_once"), "test_accuracy": s.get("test_accuracy"),
            "log": str(tmp / "local.log")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--mode", default="sync", choices=("sync", "async"))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lease", type=float, default=1.5)
    p.add_argument("--at-step", type=int, default=20, help="job steps before the Leave")
    p.add_argument("--hang-after", type=float, default=240.0)
    args = p.parse_args()
    clean = run(args, 0, fault=False)
    print(json.dumps(clean), flush=True)
    results = []
    for i in range(args.runs):
        r = run(args, i, fault=True)
        results.append(r)
        print(json.dumps(r), flush=True)
    done = [r for r in results if not r["hung"]]
    print(json.dumps({"case": f"leave-rejoin-{args.mode}-total", "runs": len(results),
                      "hangs": sum(r["hung"] for r in results), "exit_0": sum(r["rc"] == 0 for r in results),
                      "exactly_once": sum(r["exactly_once"] is True for r in results),
                      "median_seconds": sorted(r["seconds"] for r in done)[len(done) // 2] if done else None,
                      "fault_free_seconds": clean["seconds"]}), flush=True)


if __name__ == "__main__":
    main()
