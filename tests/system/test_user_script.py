"""A user's own loop on ``shoal local``: SIGTERM on the wrapper path (examples/cnn_bn.py), a script bug that
must not restart-storm, one NaN that must not fail a good run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from localrun import ROOT, SHOAL, _default_sigint, alive, job_steps, let_in, pids

from harness import wait_until

pytestmark = pytest.mark.system

PLAIN = str(Path(__file__).with_name("plain_loop.py"))
CNN_BN = str(ROOT / "examples" / "cnn_bn.py")
LONG = {"PLAIN_EPOCHS": "40", "PLAIN_STEP_DELAY": "0.03"}


def start(tmp_path: Path, script: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    log = open(tmp_path / "local.log", "w")
    return subprocess.Popen([*SHOAL, "local", "--ps", "1", "--workers", "2", "--run-dir", str(tmp_path / "run"),
                             "--summary", str(tmp_path / "summary.json"), script, *args],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, preexec_fn=_default_sigint,
                            env={**os.environ, **(env or {})})


def steps(tmp_path: Path) -> int:
    return job_steps(tmp_path) if (tmp_path / "run" / "chief.address").exists() else 0


def ended(proc: subprocess.Popen, tmp_path: Path, timeout_s: float = 240) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("shoal local did not finish:\n" + (tmp_path / "local.log").read_text()[-4000:])
    return rc, (tmp_path / "local.log").read_text()


def test_sigterm_on_a_cnn_bn_worker_hands_back_and_exits_0_within_seconds(tmp_path):
    proc = start(tmp_path, CNN_BN, "--epochs", "3")
    try:
        wait_until(lambda: steps(tmp_path) >= 20, timeout_s=180, what="20 steps of training")
        victim = pids(tmp_path)["worker0"]
        os.kill(victim, signal.SIGTERM)
        sent = time.monotonic()
        wait_until(lambda: not alive(victim), timeout_s=30, interval_s=0.05, what="the worker to leave")
        took = time.monotonic() - sent
        rc, log = ended(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["worker_exit_codes"]["worker0"] == 0
    assert "stopping on request (SIGTERM)" in log and log.count("stopping on request (SIGTERM)") == 1
    assert summary["exactly_once"] is True, summary.get("exactly_once_detail")
    assert took < 10, f"the worker took {took:.1f}s to leave after SIGTERM"


def test_a_script_bug_stops_shoal_local_with_the_scripts_error_and_exit_3(tmp_path):
    t0 = time.monotonic()
    rc, log = ended(start(tmp_path, PLAIN, env={"PLAIN_BUG_AT": "10"}), tmp_path, timeout_s=120)
    took = time.monotonic() - t0
    assert rc == 3, log[-3000:]
    assert "failed the same way" in log and "ValueError: a bug at step 10" in log.split("job stopped")[-1]
    assert took < 60, f"{took:.0f}s"


def test_one_nan_loss_is_skipped_counted_and_the_run_exits_0(tmp_path):
    rc, log = ended(start(tmp_path, PLAIN, env={"PLAIN_NAN_AT": "20"}), tmp_path)
    assert rc == 0, log[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exactly_once"] is True and summary["batches_skipped"] == 1, summary
    assert "yes, with 1 skipped" in log


def test_a_worker_joining_mid_run_with_the_same_script_contributes_and_exits_0(tmp_path):
    gate = tmp_path / "joiner.go"
    with open(tmp_path / "joiner.log", "w") as log:     # imports done first: it joins when let in
        joiner = subprocess.Popen([sys.executable, str(Path(__file__).with_name("prewarmed.py")), str(gate),
                                   "worker", "--chief", "@gate", PLAIN], stdout=log, stderr=subprocess.STDOUT,
                                  cwd=tmp_path, env={**os.environ, **LONG})
    proc = None
    try:
        wait_until(lambda: Path(f"{gate}.ready").exists(), timeout_s=120, what="the joiner's imports")
        proc = start(tmp_path, PLAIN, env=LONG)
        wait_until(lambda: steps(tmp_path) >= 40, timeout_s=180, what="40 steps of training")
        let_in(tmp_path, gate)
        assert joiner.wait(240) == 0, (tmp_path / "joiner.log").read_text()[-3000:]
        rc, log = ended(proc, tmp_path)
    finally:
        for p in (proc, joiner):
            if p is not None and p.poll() is None:
                p.kill()
    assert rc == 0, log[-3000:]
    out = (tmp_path / "joiner.log").read_text()
    # it started at the job's epoch (not 0) and trained; no iteration was empty (loss.item() after the
    # inner loop would have failed)
    assert "the job is at epoch" in out and "epoch " in out.split("the job is at epoch")[-1], out[-3000:]
    assert ": loss " in out and "Traceback" not in out, out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exactly_once"] is True
