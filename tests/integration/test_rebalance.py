"""Shard placement in a running in-process cluster (issue 17): a server promoted over a dead one holds
both shards; a new server joins and, once its copy is whole, takes one over while training goes on,
every batch applied once and the copies identical."""
import threading
import time

import pytest

from harness import run_threads, wait_until
from shoal.chief import placement
from shoal.ps.server import PSServer
from shoal.worker import Trainer

from test_cluster import assert_exactly_once, data, mlp
from test_replication import copies, in_sync, train_all


def busiest(c) -> int:
    with c.chief.servicer.lock:
        s = c.chief.state
        return max(placement.primaries(s.routing, [m.member_id for m in s.members.alive()
                                                   if m.role.value == "ps"]).values())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_joiner_takes_a_shard_off_a_promoted_server_within_10s_and_training_goes_on(cluster_factory, mode):
    c = cluster_factory(2, mode=mode, lease_seconds=1.0)
    size, batch, epochs = 1024, 16, 4
    x, y = data(size)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02) for m in models]
    steps, marks = [0], {}
    lock = threading.Lock()

    def tick():
        with lock:
            steps[0] += 1
    try:
        wait_until(lambda: in_sync(c), timeout_s=20, what="backups to be filled")

        def churn():
            wait_until(lambda: steps[0] >= 40, timeout_s=60, what="training to be under way")
            c.kill_ps(1)
            wait_until(lambda: busiest(c) == 2, timeout_s=10, what="the survivor to be promoted (2 of 2 shards)")
            marks["joined"] = time.monotonic()
            c.servers.append(PSServer(c.chief_address, bind="127.0.0.1:0").start())
            wait_until(lambda: busiest(c) <= 1, timeout_s=10, what="the busiest server to hold at most ceil(2/2)")
            marks["balanced"] = time.monotonic()
            before = steps[0]
            wait_until(lambda: steps[0] > before + 10, timeout_s=20, what="training to go on after the move")

        run_threads(lambda: train_all(trainers, models, x, y, epochs, batch, on_step=tick), churn, timeout_s=150)
        took = marks["balanced"] - marks["joined"]
        print(f"{mode}: balanced {took:.2f}s after the server's join (lease 1.0s)")
        assert took < 10.0
        new = c.servers[-1]
        assert new.host.promotions == 1 and [r for r in new.host.roles.values()].count("primary") == 1
        wait_until(lambda: in_sync(c) and all(len(v) == 2 for v in copies(c).values()), timeout_s=20,
                   what="the moved shard's new backup to be filled")
        got = copies(c)
        assert all(got[k]["primary"] == got[k]["backup"] for k in (0, 1)), got
        assert_exactly_once(c, size, batch, epochs)
    finally:
        for t in trainers:
            t.close()
