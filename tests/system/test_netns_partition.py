"""Every role on its own host (network namespace); one worker's host is cut off and comes back.

The cut worker's lease expires, its tasks go back to the queue and the other
worker trains on; after the link heals the worker joins again and the job
finishes with every batch applied once.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from localrun import DIGITS, alive

import netns
from shoal.cli.status import exactly_once
from harness import wait_until

pytestmark = pytest.mark.system

WHY = netns.unavailable()
SHOAL = [sys.executable, "-m", "shoal.cli"]


@pytest.fixture
def hosts():
    if WHY:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    h = netns.Hosts()
    try:
        yield h
    finally:
        h.remove()


def status(hosts, chief: str) -> dict:
    return json.loads(hosts.output("chief", [*SHOAL, "status", "--chief", chief, "--json"]))


def test_a_worker_cut_off_past_its_lease_is_dropped_requeued_and_rejoins(hosts, tmp_path):
    for name in ("chief", "ps0", "ps1", "w0", "w1"):
        hosts.add(name)
    procs: dict[str, subprocess.Popen] = {}
    logs = {}

    def start(name: str, argv: list[str]) -> None:
        logs[name] = tmp_path / f"{name}.log"
        procs[name] = hosts.run(name, argv, stdout=open(logs[name], "w"), stderr=subprocess.STDOUT, cwd=tmp_path)

    try:
        a = hosts.addresses
        start("chief", [*SHOAL, "chief", "--bind", f"{a['chief']}:0", "--port-file", str(tmp_path / "port"),
                        "--num-shards", "2", "--mode", "async", "--lease-seconds", "1.5"])
        wait_until(lambda: (tmp_path / "port").exists(), timeout_s=30, what="the chief's port")
        chief = f"{a['chief']}:{(tmp_path / 'port').read_text()}"
        for ps in ("ps0", "ps1"):
            start(ps, [*SHOAL, "ps", "--chief", chief, "--bind", f"{a[ps]}:0"])
        for w in ("w0", "w1"):
            start(w, [*SHOAL, "worker", "--chief", chief, DIGITS, "--epochs", "20", "--step-delay", "0.02"])
        # each poll is a new process in the chief's namespace (0.4 s of CPU for its imports): polled
        # back to back, they take a core from the five roles still starting on a 2-core host
        wait_until(lambda: status(hosts, chief)["totals"]["steps"] > 60, timeout_s=90, interval_s=0.5,
                   what="training")
        hosts.cut("w1")
        t_cut = time.monotonic()
        log = logs["chief"]
        wait_until(lambda: "expired" in log.read_text() and "re-queued" in log.read_text(), timeout_s=15,
                   what="the cut worker's lease to expire and its tasks to go back")
        steps_at_expiry = status(hosts, chief)["totals"]["steps"]
        time.sleep(2.0)
        assert status(hosts, chief)["totals"]["steps"] > steps_at_expiry       # the other worker trains on
        hosts.heal("w1")
        print(f"cut for {time.monotonic() - t_cut:.1f}s")
        wait_until(lambda: "joining again" in logs["w1"].read_text(), timeout_s=30,
                   what="the cut worker to join again")
        for w in ("w0", "w1"):
            assert procs[w].wait(240) == 0, logs[w].read_text()[-3000:]
        final = status(hosts, chief)
        assert final["tasks"]["done"] == final["tasks"]["total"]
        assert exactly_once(final), final["shards"]
    finally:
        for p in procs.values():
            if alive(p.pid):
                p.kill()
            p.wait()
