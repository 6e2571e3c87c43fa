"""``shoal local --autoscale``: the chief's desired worker count grows with a long queue of data tasks
and shrinks as it drains; the supervisor starts workers, then stops the newest with SIGTERM (they hand
back their tasks), and every batch still reaches every shard exactly once."""
from __future__ import annotations

import re

import pytest
import yaml
from localrun import finish, start_local

pytestmark = pytest.mark.system


def test_the_local_cluster_scales_out_and_back_in_without_losing_exactly_once(tmp_path):
    job = {"train": {"mode": "async"}, "cluster": {"ps": 2, "lease_seconds": 3},
           "autoscaling": {"min_workers": 1, "max_workers": 3, "target": "queue", "tasks_per_worker": 8,
                           "cooldown": "1s"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = start_local(tmp_path, "--config", str(tmp_path / "job.yaml"), "--autoscale", "--workers", "1",
                       script_args=("--epochs", "3", "--hidden", "32", "--step-delay", "0.2"))
    summary = finish(proc, tmp_path, timeout=240)
    log = (tmp_path / "local.log").read_text()
    changes = [(int(a), int(b)) for a, b in re.findall(r"autoscaling: (\d+) -> (\d+) worker", log)]
    assert changes and changes[0][0] == 1 and changes[0][1] > 1, changes          # scaled out first
    assert any(b < a for a, b in changes), changes                                  # then back in
    assert "stopping on request (SIGTERM)" in log                                   # a graceful leave
    assert summary["workers_seen"] >= 2
    assert summary["autoscale_desired_workers"] == 1                                # the queue is empty
    assert summary["exactly_once"] is True, summary.get("ledger")
    assert summary["tasks_done"] == summary["tasks_total"]
    assert all(code in (0, -15) for code in summary["worker_exit_codes"].values()), summary["worker_exit_codes"]
