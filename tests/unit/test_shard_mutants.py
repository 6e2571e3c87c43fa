"""Shard behaviour the other shard tests let through (found by mutation testing, ``make mutate``).

Pure state, no sockets, no sleeps: a fake clock where time matters, an event where a thread must be
waiting. Each test names the behaviour it pins; bench/RESULTS.md lists the mutants they kill and
the ones left (equivalent, or a tuning constant no test should pin).
"""
from __future__ import annotations

import logging
import math
import threading

import pytest
import torch

from shoal.settings.config import OptimizerSpec
from shoal.errors import HANDED_OVER, NOT_PRIMARY, FailedPrecondition, InvalidArgument, ResourceExhausted
from shoal.ps import shard as shard_module
from shoal.ps.consistency import AsyncRule, SSPRule, SyncRule
from shoal.ps.ledger import BatchKey
from shoal.ps.shard import Shard
from shoal.ps.sparse import SparseGrad
from shoal.ps.update import Update

SGD = OptimizerSpec("sgd", {"lr": 1.0})


def shard(rule=None, n=4, **kw) -> Shard:
    return Shard(0, torch.zeros(n), SGD, rule or AsyncRule(), "fp", **kw)


def ones(v, n=4) -> torch.Tensor:
    return torch.full((n,), float(v))


def at(n: int, idx, value: float = 1.0) -> torch.Tensor:
    g = torch.zeros(n)
    g[list(idx)] = value
    return g


class StillClock:
    """A clock that never moves and fails loudly once polled more than ``limit`` times: a push that
    spins on it instead of waiting (or giving up) raises AssertionError instead of hanging."""

    def __init__(self, limit: int = 20, now: float = 1000.0):
        self.now, self.limit, self.calls = now, limit, 0
        self.polled_twice = threading.Event()

    def __call__(self) -> float:
        self.calls += 1
        if self.calls >= 2:
            self.polled_twice.set()
        if self.calls > self.limit:
            raise AssertionError(f"the shard read the clock {self.calls} times: it spins")
        return self.now


# ---------------------------------------------------------------- construction and counters

def test_a_shard_takes_only_a_one_dimensional_float32_tensor():
    for bad in (torch.zeros(2, 2), torch.zeros(4, dtype=torch.float64)):
        with pytest.raises(InvalidArgument, match="1-D float32"):
            Shard(0, bad, SGD, AsyncRule(), "fp")
    assert shard().numel == 4


def test_stats_count_from_zero_each_push_applied_dropped_and_update_once():
    s = shard(SyncRule())
    st = s.stats
    assert (st.pushes_applied, st.pushes_dropped, st.updates, st.sparse_updates, st.nonfinite) == (0, 0, 0, 0, {})
    s.set_live_workers({"a", "b"})
    s.push("a", 0, ones(1), key="a1", batch=BatchKey(0, 0))
    assert (st.pushes_applied, st.pushes_dropped, st.updates) == (1, 0, 0)
    assert not s.push("a", 0, ones(1), key="a1x").accepted            # the rule drops it: already pushed
    assert (st.pushes_applied, st.pushes_dropped, st.updates) == (1, 1, 0)
    s.push("b", 0, ones(1), key="b1", batch=BatchKey(0, 8))
    assert (st.pushes_applied, st.pushes_dropped, st.updates) == (2, 1, 1)
    assert not s.push("a", 1, ones(1), key="a2", batch=BatchKey(0, 0)).accepted   # a batch applied before
    assert (st.pushes_applied, st.pushes_dropped, st.updates, st.sparse_updates) == (2, 2, 1, 0)

    a = shard()
    a.push("w", 0, SparseGrad(torch.tensor([1, 3]), torch.tensor([1.0, 2.0]), 4))
    assert (a.stats.pushes_applied, a.stats.updates, a.stats.sparse_updates) == (1, 1, 1)
    assert torch.equal(a.values(), torch.tensor([0.0, -1.0, 0.0, -2.0]))


def test_worker_clocks_start_at_zero_and_count_the_updates_each_worker_was_in():
    s = shard()
    s.set_live_workers({"a", "b"})
    assert s.worker_clocks() == {"a": 0, "b": 0}
    s.push("a", 0, ones(1))
    s.push("c", 1, ones(1))                                  # not (yet) a live worker: counted from 0 too
    assert s.worker_clocks() == {"a": 1, "b": 0, "c": 1}


# ---------------------------------------------------------------- waiting pushes

def test_a_push_that_must_wait_with_no_time_left_fails_at_once():
    clock = StillClock()
    s = shard(SSPRule(staleness=0), clock=clock)
    s.set_live_workers({"a", "b"})
    s.push("a", 0, ones(1))
    with pytest.raises(ResourceExhausted, match="more than 0 ahead"):
        s.push("a", 1, ones(1), wait_s=0.0)                  # b has not moved and no time is left
    assert s.version == 1


def test_a_waiting_push_with_time_left_blocks_until_the_state_changes_without_spinning():
    clock = StillClock()
    s = shard(SSPRule(staleness=0), clock=clock)
    s.set_live_workers({"a", "b"})
    s.push("a", 0, ones(1))
    clock.calls, clock.polled_twice = 0, threading.Event()   # count this push's reads only
    got: list = []

    def ahead():
        try:
            got.append(s.push("a", 1, ones(1), wait_s=0.5))  # half a second to spare: it waits
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            got.append(exc)
    t = threading.Thread(target=ahead)
    t.start()
    assert clock.polled_twice.wait(5), "the push never computed its time left"
    s.push("b", 1, ones(1))                                  # the slowest moves: a may go
    t.join(5)
    assert not t.is_alive()
    assert len(got) == 1 and not isinstance(got[0], Exception), got
    assert got[0].accepted and s.version == 3


# ---------------------------------------------------------------- idempotency keys and batches

def test_the_newest_keys_are_remembered_and_the_oldest_forgotten_first(monkeypatch):
    monkeypatch.setattr(shard_module, "KEY_MEMORY", 2)
    s = shard()
    for k in ("k1", "k2", "k3"):
        assert s.push("a", s.version, ones(1), key=k).accepted
    assert s.push("a", 3, ones(1), key="k2").duplicate       # the latest two are remembered
    assert s.push("a", 3, ones(1), key="k3").duplicate
    assert s.version == 3
    again = s.push("a", 3, ones(1), key="k1")                # the oldest was forgotten: applied again
    assert again.accepted and not again.duplicate and s.version == 4


def test_a_refused_accumulated_push_names_the_first_of_its_batches_that_was_applied():
    s = shard()
    b0, b8 = BatchKey(0, 0), BatchKey(0, 8)
    s.push("a", 0, ones(1), key="k0", batch=b0)
    s.push("a", 1, ones(1), key="k8", batch=b8)
    r = s.push("b", 2, ones(1), key="kb", batches=(b0, b8))
    assert not r.accepted and r.duplicate and r.applied == (b0, b8)
    assert r.reason == "batch 0/0 was applied by push k0"


# ---------------------------------------------------------------- gradients: copies, sparsity, hparams

def test_a_sync_round_never_modifies_gradients_their_callers_still_own():
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})
    ga, gb = ones(1), ones(3)
    s.push("a", 0, ga)
    s.push("b", 0, gb)
    assert s.version == 1 and torch.equal(s.values(), ones(-2))
    assert torch.equal(ga, ones(1)) and torch.equal(gb, ones(3))


def test_a_gradient_applied_alone_or_handed_over_is_stepped_with_as_it_is_not_copied():
    s = shard()                                              # async: each push is applied alone
    s.replicator = (updates := []).append
    g = ones(1)
    s.push("a", 0, g)
    assert updates[-1].grad is g
    r = shard(SyncRule())                                    # a sync round given the first gradient
    r.replicator = updates.append
    r.set_live_workers({"a", "b"})
    mine = ones(1)
    r.push("a", 0, mine, owned=True)
    r.push("b", 0, ones(3), owned=True)
    assert updates[-1].grad is mine and torch.equal(mine, ones(2))   # summed and averaged in place


def test_a_push_not_declared_sparse_makes_the_next_delta_a_full_pull():
    s = shard(n=100)
    s.push("a", 0, at(100, [0]), sparse=True)
    s.push("a", 1, at(100, [5]), sparse=True)
    assert s.delta("none", 1)[1].tolist() == [5]             # top-k pushes: only what they changed
    s.push("a", 2, at(100, [3]))                             # a dense push that happens to be nearly zero
    assert s.delta("none", 2) is None and s.delta("none", 1) is None


def test_a_round_with_any_dense_push_is_a_dense_update():
    s = shard(SyncRule(), n=100)
    s.replicator = (updates := []).append
    s.set_live_workers({"a", "b"})
    s.push("a", 0, at(100, [1]), sparse=True)
    s.push("b", 0, at(100, [2]), sparse=True)
    s.push("a", 1, at(100, [3]), sparse=True)
    s.push("b", 1, at(100, [4]))
    assert [u.sparse for u in updates] == [True, False]


def test_a_delta_pull_larger_than_the_weights_is_answered_in_full():
    s = shard(n=100)
    s.push("a", 0, at(100, [0]), sparse=True)                # version 1: the log covers pulls since 1
    for v, first in enumerate((1, 25, 49, 73), start=1):     # 4 updates of 24 elements each
        s.push("a", v, at(100, range(first, first + 24)), sparse=True)
    s.push("a", 5, at(100, [97, 98]), sparse=True)
    assert s.delta("none", 5)[1].tolist() == [97, 98]        # 2 of 100: 16 bytes against 400
    assert s.delta("none", 1) is None                        # 98 of 100: 784 bytes against 400


def test_the_hyper_parameters_a_push_carries_are_the_ones_its_update_steps_with():
    s = shard()
    s.push("a", 0, ones(1), hparams={"0.lr": 0.5})
    assert torch.equal(s.values(), ones(-0.5)) and s.applied_hparams["0.lr"] == 0.5
    s.push("a", 1, ones(1))                                  # none carried: the last ones stay
    assert torch.equal(s.values(), ones(-1.0)) and s.applied_hparams["0.lr"] == 0.5


def test_a_backup_takes_a_resent_update_at_its_version_as_a_no_op():
    backup = shard()
    u = Update(1, ones(1))
    assert backup.apply_replica(u) == 1
    assert backup.apply_replica(u) == 1                      # sent again (a retry): nothing happens
    assert torch.equal(backup.values(), ones(-1)) and backup.stats.updates == 1
    with pytest.raises(FailedPrecondition, match="needs a fresh copy"):
        backup.apply_replica(Update(3, ones(1)))


# ---------------------------------------------------------------- replication failures and fencing

def failing(exc: Exception, before=lambda: None):
    def replicate(update):
        before()
        raise exc
    return replicate


def shard_records(caplog):
    return [r for r in caplog.records if r.name == shard_module.__name__ and "cannot replicate" in r.getMessage()]


def test_a_replication_failure_fences_the_copy_and_logs_an_error_naming_the_cause(caplog):
    caplog.set_level(logging.INFO, logger=shard_module.__name__)
    s = shard()
    s.replicator = failing(RuntimeError("backup unreachable"))
    with pytest.raises(RuntimeError, match="backup unreachable"):
        s.push("a", 0, ones(1))
    assert s.version == 0 and s.fenced == "backup unreachable"
    [rec] = shard_records(caplog)
    assert rec.levelno == logging.ERROR and "backup unreachable" in rec.getMessage()
    with pytest.raises(FailedPrecondition, match=NOT_PRIMARY):
        s.push("a", 0, ones(1))


def test_a_copy_handed_over_to_its_backup_logs_the_refusal_as_routine(caplog):
    caplog.set_level(logging.INFO, logger=shard_module.__name__)
    s = shard()
    s.replicator = failing(FailedPrecondition(f"shard 0 was {HANDED_OVER}"))
    with pytest.raises(FailedPrecondition, match=HANDED_OVER):
        s.push("a", 0, ones(1))
    [rec] = shard_records(caplog)
    assert rec.levelno == logging.INFO and s.version == 0


def test_a_copy_the_view_moved_while_its_update_was_on_the_way_refuses_as_not_primary(caplog):
    """The fence (set without the lock) names the planned move before the replicator's own error."""
    caplog.set_level(logging.INFO, logger=shard_module.__name__)
    s = shard()

    def moved():
        s.fenced = f"moved to ps-1 ({HANDED_OVER})"
    s.replicator = failing(RuntimeError("stream closed"), before=moved)
    with pytest.raises(FailedPrecondition, match=NOT_PRIMARY):
        s.push("a", 0, ones(1))
    [rec] = shard_records(caplog)
    assert rec.levelno == logging.INFO and s.version == 0 and HANDED_OVER in s.fenced


def test_a_second_fence_keeps_the_first_reason():
    s = shard()
    s.fence("ps-1 is primary now")
    s.fence("ps-2 is primary now")
    assert s.fenced == "ps-1 is primary now"
    with pytest.raises(FailedPrecondition, match="ps-1 is primary now"):
        s.push("a", 0, ones(1))


def test_a_round_closed_by_membership_or_thaw_that_cannot_replicate_fences_without_raising():
    for close in ("membership", "thaw"):
        s = shard(SyncRule())
        s.set_live_workers({"a", "b"})
        s.replicator = failing(RuntimeError("backup down"))
        s.push("a", 0, ones(1))
        if close == "membership":
            s.set_live_workers({"a"})                        # b left: the round is complete
        else:
            s.freeze(0)
            s.set_live_workers({"a"})
            s.thaw()
        assert s.fenced == "backup down" and s.version == 0, close


# ---------------------------------------------------------------- freeze / thaw

def test_a_hold_that_reaches_its_end_lets_a_push_through_at_once(clock):
    s = shard(clock=clock)
    s.freeze(0, hold_s=5.0)
    clock.advance(5.0)                                       # exactly the hold: it is over
    assert s.push("a", 0, ones(1), wait_s=0.0).accepted and s.version == 1


def test_thaw_returns_how_long_the_shard_was_held_from_the_first_freeze(clock):
    s = shard(clock=clock)
    s.freeze(0, hold_s=60.0)
    clock.advance(5.0)
    s.freeze(0, hold_s=60.0)                                 # held again (a retried freeze): still held since the first
    clock.advance(5.0)
    assert s.thaw() == 10.0
    assert s.thaw() == 0.0


# ---------------------------------------------------------------- checkpoints and digests

def test_an_exported_shard_starts_where_it_was_placed_in_the_flat_model():
    assert (shard().export_state().start, shard().export_state().stop) == (0, 4)
    placed = Shard(0, torch.zeros(4), SGD, AsyncRule(), "fp", flat_start=10)
    assert (placed.export_state().start, placed.export_state().stop) == (10, 14)
    assert placed.export_state(start=20).start == 20


def test_the_digest_covers_the_optimizer_state_to_the_last_bit():
    momentum = OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9})
    s = Shard(0, torch.zeros(4), momentum, AsyncRule(), "fp")
    s.push("a", 0, ones(0.3))                                # momentum 0.3: printed as 0.3000
    same = Shard.from_state(s.export_state(), AsyncRule(), "fp")
    assert same.digest() == s.digest()
    state = s.export_state()
    state.opt_state["state"][0]["momentum_buffer"][2] += 1e-5      # invisible at print precision
    other = Shard.from_state(state, AsyncRule(), "fp")
    assert torch.equal(other.values(), s.values())
    assert other.digest()[0] == s.digest()[0] and other.digest()[1] != s.digest()[1]


# ---------------------------------------------------------------- NaN/Inf: what each --nonfinite policy does

def poisoned(n=4) -> torch.Tensor:
    g = torch.ones(n)
    g[1] = math.nan
    return g


def test_refuse_fails_the_fourth_non_finite_push_in_a_row_as_the_readme_says():
    s = shard()
    assert s.nonfinite == "refuse"
    for k in (1, 2, 3):                                      # README: "after 3 in a row the worker's push fails"
        r = s.push("a", 0, poisoned())
        assert (r.accepted, r.duplicate, r.version) == (False, True, 0) and "non-finite" in r.reason
        assert s.nonfinite_counts() == {"a": k}
    with pytest.raises(InvalidArgument, match="4 such push"):
        s.push("a", 0, poisoned())
    assert s.nonfinite_counts() == {"a": 4} and s.stats.nonfinite == {"a": 4} and s.version == 0


def test_skip_never_fails_the_worker_and_stop_fails_its_first_push():
    s = shard()
    s.nonfinite = "skip"
    for _ in range(5):
        r = s.push("a", 0, poisoned())
        assert not r.accepted and r.duplicate
    assert s.nonfinite_counts() == {"a": 5}
    s = shard()
    s.nonfinite = "stop"
    with pytest.raises(InvalidArgument, match="1 such push.*--nonfinite stop"):
        s.push("a", 0, poisoned())


def test_a_workers_first_non_finite_push_is_logged_and_the_next_ones_are_not(caplog):
    caplog.set_level(logging.WARNING, logger=shard_module.__name__)
    s = shard()
    s.nonfinite = "skip"

    def warnings():
        return [r for r in caplog.records if "non-finite" in r.getMessage()]
    s.push("a", 0, poisoned())
    assert len(warnings()) == 1
    s.push("a", 0, poisoned())
    s.push("a", 0, poisoned())
    assert len(warnings()) == 1
