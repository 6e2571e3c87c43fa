"""The change log behind delta pulls: which elements changed after a version, never missing one."""
import numpy as np
import torch

from shoal.settings.config import OptimizerSpec
from shoal.ps.changes import ChangeLog, leaves_zeros_alone
from shoal.ps.consistency import AsyncRule
from shoal.ps.shard import Shard

SGD = OptimizerSpec("sgd", {"lr": 1.0})


def sparse(n: int, idx: list[int], value: float = 1.0) -> torch.Tensor:
    g = torch.zeros(n)
    g[idx] = value
    return g


def test_only_optimizers_that_leave_zero_gradients_alone_are_tracked():
    assert leaves_zeros_alone(SGD)
    assert not leaves_zeros_alone(OptimizerSpec("sgd", {"lr": 1.0, "momentum": 0.9}))
    assert not leaves_zeros_alone(OptimizerSpec("sgd", {"lr": 1.0, "weight_decay": 1e-4}))
    assert not leaves_zeros_alone(OptimizerSpec("adam", {"lr": 1e-3}))


def test_a_new_log_answers_its_first_pull_in_full_then_lists_what_sparse_updates_touched():
    log = ChangeLog(100, version=4, optimizer=SGD)
    assert log.changed_since(4, 4) is None                 # another copy's version 4 may differ
    log.record(5, sparse(100, [3, 7]), sparse=True)
    log.record(6, sparse(100, [7, 50]), sparse=True)
    assert log.changed_since(5, 6).tolist() == [7, 50]
    assert log.changed_since(6, 6).tolist() == []
    assert log.changed_since(4, 6) is None                 # from before the log began
    assert log.changed_since(7, 6) is None                 # the client is ahead: this server went back


def test_a_dense_update_or_an_untracked_optimizer_makes_earlier_versions_full():
    log = ChangeLog(100, version=0, optimizer=SGD)
    log.record(1, sparse(100, [1]), sparse=True)
    log.record(2, torch.ones(100), sparse=False)           # a dense push
    assert log.changed_since(1, 2) is None
    assert log.changed_since(2, 2).tolist() == []
    log.record(3, sparse(100, list(range(60))), sparse=True)   # "sparse", but most of the shard
    assert log.changed_since(2, 3) is None
    adam = ChangeLog(100, version=0, optimizer=OptimizerSpec("adam", {"lr": 1e-3}))
    adam.record(1, sparse(100, [1]), sparse=True)
    assert adam.changed_since(0, 1) is None and adam.changed_since(1, 1).tolist() == []


def test_a_shards_delta_rebuilds_exactly_the_weights_a_full_pull_gives():
    rng = np.random.default_rng(0)
    n = 5003
    shard = Shard(0, torch.randn(n), SGD, AsyncRule(), "fp")
    shard.push("w", 0, sparse(n, [0]), key="first", sparse=True)
    held, held_at = shard.values(), shard.version         # a full pull at version 1
    for step in range(6):
        idx = rng.choice(n, 40, replace=False).tolist()
        shard.push("w", shard.version, sparse(n, idx, float(step + 1)), key=f"k{step}", sparse=True)
        if step % 2:                                        # the worker pulls every other version
            version, changed, values = shard.delta("none", held_at)
            held[torch.from_numpy(changed).long()] = torch.from_numpy(np.frombuffer(values, np.float32))
            held_at = version
            assert torch.equal(held, shard.values())
    assert shard.delta("none", 0) is None                   # version 0 came before this copy's log
    version, changed, _ = shard.delta("bf16", held_at)
    assert version == held_at and len(changed) == 0


def test_a_delta_since_a_recent_version_is_the_union_of_what_the_updates_after_it_touched(monkeypatch):
    from shoal.ps import changes

    touched = {v: np.sort(np.random.default_rng(v).choice(1000, 30, replace=False)) for v in range(1, 9)}

    def log_of_updates() -> ChangeLog:
        log = ChangeLog(1000, version=0, optimizer=SGD)
        for v in range(1, 9):
            log.record(v, None, True, torch.from_numpy(touched[v]))
        return log
    with monkeypatch.context() as m:
        m.setattr(changes, "RECENT_ENTRIES", 0.0)            # nothing kept: every delta scans
        scanning = log_of_updates()
        scanned = {since: scanning.changed_since(since, 8) for since in range(1, 9)}

    def no_scan(*a, **kw):
        raise AssertionError("a delta since a recent version scanned the shard")
    recent = log_of_updates()
    monkeypatch.setattr(changes.np, "flatnonzero", no_scan)
    for since in range(1, 9):
        got = recent.changed_since(since, 8)
        want = np.unique(np.concatenate([touched[v] for v in range(since + 1, 9)] or [np.empty(0, int)]))
        assert got.dtype == np.int32 and got.tolist() == want.tolist() == scanned[since].tolist()
