"""Both copies of the shards SIGKILLed at once: what ``--recovery consistent|fast`` do about it."""
from __future__ import annotations

import os
import signal

import pytest
from localrun import finish, job_steps, pids, start_local

from shoal.state.checkpoint import list_checkpoints
from harness import wait_until

pytestmark = pytest.mark.system


def kill_every_ps(tmp_path) -> None:
    p = pids(tmp_path)
    for name in ("ps0", "ps1"):
        os.kill(p[name], signal.SIGKILL)


def under_way(tmp_path, steps: int) -> None:
    wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > steps,
               timeout_s=90, what="training to be under way")


def test_consistent_recovery_rolls_the_whole_job_back_to_the_newest_checkpoint(tmp_path):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", "sync", "--lease-seconds", "1.5",
                       "--restart-backoff", "0.3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--checkpoint-interval", "40", script_args=("--epochs", "8"))
    under_way(tmp_path, 120)
    # a checkpoint's fsyncs may take seconds on a slow disk: kill once one is committed, not after so many steps
    wait_until(lambda: list_checkpoints(tmp_path / "ckpt"), timeout_s=60, what="a committed checkpoint")
    kill_every_ps(tmp_path)
    summary = finish(proc, tmp_path)
    log = (tmp_path / "local.log").read_text()
    assert "lost every copy" in log and "rolling back" in log
    assert summary["rollbacks"] == 1
    assert summary["restored_step"] >= 40, summary
    assert summary["exactly_once"], summary["ledger"]       # the restored ledger plus what came after
    assert summary["test_accuracy"] >= 0.95, summary


def test_consistent_recovery_without_a_checkpoint_stops_the_job_with_a_clear_error(tmp_path):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", "async", "--lease-seconds", "1.5",
                       "--restart-backoff", "0.3", script_args=("--epochs", "30"))
    under_way(tmp_path, 60)
    kill_every_ps(tmp_path)
    rc = proc.wait(120)
    log = (tmp_path / "local.log").read_text()
    assert rc == 75, log[-3000:]                        # stopped: data lost (docs/exit-codes.md)
    assert "no --checkpoint-dir to roll back to" in log and "lost every copy" in log


def test_fast_recovery_goes_on_from_a_workers_weights_and_says_what_was_lost(tmp_path):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", "async", "--lease-seconds", "1.5",
                       "--restart-backoff", "0.3", "--recovery", "fast", script_args=("--epochs", "12"))
    under_way(tmp_path, 60)
    kill_every_ps(tmp_path)
    summary = finish(proc, tmp_path, expect=65)         # finished with data lost: never a clean exit 0
    log = (tmp_path / "local.log").read_text()
    assert summary["outcome"] == "finished with data lost"
    assert "--recovery fast" in log
    assert summary["recovery"] == "fast" and sorted(summary["lost_shards"]) == [0, 1]
    assert summary["exactly_once"] is False          # the batches the lost copies held are gone, and it says so
    assert summary["tasks_done"] == summary["tasks_total"]
    assert summary["test_accuracy"] >= 0.9, summary
