"""A chief that comes back without its journal under ``shoal local``: refused, never a silent new job.

Before job ids, a chief whose ``chief.db`` was emptied or removed started a new job: in sync the job
hung (the servers ignored its lower view epochs), otherwise the workers crash-looped and the run ended
with exit 3 and no word about the journal.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from localrun import alive, job_steps, pids, start_local

from harness import wait_until

pytestmark = pytest.mark.system


def lose_journal(run: Path, how: str) -> str:
    """Kills the chief and loses its journal: ``empty`` (0 bytes; the job's marker stays beside it) or
    ``gone`` (the journal and its marker removed, as a wiped run directory would). Returns the job id."""
    journal = run / "chief.db"
    job = json.loads(Path(f"{journal}.job").read_text())["job_id"]
    os.kill(pids(run.parent)["chief"], signal.SIGKILL)
    for suffix in ("-wal", "-shm") + ((".job", "") if how == "gone" else ()):
        Path(f"{journal}{suffix}").unlink(missing_ok=True)
    if how == "empty":
        journal.write_bytes(b"")
    return job


@pytest.mark.parametrize("how", ["empty", "gone"])
def test_a_chief_back_without_its_journal_is_refused_and_the_run_exits_78(tmp_path, how):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", "sync", "--lease-seconds", "2",
                       "--restart-backoff", "0.2", script_args=("--epochs", "30"))
    try:
        wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > 5,
                   timeout_s=90, what="training to be under way")
        job = lose_journal(tmp_path / "run", how)
        t0 = time.monotonic()
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - t0
    log = (tmp_path / "local.log").read_text()
    assert rc == 78, log[-3000:]                              # refused: restarting would not help
    assert took < 30, took
    stopped = [line for line in log.splitlines() if "job stopped:" in line]
    assert len(stopped) == 1 and job in stopped[0] and "exit 78: refused" in stopped[0], stopped
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_code"] == 78 and summary["outcome"] == "refused" and job in summary["error"]
    if how == "empty":      # the marker says a job was journaled there: the chief refuses to start
        assert "chief exited with 78" in summary["error"] and "is missing or empty" in summary["error"]
    else:                   # the members refuse the new job's chief, each in one line naming the job
        refusals = [line for line in log.splitlines() if f"not this member's job {job}" in line
                    or f"belongs to job {job}" in line]
        assert refusals, log[-3000:]
        assert "joining again" not in log or refusals
    wait_until(lambda: not any(alive(p) for p in pids(tmp_path).values()), timeout_s=15, what="no stray process")
