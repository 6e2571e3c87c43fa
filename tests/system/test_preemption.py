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
from shoal.settings.config import JobConfig

pytestmark = pytest.mark.system

GRACE_S = 30.0            # the generated pods' terminationGracePeriodSeconds


def _worker(chief: str, log, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*SHOAL, "worker", "--chief", chief, DIGITS, "--epochs", "4", "--hidden", "32",
                             *args], stdout=log, stderr=subprocess.STDOUT)


def test_sigterm_on_a_worker_hands_back_its_task_and_exits_0(tmp_path):
    # a long lease: the job can only go on quickly if the worker really left instead of going silent
    with InProcessCluster(2, JobConfig(num_shards=2, mode="async", lease_seconds=60)) as c:
        logs = {n: open(tmp_path / f"{n}.log", "w+") for n in ("a", "b")}
        # the same pace for both: a worker that is twice as fast could take nearly every task before the
        # other logs its 50th step (seen on a loaded 2-core CI machine)
        a = _worker(c.chief_address, logs["a"], "--step-delay", "0.05")
        b = _worker(c.chief_address, logs["b"], "--step-delay", "0.05")
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


def test_sigterm_on_a_ps_hands_its_shards_to_their_backups(tmp_path):
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *argv: str) -> None:
        procs[name] = subprocess.Popen([*SHOAL, *argv], stdout=open(tmp_path / f"{name}.log", "w"),
                                       stderr=subprocess.STDOUT)

    log = lambda name: (tmp_path / f"{name}.log").read_text()     # noqa: E731
    try:
        start("chief", "chief", "--bind", "127.0.0.1:0", "--port-file", str(tmp_path / "port"), "--num-shards", "2",
              "--mode", "async", "--lease-seconds", "60")
        wait_until(lambda: (tmp_path / "port").exists(), timeout_s=30, what="the chief's port")
        chief = f"127.0.0.1:{(tmp_path / 'port').read_text()}"
        for ps in ("ps0", "ps1"):
            start(ps, "ps", "--chief", chief, "--bind", "127.0.0.1:0")
        start("worker", "worker", "--chief", chief, DIGITS, "--epochs", "3", "--hidden", "32", "--step-delay", "0.02")
        wait_until(lambda: "step 50 " in log("worker"), timeout_s=90, what="the worker 50 steps into training")
        procs["ps0"].send_signal(signal.SIGTERM)
        assert procs["ps0"].wait(GRACE_S) == 0
        assert procs["worker"].wait(120) == 0, log("worker")[-2000:]
        final = collect(chief)
        assert final["tasks"]["done"] == final["tasks"]["total"]
        assert exactly_once(final), final["shards"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert "handed over to" in log("chief")
    for bad in ("lost its primary", "lost every copy"):
        assert bad not in log("chief"), log("chief")[-3000:]
    # the worker followed the view: no failed call, no search for a primary
    assert "looking for its primary" not in log("worker") and "handed over to" in log("worker"), log("worker")[-3000:]
    assert "WARNING" not in log("ps0"), log("ps0")
