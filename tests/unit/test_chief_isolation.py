"""A chief that hears from no parameter server at all judges itself cut off (chief/membership.py): it holds
off expiring them, for a while, rather than declare every shard lost (bench/nemesis.py --netns: the chief's
host cut off for 4.5 s with a 1.5 s lease rolled the whole job back to its checkpoint)."""
from shoal.chief.membership import Membership, Role
from shoal.chief.state import ChiefState
from shoal.settings.config import JobConfig
from shoal.errors import InvalidArgument

import pytest

LEASE = 1.5
HOLD = 3 * LEASE


def run(clock, m: Membership, seconds: float, beating=()) -> list[str]:
    """The ticker for ``seconds`` (every 0.1 s), ``beating`` members heartbeating; the ids it expired."""
    gone = []
    for _ in range(round(seconds / 0.1)):
        clock.advance(0.1)
        for member in beating:
            m.heartbeat(member.member_id)
        gone += [g.member_id for g in m.expire()]
    return gone


def members(clock):
    m = Membership(LEASE, clock)
    m.hold_when_servers_silent(HOLD)
    return m, m.join(Role.PS), m.join(Role.PS), m.join(Role.WORKER)


def test_every_server_silent_is_held_for_the_hold_then_expires(clock):
    m, ps0, ps1, w = members(clock)
    assert run(clock, m, LEASE + HOLD - 0.2) == ["worker-0"]    # the worker goes at its lease; no server
    assert ps0.live and ps1.live and m.isolations_held == 1
    assert sorted(run(clock, m, 0.5)) == ["ps-0", "ps-1"]        # past the hold: expired as before


def test_the_first_server_heard_again_ends_the_hold_and_the_others_get_a_lease_from_then(clock):
    m, ps0, ps1, w = members(clock)
    assert run(clock, m, 4.0, beating=[w]) == []                  # cut off from both servers, not the worker
    m.heartbeat(ps0.member_id)                                    # the partition heals: ps0's heartbeat first
    assert run(clock, m, LEASE - 0.2, beating=[w, ps0]) == []     # ps1 is not expired for the chief's silence
    assert run(clock, m, 0.4, beating=[w, ps0]) == ["ps-1"]       # still silent a lease later: it is gone
    assert ps0.live


def test_one_silent_server_expires_at_its_lease_as_before(clock):
    m, ps0, ps1, w = members(clock)
    assert run(clock, m, LEASE + 0.2, beating=[w, ps0]) == ["ps-1"]
    assert m.isolations_held == 0


def test_a_chief_cut_off_past_a_lease_loses_no_shard(clock):
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=LEASE), clock)
    s.members.hold_when_servers_silent(HOLD)
    ps = [s.join_ps(f"h:{i}")[0] for i in range(2)]
    routes = s.view().routes
    for _ in range(30):                         # 3 s: every lease lapses (the chief hears from nobody)
        clock.advance(0.1)
        s.tick()
    for p in ps:
        s.heartbeat(p.member_id)
    clock.advance(0.1)
    s.tick()
    assert not s.lost and all(s.members.get(p.member_id).live for p in ps)
    assert s.view().routes == routes


def test_without_the_hold_every_silent_server_expires_at_its_lease(clock):
    m = Membership(LEASE, clock)
    ps0, ps1 = m.join(Role.PS), m.join(Role.PS)
    assert sorted(run(clock, m, LEASE + 0.2)) == ["ps-0", "ps-1"]


@pytest.mark.parametrize("hold", [0.0, -1.0])
def test_a_hold_that_is_not_positive_is_refused(clock, hold):
    with pytest.raises(InvalidArgument, match="must be > 0"):
        Membership(LEASE, clock).hold_when_servers_silent(hold)
