"""The lease check looks only at leases that may have run out (chief/membership.py's heap of deadlines)
and finds exactly what a sweep of every member would: a random life of a small cluster (joins, heartbeats,
leaves, broken watches and connections, pauses, the chief's backlog, restarts from its own snapshot),
driven by hypothesis with a fake clock, checked against that sweep after every lease check."""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shoal.chief.membership import Membership, Role

LEASE = 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Leases(RuleBasedStateMachine):
    @initialize(hold=st.booleans(), bridge=st.booleans())
    def start(self, hold, bridge):
        self.clock = Clock()
        self.ms = Membership(LEASE, self.clock)
        self.hold, self.bridge = hold, bridge
        self._configure(self.ms)
        self.ids: list[str] = []
        for role in (Role.PS, Role.WORKER, Role.PS, Role.WORKER, Role.WORKER):
            self.ids.append(self.ms.join(role).member_id)

    def _configure(self, ms):
        if self.hold:
            ms.hold_when_servers_silent(2 * LEASE)
        if self.bridge:
            ms.bridge_pauses_over(1.5)

    def _pick(self, i):
        return self.ids[i % len(self.ids)]          # never empty: five members join at the start

    @rule(role=st.sampled_from([Role.WORKER, Role.WORKER, Role.PS]), again=st.integers(0, 20))
    def join(self, role, again):
        old = self._pick(again) if again % 3 == 0 else ""
        m = self.ms.join(role, member_id=old or "")
        if m.member_id not in self.ids:
            self.ids.append(m.member_id)

    @rule(i=st.integers(0, 50))
    def heartbeat(self, i):
        self.ms.heartbeat(self._pick(i))

    @rule(mask=st.integers(0, 255))
    def heartbeat_some(self, mask):
        """Heartbeats from some members (bit i: the i-th to join): leases come due out of join order, and
        servers fall silent together while workers go on (the hold)."""
        for i, mid in enumerate(self.ids[:8]):
            if mask >> i & 1:
                self.ms.heartbeat(mid)

    @rule(steps=st.integers(1, 20))
    def servers_fall_silent(self, steps):
        """The chief ticks every 0.5 s and hears its workers but no server (it may be cut off itself)."""
        for _ in range(steps):
            self.clock.now += 0.5
            for mid in self.ids:
                if self.ms.get(mid).role is Role.WORKER:
                    self.ms.heartbeat(mid)
            self.check()

    @rule(i=st.integers(0, 50))
    def leave(self, i):
        self.ms.leave(self._pick(i))

    @rule(i=st.integers(0, 50), answered=st.booleans())
    def watch(self, i, answered):
        mid = self._pick(i)
        self.ms.watch_opened(mid)
        self.ms.watch_closed(mid, answered)

    @rule(i=st.integers(0, 50))
    def connection_lost(self, i):
        self.ms.connection_lost(self._pick(i))

    @rule(i=st.integers(0, 50))
    def expire_now(self, i):
        self.ms.expire_now(self._pick(i), "test")

    @rule(dt=st.sampled_from([0.05, 0.2, 0.5, 1.0, 1.01, 2.9, 3.0, 4.0, 10.0]))
    def advance(self, dt):
        self.clock.now += dt

    @rule(backlog=st.sampled_from([0.0, 0.0, 0.4, 1.5]))
    def backlog(self, backlog):
        self.ms.backlog_s = backlog

    @rule()
    def restart(self):
        """A chief restarted from its snapshot judges the same leases (its heap is rebuilt)."""
        ms = Membership.from_dict(self.ms.to_dict(), self.clock)
        ms.backlog_s = self.ms.backlog_s
        self._configure(ms)
        self.ms = ms

    @rule()
    def check(self):
        ms, now = self.ms, self.clock.now
        live = [m for m in ms.all() if m.live]
        lapsed = {m.member_id for m in live if m.lease_until + ms.backlog_s < now}
        unwatched = {m.member_id for m in live if ms._lost_unwatched(m.member_id, now)} - lapsed
        servers = [m for m in live if m.role is Role.PS]
        may_hold = self.hold and servers and all(m.lease_until < now for m in servers)
        hold_ends = ms._servers_silent_since is not None and not may_hold   # the others get a lease
        gap_bridged = self.bridge and ms._last_check is not None and now - ms._last_check > 1.5
        gone = ms.expire()
        got = [m.member_id for m in gone]
        assert len(got) == len(set(got)), got
        assert got == sorted(got, key=[m.member_id for m in ms.all()].index), "not in join order"
        if gap_bridged:                    # leases were extended first: a subset of the sweep's answer
            assert set(got) <= lapsed | unwatched
            return
        lapsed_ps = {k for k in lapsed if ms.get(k).role is Role.PS}
        assert set(got) - lapsed_ps == (lapsed | unwatched) - lapsed_ps
        # servers: the lapsed ones expire, unless every server is silent (the chief may be the one cut
        # off): then, within the hold, none does; a server heard again ends the hold with a lease for all
        assert set(got) & lapsed_ps in ((set(), lapsed_ps) if may_hold else (set(),) if hold_ends else (lapsed_ps,))

    @invariant()
    def every_live_lease_is_filed_no_later_than_it_ends(self):
        ms = getattr(self, "ms", None)
        if ms is None:
            return
        filed = {}
        for deadline, seq, mid in ms._deadlines:
            if ms._queued.get(mid) == seq:
                assert mid not in filed, f"{mid} filed twice"
                filed[mid] = deadline
        for m in ms.all():
            if m.live:
                assert m.member_id in filed and filed[m.member_id] <= m.lease_until, m


TestLeases = Leases.TestCase
TestLeases.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])


def test_a_lease_check_at_many_members_looks_at_the_due_ones_only():
    """10 000 members heartbeating: a check with nothing due pops nothing; each lease is filed once."""
    clock = Clock()
    ms = Membership(LEASE, clock)
    ids = [ms.join(Role.WORKER).member_id for _ in range(10_000)]
    assert len(ms._deadlines) == 10_000
    for _ in range(9):                               # 3 leases of heartbeats, every lease / 3
        clock.now += LEASE / 3
        for k in ids:
            ms.heartbeat(k)
        assert ms.expire() == []
    # each member's entry came due once a lease and was filed again: the heap holds one per member
    assert len(ms._deadlines) == 10_000
    popped = []
    real = ms._queue
    ms._queue = lambda m: (popped.append(m.member_id), real(m))
    clock.now += 0.2
    assert ms.expire() == [] and popped == []        # nothing was due: nothing looked at


# ---- exact edges of the heap's checks (fake clock, floats exact in binary), each a mutation survivor

def test_a_lease_renewed_since_it_was_filed_is_judged_with_the_backlog_at_its_exact_end(caplog):
    clock = Clock()
    ms = Membership(LEASE, clock)
    w = ms.join(Role.WORKER)                         # filed at 1003.0
    clock.now = 1002.0
    ms.heartbeat(w.member_id)                        # 1005.0, still filed at 1003.0
    ms.backlog_s = 1.0                               # the chief is 1 s behind: judged 1 s later
    clock.now = 1006.0                               # the entry is due; the lease ends exactly now
    assert ms.expire() == [] and w.live
    clock.now = 1006.5
    with caplog.at_level("INFO", logger="shoal.chief.membership"):
        assert ms.expire() == [w]
    assert f"member {w.member_id} expired (no heartbeat for 3.0s)" in caplog.text


def test_a_worker_whose_connection_dropped_ends_by_that_sighting_up_to_its_lease_end_with_the_backlog(caplog):
    clock = Clock()
    ms = Membership(LEASE, clock)
    w = ms.join(Role.WORKER)
    ms.connection_lost(w.member_id)                  # not watching: the lease is cut to 1001.0
    ms.backlog_s = 1.0
    clock.now = 1002.0                               # not lapsed (1001 + 1 is not before 1002)
    with caplog.at_level("INFO", logger="shoal.chief.membership"):
        assert ms.expire() == [w]
    assert "saw its data connection drop and it has not watched the view since" in caplog.text
    assert "no heartbeat" not in caplog.text


def test_a_worker_ended_at_once_after_its_connection_dropped_is_not_ended_again():
    clock = Clock()
    ms = Membership(LEASE, clock)
    w = ms.join(Role.WORKER)
    ms.connection_lost(w.member_id)
    assert ms.expire_now(w.member_id, "the chief could not reach it") is w
    clock.now += LEASE / 6
    assert ms.expire() == [] and not w.live
    assert ms.expire() == []


def test_when_a_silent_server_is_heard_again_every_other_server_gets_a_lease_from_then():
    clock = Clock()
    ms = Membership(LEASE, clock)
    ms.hold_when_servers_silent(6.0)
    a, b = ms.join(Role.PS), ms.join(Role.PS)        # both until 1003.0
    clock.now = 1004.0
    assert ms.expire() == [] and ms.isolations_held == 1          # all silent: held
    ms.heartbeat(a.member_id)
    assert ms.expire() == [] and b.live
    assert b.lease_until == 1004.0 + LEASE


def test_a_hold_under_a_second_is_taken():
    ms = Membership(LEASE, Clock())
    ms.hold_when_servers_silent(0.5)
    assert ms._servers_hold_s == 0.5


def test_every_change_to_who_is_live_moves_the_live_version():
    """ViewBoard keeps the workers' ranks until this moves (chief/views.py)."""
    clock = Clock()
    ms = Membership(LEASE, clock)
    seen = [ms.live_version]
    a, b, c = (ms.join(Role.WORKER) for _ in range(3))
    seen.append(ms.live_version)
    ms.leave(a.member_id)
    seen.append(ms.live_version)
    ms.expire_now(b.member_id, "test")
    seen.append(ms.live_version)
    clock.now += 2 * LEASE
    assert ms.expire() == [c]
    seen.append(ms.live_version)
    assert seen == sorted(set(seen)), seen
