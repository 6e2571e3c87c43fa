"""A SIGKILLed parameter server under ``shoal local``: its backup takes over, the restarted process
becomes the new backup, and the job finishes with every batch applied once and identical copies.
A SIGKILLed worker in the same job is restarted and joins again."""
from __future__ import annotations

import re

import pytest
from localrun import finish, job_steps, kill_and_await_restart, start_local

from harness import wait_until

pytestmark = pytest.mark.system


@pytest.mark.parametrize("mode,epochs", [("async", "16")])   # ~30 s; sync: tests/integration/test_replication.py
def test_sigkilled_primary_is_replaced_by_its_backup_and_nothing_is_lost(tmp_path, mode, epochs):
    # 50 ms a step keeps the job going long enough for the restarted ps (torch import, warm-up) to join
    # (20 ms did until shoal local gave each worker its share of the cores: the steps got faster)
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", mode, "--restart-backoff", "0.3",
                       "--lease-seconds", "1.5", script_args=("--epochs", epochs, "--step-delay", "0.05"))
    wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > 60,
               timeout_s=90, what="training to be under way")
    kill_and_await_restart(tmp_path, "ps0")
    wait_until(lambda: "holding a backup copy" in (tmp_path / "local.log").read_text().split("promoted to primary", 1)[-1],
               timeout_s=60, what="the restarted ps to take a backup copy while training goes on")
    kill_and_await_restart(tmp_path, "worker0")
    summary = finish(proc, tmp_path)
    log = (tmp_path / "local.log").read_text()
    assert summary["restarts"] == {"ps0": 1, "worker0": 1}
    # named as the chief named it, with the launcher's name (the member name follows the join order)
    assert re.search(r"worker-\d \(process worker0\) exited with -9; restarting it in 0\.3s", log)
    assert "promoted its backup" in log and "promoted to primary" in log
    assert summary["worker_exit_codes"] == {"worker0": 0, "worker1": 0}
    assert summary["tasks_done"] == summary["tasks_total"] > 0
    assert summary["exactly_once"], summary["ledger"]           # no acknowledged batch lost, none twice
    assert summary["replicas_identical"] is True, summary["replicas"]
    assert summary["test_accuracy"] >= 0.95, summary
