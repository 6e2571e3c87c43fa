"""Shard placement in the chief's pure state (chief/placement.py, issue 17): every sequence of server
joins, departures, deaths and finished copies of a small cluster, driven by hypothesis, keeps the
rules: a copy that is not whole is never promoted while a whole one is live; a shard has a primary
while a whole copy of it is live; once copies finish and nothing else happens, no server is primary
of more than ceil(shards / servers). Plus the cases by name: a promoted server with 2 of 2 shards
and a joiner, the journal keeping a move, and no move while a checkpoint is cut. Fake clock, no sockets."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import FakeClock
from shoal.chief import placement
from shoal.chief.journal import Journal
from shoal.chief.state import ChiefState
from shoal.settings.config import JobConfig
from shoal.members import Role

LEASE = 3.0


def live_ps(s: ChiefState) -> list[str]:
    return sorted(m.member_id for m in s.members.alive(Role.PS))


def busiest(s: ChiefState) -> int:
    return max(placement.primaries(s.routing, live_ps(s)).values(), default=0)


class Copies:
    """What the servers would hold, as the test sees it: which live servers hold a whole copy of each
    shard. The chief's decisions are checked against it; its own records are not trusted."""

    def __init__(self, s: ChiefState):
        self.s = s
        self.whole: dict[int, set[str]] = {k: set() for k in range(s.job.num_shards)}

    def after(self, before_routing: dict[int, str], before_backups: dict[int, str]) -> None:
        """Follows one chief step: asserts no promotion of a partial copy while a whole one is live."""
        s, live = self.s, set(live_ps(self.s))
        for k, holders in self.whole.items():
            old_whole = holders & live
            p = s.routing.get(k)
            if p is not None and p != before_routing.get(k):
                if p in holders:
                    pass                                    # promoted / moved to a whole copy
                else:
                    assert not old_whole, (f"shard {k}: {p} made primary without a whole copy while "
                                           f"{sorted(old_whole)} held one")
                    holders.clear()
                    holders.add(p)                          # a new lineage: placed fresh, or lost (recovery)
            # a server that is neither primary nor backup of k any more drops its copy
            keep = {p, s.backups.get(k)} & live
            holders &= keep

    def copy_done(self, k: int) -> str | None:
        b = self.s.backups.get(k)
        if b is None or k not in self.s.routing:
            return None
        self.whole[k].add(b)
        return self.s.routing[k]

    def report(self, primary: str) -> dict[int, str]:
        """A primary's heartbeat: the backups of its shards whose copy is whole and in step."""
        return {k: b for k, b in self.s.backups.items()
                if self.s.routing.get(k) == primary and b in self.whole[k]}


class Placement(RuleBasedStateMachine):
    @initialize(shards=st.integers(2, 6), servers=st.integers(1, 4), recovery=st.sampled_from(["fast", "consistent"]))
    def start(self, shards, servers, recovery):
        self.clock = FakeClock()
        self.s = ChiefState(JobConfig(num_shards=shards, lease_seconds=LEASE, recovery=recovery), self.clock)
        self.copies = Copies(self.s)
        self.n = 0
        for _ in range(servers):
            self.join()

    def _step(self, fn, *args):
        before_r, before_b = dict(self.s.routing), dict(self.s.backups)
        out = fn(*args)
        self.copies.after(before_r, before_b)
        return out

    def _heartbeats(self):
        for p in live_ps(self.s):
            self._step(self.s.heartbeat, p, None, None, 0.0, self.copies.report(p))

    @rule()
    def join(self):
        self.n += 1
        self._step(self.s.join_ps, f"h:{self.n}")

    @precondition(lambda self: live_ps(self.s))
    @rule(i=st.integers(0, 10), graceful=st.booleans())
    def stop(self, i, graceful):
        victims = live_ps(self.s)
        mid = victims[i % len(victims)]
        if graceful:
            self._step(self.s.leave, mid)
        else:
            self._step(self.s.expire, mid, "killed")

    @rule(k=st.integers(0, 5))
    def copy_finishes(self, k):
        if k < self.s.job.num_shards and self.copies.copy_done(k) is not None:
            self._heartbeats()

    @rule(dt=st.sampled_from([0.1, 0.5, LEASE / 4]))
    def time_passes(self, dt):
        self.clock.advance(dt)
        self._heartbeats()
        self._step(self.s.tick)

    @rule()
    def checkpoint_cut(self):
        """No primary moves while a checkpoint is cut; it goes on after."""
        self.s.moves_held += 1
        before = dict(self.s.routing)
        for k in range(self.s.job.num_shards):
            self.copies.copy_done(k)
        self._heartbeats()
        self._step(self.s.tick)
        moved = {k for k, p in before.items() if self.s.routing.get(k) not in (p, None)}
        assert not moved, f"shards {sorted(moved)} moved during a checkpoint"
        self.s.moves_held -= 1

    @rule()
    def settle(self):
        """Copies finish and time passes with no departures: the bound holds."""
        for _ in range(4 * self.s.job.num_shards + 8):
            for k in range(self.s.job.num_shards):
                self.copies.copy_done(k)
            self.clock.advance(LEASE / 4)
            self._heartbeats()
            self._step(self.s.tick)
        live = live_ps(self.s)
        if live and not self.s.stopped:
            cap = math.ceil(self.s.job.num_shards / len(live))
            assert busiest(self.s) <= cap, (self.s.routing, self.s.backups, live)
            assert set(range(self.s.job.num_shards)) == self.s.placed     # every shard had a primary
            fresh = [k for k in range(self.s.job.num_shards) if k not in self.s.lost and self.copies.whole[k]]
            assert all(k in self.s.routing for k in fresh)

    @invariant()
    def a_whole_copy_means_a_primary(self):
        live = set(live_ps(self.s))
        for k, holders in self.copies.whole.items():
            if holders & live:
                assert self.s.routing.get(k) in live, f"shard {k} has a whole copy on {holders & live} and no primary"

    @invariant()
    def primaries_are_live_and_distinct_from_backups(self):
        live = set(live_ps(self.s))
        for k, p in self.s.routing.items():
            assert p in live
            assert self.s.backups.get(k) != p


TestPlacement = Placement.TestCase
TestPlacement.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- the cases by name

def two_of_two(clock):
    """ps-0 promoted over a dead ps-1: primary of both shards, no backup."""
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=LEASE), clock)
    a, _ = s.join_ps("h:0")
    b, _ = s.join_ps("h:1")
    s.heartbeat(a.member_id, backups_complete={0: b.member_id})
    s.heartbeat(b.member_id, backups_complete={1: a.member_id})
    s.expire(b.member_id, "killed")
    assert s.routing == {0: a.member_id, 1: a.member_id} and not s.backups
    return s, a.member_id


def test_a_joiner_takes_over_one_shard_of_a_promoted_server_once_its_copy_is_whole(clock):
    s, a = two_of_two(clock)
    c, _ = s.join_ps("h:2")
    c = c.member_id
    assert s.routing == {0: a, 1: a} and s.backups == {0: c, 1: c}     # not before its copies are whole
    s.heartbeat(a, backups_complete={0: c})                            # shard 0's copy is whole
    assert s.routing == {0: c, 1: a}
    assert s.backups == {0: a, 1: c}        # refilled: the old primary backs it up (a fresh copy)
    assert s.complete == {}
    assert s.view().routes[0].backup_complete is False


def test_a_copy_the_chief_was_told_was_whole_but_the_primary_no_longer_reports_is_not_moved_to(clock):
    s, a = two_of_two(clock)
    c = s.join_ps("h:2")[0].member_id
    s.complete[0] = c                       # recorded earlier; the primary's latest heartbeat lists nothing
    s.in_sync[a] = frozenset()
    s.rebalance()
    assert s.routing == {0: a, 1: a}


def test_a_move_waits_for_a_checkpoint_cut(clock):
    s, a = two_of_two(clock)
    c = s.join_ps("h:2")[0].member_id
    s.moves_held += 1
    s.heartbeat(a, backups_complete={0: c})
    assert s.routing == {0: a, 1: a}
    s.moves_held -= 1
    s.tick()
    assert s.routing == {0: c, 1: a}


def test_a_restarted_chief_keeps_the_moved_placement(tmp_path, clock):
    s, a = two_of_two(clock)
    c = s.join_ps("h:2")[0].member_id
    j = Journal(tmp_path / "chief.db")
    j.append(s.take_changes(), "start", s.journal_snapshot)
    s.heartbeat(a, backups_complete={0: c})
    j.append(s.take_changes(), "moved", s.journal_snapshot)
    back = ChiefState.from_dict(Journal(tmp_path / "chief.db").load(), clock, recover=True)
    assert back.routing == {0: c, 1: a} and back.backups == s.backups and back.epoch > s.epoch
    back.rebalance()
    assert back.routing == {0: c, 1: a}     # nothing to redo


def test_shards_no_server_took_at_its_join_are_spread_after_a_lease(clock):
    s = ChiefState(JobConfig(num_shards=8, lease_seconds=LEASE), clock)
    ids = [s.join_ps(f"h:{i}")[0].member_id for i in range(4)]
    assert sorted(s.routing) == [0, 1, 2, 3]            # one each at the join
    clock.advance(LEASE)
    for m in ids:
        s.heartbeat(m)
    s.tick()
    assert sorted(s.routing) == list(range(8)) and busiest(s) == 2


def test_a_shard_that_lost_every_copy_is_not_placed_on_a_live_server(clock):
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=LEASE, recovery="fast", replicas=1), clock)
    a = s.join_ps("h:0")[0].member_id
    b = s.join_ps("h:1")[0].member_id
    s.expire(b, "killed")
    clock.advance(2 * LEASE)
    s.heartbeat(a)
    s.tick()
    assert s.routing == {0: a} and s.lost == [1]         # --recovery fast: the next server to join takes it


def test_the_bound():
    assert placement.bound(16, 8) == 2 and placement.bound(16, 7) == 3 and placement.bound(2, 3) == 1
    assert placement.bound(5, 0) == 5


@pytest.mark.parametrize("replicas", [1, 2])
def test_no_server_over_the_bound_moves_nothing(clock, replicas):
    s = ChiefState(JobConfig(num_shards=4, lease_seconds=LEASE, replicas=replicas), clock)
    for i in range(4):
        s.join_ps(f"h:{i}")
    routing = dict(s.routing)
    assert not [line for line in placement.rebalance(4, s.routing, s.backups, s.complete, {}, live_ps(s), replicas)
                if "moved" in line]
    assert s.routing == routing


def test_a_shard_whose_last_copy_left_is_not_placed_fresh_on_a_live_server(clock):
    """The servers leave one by one at the end of a job: a shard whose last copy left must not come back
    empty on a server still there (a worker would Init it from its own weights)."""
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=LEASE, replicas=1), clock)
    a = s.join_ps("h:0")[0].member_id
    b = s.join_ps("h:1")[0].member_id
    s.leave(b)
    clock.advance(2 * LEASE)
    s.heartbeat(a)
    s.tick()
    assert s.routing == {0: a} and s.lost == []
    assert ChiefState.from_dict(s.to_dict(), clock).placed == {0, 1}     # journaled


def test_shards_are_placed_once_no_server_has_joined_for_a_lease(clock):
    s = ChiefState(JobConfig(num_shards=4, lease_seconds=LEASE), clock)
    a = s.join_ps("h:0")[0].member_id
    clock.advance(LEASE * 0.9)
    b = s.join_ps("h:1")[0].member_id
    clock.advance(LEASE * 0.9)          # a lease after the first join, not after the last
    s.heartbeat(a), s.heartbeat(b), s.tick()
    assert sorted(s.routing) == [0, 1]
    clock.advance(LEASE * 0.2)
    s.heartbeat(a), s.heartbeat(b), s.tick()
    assert sorted(s.routing) == [0, 1, 2, 3] and busiest(s) == 2
