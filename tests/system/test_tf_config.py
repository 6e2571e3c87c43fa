"""Every role started from TF_CONFIG alone (as Kubeflow's TFJob operator starts them), each on its own
host (network namespace), trains the example job file: ``shoal start --config job.yaml`` and nothing else."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import yaml
from localrun import DIGITS, ROOT, SHOAL, alive

import netns

from shoal.cli.status import exactly_once

pytestmark = pytest.mark.system

WHY = netns.unavailable()
# every host is a fresh network namespace of its own, so the operator's fixed port cannot collide
PORT = 2222


@pytest.fixture
def hosts():
    if WHY:
        pytest.skip(f"network namespaces unavailable: {WHY}")
    h = netns.Hosts()
    try:
        yield h
    finally:
        h.remove()


def test_every_role_from_tf_config_alone_trains_the_example(hosts, tmp_path):
    job = yaml.safe_load((ROOT / "examples" / "job.yaml").read_text())
    job["train"].update(epochs=1, script=DIGITS)
    job.pop("checkpointing")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    names = {"chief": ["chief"], "ps": ["ps0", "ps1"], "worker": ["w0"]}
    for group in names.values():
        for name in group:
            hosts.add(name)
    cluster = {kind: [f"{hosts.addresses[n]}:{PORT}" for n in group] for kind, group in names.items()}
    procs: dict[str, subprocess.Popen] = {}
    logs = {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    try:
        for kind, group in names.items():
            for index, name in enumerate(group):
                tf = json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})
                logs[name] = tmp_path / f"{name}.log"
                procs[name] = hosts.run(name, [*SHOAL, "start", "--config", str(tmp_path / "job.yaml")],
                                        env={**env, "TF_CONFIG": tf}, cwd=tmp_path, stderr=subprocess.STDOUT,
                                        stdout=open(logs[name], "w"))
        assert procs["w0"].wait(180) == 0, logs["w0"].read_text()[-3000:]
        final = json.loads(hosts.output("chief", [*SHOAL, "status", "--chief", cluster["chief"][0], "--json"]))
        assert final["tasks"]["done"] == final["tasks"]["total"] > 0
        assert exactly_once(final), final["shards"]
        # each server is reached at the place TF_CONFIG gave it, and there are as many shards as ps
        assert sorted(m["address"] for m in final["members"] if m["role"] == "ps") == sorted(cluster["ps"])
        assert sorted(s["address"] for s in final["shards"]) == sorted(cluster["ps"])
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
