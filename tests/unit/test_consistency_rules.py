"""The consistency rules as the pure functions they are: every boundary of admission and round closing.

The shard tests (test_shard_rounds.py) drive these rules through a shard; these pin each
comparison on both sides of its boundary, so an off-by-one (``>`` for ``>=``, ``<`` for ``<=``)
in a rule fails here by name.
"""
import pytest

from shoal.settings.config import JobConfig
from shoal.errors import InvalidArgument
from shoal.ps.consistency import Action, AsyncRule, PushContext, Rule, SSPRule, SyncRule, rule_for


def ctx(worker="a", push=3, shard=3, contributors=(), live=(), clocks=None):
    return PushContext(worker, push, shard, frozenset(contributors), frozenset(live), clocks or {})


@pytest.mark.parametrize("rule", [AsyncRule(), SSPRule(1), SyncRule()])
def test_a_push_computed_on_a_version_the_shard_has_not_reached_is_invalid(rule):
    assert rule.admit(ctx(push=3, shard=3)).action is Action.ACCUMULATE
    with pytest.raises(InvalidArgument, match="version 4, shard is at 3"):
        rule.admit(ctx(push=4, shard=3))


def test_async_accepts_any_older_version():
    assert AsyncRule().admit(ctx(push=0, shard=9)).action is Action.ACCUMULATE


def test_sync_drops_a_gradient_of_a_closed_round_and_a_second_one_in_the_same_round():
    rule = SyncRule()
    stale = rule.admit(ctx(push=2, shard=3))
    assert stale.action is Action.DROP and stale.reason.startswith("stale: round 2 closed, shard at 3")
    again = rule.admit(ctx(worker="a", contributors={"a"}, live={"a", "b"}))
    assert again.action is Action.DROP and "already pushed in round 3" in again.reason
    assert rule.admit(ctx(worker="b", contributors={"a"}, live={"a", "b"})).action is Action.ACCUMULATE


def test_sync_round_closes_with_every_live_worker_and_not_before():
    rule = SyncRule()
    assert not rule.round_complete(set(), {"a"})                    # nothing to apply
    assert rule.round_complete({"a"}, set())                        # nobody else to wait for
    assert rule.round_complete({"a", "b"}, {"a", "b"})
    assert rule.round_complete({"a", "b", "x"}, {"a", "b"})          # x left after pushing
    assert not rule.round_complete({"a"}, {"a", "b"})
    assert not rule.round_complete({"a", "x"}, {"a", "b"})           # x is not waited for, b is


def test_backup_workers_close_the_round_at_live_minus_b_and_never_at_zero():
    rule = SyncRule(backup_workers=1)
    live = {"a", "b", "c"}
    assert not rule.round_complete({"a"}, live)
    assert rule.round_complete({"a", "b"}, live)                    # 3 - 1 gradients
    assert not rule.round_complete({"a", "x"}, live)                 # x is not live: one of the two counts
    many = SyncRule(backup_workers=5)
    assert many.round_complete({"a"}, live)                          # at least one gradient, not zero
    assert not many.round_complete(set(), live)


def test_ssp_waits_only_when_more_than_staleness_ahead_of_the_slowest_other_worker():
    rule = SSPRule(1)
    live = {"a", "b", "c"}
    assert rule.admit(ctx("a", live=live, clocks={"a": 5, "b": 4, "c": 9})).action is Action.ACCUMULATE
    wait = rule.admit(ctx("a", live=live, clocks={"a": 6, "b": 4, "c": 9}))
    assert wait.action is Action.WAIT and "clock 6 is more than 1 ahead of the slowest live worker (4)" in wait.reason
    assert rule.admit(ctx("a", live=live, clocks={"a": 2})).action is Action.WAIT      # unknown clocks are 0
    assert rule.admit(ctx("a", live={"a"}, clocks={"a": 50})).action is Action.ACCUMULATE   # alone
    assert rule.admit(ctx("a", live={"b"}, clocks={"a": 1, "b": 0})).action is Action.ACCUMULATE
    assert rule.admit(ctx("a", live={"b"}, clocks={"a": 2, "b": 0})).action is Action.WAIT   # a need not be live
    strict = SSPRule(0)
    assert strict.admit(ctx("a", live={"a", "b"}, clocks={"a": 3, "b": 3})).action is Action.ACCUMULATE
    assert strict.admit(ctx("a", live={"a", "b"}, clocks={"a": 4, "b": 3})).action is Action.WAIT


def test_ssp_staleness_below_zero_is_refused_quoting_it():
    with pytest.raises(InvalidArgument, match="--staleness must be >= 0, got -1"):
        SSPRule(-1)
    assert SSPRule(0).staleness == 0


def test_async_and_ssp_apply_each_admitted_push_alone():
    for rule in (AsyncRule(), SSPRule(2)):
        assert rule.round_complete({"a"}, {"a", "b", "c"})
        assert not rule.round_complete(set(), {"a"})


def test_rule_for_builds_the_jobs_rule_with_its_parameters():
    sync = rule_for(JobConfig(mode="sync", backup_workers=1))
    assert isinstance(sync, SyncRule) and sync.backup_workers == 1
    assert isinstance(rule_for(JobConfig(mode="async")), AsyncRule)
    ssp = rule_for(JobConfig(mode="ssp", staleness=3))
    assert isinstance(ssp, SSPRule) and ssp.staleness == 3
    with pytest.raises(NotImplementedError):
        Rule().admit(ctx())


def test_a_worker_without_a_clock_counts_as_zero_on_both_sides():
    rule = SSPRule(1)
    assert rule.admit(ctx("a", live={"a", "b"}, clocks={"a": 1})).action is Action.ACCUMULATE   # b unknown: 0
    assert rule.admit(ctx("a", live={"a", "b"}, clocks={"a": 2})).action is Action.WAIT
    strict = SSPRule(0)
    assert strict.admit(ctx("a", live={"a", "b"}, clocks={"b": 0})).action is Action.ACCUMULATE  # a unknown: 0


def test_with_more_backup_workers_than_live_ones_a_gradient_of_a_live_worker_is_still_needed():
    many = SyncRule(backup_workers=5)
    assert not many.round_complete({"gone"}, {"a", "b"})     # only a worker that left pushed
    assert many.round_complete({"gone", "a"}, {"a", "b"})


def test_admissions_and_push_contexts_are_immutable_values():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx().push_version = 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        SyncRule().admit(ctx()).action = Action.DROP
