"""``shoal local`` as its user sees it: member-named prefixes, closing lines, /metrics on every role, TensorBoard."""
from __future__ import annotations

import json
import re
import urllib.request

import pytest
from localrun import finish, job_steps, start_local
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from harness import wait_until

pytestmark = pytest.mark.system


def scrape(target: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_local_run_serves_metrics_writes_tensorboard_and_ends_with_a_short_result(tmp_path):
    proc = start_local(tmp_path, "--ps", "2", "--workers", "2", "--metrics-port", "0",
                       script_args=("--epochs", "2", "--step-delay", "0.1"))
    targets_dir = tmp_path / "run" / "metrics"
    members = {"chief", "ps-0", "ps-1", "worker-0", "worker-1"}
    wait_until(lambda: targets_dir.is_dir() and {p.stem for p in targets_dir.glob("*.json")} == members,
               timeout_s=90, what="every role to write its Prometheus target file")
    wait_until(lambda: job_steps(tmp_path) > 10, timeout_s=60, what="training to start")
    targets = {p.stem: json.loads(p.read_text())[0] for p in targets_dir.glob("*.json")}
    assert targets["worker-1"]["labels"] == {"role": "worker", "member": "worker-1"}
    scraped = {m: scrape(t["targets"][0]) for m, t in targets.items()}
    assert scraped["worker-0"]["shoal_push_bytes_total"] > 0 and scraped["worker-1"]["shoal_steps_total"] > 0
    assert scraped["ps-0"]["shoal_shard_version"] > 0 and scraped["ps-0"]["shoal_rpc_duration_seconds_count"] > 0
    wait_until(lambda: scrape(targets["chief"]["targets"][0]).get("shoal_live_workers") == 2, timeout_s=20,
               what="the chief to count both workers")
    summary = finish(proc, tmp_path)

    out = (tmp_path / "local.log").read_text()
    prefixes = set(re.findall(r"^\[([^\]]+)\] ", out, re.M))
    assert {"chief", "worker-0", "worker-1", "ps-0", "ps-1"} <= prefixes, prefixes
    # a child has no member name before the chief gives it one: only its line announcing the join keeps
    # the supervisor's name for it
    early = [(name, rest) for name, rest in re.findall(r"^\[([^\]]+)\] (.*)$", out, re.M)
             if name in {"worker0", "worker1", "ps0", "ps1"}]
    assert all("joining the chief at" in rest for _, rest in early), early
    assert re.search(r"^training finished in [\d.]+s: sync mode, 2 ps, 2 workers$", out, re.M)
    assert re.search(r"^  exactly once    yes", out, re.M) and f"summary         {tmp_path}/summary.json" in out
    assert "train_loss" in summary and summary["exactly_once"]

    runs = list((tmp_path / "run" / "tb").glob("sync-*"))
    assert len(runs) == 1 and summary["tensorboard"] == str(tmp_path / "run" / "tb")
    assert {p.name for p in runs[0].iterdir()} == {"chief", "worker-0", "worker-1"}
    ea = EventAccumulator(str(runs[0] / "worker-0"))
    ea.Reload()
    assert {"train/loss", "train/grad_norm", "step_time/push_ms", "eval/test_accuracy"} <= set(ea.Tags()["scalars"])
