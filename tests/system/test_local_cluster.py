"""Real multi-process clusters through ``shoal local``, with SIGKILL and Ctrl-C."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest
from localrun import DIGITS, SHOAL, alive, finish, job_steps, pids, start_local

from harness import wait_until

pytestmark = pytest.mark.system


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_digits_reaches_the_accuracy_bar(tmp_path, mode):
    summary = finish(start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", mode), tmp_path)
    assert summary["mode"] == mode and summary["workers"] == 2 and summary["ps"] == 2
    assert summary["test_accuracy"] >= 0.95, summary
    assert summary["test_accuracy_from"] in {"worker-0", "worker-1"}      # the worker that evaluated it
    assert summary["tasks_done"] == summary["tasks_total"] > 0
    assert summary["exactly_once"] and summary["samples"] >= 15 * 1347
    assert summary["bytes_pushed"] > 0 and summary["bytes_pulled"] > 0
    assert summary["seconds"] < 90


def test_ctrl_c_stops_every_process(tmp_path):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", script_args=("--epochs", "200"))
    wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > 5,
               timeout_s=90, what="training to start")
    children = pids(tmp_path)
    assert len(children) == 5
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:          # the failure is reported; the 200-epoch job must not outlive it
            proc.terminate()
            proc.wait(30)
    wait_until(lambda: not any(alive(p) for p in children.values()), timeout_s=15, what="children to exit")


def test_bad_flags_are_one_line_errors(tmp_path):
    r = subprocess.run([*SHOAL, "local", "--ps", "0", DIGITS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "shoal local: error: --ps must be >= 1, got 0"
    r = subprocess.run([*SHOAL, "local", "--staleness", "-1", "--mode", "ssp", DIGITS], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "shoal local: error: --staleness must be >= 0, got -1"
    r = subprocess.run([*SHOAL, "local", str(tmp_path / "nope.py")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr
    started = time.monotonic()
    r = subprocess.run([*SHOAL, "local", "--mode", "fast", DIGITS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'fast'" in r.stderr and time.monotonic() - started < 30
