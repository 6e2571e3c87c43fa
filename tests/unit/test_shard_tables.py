"""A shard's table partitions in its rounds (ps/shard_tables.py): rows summed and averaged like the dense
gradient, applied once per key, refused when non-finite or misplaced, and the same on a backup and a copy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.settings.config import OptimizerSpec
from shoal.errors import FailedPrecondition, InvalidArgument
from shoal.ps.consistency import AsyncRule, SyncRule
from shoal.ps.shard import Shard
from shoal.state.tables import partition_of

SGD = OptimizerSpec("sgd", {"lr": 1.0})
DIM = 3


def spec(name="emb", n=None, optimizer="sgd", lr=0.5):
    hyper = {"alpha": lr} if optimizer == "ftrl" else {"lr": lr}
    return {"name": name, "dim": DIM, "num_embeddings": n, "optimizer": optimizer, "hyper": hyper,
            "init_std": 1.0, "seed": 7, "evict_after_steps": None, "evict_min_count": 0}


def shard(rule, k=0, shards=2, **kw):
    s = Shard(k, torch.zeros(2), SGD, rule, "fp")
    s.declare_tables([spec(**kw)], shards)
    return s


def mine(k=0, shards=2, count=4, n=1000):
    ids = np.arange(n, dtype=np.int64)
    return ids[partition_of(ids, shards) == k][:count]


def rows(ids, value):
    return (("emb", ids, np.full((len(ids), DIM), value, np.float32)),)


def test_a_sync_round_sums_the_workers_row_gradients_per_id_and_divides_by_the_workers():
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})
    ids = mine()
    _, start = s.lookup_rows("emb", ids)
    assert s.push("a", 0, torch.ones(2), rows=rows(ids[:3], 1.0)).accepted and s.version == 0
    assert s.push("b", 0, torch.ones(2), rows=rows(ids[1:], 3.0)).accepted and s.version == 1
    _, now = s.lookup_rows("emb", ids)
    moved = (start - now) / 0.5                          # sgd, lr 0.5: the averaged gradient
    assert np.allclose(moved, np.array([[0.5], [2.0], [2.0], [1.5]]).repeat(DIM, 1))
    assert s.table_status()[0]["rows"] == 4


def test_a_retried_push_moves_its_rows_once_and_async_applies_each_push():
    s = shard(AsyncRule())
    s.set_live_workers({"a"})
    ids = mine()
    _, start = s.lookup_rows("emb", ids)
    for _ in range(2):
        s.push("a", 0, torch.zeros(2), key="k1", rows=rows(ids, 1.0))
    s.push("a", 1, torch.zeros(2), key="k2", rows=rows(ids[:1], 2.0))
    _, now = s.lookup_rows("emb", ids)
    assert np.allclose(start - now, np.array([[1.5], [0.5], [0.5], [0.5]]).repeat(DIM, 1))
    assert s.version == 2


def test_non_finite_rows_are_refused_like_a_dense_gradient_and_change_nothing():
    s = shard(AsyncRule())
    s.set_live_workers({"a"})
    ids = mine()
    before = s.digest()
    bad = np.ones((len(ids), DIM), np.float32)
    bad[2, 1] = np.nan
    r = s.push("a", 0, torch.zeros(2), rows=(("emb", ids, bad),))
    assert not r.accepted and "1 non-finite" in r.reason
    assert s.digest() == before and s.nonfinite_counts() == {"a": 1}


def test_rows_another_shard_holds_an_unknown_table_or_an_id_out_of_range_are_refused():
    s = shard(AsyncRule(), n=1000)
    s.set_live_workers({"a"})
    with pytest.raises(InvalidArgument, match="another shard holds"):
        s.push("a", 0, torch.zeros(2), rows=rows(mine(k=1), 1.0))
    with pytest.raises(InvalidArgument, match="no table 'other'"):
        s.push("a", 0, torch.zeros(2), rows=(("other", mine(), np.ones((4, DIM), np.float32)),))
    with pytest.raises(InvalidArgument, match="row id 5000 outside"):
        s.lookup_rows("emb", np.array([5000], np.int64))
    with pytest.raises(InvalidArgument, match="rows of 3"):
        s.push("a", 0, torch.zeros(2), rows=(("emb", mine(), np.ones((4, 2), np.float32)),))
    assert s.version == 0


def test_a_table_declared_again_must_match():
    s = shard(AsyncRule())
    assert s.declare_tables([spec()], 2) == []
    with pytest.raises(FailedPrecondition, match="is held on shard 0"):
        s.declare_tables([spec(lr=0.1)], 2)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam", "ftrl"])
def test_the_backup_and_a_copy_hold_the_primarys_rows_and_row_state(optimizer):
    primary, backup = shard(AsyncRule(), optimizer=optimizer), shard(AsyncRule(), optimizer=optimizer)
    primary.replicator = lambda u: backup.apply_replica(u)
    primary.set_live_workers({"a"})
    g = np.random.default_rng(0)
    for v in range(5):
        ids = np.sort(g.choice(mine(count=50), 10, replace=False))
        grads = g.standard_normal((10, DIM)).astype(np.float32)
        primary.push("a", v, torch.zeros(2), rows=(("emb", ids, grads),))
    assert primary.version == backup.version == 5
    assert primary.digest() == backup.digest()
    copy = Shard.from_replica(primary.export_replica(), AsyncRule())
    assert copy.digest() == primary.digest()
    assert copy.tables.specs() == primary.tables.specs()


def test_eviction_passes_run_on_primary_and_backup_alike():
    from shoal.ps.shard_tables import EVICT_EVERY

    def evicting():
        s = Shard(0, torch.zeros(2), SGD, AsyncRule(), "fp")
        s.declare_tables([{**spec(), "evict_after_steps": 8}], 2)
        return s
    primary, backup = evicting(), evicting()
    primary.replicator = lambda u: backup.apply_replica(u)
    primary.set_live_workers({"a"})
    early, late = mine(count=2)
    primary.push("a", 0, torch.zeros(2), rows=rows(np.array([early]), 1.0))
    for v in range(1, EVICT_EVERY):
        primary.push("a", v, torch.zeros(2), rows=rows(np.array([late]), 1.0) if v > EVICT_EVERY - 4 else ())
    assert primary.version == EVICT_EVERY
    assert primary.table_status()[0]["rows"] == 1          # the row not updated for 8 steps is gone
    assert primary.digest() == backup.digest()


def test_an_adam_table_steps_on_every_update_as_sparse_adam_does():
    """SparseAdam's step count is global: an update that brought this partition no rows still counts."""
    from shoal.ps.tables import initial_rows

    s = shard(AsyncRule(), optimizer="adam", lr=0.1)
    s.set_live_workers({"a"})
    mine0, other = mine(count=1), mine(k=1, count=1)
    n = int(max(mine0[0], other[0])) + 1
    emb = torch.nn.Embedding(n, DIM, sparse=True)
    with torch.no_grad():
        ids = np.array([mine0[0], other[0]])
        emb.weight[torch.from_numpy(ids)] = torch.from_numpy(initial_rows(7, ids, DIM, 1.0))
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    g = np.random.default_rng(1).standard_normal((3, DIM)).astype(np.float32)
    for step, (row, grad) in enumerate([(mine0, g[0]), (other, g[1]), (mine0, g[2])]):
        opt.zero_grad()
        (emb(torch.from_numpy(row)) * torch.from_numpy(grad)).sum().backward()
        opt.step()
        held = rows(row, 0.0) if row is mine0 else ()
        s.push("a", step, torch.zeros(2), rows=(("emb", row, grad[None, :]),) if held else ())
    _, got = s.lookup_rows("emb", mine0)
    torch.testing.assert_close(torch.from_numpy(got), emb.weight[torch.from_numpy(mine0)].detach())
