"""Edges of the chief's shard placement (chief/placement.py) that mutation testing found untested: the pure
functions called directly on hand-made states, each choice by name (which server takes a free shard, a
backup, a move, a re-aimed backup), the boundaries at the bound, and properties over small random states
driven by hypothesis (every move goes to a whole, in-sync backup with room; copies finishing with nothing
else happening reach the bound and then change nothing). No clock, no sockets."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.chief import placement


def synced(routing: dict[int, str], backups: dict[int, str], shards=None):
    """``complete`` and ``in_sync`` as the chief has them once the primaries report these shards' backups
    (all by default) whole and in step."""
    ks = sorted(k for k in backups if shards is None or k in shards)
    pairs: dict[str, set] = {}
    for k in ks:
        pairs.setdefault(routing[k], set()).add((k, backups[k]))
    return {k: backups[k] for k in ks}, {p: frozenset(v) for p, v in pairs.items()}


def run(num_shards, routing, backups, live, complete=None, in_sync=None, replicas=2, **kw):
    """``placement.rebalance`` with nothing whole, no pairs in sync and 2 replicas unless given."""
    complete = {} if complete is None else complete
    return placement.rebalance(num_shards, routing, backups, complete, in_sync or {}, live, replicas, **kw)


# ---------------------------------------------------------------- counting

def test_primaries_counts_each_live_server_from_zero_and_ignores_the_others():
    assert placement.primaries({0: "a", 1: "a", 2: "x", 3: "b"}, ["a", "b", "c"]) == {"a": 2, "b": 1, "c": 0}


# ---------------------------------------------------------------- backups

def test_a_backup_goes_to_the_server_holding_fewest_copies_backups_included():
    # c is primary of nothing but backs up two shards: 2 copies; b and d hold one each
    routing, backups, complete = {0: "a", 1: "b", 2: "d"}, {1: "c", 2: "c"}, {0: "z"}
    assert placement.assign_backups(routing, backups, complete, ["a", "b", "c", "d"]) == ["shard 0: backup b"]
    assert backups == {0: "b", 1: "c", 2: "c"} and complete == {}


def test_a_server_backing_up_one_shard_holds_fewer_copies_than_one_primary_of_two():
    routing, backups = {0: "a", 1: "b", 2: "b"}, {1: "c", 2: "a"}
    assert placement.assign_backups(routing, backups, {}, ["a", "b", "c"]) == ["shard 0: backup c"]


def test_every_shard_without_a_backup_gets_one_whatever_comes_before_it():
    routing, backups = {0: "a", 1: "b", 2: "a"}, {0: "b"}
    assert placement.assign_backups(routing, backups, {}, ["a", "b"]) == ["shard 1: backup a", "shard 2: backup b"]
    assert backups == {0: "b", 1: "a", 2: "b"}


def test_with_one_live_server_no_shard_gets_a_backup():
    routing, backups = {0: "a", 1: "a"}, {}
    assert placement.assign_backups(routing, backups, {}, ["a"]) == [] and backups == {}


# ---------------------------------------------------------------- free shards

def test_a_free_shard_goes_to_the_server_with_fewest_primaries_before_fewest_copies():
    # a: no primary, two backups (2 copies); b: one primary (1 copy); c: two primaries
    routing, backups = {0: "c", 1: "c", 2: "b"}, {0: "a", 1: "a"}
    assert run(4, routing, backups, ["a", "b", "c"], replicas=1, placeable=[3]) == ["shard 3 -> a (placed)"]
    assert routing[3] == "a"


def test_between_servers_with_as_many_primaries_a_free_shard_goes_to_the_one_with_fewer_copies():
    routing, backups = {0: "c"}, {0: "a"}
    assert run(2, routing, backups, ["a", "b", "c"], replicas=1, placeable=[1]) == ["shard 1 -> b (placed)"]


def test_only_unrouted_shards_of_the_job_are_placed_and_a_stale_backup_is_dropped():
    routing, backups, complete = {1: "a"}, {2: "b"}, {2: "b"}
    lines = run(3, routing, backups, ["a", "b"], complete, replicas=1, placeable=[3, -1, 2, 1, 0, 0])
    assert lines == ["shard 0 -> b (placed)", "shard 2 -> a (placed)"]
    assert routing == {0: "b", 1: "a", 2: "a"} and backups == {} and complete == {}


def test_with_one_replica_no_shard_gets_a_backup_and_nothing_moves():
    routing, backups = {0: "a", 1: "a", 2: "a"}, {}
    assert run(3, routing, backups, ["a", "b"], replicas=1) == []
    assert routing == {0: "a", 1: "a", 2: "a"} and backups == {}


def test_with_no_live_server_nothing_happens():
    routing, backups = {}, {}
    assert run(2, routing, backups, [], placeable=[0, 1]) == [] and routing == {}


# ---------------------------------------------------------------- moves

def three_servers_one_over():
    """a is primary of 2 of 3 shards over 3 servers (bound 1), both backed up whole and in sync on b."""
    routing, backups = {0: "a", 1: "a", 2: "c"}, {0: "b", 1: "b", 2: "a"}
    complete, in_sync = synced(routing, backups)
    return routing, backups, complete, in_sync


def test_moves_are_on_by_default_and_go_to_the_whole_backup_then_the_shard_is_backed_up_again():
    routing, backups, complete, in_sync = three_servers_one_over()
    lines = placement.rebalance(3, routing, backups, complete, in_sync, ["a", "b", "c"], 2)
    assert lines == ["shard 0: moved from a to b (its whole backup; a held 2 > 1)", "shard 0: backup c"]
    assert routing == {0: "b", 1: "a", 2: "c"} and backups == {0: "c", 1: "b", 2: "a"}
    assert complete == {1: "b", 2: "a"}


def test_no_move_while_moves_are_held():
    routing, backups, complete, in_sync = three_servers_one_over()
    assert placement.rebalance(3, routing, backups, complete, in_sync, ["a", "b", "c"], 2, moves=False) == []
    assert routing == {0: "a", 1: "a", 2: "c"}


@pytest.mark.parametrize("case", ["neither", "in_sync only", "complete only", "complete names another",
                                  "listed by another primary"])
def test_a_shard_moves_only_to_a_backup_recorded_whole_and_listed_in_sync_by_its_primary(case):
    routing, backups = {0: "a", 1: "a"}, {0: "b", 1: "b"}
    whole = {0: "b", 1: "b"}
    pairs = frozenset({(0, "b"), (1, "b")})
    complete, in_sync = {
        "neither": ({}, {}),
        "in_sync only": ({}, {"a": pairs}),
        "complete only": (whole, {"a": frozenset()}),
        "complete names another": ({0: "c", 1: "c"}, {"a": pairs}),
        "listed by another primary": (whole, {"b": pairs}),
    }[case]
    assert run(2, routing, backups, ["a", "b"], dict(complete), in_sync) == []
    assert routing == {0: "a", 1: "a"}


def test_a_primary_at_the_bound_keeps_its_shards_though_a_whole_backup_has_room():
    routing, backups = {0: "a", 1: "a", 2: "c", 3: "c"}, {0: "b", 1: "b", 2: "b", 3: "b"}
    complete, in_sync = synced(routing, backups)
    assert run(4, routing, backups, ["a", "b", "c"], complete, in_sync) == []
    assert routing == {0: "a", 1: "a", 2: "c", 3: "c"}


def test_the_busiest_primary_moves_first_whatever_copies_the_others_hold():
    # a and z hold 4 copies each; z is primary of 3 (bound 2), a of 1
    routing, backups = {0: "z", 1: "z", 2: "z", 3: "a"}, {0: "a", 1: "a", 2: "a", 3: "z"}
    complete, in_sync = synced(routing, backups)
    lines = run(4, routing, backups, ["a", "z"], complete, in_sync)
    assert lines[0] == "shard 0: moved from z to a (its whole backup; z held 3 > 2)"
    assert routing == {0: "a", 1: "z", 2: "z", 3: "a"}


# ---------------------------------------------------------------- re-aimed backups

def at_the_bound_elsewhere(whole=(0, 1, 2)):
    """z is primary of 3 of 6 shards over 3 servers (bound 2), its backups all on a, which is at the bound;
    b, primary of 1, has room for one. ``whole``: z's shards whose backup is whole and in sync."""
    routing = {0: "z", 1: "z", 2: "z", 3: "a", 4: "a", 5: "b"}
    backups = {0: "a", 1: "a", 2: "a", 3: "z", 4: "z", 5: "z"}
    complete, in_sync = synced(routing, backups, whole)
    return routing, backups, complete, in_sync


def test_an_overloaded_primary_never_moves_a_shard_onto_a_server_at_the_bound_it_reaims_a_backup_instead():
    routing, backups, complete, in_sync = at_the_bound_elsewhere()
    lines = run(6, routing, backups, ["a", "b", "z"], complete, in_sync)
    assert lines == ["shard 0: backup b (was a), to take it over from z"]
    assert routing == {0: "z", 1: "z", 2: "z", 3: "a", 4: "a", 5: "b"}
    assert backups == {0: "b", 1: "a", 2: "a", 3: "z", 4: "z", 5: "z"} and 0 not in complete


def test_the_backup_reaimed_first_is_one_that_is_not_whole():
    routing, backups, complete, in_sync = at_the_bound_elsewhere(whole=(0, 2))
    assert run(6, routing, backups, ["a", "b", "z"], complete, in_sync) == \
        ["shard 1: backup b (was a), to take it over from z"]
    assert complete == {0: "a", 2: "a"}


def test_a_balanced_cluster_is_left_as_it_is():
    routing, backups = {0: "a", 1: "b", 2: "c"}, {0: "b", 1: "c", 2: "a"}
    assert run(3, routing, backups, ["a", "b", "c", "d"]) == []
    assert backups == {0: "b", 1: "c", 2: "a"}


def test_only_as_many_backups_are_reaimed_as_the_primary_holds_over_the_bound_counting_those_aimed_already():
    # 11 shards on 5 servers: bound 3. z holds 4: shards 0 and 1 are backed up on r, which has room,
    # so one more than needed is aimed already; s has room too and is left alone
    routing = {0: "z", 1: "z", 2: "z", 3: "z", 4: "A", 5: "A", 6: "A", 7: "B", 8: "B", 9: "B", 10: "r"}
    backups = {0: "r", 1: "r", 2: "A", 3: "B", 4: "z", 5: "z", 6: "z", 7: "z", 8: "z", 9: "z", 10: "A"}
    before = dict(backups)
    assert run(11, routing, backups, ["A", "B", "r", "s", "z"]) == []
    assert backups == before


def test_a_server_with_room_left_only_for_the_moves_on_their_way_is_not_aimed_at():
    # 10 shards on 5 servers: bound 2. y and z hold 3 each; y's shards 0 and 1 are backed up on r1 and r2,
    # each primary of 1: once those copies are whole y moves one there, so neither has room for z's
    routing = {0: "y", 1: "y", 2: "y", 3: "z", 4: "z", 5: "z", 6: "r1", 7: "r2", 8: "A", 9: "A"}
    backups = {0: "r1", 1: "r2", 2: "A", 3: "A", 4: "A", 5: "y", 6: "z", 7: "z", 8: "z", 9: "y"}
    before = dict(backups)
    assert run(10, routing, backups, ["A", "r1", "r2", "y", "z"]) == []
    assert backups == before


def test_a_backup_is_reaimed_at_the_server_with_fewest_primaries_and_pending_moves_then_fewest_copies():
    # 6 shards on 5 servers: bound 2. z holds 4, shard 0 backed up on r (a move on its way there);
    # s and t have room and no primary, s holds more copies
    routing = {0: "z", 1: "z", 2: "z", 3: "z", 4: "a", 5: "a"}
    backups = {0: "r", 1: "a", 2: "a", 3: "a", 4: "s", 5: "s"}
    assert run(6, routing, backups, ["a", "r", "s", "t", "z"]) == ["shard 1: backup t (was a), to take it over from z"]


def test_a_backup_is_reaimed_at_the_server_with_fewest_primaries_not_fewest_copies():
    # 6 shards on 4 servers: bound 2. s is primary of none and backs up 2 shards; t is primary of 1 and
    # backs up none: s has more room for primaries
    routing = {0: "z", 1: "z", 2: "z", 3: "a", 4: "a", 5: "t"}
    backups = {0: "a", 1: "a", 2: "a", 3: "s", 4: "s", 5: "z"}
    assert run(6, routing, backups, ["a", "s", "t", "z"]) == ["shard 0: backup s (was a), to take it over from z"]


def test_the_backups_of_a_primary_at_the_bound_are_not_moves_on_their_way():
    # 6 shards on 4 servers: bound 2. a is at the bound: its shard 4's backup on s is no move to come,
    # so s (no primary, nothing on its way) is aimed at before r (a move of z's on its way)
    routing = {0: "z", 1: "z", 2: "z", 3: "z", 4: "a", 5: "a"}
    backups = {0: "r", 1: "a", 2: "a", 3: "a", 4: "s", 5: "z"}
    assert run(6, routing, backups, ["a", "r", "s", "z"]) == ["shard 1: backup s (was a), to take it over from z"]


def test_a_move_on_its_way_counts_once():
    # 7 shards on 4 servers: bound 2. z holds 4, shard 0 backed up on r (no primary): r still has room
    # for one more, before u (primary of 1, holding more copies)
    routing = {0: "z", 1: "z", 2: "z", 3: "z", 4: "a", 5: "a", 6: "u"}
    backups = {0: "r", 1: "a", 2: "a", 3: "a", 4: "u", 5: "u", 6: "z"}
    assert run(7, routing, backups, ["a", "r", "u", "z"]) == ["shard 1: backup r (was a), to take it over from z"]


# ---------------------------------------------------------------- properties over small random states

NAMES = ["a", "b", "c", "d"]


@st.composite
def states(draw):
    """A state the chief can be in: live servers, primaries on them, backups on another live server,
    ``complete`` only ever naming the backup, each primary's in-sync pairs some of its backups."""
    n = draw(st.integers(1, 6))
    live = NAMES[:draw(st.integers(1, 4))]
    routing = {k: draw(st.sampled_from(live)) for k in range(n) if draw(st.integers(0, 5))}
    backups, complete, pairs = {}, {}, {}
    for k, p in routing.items():
        others = [q for q in live if q != p]
        if others and draw(st.integers(0, 4)):
            backups[k] = draw(st.sampled_from(others))
            if draw(st.booleans()):
                complete[k] = backups[k]
            if draw(st.booleans()):
                pairs.setdefault(p, set()).add((k, backups[k]))
    in_sync = {p: frozenset(v) for p, v in pairs.items()}
    placeable = draw(st.lists(st.integers(-1, n), max_size=4))
    return n, routing, backups, complete, in_sync, live, placeable


def check_step(n, before, after, live, placeable, moves, replicas=2):
    """One rebalance, as the module docstring promises it."""
    routing0, backups0, complete0, in_sync0 = before
    routing, backups, complete = after
    cap = placement.bound(n, len(live))
    count = placement.primaries(routing, live)
    for k, p in routing.items():
        assert p in live and backups.get(k) != p
        assert backups.get(k, live[0]) in live
        if replicas >= 2 and len(live) >= 2:
            assert k in backups, f"shard {k} has no backup"
        if k not in routing0:
            assert k in placeable and 0 <= k < n, f"shard {k} placed without being placeable"
        elif routing0[k] != p:
            old = routing0[k]
            assert moves and replicas >= 2
            assert backups0.get(k) == p and complete0.get(k) == p and (k, p) in in_sync0.get(old, ()), \
                f"shard {k} moved to {p}, not a whole backup in sync"
            assert placement.primaries(routing0, live)[old] > cap and count[old] >= cap and count[p] <= cap
    assert set(routing) >= set(routing0)
    assert {k for k in placeable if 0 <= k < n} <= set(routing)
    for k, b in complete.items():
        assert complete0.get(k) == b and backups.get(k) == b and routing.get(k) == routing0.get(k)
    if replicas < 2:
        assert backups == {k: b for k, b in backups0.items() if k in routing0}
    if not moves or replicas < 2:
        assert all(backups.get(k) == b for k, b in backups0.items() if k in routing0), "a backup re-aimed"


# the same examples every run (a mutant is killed or not, never by luck); about 0.7 s for both properties
EXAMPLES = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@EXAMPLES
@given(states(), st.booleans(), st.sampled_from([1, 2]))
def test_one_rebalance_keeps_the_rules(state, moves, replicas):
    n, routing, backups, complete, in_sync, live, placeable = state
    before = (dict(routing), dict(backups), dict(complete), in_sync)
    lines = placement.rebalance(n, routing, backups, complete, in_sync, live, replicas, placeable, moves)
    check_step(n, before, (routing, backups, complete), live, placeable, moves, replicas)
    assert bool(lines) == ((routing, backups) != before[:2])


@EXAMPLES
@given(states())
def test_copies_finishing_with_nothing_else_happening_reach_the_bound_and_then_change_nothing(state):
    n, routing, backups, complete, in_sync, live, _ = state
    placeable = range(n)
    for _ in range(4 * n + 8):
        before = (dict(routing), dict(backups), dict(complete), in_sync)
        lines = placement.rebalance(n, routing, backups, complete, in_sync, live, 2, placeable)
        check_step(n, before, (routing, backups, complete), live, placeable, True)
        now = synced(routing, backups)                      # the new copies finish; heartbeats report them
        if not lines and now == (complete, in_sync):
            break
        complete, in_sync = now
    else:
        raise AssertionError(f"still changing: {lines}")
    assert sorted(routing) == list(range(n))
    assert max(placement.primaries(routing, live).values()) <= math.ceil(n / len(live)), (routing, backups)
