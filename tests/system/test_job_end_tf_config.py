"""A TF_CONFIG-started job (chief, 2 ps, 2 workers, each its own process on its own host) ends on its own:
every process exits 0 within the drain after the last task (chief/lifecycle.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import yaml
from localrun import DIGITS, ROOT, SHOAL, alive

import netns

pytestmark = pytest.mark.system

WHY = netns.unavailable()
PORT = 2222          # every host is a network namespace of its own: the operator's fixed port cannot collide
DRAIN_S = 20


@pytest.fixture
def hosts():
    if WHY:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    h = netns.Hosts()
    try:
        yield h
    finally:
        h.remove()


def test_a_tf_config_job_ends_on_its_own_with_exit_0(hosts, tmp_path):
    job = yaml.safe_load((ROOT / "examples" / "job.yaml").read_text())
    job["train"].update(epochs=1, script=DIGITS, args=["--hidden", "32"])
    job.pop("checkpointing")
    job["cluster"]["lease_seconds"] = 1
    job["chief"] = {"end_drain": f"{DRAIN_S}s"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    names = {"chief": ["chief"], "ps": ["ps0", "ps1"], "worker": ["w0", "w1"]}
    for group in names.values():
        for name in group:
            hosts.add(name)
    cluster = {kind: [f"{hosts.addresses[n]}:{PORT}" for n in group] for kind, group in names.items()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    procs: dict[str, subprocess.Popen] = {}
    logs = {}

    def start(kind: str, index: int, name: str) -> None:
        tf = json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})
        logs[name] = tmp_path / f"{name}.log"
        procs[name] = hosts.run(name, [*SHOAL, "start", "--config", str(tmp_path / "job.yaml")],
                                env={**env, "TF_CONFIG": tf}, cwd=tmp_path, stderr=subprocess.STDOUT,
                                stdout=open(logs[name], "w"))

    try:
        for kind, group in names.items():
            for index, name in enumerate(group):
                start(kind, index, name)
        for w in ("w0", "w1"):
            assert procs[w].wait(180) == 0, logs[w].read_text()[-3000:]
        ended = time.monotonic()
        for name in ("chief", "ps0", "ps1"):       # on their own, within the drain (plus the chief's grace)
            left = ended + DRAIN_S + 15 - time.monotonic()
            try:
                assert procs[name].wait(max(left, 1)) == 0, logs[name].read_text()[-3000:]
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running {DRAIN_S + 15}s after the workers ended:\n"
                            + logs[name].read_text()[-2000:])
        assert "job finished: " in logs["chief"].read_text()
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
