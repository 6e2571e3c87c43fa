"""Workers started and SIGKILLed at random points of a real job, in every mode.

Each run checks the exactly-once ledger of every shard (each batch of each
epoch applied once) and the accuracy bar of the digits example.
"""
from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
from localrun import finish, job_steps, let_in, pids, prewarmed_worker, start_local

from harness import wait_until

pytestmark = pytest.mark.system


# Plain sync (no backup workers) under kills is left to the fixed nemesis schedules (tests/system/test_nemesis.py)
# and the failover tests: a fourth job of ~20 s here bought no path the other three do not take.
@pytest.mark.parametrize("mode,extra", [
    ("async", ()),
    ("ssp", ("--staleness", "2")),
    ("sync", ("--backup-workers", "1")),
], ids=["async", "ssp", "sync-backup"])
def test_random_joins_and_kills_keep_exactly_once(tmp_path, mode, extra):
    rng = random.Random(f"{mode}{extra}")
    epochs = ("--epochs", "16")          # long enough that the late worker joins a running job
    # the late worker imports before the job starts and joins at the first mark: one started there could
    # still be importing when the job ended (~10 s of imports on a busy host, the job ~25 s)
    late, gate = prewarmed_worker(tmp_path, "late-worker", *epochs)
    try:
        wait_until(lambda: Path(f"{gate}.ready").exists() or late.poll() is not None, timeout_s=120,
                   what="the late worker's imports")
        assert late.poll() is None, (tmp_path / "late-worker.log").read_text()[-3000:]
        proc = start_local(tmp_path, "--ps", "2", "--workers", "3", "--mode", mode, "--lease-seconds", "1.5",
                           "--no-restart", *extra, script_args=epochs)
        wait_until(lambda: (tmp_path / "run" / "chief.address").exists(), timeout_s=60, what="the chief")
        # 688 batches in all; a join, then two kills, at random points of the first 40%
        marks = sorted(rng.sample(range(40, 275), 3))
        victims = rng.sample(["worker0", "worker1", "worker2"], 2)
        for i, mark in enumerate(marks):
            try:
                wait_until(lambda m=mark: job_steps(tmp_path) >= m, timeout_s=120, what=f"step {mark}")
            except AssertionError:
                proc.kill()
                raise AssertionError(f"no step {mark}:\n" + (tmp_path / "local.log").read_text()[-6000:]) from None
            if i == 0:   # first, so that the new worker meets a running job
                let_in(tmp_path, gate)
            else:
                os.kill(pids(tmp_path)[victims.pop()], signal.SIGKILL)
        summary = finish(proc, tmp_path)
        # shoal local drains: it stops the servers only once the outside worker has left
        assert late.wait(30) == 0, (tmp_path / "late-worker.log").read_text()[-3000:]
    finally:
        if late.poll() is None:
            late.kill()
            late.wait()
    codes = summary["worker_exit_codes"]
    assert sorted(codes.values()) == [-signal.SIGKILL, -signal.SIGKILL, 0]
    assert summary["exactly_once"], summary["ledger"]
    assert summary["tasks_done"] == summary["tasks_total"]
    assert summary["test_accuracy"] >= 0.95, summary
