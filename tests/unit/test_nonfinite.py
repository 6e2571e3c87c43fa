"""Gradients and updates holding NaN/Inf are never applied; the job's --nonfinite policy says what the worker hears."""
import math

import pytest
import torch

from shoal.state import convert
from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.errors import InvalidArgument
from shoal.ps.consistency import AsyncRule, SyncRule
from shoal.ps.shard import NONFINITE_STREAK, Shard
from shoal.ps.update import Update, count_nonfinite

SGD = OptimizerSpec("sgd", {"lr": 1.0})


def shard(rule=None, policy="refuse", n=4):
    s = Shard(0, torch.zeros(n), SGD, rule or AsyncRule(), "fp")
    s.nonfinite = policy
    return s


def poisoned(value, n=4):
    g = torch.ones(n)
    g[1] = value
    return g


@pytest.mark.parametrize("value,want", [(1.0, 0), (math.nan, 1), (math.inf, 1), (-math.inf, 1)])
def test_count_nonfinite(value, want):
    assert count_nonfinite(poisoned(value)) == want


def test_finite_terms_whose_sum_overflows_are_finite():
    assert count_nonfinite(torch.full((8,), 3e38)) == 0
    assert count_nonfinite(torch.tensor([math.inf, -math.inf, math.nan, 0.0])) == 3
    assert count_nonfinite(torch.empty(0)) == 0


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_refuse_never_applies_counts_per_worker_and_fails_a_worker_that_keeps_at_it(value):
    s = shard(policy="refuse")
    for k in range(NONFINITE_STREAK):
        r = s.push("a", 0, poisoned(value), key=f"k{k}")
        assert not r.accepted and r.duplicate and "non-finite" in r.reason
    with pytest.raises(InvalidArgument, match="in a row.*--nonfinite refuse"):
        s.push("a", 0, poisoned(value), key="last")
    assert s.version == 0 and torch.equal(s.values(), torch.zeros(4))
    assert s.nonfinite_counts() == {"a": NONFINITE_STREAK + 1}


def test_refuse_streak_restarts_after_an_applied_gradient():
    s = shard(policy="refuse")
    for round_ in range(3):
        for k in range(NONFINITE_STREAK):
            assert not s.push("a", s.version, poisoned(math.nan), key=f"{round_}.{k}").accepted
        assert s.push("a", s.version, torch.ones(4), key=f"{round_}.ok").accepted
    assert s.version == 3 and torch.equal(s.values(), torch.full((4,), -3.0))
    assert s.nonfinite_counts() == {"a": 3 * NONFINITE_STREAK}


def test_skip_never_fails_the_worker_and_stop_fails_it_at_once():
    s = shard(policy="skip")
    for k in range(3 * NONFINITE_STREAK):
        assert not s.push("a", 0, poisoned(math.nan), key=str(k)).accepted
    assert s.nonfinite_counts() == {"a": 3 * NONFINITE_STREAK}
    s = shard(policy="stop")
    with pytest.raises(InvalidArgument, match="--nonfinite stop"):
        s.push("a", 0, poisoned(math.inf))
    assert s.version == 0 and s.nonfinite_counts() == {"a": 1}


def test_a_poisoned_gradient_never_enters_a_sync_round():
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})
    assert s.push("a", 0, torch.ones(4)).accepted
    assert not s.push("b", 0, poisoned(math.nan)).accepted
    assert s.version == 0                                  # the round still waits for b's real gradient
    assert s.push("b", 0, torch.full((4,), 3.0)).accepted
    assert s.version == 1 and torch.equal(s.values(), torch.full((4,), -2.0))


def test_the_warning_is_logged_once_per_worker(caplog):
    s = shard(policy="skip")
    for w in ("a", "a", "b", "a", "b"):
        s.push(w, 0, poisoned(math.nan))
    lines = [r for r in caplog.records if "non-finite" in r.getMessage()]
    assert [r.getMessage().split("gradient of ")[1].split()[0] for r in lines] == ["a", "b"]


def test_a_backup_refuses_a_poisoned_update():
    s = shard()
    with pytest.raises(InvalidArgument, match="non-finite"):
        s.apply_replica(Update(1, poisoned(math.nan)))
    assert s.version == 0 and torch.equal(s.values(), torch.zeros(4))
    assert s.apply_replica(Update(1, torch.ones(4))) == 1


def test_the_policy_is_a_validated_job_setting_that_travels_in_the_view():
    assert JobConfig().nonfinite == "skip"          # one NaN batch is skipped and counted, not a failed run
    with pytest.raises(InvalidArgument, match="--nonfinite 'ignore' is not one of refuse, skip, stop"):
        JobConfig(nonfinite="ignore")
    job = JobConfig(nonfinite="skip")
    assert convert.job_from_pb(convert.job_to_pb(job)) == job


def test_shoal_status_shows_the_refused_pushes_per_worker():
    from shoal.cli.status import render

    shard_row = {"shard": 0, "primary": "ps-0", "backup": "", "backup_state": "none", "version": 5, "applied": 9,
                 "dropped": 0, "ledger": [], "nonfinite": {"worker-1": 4}}
    s = {"mode": "sync", "view_epoch": 3, "ready": True, "epochs": {"completed": 0, "total": 1},
         "tasks": {"done": 1, "total": 4, "queue_depth": 3}, "totals": {"steps": 9}, "members": [],
         "shards": [shard_row]}
    assert "pushes refused for NaN/Inf: worker-1 4 (shard 0)" in render(s)
    shard_row["nonfinite"] = {}
    assert "NaN" not in render(s)
