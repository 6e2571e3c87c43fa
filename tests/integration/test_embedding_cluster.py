"""Embedding tables served by the parameter servers, on an in-process cluster: a table no worker holds,
trained end to end; sync rounds; a user's nn.Embedding on the meta device; a primary killed mid-training."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness import run_threads, wait_until
from shoal.state.tables import partition_of
from shoal.worker import DistributedOptimizer, DistributedSampler, Trainer
from shoal.worker.embedding import ShardedEmbedding, ShardedEmbeddingBag

from test_cluster import assert_exactly_once

HUGE = 2 ** 40          # rows: 16 TiB at 4 floats a row, if anything allocated the table


def planted(n: int, seed: int = 0, features: int = 40):
    """Samples (id, target): ``features`` ids spread over [0, HUGE), each with its own target in [-1, 1]."""
    g = np.random.default_rng(seed)
    keys = g.choice(HUGE // 1024, features, replace=False).astype(np.int64) * 1024 + 7
    target = g.uniform(-1, 1, features).astype(np.float32)
    pick = g.integers(0, features, n)
    return torch.from_numpy(keys[pick]), torch.from_numpy(target[pick]), keys


class Ctr(torch.nn.Module):
    def __init__(self, table: torch.nn.Module, dim: int = 4, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = table
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


def loss_on(model, ids, y) -> float:
    with torch.no_grad():
        return F.mse_loss(model(ids), y).item()


def table_rows(c) -> dict[int, int]:
    """shard -> rows its primary holds, over all tables."""
    out = {}
    for ps in c.servers:
        if getattr(ps, "killed", False):
            continue
        for k, s in list(ps.host.shards.items()):
            if ps.host.roles.get(k) == "primary":
                out[k] = sum(t["rows"] for t in s.table_status())
    return out


@pytest.mark.parametrize("mode,transport", [("async", "tcp"), ("ssp", "tcp"), ("async", "grpc")])
def test_a_table_of_2_to_the_40_rows_trains_and_no_worker_holds_it(cluster_factory, mode, transport):
    c = cluster_factory(2, mode=mode, **({"staleness": 2} if mode == "ssp" else {}))
    ids, y, _ = planted(512)
    model = Ctr(ShardedEmbedding(HUGE, 4, optimizer="sgd", hyper={"lr": 0.2}, init_std=0.1))
    assert list(model.state_dict()) == ["head.weight", "head.bias"]       # the table is not the worker's
    t = Trainer(model, chief=c.chief_address, optimizer="sgd", lr=0.1, transport=transport)
    try:
        before = loss_on(model, ids, y)
        for xb, yb in t.batches((ids, y), batch_size=32, epochs=6, batches_per_task=4):
            t.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            t.step()
        t.pull()
        after = loss_on(model, ids, y)
        print(f"mse {before:.4f} -> {after:.4f}")
        assert after < 0.1 * before
        # every row the batches touched is held by the shard partition_of names, and nothing else
        want = np.bincount(partition_of(np.unique(ids.numpy()), 2), minlength=2)
        assert table_rows(c) == {0: int(want[0]), 1: int(want[1])}
        assert_exactly_once(c, 512, 32, 6)
        assert t.tables.rows_pushed > 0 and t.tables.rows_pulled > 0
    finally:
        t.close()


def test_sync_rounds_average_the_workers_row_gradients(cluster_factory):
    """Two workers push disjoint batches in a sync round: each row moves by lr * (sum of the pushes) / 2,
    as the dense average does; their models agree after the round."""
    c = cluster_factory(2, mode="sync")
    ids, y, _ = planted(256, seed=1)
    models = [Ctr(ShardedEmbeddingBag(HUGE, 4, mode="sum", optimizer="sgd", hyper={"lr": 0.5}, init_std=0.1), seed=s)
              for s in (0, 1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="sgd", lr=0.1) for m in models]

    def one(t, m):
        for xb, yb in t.batches((ids, y), batch_size=16, epochs=6, batches_per_task=2):
            t.zero_grad()
            F.mse_loss(m(xb.view(-1, 1)), yb).backward()
            t.step()
    try:
        before = loss_on(models[0], ids.view(-1, 1), y)
        run_threads(*[lambda t=t, m=m: one(t, m) for t, m in zip(trainers, models)], timeout_s=120)
        for t in trainers:
            t.pull()
        after = [loss_on(m, ids.view(-1, 1), y) for m in models]
        print(f"sync mse {before:.4f} -> {after}")
        assert after[0] == pytest.approx(after[1], rel=1e-6) and after[0] < 0.3 * before
        assert_exactly_once(c, 256, 16, 6)
    finally:
        for t in trainers:
            t.close()


def test_a_users_nn_embedding_on_meta_is_served_with_the_users_optimizer(cluster_factory):
    c = cluster_factory(2, mode="async")
    ids, y, _ = planted(256, seed=2)
    model = Ctr(torch.nn.Embedding(HUGE, 4, sparse=True, device="meta"))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.3)
    dist = DistributedOptimizer(opt, model, chief=c.chief_address)
    assert isinstance(model.emb, ShardedEmbedding) and model.emb.row_optimizer == "adagrad"
    assert all(p.device.type == "cpu" for g in dist.param_groups for p in g["params"])
    ds = torch.utils.data.TensorDataset(ids, y)
    sampler = DistributedSampler(ds, batch_size=32, epochs=5)
    loader = torch.utils.data.DataLoader(ds, batch_size=32, sampler=sampler)
    try:
        before = loss_on(model, ids, y)
        for _ in range(5):
            for xb, yb in loader:
                dist.zero_grad()
                F.mse_loss(model(xb), yb).backward()
                dist.step()
        dist.synchronize()
        after = loss_on(model, ids, y)
        print(f"meta nn.Embedding, Adagrad rows: mse {before:.4f} -> {after:.4f}")
        assert after < 0.2 * before
        spec = next(s for ps in c.servers for s in ps.host.shards.values()).tables.tables["emb"].spec
        assert spec.optimizer == "adagrad" and spec.hyper["lr"] == pytest.approx(0.3)
    finally:
        dist.close()


def test_a_forward_outside_a_job_says_what_serves_the_table():
    with pytest.raises(Exception, match="DistributedOptimizer"):
        ShardedEmbedding(10, 4)(torch.tensor([1]))


def _copies(c):
    out: dict = {}
    for ps in c.servers:
        if not getattr(ps, "killed", False):
            for k, s in list(ps.host.shards.items()):
                out.setdefault(k, {})[ps.host.roles[k]] = s.digest()
    return out


def test_a_primary_killed_mid_training_loses_no_acknowledged_row(cluster_factory):
    c = cluster_factory(2, mode="async", lease_seconds=1.0)
    size, batch, epochs = 640, 16, 4
    ids, y, _ = planted(size, seed=3)
    models = [Ctr(ShardedEmbedding(HUGE, 4, hyper={"lr": 0.2}, init_std=0.1), seed=s) for s in (0, 1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="sgd", lr=0.1) for m in models]
    steps, marks, lock = [0], {}, threading.Lock()

    def train(t, m):
        for xb, yb in t.batches((ids, y), batch_size=batch, epochs=epochs, batches_per_task=4):
            began = time.monotonic()
            t.zero_grad()
            F.mse_loss(m(xb), yb).backward()
            t.step()
            with lock:
                steps[0] += 1
                # the first step begun after the kill: its lookups and push reach every shard as they are now
                if "killed" in marks and began > marks["killed"] and "next" not in marks:
                    marks["next"] = time.monotonic()

    def killer():
        wait_until(lambda: steps[0] >= 40, timeout_s=60, what="training to be under way")
        victim = c.chief.state.routing[0]
        i = next(i for i, s in enumerate(c.servers) if s.chief.member_id == victim)
        marks["killed"] = time.monotonic()
        c.kill_ps(i)
    try:
        wait_until(lambda: all(r.state == "in_sync" for ps in c.servers for r in ps.host.replicators.values()),
                   timeout_s=20, what="backups to be filled")
        before = loss_on(models[0], ids, y)
        run_threads(*[lambda t=t, m=m: train(t, m) for t, m in zip(trainers, models)], killer, timeout_s=120)
        print(f"first step begun after the kill ended {marks['next'] - marks['killed']:.2f}s after the primary "
              f"died (lease 1.0s)")
        assert marks["next"] - marks["killed"] < 5.0
        survivor = next(s for s in c.servers if not getattr(s, "killed", False))
        assert survivor.host.promotions == 1 and sorted(survivor.host.shards) == [0, 1]
        assert_exactly_once(c, size, batch, epochs)
        for t in trainers:
            t.pull()
        assert loss_on(models[0], ids, y) < 0.2 * before
    finally:
        for t in trainers:
            t.close()


def test_backups_hold_the_same_rows_as_their_primaries(cluster_factory):
    c = cluster_factory(2, mode="async", lease_seconds=2.0)
    ids, y, _ = planted(256, seed=4)
    model = Ctr(ShardedEmbedding(None, 4, optimizer="adam", hyper={"lr": 0.05}))
    t = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.01)
    try:
        wait_until(lambda: all(r.state == "in_sync" for ps in c.servers for r in ps.host.replicators.values())
                   and len(_copies(c)) == 2, timeout_s=20, what="backups to be filled")
        for xb, yb in t.batches((ids, y), batch_size=16, epochs=2):
            t.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            t.step()
        got = _copies(c)
        for k in (0, 1):
            assert got[k]["primary"] == got[k]["backup"], f"shard {k}: the backup's rows differ"
        assert sum(table_rows(c).values()) == 40
    finally:
        t.close()


def test_status_and_metrics_show_each_tables_rows_and_memory(cluster_factory):
    from shoal.cli.status import collect, render
    from shoal.ps.telemetry import collector

    c = cluster_factory(2, mode="async", replicas=1)
    ids, y, _ = planted(128, seed=5)
    model = Ctr(ShardedEmbedding(HUGE, 4, hyper={"lr": 0.1}))
    t = Trainer(model, chief=c.chief_address, optimizer="sgd", lr=0.1)
    try:
        for xb, yb in t.batches((ids, y), batch_size=32, epochs=1):
            t.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            t.step()
        status = collect(c.chief_address)
        tables = {sh["shard"]: sh["tables"] for sh in status["shards"]}
        want = np.bincount(partition_of(np.unique(ids.numpy()), 2), minlength=2)     # the ids trained
        for k in (0, 1):
            (tab,) = tables[k]
            assert (tab["name"], tab["rows"], tab["dim"], tab["num_embeddings"]) == ("emb", want[k], 4, HUGE)
            assert tab["bytes"] >= tab["rows"] * tab["bytes_per_row"] > 0      # capacity grows by doubling
        text = render(status)
        assert f"emb              0      {want[0]:>12,}" in text and "1,099,511,627,776 x 4, sgd" in text
        families = {f.name: f for ps in c.servers for f in collector(ps.host)()}
        rows = {s.labels["shard"]: s.value for ps in c.servers for f in collector(ps.host)()
                if f.name == "shoal_table_rows" for s in f.samples}
        assert rows == {"0": want[0], "1": want[1]}
        assert "shoal_table_bytes" in families and "shoal_table_bytes_per_row" in families
    finally:
        t.close()


def test_sparse_adam_over_the_table_and_adam_over_the_rest_as_in_one_process(cluster_factory):
    from shoal.worker.embedding import table_options

    c = cluster_factory(2, mode="async")
    ids, y, _ = planted(256, seed=6)
    model = Ctr(table_options(torch.nn.Embedding(HUGE, 4, sparse=True, device="meta"), init_std=0.01))
    table_opt = torch.optim.SparseAdam([model.emb.weight], lr=0.05)
    dense_opt = torch.optim.Adam(model.head.parameters(), lr=0.01)
    opts = [DistributedOptimizer(table_opt, model, chief=c.chief_address),
            DistributedOptimizer(dense_opt, model, chief=c.chief_address)]
    try:
        spec = model.emb.table_name, model.emb.row_optimizer, model.emb.init_std
        assert spec == ("emb", "adam", 0.01)
        before = loss_on(model, ids, y)
        for xb, yb in opts[1].trainer.batches((ids, y), batch_size=32, epochs=4):
            for o in opts:
                o.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            for o in opts:
                o.step()
        opts[0].synchronize()
        after = loss_on(model, ids, y)
        print(f"SparseAdam rows + Adam dense: mse {before:.4f} -> {after:.4f}")
        assert after < 0.3 * before
        with pytest.raises(Exception, match="before the dense one"):
            DistributedOptimizer(torch.optim.SparseAdam([torch.nn.Embedding(3, 4, sparse=True, device="meta").weight]),
                                 model, chief=c.chief_address)
    finally:
        opts[1].close()


def test_a_hot_row_cache_serves_repeated_rows_in_async_and_is_refused_in_sync(cluster_factory):
    c = cluster_factory(2, mode="async", replicas=1)
    ids, y, _ = planted(512, seed=7)
    model = Ctr(ShardedEmbedding(HUGE, 4, hyper={"lr": 0.2}, init_std=0.1))
    t = Trainer(model, chief=c.chief_address, optimizer="sgd", lr=0.1, row_cache=1000, row_cache_steps=2)
    try:
        before = loss_on(model, ids, y)
        for xb, yb in t.batches((ids, y), batch_size=32, epochs=6):
            t.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            t.step()
        cache = t.tables.caches["emb"]
        assert cache.hits > cache.misses > 0            # 40 ids, each pulled again every 2 steps at most
        t.pull()
        assert loss_on(model, ids, y) < 0.2 * before
    finally:
        t.close()
    s = cluster_factory(1, mode="sync")
    with pytest.raises(Exception, match="sync job"):
        Trainer(Ctr(ShardedEmbedding(10, 4)), chief=s.chief_address, row_cache=10)


def test_rows_ride_the_jobs_token_a_lookup_without_it_is_refused():
    import grpc

    from harness import InProcessCluster
    from shoal.security import auth
    from shoal.net import frames
    from shoal.settings.config import JobConfig
    from shoal.proto import shoal_pb2 as pb
    from shoal.net.wire import DataStubs

    auth.use_token(b"0123456789abcdef-table-token")
    c = InProcessCluster(2, JobConfig(num_shards=2, mode="async"))
    try:
        ids, y, _ = planted(64, seed=8)
        model = Ctr(ShardedEmbedding(HUGE, 4, hyper={"lr": 0.1}))
        t = Trainer(model, chief=c.chief_address, optimizer="sgd", lr=0.1)
        for xb, yb in t.batches((ids, y), batch_size=16, epochs=1):
            t.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            t.step()
        assert sum(table_rows(c).values()) > 0
        t.close()
        raw = grpc.insecure_channel(c.servers[0].address)       # no token
        request = frames.pack(pb.RowsHeader(shard=0, table="emb", count=1), np.array([7], np.int64).tobytes())
        with pytest.raises(grpc.RpcError) as err:
            DataStubs(raw).lookup_rows(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        raw.close()
    finally:
        c.stop()
        auth.reset()


def test_prefetched_rows_serve_the_forward_in_async(cluster_factory):
    c = cluster_factory(2, mode="async", replicas=1)
    ids, y, _ = planted(256, seed=9)
    model = Ctr(ShardedEmbedding(HUGE, 4, hyper={"lr": 0.2}, init_std=0.1))
    t = Trainer(model, chief=c.chief_address, optimizer="sgd", lr=0.1)
    try:
        before, looked_up = loss_on(model, ids, y), 0
        for xb, yb in t.batches((ids, y), batch_size=32, epochs=10):
            model.emb.prefetch(xb)              # in a real loop: the next batch's, while this one computes
            looked_up += len(torch.unique(xb))
            t.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            t.step()
        assert t.tables.rows_prefetched == looked_up
        t.pull()
        assert loss_on(model, ids, y) < 0.3 * before
    finally:
        t.close()


def test_a_prefetch_from_before_a_sync_steps_update_is_not_used(cluster_factory):
    c = cluster_factory(2, mode="sync", replicas=1)
    ids, y, _ = planted(128, seed=10)
    model = Ctr(ShardedEmbedding(HUGE, 4, hyper={"lr": 0.5}, init_std=0.1))
    t = Trainer(model, chief=c.chief_address, optimizer="sgd", lr=0.1)
    try:
        it = iter(t.batches((ids, y), batch_size=32, epochs=1))
        xb, yb = next(it)
        model.emb.prefetch(xb)                  # at the version of the weights: used
        t.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        used = t.tables.rows_prefetched
        assert used == len(torch.unique(xb))
        model.emb.prefetch(xb)                  # before the step's update: stale once the step is done
        t.step()
        with torch.no_grad():
            after = model(xb)
            assert t.tables.rows_prefetched == used
            assert torch.equal(after, model(xb))
        for xb, yb in it:
            t.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            t.step()
    finally:
        t.close()
