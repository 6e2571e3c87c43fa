"""Replicated shards: byte-identical copies, a primary killed mid-training, a new backup filled live."""
import threading
import time

import pytest
import torch.nn.functional as F

from harness import run_threads, wait_until
from shoal.worker import Trainer

from test_cluster import assert_exactly_once, data, mlp


def copies(c):
    """shard -> {role: (version, sha256)} over every live server."""
    out: dict = {}
    for ps in c.servers:
        if getattr(ps, "killed", False):
            continue
        for k, s in list(ps.host.shards.items()):
            out.setdefault(k, {})[ps.host.roles[k]] = s.digest()
    return out


def in_sync(c):
    return all(r.state == "in_sync" for ps in c.servers if not getattr(ps, "killed", False)
               for k, r in ps.host.replicators.items() if ps.host.roles.get(k) == "primary")


def train_all(trainers, models, x, y, epochs, batch=16, on_step=None):
    def one(t, m):
        for xb, yb in t.batches((x, y), batch_size=batch, epochs=epochs, batches_per_task=4):
            t.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            t.step()
            if on_step is not None:
                on_step()
    run_threads(*[lambda t=t, m=m: one(t, m) for t, m in zip(trainers, models)], timeout_s=120)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_backups_are_byte_identical_to_their_primaries(cluster_factory, mode):
    c = cluster_factory(2, mode=mode, lease_seconds=2.0)
    assert c.job.replicas == 2
    x, y = data(512)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02) for m in models]
    try:
        wait_until(lambda: in_sync(c) and len(copies(c)) == 2, timeout_s=20, what="backups to be filled")
        train_all(trainers, models, x, y, epochs=3)
        got = copies(c)
        for k in (0, 1):
            assert set(got[k]) == {"primary", "backup"}
            assert got[k]["primary"] == got[k]["backup"], f"shard {k} copies differ"
            assert got[k]["primary"][0] > 10
        assert_exactly_once(c, 512, 16, 3)          # every copy's ledger, backups included
        assert {ps.host.replicators[k].transport for ps in c.servers for k in ps.host.replicators
                if ps.host.roles.get(k) == "primary"} == {"tcp"}   # updates went over the data channel
    finally:
        for t in trainers:
            t.close()


@pytest.mark.parametrize("mode,optimizer", [("sync", dict(optimizer="sgd", momentum=0.9)),
                                            ("async", dict(optimizer="adam"))], ids=["sync-sgd", "async-adam"])
def test_top_k_updates_applied_sparse_on_the_primary_leave_the_backup_byte_identical(cluster_factory, mode,
                                                                                      optimizer):
    # with top-k the workers keep the momentum (or Adam's moments) and the shards run plain SGD: the
    # primaries apply each push to the elements it names, and so do the backups, sent only those entries
    c = cluster_factory(2, mode=mode, lease_seconds=2.0)
    x, y = data(512)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, lr=0.02, compression="topk:0.1", **optimizer) for m in models]
    try:
        wait_until(lambda: in_sync(c) and len(copies(c)) == 2, timeout_s=20, what="backups to be filled")
        train_all(trainers, models, x, y, epochs=3)
        got = copies(c)
        for k in (0, 1):
            assert got[k]["primary"] == got[k]["backup"], f"shard {k} copies differ"
            assert got[k]["primary"][0] > 10
        primaries = [s for ps in c.servers for k, s in ps.host.shards.items() if ps.host.roles[k] == "primary"]
        backups = [s for ps in c.servers for k, s in ps.host.shards.items() if ps.host.roles[k] == "backup"]
        assert len(primaries) == len(backups) == 2
        for s in primaries:
            assert s.optimizer_spec.name == "sgd" and s.stats.sparse_updates == s.stats.updates == s.version
        for s in backups:       # every update since the backup's copy came as entries and was applied as such
            assert s.stats.updates > 10 and s.stats.sparse_updates == s.stats.updates
        assert_exactly_once(c, 512, 16, 3)
    finally:
        for t in trainers:
            t.close()


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_updates_from_half_precision_pushes_travel_in_it_and_leave_the_backup_byte_identical(cluster_factory,
                                                                                            codec):
    c = cluster_factory(2, mode="async", lease_seconds=2.0)
    x, y = data(512)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, lr=0.02, optimizer="adam", compression=codec) for m in models]
    sent = []
    try:
        wait_until(lambda: in_sync(c) and len(copies(c)) == 2, timeout_s=20, what="backups to be filled")
        for ps in c.servers:        # what each primary hands its replicator, as the wire sends it
            for k, r in ps.host.replicators.items():
                real = r.start
                r.start = lambda u, real=real: sent.append(u.exact) or real(u)
        train_all(trainers, models, x, y, epochs=2)
        got = copies(c)
        for k in (0, 1):
            assert got[k]["primary"] == got[k]["backup"], f"shard {k} copies differ"
        assert len(sent) > 20 and set(sent) == {"bfloat16" if codec == "bf16" else "float16"}
    finally:
        for t in trainers:
            t.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killing_a_primary_promotes_its_backup_and_loses_nothing(cluster_factory, mode):
    c = cluster_factory(2, mode=mode, lease_seconds=1.0)
    size, batch, epochs = 1024, 16, 4
    x, y = data(size)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02) for m in models]
    steps, marks = [0], {}
    lock = threading.Lock()

    def on_step():
        with lock:
            steps[0] += 1
            if "killed" in marks and "next" not in marks:
                marks["next"] = time.monotonic()
    try:
        wait_until(lambda: in_sync(c), timeout_s=20, what="backups to be filled")

        def killer():
            wait_until(lambda: steps[0] >= 60, timeout_s=60, what="training to be under way")
            victim = c.chief.state.routing[0]
            i = next(i for i, s in enumerate(c.servers) if s.chief.member_id == victim)
            marks["killed"] = time.monotonic()
            c.kill_ps(i)

        run_threads(lambda: train_all(trainers, models, x, y, epochs, batch, on_step), killer, timeout_s=120)
        gap = marks["next"] - marks["killed"]
        print(f"{mode}: first step completed {gap:.2f}s after the primary died (lease 1.0s)")
        assert gap < 5.0
        survivor = next(s for s in c.servers if not getattr(s, "killed", False))
        assert survivor.host.promotions == 1
        assert sorted(survivor.host.shards) == [0, 1]
        # the workers went to the new primary: after a failed call (a failover), or, when the chief's new
        # view reached a worker before its next call did (a slow worker, a loaded host), by following it
        assert sum(t.failovers + t.routes.moves for t in trainers) >= 1
        assert_exactly_once(c, size, batch, epochs)   # no acknowledged batch lost, none applied twice
        for t in trainers:
            t.pull()
        assert F.cross_entropy(models[0](x), y).item() < 0.8
    finally:
        for t in trainers:
            t.close()


def test_a_new_server_becomes_the_backup_and_is_filled_while_training_goes_on(cluster_factory):
    from shoal.ps.server import PSServer

    c = cluster_factory(2, mode="async", lease_seconds=1.0)
    x, y = data(1024)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02) for m in models]
    steps = [0]
    try:
        wait_until(lambda: in_sync(c), timeout_s=20, what="backups to be filled")

        def churn():
            wait_until(lambda: steps[0] >= 40, timeout_s=60, what="training")
            c.kill_ps(1)
            wait_until(lambda: all(r.backup_id == "" for r in c.chief.state.view().routes), timeout_s=10,
                       what="the chief to promote")
            before = steps[0]
            c.servers.append(PSServer(c.chief_address, bind="127.0.0.1:0").start())
            wait_until(lambda: in_sync(c) and all(r.backup_id for r in c.chief.state.view().routes),
                       timeout_s=20, what="the new server to hold both backups")
            wait_until(lambda: steps[0] > before + 10, timeout_s=10, what="training to go on")   # not paused

        def tick():
            steps[0] += 1
        run_threads(lambda: train_all(trainers, models, x, y, 4, on_step=tick), churn, timeout_s=120)
        got = copies(c)
        assert all(got[k]["primary"] == got[k]["backup"] for k in (0, 1)), got
        assert_exactly_once(c, 1024, 16, 4)
    finally:
        for t in trainers:
            t.close()


def dead_address() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"     # closed again: nothing listens there


def test_a_primary_holds_updates_for_an_unreachable_backup_until_the_view_drops_it():
    import torch

    from shoal.settings.config import JobConfig, OptimizerSpec
    from shoal.proto import shoal_pb2 as pb
    from shoal.ps.host import ShardHost

    host = ShardHost()
    host.member_id = "ps-a"
    host.assign(0, JobConfig(mode="async"))
    shard, _ = host.create(0, torch.zeros(4), OptimizerSpec("sgd", {"lr": 0.1}), "fp")
    route = pb.ShardRoute(shard=0, primary_id="ps-a", backup_id="ps-b", backup_address=dead_address())
    host.set_view(frozenset({"w"}), 0, [route])
    r = host.replicators[0]
    wait_until(lambda: r.state == "installing", timeout_s=5, what="the replicator to aim at the backup")
    r._state = "in_sync"          # as if the copy had been made before the backup died
    done = threading.Event()
    threading.Thread(target=lambda: (shard.push("w", 0, torch.ones(4)), done.set()), daemon=True).start()
    wait_until(lambda: shard.version == 1, timeout_s=5, what="the primary's own step (while the update travels)")
    pulled = []
    threading.Thread(target=lambda: pulled.append(shard.snapshot()), daemon=True).start()
    time.sleep(0.3)
    assert not done.is_set() and pulled == []                # neither acknowledged nor seen without the backup
    t0 = time.monotonic()
    host.set_view(frozenset({"w", "w2"}), 0, [route])        # other view changes still get through
    assert time.monotonic() - t0 < 1.0
    host.set_view(frozenset({"w", "w2"}), 0, [pb.ShardRoute(shard=0, primary_id="ps-a")])   # backup dropped
    assert done.wait(5) and shard.version == 1
    wait_until(lambda: pulled, timeout_s=5, what="the pull")
    assert pulled[0][0] == 1
    host.close()


def test_a_primary_the_chief_cannot_reach_either_is_replaced_before_its_lease_ends(cluster_factory):
    c = cluster_factory(2, mode="async", lease_seconds=6.0)      # waiting out the lease would take 6 s
    x, y = data(1024)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02) for m in models]
    steps, marks = [0], {}

    def on_step():
        steps[0] += 1
    try:
        wait_until(lambda: in_sync(c), timeout_s=20, what="backups to be filled")

        def killer():
            wait_until(lambda: steps[0] >= 60, timeout_s=60, what="training to be under way")
            shard = c.servers[0].host.assigned and min(c.servers[0].host.assigned)
            at = c.servers[0].host.shards[shard].version
            marks["killed"] = time.monotonic()
            c.kill_ps(0)
            survivor = c.servers[1].host

            def applied_on_new_primary():   # the next accepted push on the killed primary's shard
                s = survivor.shards.get(shard)
                return survivor.roles.get(shard) == "primary" and s is not None and s.version > at
            wait_until(applied_on_new_primary, timeout_s=30, interval_s=0.005, what="the new primary")
            marks["next"] = time.monotonic()

        run_threads(lambda: train_all(trainers, models, x, y, 4, on_step=on_step), killer, timeout_s=120)
        gap = marks["next"] - marks["killed"]
        print(f"next update on the dead primary's shard {gap:.2f}s after it died (lease 6 s)")
        assert gap < 2.0
        assert_exactly_once(c, 1024, 16, 4)
    finally:
        for t in trainers:
            t.close()


def test_a_report_about_a_live_server_changes_nothing(cluster_factory):
    from shoal.proto import shoal_pb2 as pb

    c = cluster_factory(2, mode="async", lease_seconds=6.0)
    victim = c.servers[0].chief.member_id
    reply = c.chief.servicer.ReportUnreachable(pb.UnreachableReport(reporter_id="w", member_id=victim), None)
    assert not reply.expired and c.chief.state.members.get(victim).live


def test_a_member_whose_view_watch_breaks_off_is_dropped_after_a_third_of_its_lease(cluster_factory):
    c = cluster_factory(1, lease_seconds=6.0)
    t = Trainer(mlp(0), chief=c.chief_address)
    try:
        wid = t.member_id
        wait_until(lambda: c.chief.state.members.get(wid).live, timeout_s=5, what="the worker to join")
        t.chief.close()                       # heartbeats and the watch stop, no Leave: as if it died
        t0 = time.monotonic()                 # (close waits for the threads; the watch breaks at its end)
        wait_until(lambda: not c.chief.state.members.get(wid).live, timeout_s=6, what="the worker to expire")
        assert time.monotonic() - t0 < 3.5    # a third of the lease (2 s) plus a tick, not the whole 6 s
    finally:
        t._pool.shutdown(wait=False)
        for client in t._clients.values():
            client.close()
