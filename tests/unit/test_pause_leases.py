"""Leases judged on the chief's running time (issue 40): a chief that stood still cuts no lease short for a
lease after it wakes; a member heard from since keeps a whole lease of the chief's running time."""
from shoal.chief.membership import Membership
from shoal.members import Role

LEASE = 1.5


def _member_after_a_pause(clock, pause_s: float):
    m = Membership(LEASE, clock)
    m.bridge_pauses_over(0.6)                  # the ticker checks every 0.2 s
    w = m.join(Role.WORKER)
    m.watch_opened(w.member_id)
    for _ in range(5):
        clock.advance(0.2)
        m.heartbeat(w.member_id)
        assert m.expire() == []
    clock.advance(pause_s)                     # SIGSTOP (or starved): no tick, no call read
    return m, w


def test_a_watch_broken_by_the_chiefs_own_pause_does_not_expire_a_member_heard_from_after_it(clock):
    """The probe's case: paused 3 s, the worker's heartbeat read on waking, then its view watch (whose
    keepalive pings went unanswered during the pause) reported broken: it was expired 0.58 s later."""
    for pause in (3.0, 10.0):
        m, w = _member_after_a_pause(clock, pause)
        m.heartbeat(w.member_id)               # read before the ticker saw the gap
        heard = clock()
        assert m.watch_closed(w.member_id, answered=False) is False     # not cut, not a sighting
        assert m.connection_lost(w.member_id) is False                  # a server's sighting neither
        while clock() + 0.1 - heard < LEASE - 0.05:     # no news for just under a lease of running time
            clock.advance(0.1)
            assert m.expire() == [], f"expired {clock() - heard:.2f}s after its heartbeat ({pause} s pause)"
        clock.advance(0.2)                     # a full lease without news: it goes
        assert [x.member_id for x in m.expire()] == [w.member_id]

    # and a lease of running time after the wake, the fast path is back: both sightings end a worker at once
    m, w = _member_after_a_pause(clock, 3.0)
    for _ in range(int(LEASE / 0.2) + 3):
        clock.advance(0.2)
        m.heartbeat(w.member_id)
        assert m.expire() == []
    assert m.watch_closed(w.member_id, answered=False) is False      # cut to a third, a first sighting
    assert m.connection_lost(w.member_id) is True                     # both: the caller ends it now
