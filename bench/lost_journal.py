"""A chief that comes back without its journal (issue 40): the digits example under ``shoal local``;
once training is under way the chief is SIGKILLed and its journal lost before the supervisor restarts it:

- ``empty``: ``chief.db`` truncated to 0 bytes (its -wal/-shm removed; the job marker ``chief.db.job`` stays);
- ``gone``: the journal and its marker removed, as a wiped run directory would be.

Per run it prints one JSON line: shoal local's exit status, seconds from the kill to its exit, whether it
hung (no exit within ``--timeout``), and which roles said the job's id in a refusal. Then one line per
case with the totals. Target: exit 78 ("refused", docs/exit-codes.md) within 30 s, 0 hangs. Before job
ids the same runs started a new job silently: sync hung, async crash-looped and exited 3.

    .venv/bin/python bench/lost_journal.py                          # each case once, sync
    .venv/bin/python bench/lost_journal.py --runs 5 --mode sync,async
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

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.py")
CASES = ("empty", "gone")


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
    except Exception:  # noqa: BLE001 - not serving yet
        return 0
    finally:
        ch.close()


def one_run(case: str, mode: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="lostj-") as tmp:
        tmp = Path(tmp)
        run = tmp / "run"
        log = open(tmp / "local.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "local", "--run-dir", str(run), "--summary",
                                 str(tmp / "summary.json"), "--ps", "2", "--workers", "2", "--mode", mode,
                                 "--lease-seconds", "2", "--restart-backoff", "0.2", DIGITS, "--epochs", "30"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        try:
            deadline = time.monotonic() + 120
            while job_steps(run) <= 5:
                if proc.poll() is not None or time.monotonic() > deadline:
                    lines = [x for x in (tmp / "local.log").read_text().splitlines() if "WARNING" in x or "ERROR" in x
                             or "error" in x]
                    return {"case": case, "mode": mode, "rc": proc.poll(), "not_under_way": lines[-12:]}
                time.sleep(0.2)
            journal = run / "chief.db"
            job = json.loads(Path(f"{journal}.job").read_text())["job_id"]
            chief = json.loads((run / "pids.json").read_text())["chief"]
            os.kill(chief, signal.SIGKILL)
            t0 = time.monotonic()
            for suffix in ("-wal", "-shm") + ((".job", "") if case == "gone" else ()):
                Path(f"{journal}{suffix}").unlink(missing_ok=True)
            if case == "empty":
                journal.write_bytes(b"")
            try:
                rc = proc.wait(timeout_s)
                hung = False
            except subprocess.TimeoutExpired:
                rc, hung = None, True
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        text = (tmp / "local.log").read_text()
        said = sorted({m.group(1) for m in re.finditer(r"^\[([\w-]+)\] .*(?:job|journal)[^\n]*" + re.escape(job),
                                                        text, re.M)} - {"chief"})
        chief_said = bool(re.search(r"^\[chief\] .*" + re.escape(job), text[text.find("exited with -9"):], re.M))
        return {"case": case, "mode": mode, "rc": rc, "seconds_to_exit": round(took, 2), "hung": hung,
                "job_id": job, "members_refusing": said, "chief_named_job": chief_said}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1, help="runs per case and mode")
    p.add_argument("--mode", default="sync", help="comma-separated: sync,async,ssp")
    p.add_argument("--case", default=",".join(CASES))
    p.add_argument("--timeout", type=float, default=60.0, help="seconds after the kill that count as a hang")
    args = p.parse_args()
    for mode in args.mode.split(","):
        for case in args.case.split(","):
            rows = []
            for _ in range(args.runs):
                row = one_run(case, mode, args.timeout)
                rows.append(row)
                print(json.dumps(row), flush=True)
            rows = [r for r in rows if "not_under_way" not in r]     # ended before the fault: no measure
            secs = [r["seconds_to_exit"] for r in rows if not r["hung"]]
            print(json.dumps({"case": case, "mode": mode, "runs": len(rows),
                              "exit_78": sum(r["rc"] == 78 for r in rows), "hangs": sum(r["hung"] for r in rows),
                              "within_30s": sum(not r["hung"] and r["seconds_to_exit"] < 30 for r in rows),
                              "max_seconds_to_exit": max(secs) if secs else None}), flush=True)


if __name__ == "__main__":
    main()
