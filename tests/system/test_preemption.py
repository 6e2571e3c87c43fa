"""Graceful preemption: SIGTERM (docker stop, kubectl delete pod, a spot notice) on a worker hands back
its task, leaves the job and exits 0 well within a pod's grace period; the others finish the job with
every batch applied exactly once, and the chief never had to wait out a lease."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest
from localrun import DIGITS, SHOAL

from harness import InProcessCluster, wait_until
from shoal.cli.status import collect, exactly_once
from shoal.config import JobConfig

pytestmark = pytest.mark.system

GRACE_S = 30.0            # the generated pods' terminationGracePeriodSeconds


def _worker(chief: str, log, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*SHOAL, "worker", "--chief", chief, DIGITS, "--epochs", "4", "--hidden", "32",
                             *args], stdout=log, stderr=subprocess.STDOUT)


def test_sigterm_on_a_worker_hands_back_its_task_and_exits_0(tmp_path):
    # a long lease: the job can only go on quickly if the worker really left instead of going silent
    with InProcessCluster(2, JobConfig(num_shards=2, mode="async", lease_seconds=60)) as c:
        logs = {n: open(tmp_path / f"{n}.log", "w+") for n in ("a", "b")}
        a = _worker(c.chief_address, logs["a"], "--step-delay", "0.05")
        b = _worker(c.chief_address, logs["b"])
        try:
            wait_until(lambda: "step 50 " in (tmp_path / "a.log").read_text(), timeout_s=90,
                       what="the worker to be 50 steps into training")
            a.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            assert a.wait(GRACE_S) == 0
            took = time.monotonic() - sent
            assert b.wait(120) == 0, (tmp_path / "b.log").read_text()[-2000:]
            final = collect(c.chief_address)
        finally:
            for p in (a, b):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        out_a = (tmp_path / "a.log").read_text()
        assert "stopping on request (SIGTERM)" in out_a and "Traceback" not in out_a, out_a[-2000:]
        assert took < 10, f"the preempted worker took {took:.1f}s to leave"
        assert final["tasks"]["done"] == final["tasks"]["total"]
        assert exactly_once(final), final["shards"]
