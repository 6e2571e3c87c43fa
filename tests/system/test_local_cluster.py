"""Real multi-process clusters through ``shoal local``, with SIGKILL and Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.rpc import open_channel
from shoal.testing import wait_until

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")
SHOAL = [sys.executable, "-m", "shoal.cli"]


def start_local(tmp_path: Path, *args: str, script_args: tuple[str, ...] = ()) -> subprocess.Popen:
    log = open(tmp_path / "local.log", "w")
    return subprocess.Popen([*SHOAL, "local", "--run-dir", str(tmp_path / "run"),
                             "--summary", str(tmp_path / "summary.json"), *args, DIGITS, *script_args],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)


def finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = 240) -> dict:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("shoal local did not finish:\n" + (tmp_path / "local.log").read_text()[-4000:])
    log = (tmp_path / "local.log").read_text()
    assert rc == 0, log[-4000:]
    return json.loads((tmp_path / "summary.json").read_text())


def pids(tmp_path: Path) -> dict[str, int]:
    return json.loads((tmp_path / "run" / "pids.json").read_text())


def job_steps(tmp_path: Path) -> int:
    address = (tmp_path / "run" / "chief.address").read_text()
    ch = open_channel(address)
    try:
        return pb_grpc.ChiefStub(ch).GetJobStats(pb.Empty(), timeout=2).totals.steps
    except grpc.RpcError:
        return 0
    finally:
        ch.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_digits_reaches_the_accuracy_bar(tmp_path, mode):
    summary = finish(start_local(tmp_path, "--ps", "2", "--workers", "2", "--mode", mode), tmp_path)
    assert summary["mode"] == mode and summary["workers"] == 2 and summary["ps"] == 2
    assert summary["test_accuracy"] >= 0.95, summary
    assert summary["tasks_done"] == summary["tasks_total"] > 0
    assert summary["samples"] == 15 * 1347                       # every sample of every epoch, once
    assert summary["bytes_pushed"] > 0 and summary["bytes_pulled"] > 0
    assert summary["seconds"] < 90


def test_sigkill_of_a_worker_in_sync_mode_does_not_stop_training(tmp_path):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "3", "--mode", "sync", "--lease-seconds", "1.5")
    wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > 60,
               timeout_s=90, what="training to be under way")
    victim = pids(tmp_path)["worker1"]
    os.kill(victim, signal.SIGKILL)
    summary = finish(proc, tmp_path)
    assert summary["worker_exit_codes"]["worker1"] == -signal.SIGKILL
    assert summary["worker_exit_codes"]["worker0"] == 0 and summary["worker_exit_codes"]["worker2"] == 0
    assert summary["tasks_done"] == summary["tasks_total"]
    assert summary["test_accuracy"] >= 0.95, summary
    assert "expired" in (tmp_path / "local.log").read_text()


def test_ctrl_c_stops_every_process(tmp_path):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", script_args=("--epochs", "200"))
    wait_until(lambda: (tmp_path / "run" / "chief.address").exists() and job_steps(tmp_path) > 5,
               timeout_s=90, what="training to start")
    children = pids(tmp_path)
    assert len(children) == 5
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
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
