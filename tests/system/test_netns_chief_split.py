"""A partition that splits the chief from one parameter server, while the workers still reach both.

Each role on its own host (network namespace); blackhole routes between the chief's host
and ps0's cut only that pair. The chief stops hearing ps0: its lease ends, its primary
shard is promoted on its backup, and the workers follow the view there (ps0, which
still answers them, must not keep the shard). After the heal ps0 joins again and the
job finishes with every batch applied once and the copies identical.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from localrun import DIGITS, alive

import netns
from harness import wait_until
from shoal.cli.status import exactly_once

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


def split(hosts, a: str, b: str, on: bool) -> None:
    """Drops every packet between hosts ``a`` and ``b`` (both ways), or lets them through again."""
    for src, dst in ((a, b), (b, a)):
        subprocess.run(["ip", "-n", hosts.ns(src), "route", "add" if on else "del", "blackhole",
                        f"{hosts.addresses[dst]}/32"], check=True, capture_output=True)


def status(hosts, chief: str) -> dict:
    return json.loads(hosts.output("w0", [*SHOAL, "status", "--chief", chief, "--json"]))


def test_the_chief_split_from_one_server_but_not_from_the_workers(hosts, tmp_path):
    for name in ("chief", "ps0", "ps1", "w0"):
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
        start("w0", [*SHOAL, "worker", "--chief", chief, DIGITS, "--epochs", "3", "--step-delay", "0.02"])
        wait_until(lambda: status(hosts, chief)["totals"]["steps"] > 20, timeout_s=90, what="training")
        split(hosts, "chief", "ps0", True)
        wait_until(lambda: "promoted" in logs["chief"].read_text() or "lost" in logs["chief"].read_text(),
                   timeout_s=20, what="the chief to give ps0's shard to its backup")
        steps = status(hosts, chief)["totals"]["steps"]
        wait_until(lambda: status(hosts, chief)["totals"]["steps"] > steps + 10, timeout_s=30,
                   what="training to go on without ps0")
        split(hosts, "chief", "ps0", False)
        wait_until(lambda: "joining again" in logs["ps0"].read_text(), timeout_s=30, what="ps0 to join again")
        assert procs["w0"].wait(240) == 0, logs["w0"].read_text()[-3000:]
        final = status(hosts, chief)
        assert final["tasks"]["done"] == final["tasks"]["total"]
        assert exactly_once(final), final["shards"]
        assert procs["ps0"].poll() is None and procs["ps1"].poll() is None     # nobody gave up or crashed
    finally:
        for p in procs.values():
            if alive(p.pid):
                p.kill()
            p.wait()
