"""Edges of the chief's leases and sightings (chief/membership.py) that mutation testing found untested:
exact boundaries with a fake clock, ids, repeated watches, journal rows and the pause bridge."""
import logging

import pytest

from shoal.chief.membership import MemberState, Membership, Role
from shoal.errors import InvalidArgument

LEASE = 3.0                     # a third of it is exactly 1.0: boundaries compare exactly


@pytest.mark.parametrize("lease", [0.0, -0.5, -1.0])
def test_a_lease_that_is_not_positive_is_refused(clock, lease):
    with pytest.raises(InvalidArgument, match="lease must be > 0"):
        Membership(lease_seconds=lease, clock=clock)


def test_ids_count_from_zero_per_role(clock):
    m = Membership(LEASE, clock)
    assert [m.join(Role.PS).member_id, m.join(Role.WORKER).member_id, m.join(Role.PS).member_id] == \
        ["ps-0", "worker-0", "ps-1"]


def test_an_unanswered_watch_cuts_the_lease_to_exactly_a_third(clock):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    m.watch_opened(a.member_id)
    assert not m.watch_closed(a.member_id, answered=False)
    assert a.lease_until == clock() + LEASE / 3
    clock.advance(LEASE / 3 - 0.01)
    assert m.expire() == []
    clock.advance(0.02)
    assert m.expire() == [a]


def test_a_data_connection_drop_cuts_the_lease_to_exactly_a_third(clock):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    m.watch_opened(a.member_id)                   # watching: the drop alone does not end it
    assert not m.connection_lost(a.member_id)
    assert a.lease_until == clock() + LEASE / 3


def test_a_second_sighting_exactly_a_third_of_a_lease_later_still_ends_it_and_later_does_not(clock):
    m = Membership(LEASE, clock)
    a, b = m.join(Role.WORKER), m.join(Role.WORKER)
    for w in (a, b):
        m.watch_opened(w.member_id)
        m.watch_closed(w.member_id, answered=False)
    clock.advance(LEASE / 3)                      # on the boundary: recent
    assert m.connection_lost(a.member_id)
    clock.advance(0.01)                           # just past it (and short of half a lease): not recent
    assert not m.connection_lost(b.member_id)


def test_a_member_with_two_watches_open_still_watches_after_one_closes(clock):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    m.watch_opened(a.member_id)
    m.watch_opened(a.member_id)                   # a new watch opened before the old one ended
    m.watch_closed(a.member_id, answered=True)
    assert m.watching(a.member_id)
    m.watch_closed(a.member_id, answered=True)
    assert not m.watching(a.member_id)


def test_joining_again_under_its_id_clears_the_sightings_against_a_member(clock):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    m.watch_opened(a.member_id)
    m.watch_closed(a.member_id, answered=False)   # one sighting
    assert m.join(Role.WORKER, member_id=a.member_id) is a   # it is alive: it just joined again
    assert not m.connection_lost(a.member_id)     # the old sighting does not pair with a new one
    assert a.live


def test_a_join_asking_for_the_id_of_a_member_that_left_gets_a_new_id_and_says_why(clock, caplog):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    m.leave(a.member_id)
    with caplog.at_level(logging.INFO, logger="shoal.chief.membership"):
        b = m.join(Role.WORKER, member_id=a.member_id)
    assert b.member_id != a.member_id and a.state is MemberState.LEFT
    assert f"member {a.member_id} left for good" in caplog.text
    caplog.clear()
    c = m.join(Role.WORKER)                       # an expired member's id is given back, with nothing of the kind
    clock.advance(LEASE + 1)
    assert c in m.expire()
    with caplog.at_level(logging.INFO, logger="shoal.chief.membership"):
        m.join(Role.WORKER, member_id=c.member_id)
    assert "left for good" not in caplog.text


def test_a_journal_row_keeps_when_a_member_joined_and_how_much_lease_it_has(clock):
    m = Membership(LEASE, clock)
    m.join(Role.WORKER)
    joined_at = clock()
    clock.advance(1.25)
    m.join(Role.PS)
    (row_w, row_p) = m.take_changed()
    clock.advance(0.5)
    entry = Membership.entry_from_row(row_w, clock())
    assert entry["joined_ago"] == pytest.approx(1.75) and entry["lease_left"] == pytest.approx(LEASE - 1.75)
    again = Membership.from_dict({**m.meta(), "members": [entry, Membership.entry_from_row(row_p, clock())]}, clock)
    assert again.get("worker-0").joined_at == pytest.approx(joined_at)
    assert again.get("ps-0").lease_until == pytest.approx(joined_at + 1.25 + LEASE)


def test_the_pause_bridge_says_how_many_leases_it_extended(clock, caplog):
    m = Membership(LEASE, clock)
    m.bridge_pauses_over(0.6)
    members = [m.join(Role.WORKER) for _ in range(3)]
    m.leave(members[0].member_id)
    m.expire()
    clock.advance(10.0)
    with caplog.at_level(logging.WARNING, logger="shoal.chief.membership"):
        assert m.expire() == []
    assert "extended 2 lease(s)" in caplog.text


def test_sightings_age_only_while_the_chief_runs(clock):
    """A watch broke just before the chief stood still: a data connection dropping just after it wakes is
    the same death seen twice (a third of a lease apart in the chief's running time), and ends it."""
    m = Membership(LEASE, clock)
    m.bridge_pauses_over(0.6)
    a = m.join(Role.WORKER)
    m.expire()
    m.watch_opened(a.member_id)
    m.watch_closed(a.member_id, answered=False)
    clock.advance(0.2)                            # no heartbeat: the process is dead
    m.expire()
    clock.advance(5.0)                            # the chief stands still 5 s
    assert m.expire() == []                       # bridged: its lease (cut to a third) is extended by the gap
    clock.advance(0.1)
    assert m.connection_lost(a.member_id)         # 0.3 s of the chief's running time after the watch broke


def test_joining_again_while_alive_renews_the_lease_in_full(clock):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    clock.advance(2.0)
    assert m.join(Role.WORKER, member_id=a.member_id) is a
    assert a.lease_until == clock() + LEASE


def test_leases_are_extended_by_exactly_the_chiefs_own_gap(clock, caplog):
    m = Membership(LEASE, clock)
    m.bridge_pauses_over(0.6)
    a = m.join(Role.WORKER)                       # its lease ends 3 s from now
    clock.advance(0.5)
    m.expire()
    clock.advance(10.0)                           # the chief stood still 10 s
    with caplog.at_level(logging.WARNING, logger="shoal.chief.membership"):
        m.expire()
    assert a.lease_until == pytest.approx(clock() - 10.5 + LEASE + 10.0)   # 2.5 s left, as before the pause
    assert "no progress for 10.0s" in caplog.text


@pytest.mark.parametrize("gap", [0.0, -1.0])
def test_a_pause_threshold_that_is_not_positive_is_refused(clock, gap):
    with pytest.raises(InvalidArgument, match="must be > 0"):
        Membership(LEASE, clock).bridge_pauses_over(gap)


def test_a_cut_that_does_not_shorten_the_lease_changes_nothing_to_journal(clock):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    m.take_changed()
    assert m.cut_lease(a.member_id, LEASE)        # the same end as now: nothing to write
    assert m.cut_lease(a.member_id, LEASE + 1)
    assert m.take_changed() == []
    assert m.cut_lease(a.member_id, 1.0)
    assert [r["member_id"] for r in m.take_changed()] == [a.member_id]


def test_set_busy_says_whether_the_state_changed(clock):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    assert m.set_busy(a.member_id, True) and a.state is MemberState.ALIVE
    assert not m.set_busy(a.member_id, True)
    assert m.set_busy(a.member_id, False) and a.state is MemberState.IDLE
    assert not m.set_busy(a.member_id, False)
    m.expire_now(a.member_id, "test")
    assert not m.set_busy(a.member_id, True) and a.state is MemberState.EXPIRED


def test_sightings_of_members_that_are_gone_or_servers_change_nothing(clock):
    m = Membership(LEASE, clock)
    a, ps = m.join(Role.WORKER), m.join(Role.PS)
    m.watch_opened(a.member_id)
    m.watch_closed(a.member_id, answered=False)   # a sighting, then the member is ended another way
    assert m.expire_now(a.member_id, "unreachable") is a
    assert not m.connection_lost(a.member_id)     # no second ending of a member already gone
    lease = ps.lease_until
    assert not m.connection_lost(ps.member_id)    # servers are not judged by a worker's connections
    assert ps.lease_until == lease
    assert m.expire_now(a.member_id, "again") is None
    assert m.expire_now("worker-77", "unknown") is None


def test_a_dropped_connection_with_no_watch_ends_a_worker_after_exactly_a_sixth_of_its_lease(clock):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    assert not m.connection_lost(a.member_id)
    clock.advance(LEASE / 6 - 0.01)
    assert m.expire() == []
    clock.advance(0.01)
    assert m.expire() == [a]


def test_a_lease_that_ends_exactly_now_has_not_lapsed_yet(clock):
    m = Membership(LEASE, clock)
    a = m.join(Role.WORKER)
    clock.advance(LEASE)
    assert m.expire() == []
    clock.advance(0.001)
    assert m.expire() == [a]


def test_a_gap_of_exactly_the_threshold_is_not_a_pause(clock):
    m = Membership(LEASE, clock)
    m.bridge_pauses_over(0.5)
    m.join(Role.WORKER)
    m.expire()
    clock.advance(0.5)
    m.expire()
    assert m.pauses_bridged == 0
    clock.advance(0.501)
    m.expire()
    assert m.pauses_bridged == 1


def test_members_by_role(clock, caplog):
    m = Membership(LEASE, clock)
    with caplog.at_level(logging.INFO, logger="shoal.chief.membership"):
        w, p = m.join(Role.WORKER), m.join(Role.PS, address="h:1")
    assert list(m.all(Role.PS)) == [p] and list(m.all(Role.WORKER)) == [w] and list(m.all()) == [w, p]
    assert m.alive(Role.PS) == [p]
    assert "member ps-0 joined (ps at h:1)" in caplog.text and "member worker-0 joined (worker)" in caplog.text


def test_a_chief_behind_in_taking_calls_judges_leases_that_much_later(clock, caplog):
    """Heartbeats waiting in the chief's own queue (its event loop's lag) were sent in time."""
    m = Membership(LEASE, clock)
    a, b = m.join(Role.WORKER), m.join(Role.PS)
    clock.advance(LEASE + 0.5)                    # both leases passed half a second ago...
    m.backlog_s = 1.0                             # ...but the chief is a second behind
    with caplog.at_level(logging.WARNING):
        assert m.expire() == []
    assert "1.0s behind in taking calls" in caplog.text
    clock.advance(0.6)                            # now past lease + backlog
    assert {x.member_id for x in m.expire()} == {a.member_id, b.member_id}


def test_a_backlog_under_a_quarter_lease_is_not_warned_about(clock, caplog):
    m = Membership(LEASE, clock)
    m.join(Role.WORKER)
    m.backlog_s = LEASE / 4
    with caplog.at_level(logging.WARNING):
        m.expire()
    assert "behind in taking calls" not in caplog.text
