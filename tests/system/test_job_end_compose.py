"""The generated compose file's commands, run as docker compose would run them without an engine: each
service a process on a host of its own named as the service (``chief``, ``ps-0``, ...: ``ip netns exec``
reads /etc/netns/<ns>/hosts as /etc/hosts), with the service's environment and its volumes mapped to
folders. The job (with its checkpoints) ends on its own: every process exits 0, the chief last, as
``docker compose up`` would return and ``docker compose wait chief`` would report (chief/lifecycle.py)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from localrun import DIGITS, ROOT, SHOAL, alive

import netns

from shoal.cli import compose
from shoal.settings.jobfile import parse_job

pytestmark = pytest.mark.system

WHY = netns.unavailable()
DRAIN_S = 20


@pytest.fixture
def hosts():
    if WHY:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    h = netns.Hosts()
    try:
        yield h
    finally:
        for name in h.addresses:
            shutil.rmtree(Path("/etc/netns") / h.ns(name), ignore_errors=True)
        h.remove()


def _mapped(arg: str, tmp_path: Path, job_file: Path) -> str:
    """A container path of the compose file as this host's folder (its volumes)."""
    if arg == compose.JOB_PATH:
        return str(job_file)
    if arg.startswith(compose.STATE):
        return str(tmp_path / "state") + arg[len(compose.STATE):]
    return arg


def test_the_compose_commands_end_the_job_on_their_own_with_exit_0(hosts, tmp_path):
    raw = yaml.safe_load((ROOT / "examples" / "job.yaml").read_text())
    raw["train"].update(epochs=1, script=DIGITS, args=["--hidden", "32"])
    raw["cluster"]["lease_seconds"] = 1
    raw["chief"] = {"end_drain": f"{DRAIN_S}s"}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(raw))
    (tmp_path / "state").mkdir()
    services = compose.compose(parse_job(raw, env={}), "./job.yaml")["services"]
    names = ["chief", *(n for n in services if n.startswith("ps-")),
             *(f"worker-{i}" for i in range(services["worker"]["scale"]))]
    for name in names:
        hosts.add(name)
    lines = "".join(f"{hosts.addresses[n]} {n}\n" for n in names)
    for name in names:
        d = Path("/etc/netns") / hosts.ns(name)
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text("127.0.0.1 localhost\n" + lines)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    try:
        for name in names:
            svc = services["worker" if name.startswith("worker") else name]
            env = {**base, **svc["environment"]}
            logs[name] = tmp_path / f"{name}.log"
            procs[name] = hosts.run(name, [*SHOAL, *(_mapped(a, tmp_path, job_file) for a in svc["command"])],
                                    env=env, cwd=tmp_path, stderr=subprocess.STDOUT, stdout=open(logs[name], "w"))
            if name == "chief":     # depends_on: the servers start once the chief is healthy
                deadline = time.monotonic() + 60
                while subprocess.run(["ip", "netns", "exec", hosts.ns("chief"), *SHOAL, "health", "-q",
                                      "127.0.0.1:7070"], capture_output=True).returncode != 0:
                    assert time.monotonic() < deadline, logs["chief"].read_text()[-2000:]
                    time.sleep(0.5)
        workers = [n for n in names if n.startswith("worker")]
        for w in workers:
            assert procs[w].wait(180) == 0, logs[w].read_text()[-3000:]
        ended = time.monotonic()
        for name in [n for n in names if n.startswith("ps-")] + ["chief"]:
            try:
                code = procs[name].wait(max(ended + DRAIN_S + 20 - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running {DRAIN_S + 20}s after the workers ended:\n"
                            + logs[name].read_text()[-2000:])
            assert code == 0, logs[name].read_text()[-3000:]
        chief_log = logs["chief"].read_text()
        assert "job finished: " in chief_log and "final checkpoint step" in chief_log, chief_log[-2000:]
    finally:
        for p in procs.values():
            if alive(p.pid):
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
