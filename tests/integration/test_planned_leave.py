"""A parameter server stopped on purpose (SIGTERM: ``PSServer.stop``) hands its shards to their backups
while training goes on: its workers follow the view with no failed call, no warning and no failover, it
waits for their data connections to close before it closes its own, and every batch is applied once."""
import logging
import threading

import pytest

from harness import run_threads, wait_until
from shoal.ps import server as server_module
from shoal.worker import Trainer

from test_cluster import assert_exactly_once, data, mlp
from test_replication import in_sync, train_all


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_ps_stopped_mid_training_hands_over_without_a_warning_on_any_worker(cluster_factory, mode, caplog,
                                                                              monkeypatch):
    caplog.set_level(logging.INFO, logger="shoal")
    c = cluster_factory(3, mode=mode, lease_seconds=2.0)
    size, batch, epochs = 512, 16, 3
    x, y = data(size)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02) for m in models]
    drained: list[tuple[float, bool]] = []
    real_drain = server_module.DataChannelServer.drain

    def drain(self, timeout_s):
        ok = real_drain(self, timeout_s)
        drained.append((timeout_s, ok))
        return ok
    monkeypatch.setattr(server_module.DataChannelServer, "drain", drain)
    steps = [0]
    lock = threading.Lock()

    def tick():
        with lock:
            steps[0] += 1
    try:
        wait_until(lambda: in_sync(c), timeout_s=20, what="backups to be filled")
        leaving = c.servers[0]
        held = sorted(k for k, r in leaving.host.roles.items() if r == "primary")

        def stop_one():
            wait_until(lambda: steps[0] >= 30, timeout_s=60, what="training to be under way")
            leaving.stop()
            leaving.killed = True          # stopped: the cluster's stop skips it, copies() too

        run_threads(lambda: train_all(trainers, models, x, y, epochs, batch, on_step=tick), stop_one, timeout_s=150)
        assert held, "the leaving server held no primary: nothing was handed over"
        assert drained == [(server_module.DRAIN_S, True)], "the server closed its data channel with workers on it"
        assert sum(t.routes.failovers for t in trainers) == 0
        assert all(t.routes.moves >= 1 for t in trainers)
        complaints = [r.getMessage() for r in caplog.records
                      if r.levelno >= logging.WARNING and r.name.startswith("shoal.worker")]
        assert not complaints, complaints
        assert "handed over to" in caplog.text
        assert_exactly_once(c, size, batch, epochs)
    finally:
        for t in trainers:
            t.close()
