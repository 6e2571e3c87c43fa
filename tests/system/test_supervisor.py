"""shoal local gives up at once on a role that would fail the same way again, with its one-line reason."""
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


def test_a_chief_whose_journal_got_corrupt_fails_the_run_at_once(tmp_path):
    proc = start_local(tmp_path, "--ps", "1", "--workers", "1", "--restart-backoff", "0.2",
                       script_args=("--epochs", "30"))
    wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > 5,
               timeout_s=90, what="training to be under way")
    journal = tmp_path / "run" / "chief.db"
    for suffix in ("-wal", "-shm"):
        Path(f"{journal}{suffix}").unlink(missing_ok=True)
    journal.write_bytes(b"not a database, whatever the chief wrote" * 256)
    children = pids(tmp_path)
    os.kill(children["chief"], signal.SIGKILL)
    t0 = time.monotonic()
    try:
        rc = proc.wait(60)                                # before: restarted with backoff for ever
    except Exception:
        proc.kill()
        raise
    took = time.monotonic() - t0
    log = (tmp_path / "local.log").read_text()
    stopped = [line for line in log.splitlines() if "job stopped:" in line]
    assert rc == 78, log[-3000:]                      # refused for good: shoal local says so too
    assert len(stopped) == 1 and "chief exited with 78" in stopped[0] and "unreadable or corrupt" in stopped[0]
    assert took < 30, took
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "chief exited with 78" in summary["error"] and summary["restarts"] == {"chief": 1}
    wait_until(lambda: not any(alive(p) for p in pids(tmp_path).values()), timeout_s=15, what="no stray process")
