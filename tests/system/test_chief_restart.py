"""A SIGKILLed chief under ``shoal local``: restarted on its port from its journal, the job carries on."""
from __future__ import annotations


import pytest
from localrun import kill_and_await_restart, finish, job_steps, start_local

from harness import wait_until

pytestmark = pytest.mark.system


def test_sigkilled_chief_is_restarted_from_its_journal_and_the_job_finishes_exactly_once(tmp_path):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", "sync", "--restart-backoff", "0.3",
                       script_args=("--epochs", "8"))                  # 344 batches: the kill lands mid-run
    wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > 100,
               timeout_s=90, what="training to be under way")
    kill_and_await_restart(tmp_path, "chief")
    summary = finish(proc, tmp_path)
    log = (tmp_path / "local.log").read_text()
    assert summary["restarts"] == {"chief": 1}
    assert "[chief]" in log and "recovered from journal" in log
    assert summary["worker_exit_codes"] == {"worker0": 0, "worker1": 0}
    assert summary["workers_seen"] == 2                      # both re-attached as themselves,
    assert "joining again" not in log                         # without having to join again
    assert summary["tasks_done"] == summary["tasks_total"] > 0
    assert summary["exactly_once"], summary["ledger"]
    assert summary["test_accuracy"] >= 0.95, summary
