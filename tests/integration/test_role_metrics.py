"""Each role's /metrics serves its own families only, plus shoal_build_info and shoal_job_info: an
avg/min over a job's series is not dragged to 0 by roles that never train (shoal/observe/metrics.py)."""
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from harness import wait_until
from shoal.worker import Trainer

from test_cluster import data, mlp, train

WORKER_ONLY = {"shoal_steps_total", "shoal_train_loss", "shoal_gradient_norm", "shoal_samples_total",
               "shoal_push_bytes_total", "shoal_step_phase_seconds", "shoal_staleness_versions"}
CHIEF_ONLY = {"shoal_live_workers", "shoal_queue_depth", "shoal_tasks_done", "shoal_lease_expirations_total",
              "shoal_view_changes_total", "shoal_checkpoint_duration_seconds"}
PS_ONLY = {"shoal_shard_bytes", "shoal_shard_pushes_applied", "shoal_ps_received_bytes"}
EVERY_ROLE = {"shoal_build_info", "shoal_job_info", "shoal_rpc_duration_seconds"}


def families(url: str) -> dict[str, list]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {f.name.removesuffix("_total") if f.type == "counter" else f.name: f.samples
            for f in text_string_to_metric_families(text)}


def names(url: str) -> set[str]:
    found = families(url)
    # the parser names a counter family without its _total: put it back for the comparison
    return {n + "_total" if n + "_total" in WORKER_ONLY | CHIEF_ONLY else n for n in found}


def test_each_role_serves_its_own_families_and_the_info_metrics(cluster_factory, monkeypatch):
    monkeypatch.setenv("SHOAL_METRICS_PORT", "0")
    c = cluster_factory(1, mode="async")
    c.chief.watch("", metrics_port=0)
    c.servers[0].serve_metrics(0)
    m = mlp(0)
    t = Trainer(m, chief=c.chief_address, lr=0.05)
    try:
        x, y = data(64)
        train(t, m, x, y, epochs=1)
        urls = {"chief": c.chief.metrics_endpoint.url, "ps": c.servers[0].metrics_endpoint.url,
                "worker": t.telemetry.metrics_url}
        wait_until(lambda: "shoal_live_workers" in names(urls["chief"]), timeout_s=10, what="the chief's gauges")
        served = {role: names(url) for role, url in urls.items()}
        for role, mine, others in (("worker", WORKER_ONLY, CHIEF_ONLY | PS_ONLY),
                                   ("chief", CHIEF_ONLY, WORKER_ONLY | PS_ONLY),
                                   ("ps", PS_ONLY, WORKER_ONLY | CHIEF_ONLY)):
            assert EVERY_ROLE <= served[role], (role, EVERY_ROLE - served[role])
            assert mine <= served[role], (role, mine - served[role])
            assert not others & served[role], (role, others & served[role])
            (info,) = families(urls[role])["shoal_job_info"]
            assert info.labels["role"] == role and info.labels["mode"] == "async" and info.value == 1
            assert info.labels["job"] and info.labels["member"]
    finally:
        t.close()
