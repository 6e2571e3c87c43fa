"""Pauses and awkward kills (issue 20): the digits example under ``shoal local``, once per run, with

- ``primary-pause``: SIGSTOP the process holding shard 0's primary for ``--pause`` seconds (its backup
  is promoted meanwhile; it wakes with pushes, pulls and an update to its backup queued);
- ``chief-pause``: SIGSTOP the chief for ``--pause`` seconds (several leases);
- ``install-kill-before`` / ``-during`` / ``-after``: SIGKILL ps0 (the supervisor restarts it and it
  becomes the backup of both shards), then SIGKILL ps1, the primary, before the new backup's copy
  starts, while it is being sent, or just after it is installed.

Per run it prints one JSON line: whether every batch reached every shard exactly once, how many
acknowledged batches are missing from the worst ledger, the lost shards, rollbacks, members the chief
expired, and the longest stall of training during the fault (from the workers' step logs). Then one
line per case with the totals. Targets: 0 lost or doubled batches; a paused primary stalls training
about two leases at most; a paused chief expires no one.

    .venv/bin/python bench/pauses.py                       # quick: each case once, sync
    .venv/bin/python bench/pauses.py --runs 20 --mode sync,async
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _install_kill

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.py")
CASES = ("primary-pause", "chief-pause", "install-kill-before", "install-kill-during", "install-kill-after")


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
    except Exception:  # noqa: BLE001 - the chief may be paused: that is the point
        return -1
    finally:
        ch.close()


def not_reached(exc: _install_kill.NotReached) -> RuntimeError:
    return RuntimeError(f"{exc}: raise --epochs" if "ended" in str(exc) else str(exc))


def wait_for(what: str, cond, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    try:
        _install_kill.wait_for(what, cond, lambda: proc.poll() is None, timeout_s)
    except _install_kill.NotReached as exc:
        raise not_reached(exc) from None


def longest_stall(tmp: Path, start: float, stop: float) -> float:
    ends = sorted(float(line) for f in tmp.glob("steps-*.log") for line in f.read_text().splitlines()
                  if line and not line.startswith("#"))
    # training that ended inside the window is no stall: the window then ends at the last step
    after = next((t for t in ends if t >= stop), None)
    inside = [start] + [t for t in ends if start < t < stop] + ([after] if after is not None else [])
    return max((b - a for a, b in zip(inside, inside[1:])), default=0.0)


def lost_batches(summary: dict) -> int:
    want = summary.get("batches_per_epoch", 0) * summary.get("epochs", 0)
    return max((want - sum(e.get("batches", 0) for e in epochs) for epochs in summary.get("ledger", {}).values()),
               default=want)


def fault(case: str, tmp: Path, proc: subprocess.Popen, args: argparse.Namespace) -> tuple[float, float]:
    """Injects the case's fault; returns the wall-clock window it covers."""
    run_dir, log = tmp / "run", tmp / "local.log"
    pids = lambda: json.loads((run_dir / "pids.json").read_text())  # noqa: E731
    wait_for("training", lambda: job_steps(run_dir) > 30, proc)
    t0 = time.time()
    if case.endswith("-pause"):
        victim = pids()["chief" if case == "chief-pause" else "ps0"]
        os.kill(victim, signal.SIGSTOP)
        try:
            time.sleep(args.pause)
        finally:
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:   # the job ended meanwhile and its supervisor killed the stopped process
                pass
        return t0, time.time()
    try:   # kill ps0, then ps1 (the primary of both shards) before/during/after the restart's copy
        _install_kill.kill_around_install(case.rsplit("-", 1)[1], pids, log, lambda: proc.poll() is None)
    except _install_kill.NotReached as exc:
        raise not_reached(exc) from None
    return t0, time.time() + args.lease


def one(case: str, mode: str, args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"shoal-pauses-{case}-"))
    cmd = [sys.executable, "-m", "shoal.cli", "local", "--ps", "2", "--workers", "2", "--mode", mode,
           "--lease-seconds", str(args.lease), "--restart-backoff", "0.3", "--run-dir", str(tmp / "run"),
           "--checkpoint-dir", str(tmp / "ckpts"), "--checkpoint-interval", "20",
           "--summary", str(tmp / "summary.json"), DIGITS, "--epochs", str(args.epochs),
           "--step-log", str(tmp / "steps-{pid}.log")]
    with open(tmp / "local.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            start, stop = fault(case, tmp, proc, args)
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = (tmp / "local.log").read_text()
    row = {"case": case, "mode": mode, "rc": rc, "log": str(tmp / "local.log")}
    if rc == 0:
        s = json.loads((tmp / "summary.json").read_text())
        row.update(exactly_once=s.get("exactly_once"), lost_batches=lost_batches(s), lost_shards=s.get("lost_shards"),
                   rollbacks=s.get("rollbacks"), fast_path="--recovery fast" in text,
                   expired=len(re.findall(r"member \S+ expired", text)),
                   stall_s=round(longest_stall(tmp, start, stop), 2))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1, help="runs per case and mode (the issue's target: 20)")
    p.add_argument("--mode", default="sync", help="comma-separated: sync,async")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lease", type=float, default=1.5)
    p.add_argument("--pause", type=float, default=8.0, help="seconds a paused process stays stopped")
    args = p.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    for mode in args.mode.split(","):
        for case in cases:
            rows = []
            for _ in range(args.runs):
                rows.append(one(case, mode, args))
                print(json.dumps(rows[-1]), flush=True)
            ok = [r for r in rows if r["rc"] == 0]
            print(json.dumps({"case": case, "mode": mode, "runs": len(rows), "finished": len(ok),
                              "exactly_once": sum(bool(r["exactly_once"]) for r in ok),
                              "lost_batches": sum(r["lost_batches"] for r in ok),
                              "expired": sum(r["expired"] for r in ok),
                              "max_stall_s": max((r["stall_s"] for r in ok), default=None)}), flush=True)


if __name__ == "__main__":
    main()
