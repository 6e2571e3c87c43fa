"""Paused processes under ``shoal local`` (SIGSTOP/SIGCONT: what a long GC pause, a VM migration or a
swapped-out host does): a primary paused across its promotion loses and doubles nothing, a paused chief
expires no one. Repeated runs belong in a bench; CI runs each once."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
from localrun import finish, job_steps, pids, start_local

from harness import wait_until

pytestmark = pytest.mark.system


def pause(pid: int, seconds: float = 0.0, until=None, timeout_s: float = 30.0) -> float:
    """SIGSTOPs ``pid`` for ``seconds`` or until ``until()`` holds; SIGCONT always. Returns the pause."""
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        if until is not None:
            wait_until(until, timeout_s=timeout_s, what="the pause's condition")
        left = seconds - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)
    finally:
        os.kill(pid, signal.SIGCONT)
    return time.monotonic() - t0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_primary_paused_across_its_promotion_loses_and_doubles_nothing(tmp_path, mode):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", mode, "--lease-seconds", "1.5",
                       script_args=("--epochs", "3"))
    log = tmp_path / "local.log"
    wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > 30,
               timeout_s=90, what="training to be under way")
    # paused until its backup is promoted over it, and a little longer: it wakes with pushes and pulls
    # queued in its sockets and an update on its way to a backup that is now the primary
    pause(pids(tmp_path)["ps0"], seconds=1.0, until=lambda: "promoted to primary" in log.read_text())
    summary = finish(proc, tmp_path)
    text = log.read_text()
    assert summary["tasks_done"] == summary["tasks_total"] > 0
    assert summary["lost_shards"] == [], summary
    assert summary["exactly_once"], summary["ledger"]        # no acknowledged batch lost, none applied twice
    assert "lost its state" not in text and "--recovery fast" not in text, text[-3000:]


def test_a_chief_paused_for_several_leases_expires_no_one(tmp_path):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", "sync", "--lease-seconds", "1.5",
                       script_args=("--epochs", "3"))
    log = tmp_path / "local.log"
    wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > 30,
               timeout_s=90, what="training to be under way")
    paused = pause(pids(tmp_path)["chief"], seconds=10.0)
    summary = finish(proc, tmp_path)
    text = log.read_text()
    assert paused >= 10.0
    assert not re.search(r"member \S+ expired", text), text[-3000:]
    assert "extended" in text and "lease(s)" in text                 # it said what it did
    assert summary["lost_shards"] == [] and summary["restarts"] == {} and summary["rollbacks"] == 0
    assert summary["exactly_once"], summary["ledger"]
