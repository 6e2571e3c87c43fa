"""Prometheus, TensorBoard and alerts on an in-process cluster: scrape /metrics over HTTP, read the events back."""
from __future__ import annotations

import urllib.request

import grpc
import pytest
import torch
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from harness import wait_until
from shoal.chief.autoscale import AutoscalePolicy, Autoscaler
from shoal.cli.status import collect, render
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import open_channel
from shoal.worker import Trainer


def scrape(url: str) -> dict[str, list]:
    """sample name -> samples served at ``url``, parsed as Prometheus would."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(samples, name, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def scalars(run_dir) -> dict[str, list[float]]:
    ea = EventAccumulator(str(run_dir))
    ea.Reload()
    return {tag: [e.value for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


@pytest.fixture
def observed(cluster_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_TENSORBOARD", str(tmp_path / "tb"))
    monkeypatch.setenv("SHOAL_METRICS_PORT", "0")
    monkeypatch.setenv("SHOAL_ALERT_WARMUP", "5")
    c = cluster_factory(2, mode="sync")
    c.chief.servicer.autoscaler = Autoscaler(AutoscalePolicy(min_workers=1, max_workers=3, target="queue", cooldown_s=0))
    c.chief.watch(str(tmp_path / "tb"), metrics_port=0)
    c.chief.telemetry.interval_s = 0.1
    c.chief.telemetry.versions_every_s = 0.1
    for ps in c.servers:
        ps.serve_metrics(0)
    return c


def test_scrape_a_running_cluster_and_read_its_event_files(observed, tmp_path):
    c = observed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    trainer = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.02)
    assert trainer.telemetry.metrics_url
    # one registry per process: other tests' trainers counted too, so compare with what was there before
    before = scrape(trainer.telemetry.metrics_url)
    for i, (xb, yb) in enumerate(trainer.batches((x, y), batch_size=16, epochs=3)):
        trainer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        trainer.step(samples=len(xb), loss=loss if i != 30 else loss.detach() * 100)   # one spike
        if i == 20:
            wait_until(lambda: value(scrape(c.chief.metrics_endpoint.url), "shoal_live_workers") == 1,
                       timeout_s=10, what="the chief's gauge to count the worker")
            # the HPA's metric: the tasks still queued ask for more than one worker
            wait_until(lambda: value(scrape(c.chief.metrics_endpoint.url), "shoal_autoscale_desired_workers") >= 2,
                       timeout_s=10, what="the desired worker count to follow the queue")
    steps = trainer.step_count

    # a refused call is counted by method and status code
    ch = open_channel(c.chief_address)
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.ChiefStub(ch).ReportMetrics(pb.MetricsReport(member_id="nobody", values={"x": 1}), timeout=5)
    ch.close()
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    wait_until(lambda: value(scrape(trainer.telemetry.metrics_url), "shoal_steps_total")
               - value(before, "shoal_steps_total") == steps,
               timeout_s=10, what="the worker's telemetry thread to count every step")
    m = scrape(c.servers[0].metrics_endpoint.url)         # each role serves its own families (and the RPCs')
    w = scrape(trainer.telemetry.metrics_url)
    assert value(m, "shoal_rpc_duration_seconds_count", method="Join", code="OK") >= 3    # 2 ps + 1 worker
    assert value(m, "shoal_rpc_errors_total", method="ReportMetrics", code="NOT_FOUND") \
        == value(before, "shoal_rpc_errors_total", method="ReportMetrics", code="NOT_FOUND") + 1
    assert value(w, "shoal_push_bytes_total") > value(before, "shoal_push_bytes_total")
    assert value(w, "shoal_pull_bytes_total") > value(before, "shoal_pull_bytes_total")
    assert value(w, "shoal_step_phase_seconds_count", phase="push") \
        - value(before, "shoal_step_phase_seconds_count", phase="push") == steps
    assert 0 < value(w, "shoal_train_loss") < 5 and value(w, "shoal_gradient_norm") > 0
    assert value(w, "shoal_alerts_total", kind="loss_spike") - value(before, "shoal_alerts_total",
                                                                      kind="loss_spike") == 1
    assert value(m, "shoal_shard_version", shard="0", role="primary") >= steps
    assert value(m, "shoal_shard_bytes", shard="0", role="primary") > 0
    assert value(scrape(c.chief.metrics_endpoint.url), "shoal_tasks_done") > 0
    wait_until(lambda: value(scrape(c.chief.metrics_endpoint.url), "shoal_autoscale_desired_workers") == 1,
               timeout_s=10, what="the desired worker count to fall with the queue")

    status = collect(c.chief_address)
    assert {"kind": "loss_spike", "member": trainer.member_id, "step": 31} in status["alerts"]
    assert "loss_spike" in render(status)

    member = trainer.member_id
    trainer.close()
    c.chief.telemetry.stop()
    worker = scalars(tmp_path / "tb" / member)
    for tag in ("train/loss", "train/grad_norm", "throughput/samples_per_s", "step_time/compute_ms",
                "step_time/push_ms", "step_time/pull_ms", "bytes/pushed", "bytes/pulled", "train/staleness",
                "bytes/compression_ratio", "alerts/loss_spike"):
        assert tag in worker, (tag, sorted(worker))
    loss = worker["train/loss"]
    assert len(loss) == steps and loss[-1] < loss[0] / 2      # the values move: training made progress
    chief = scalars(tmp_path / "tb" / "chief")
    for tag in ("cluster/live_workers", "tasks/queue_depth", "progress/epochs", "shards/version_0",
                "shards/version_1", "cluster/view_epoch", "train/loss"):
        assert tag in chief, (tag, sorted(chief))
    assert max(chief["cluster/live_workers"]) == 1
    assert chief["shards/version_0"][-1] > chief["shards/version_0"][0]
