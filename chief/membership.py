"""Members of the job and their leases, driven by an injected clock.

Lifecycle of a member (``MemberState``)::

    IDLE  --takes a task-----> ALIVE   (workers join IDLE: they hold no data yet)
    ALIVE --runs out of tasks-> IDLE    (sync rounds do not wait for idle workers)
    ALIVE/IDLE --heartbeat----> unchanged, lease renewed
    ALIVE/IDLE --leave--------> LEFT    (graceful: its tasks were returned first)
    ALIVE/IDLE --lease ends---> EXPIRED (crashed or cut off; it must join again)

LEFT and EXPIRED are final for that member id; a process that comes back joins
again (optionally asking for its old id, which it gets back if it has expired,
never after it left: a join racing its own leave gets a new id).

Besides leases, two sightings of a dropped connection end a worker early. A
process that dies (SIGKILL, OOM) has every socket closed by its kernel at once,
so the chief sees its view watch break off unanswered and a parameter server
sees its data channel close. Either alone may be a blip and only cuts the
lease to a third (:meth:`Membership.watch_closed`, :meth:`Membership.connection_lost`);
both within ``lease / 3`` of each other, with no heartbeat or new watch in
between, end it now. A process that died between two view watches (the window
is a few milliseconds) leaves no broken watch: a dropped data connection and
no watch open for ``lease / 6`` ends it then (:meth:`Membership.expire`).

Leases are judged by the chief's own clock, which runs on while the chief
itself does not (SIGSTOP, a long GC pause, a VM migration, a swapped-out
host): on waking, every lease would look lapsed before the heartbeats waiting
in its socket are read. So a chief that sees a gap in its own progress
(:meth:`Membership.bridge_pauses_over`: two lease checks further apart than
expected) extends every live lease by the gap first: time it did not run
counts against no one. For a lease of its own running time after such a gap
it cuts short no lease of a member it heard from since waking: the connections
its members saw break while it stood still (their keepalive pings went
unanswered) are its own doing, not theirs, so such a member expires only after
a full lease of the chief's running time without news. Heartbeats and cuts look
for the gap first, so a heartbeat and a broken watch handled before the next
lease check still count as after the pause.

Likewise a chief cut off from the network hears from no parameter server at
all: every server's lease lapses at once, and expiring them declares every
shard lost (with ``--recovery consistent``, a rollback to the checkpoint). One
server silent is that server's fault; all of them at once is more likely the
chief's own isolation. So when every live server's lease has lapsed, the chief
holds off expiring servers for up to ``hold_s`` more
(:meth:`Membership.hold_when_servers_silent`); the first server heard from
again ends the hold, and the others get a lease from then (the chief could not
have heard them before), after which a server still silent expires as usual.
"""
from __future__ import annotations

import heapq
import itertools
import logging
from typing import Callable, Iterable

from shoal.errors import InvalidArgument, NotFound
from shoal.members import Counters, Member, MemberState, Role

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, lease_seconds: float, clock: Callable[[], float]):
        if not lease_seconds > 0:
            raise InvalidArgument(f"lease must be > 0 seconds, got {lease_seconds}")
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._members: dict[str, Member] = {}
        # alive()'s answers, kept until a member joins or stops being live (``_live_changed``): views are
        # built from them on every change and every answer, and a scan of 1000 members' states per
        # call was most of a loaded chief's time (bench/chief_grpc.py, py-spy).
        self._alive: dict[Role | None, list[Member]] | None = None
        self.live_version = 0          # counts the changes to who is live (see ViewBoard's ranks)
        self._next_id = {Role.WORKER: 0, Role.PS: 0}
        # Lease deadlines, earliest first, so a lease check looks only at leases that may have run out
        # (``_due``): the sweep of every member ever seen cost 56 ms per check at 100k members
        # (bench/chief_scale.py). Lazy: a heartbeat moves a lease on without touching the heap; an
        # entry that comes due for a lease since renewed is pushed again at the new deadline, so a
        # member costs one pop and push per lease, not per heartbeat. A member's one valid entry is
        # the one whose sequence number ``_queued`` holds (a cut lease pushes an earlier entry and
        # leaves the old one to be skipped).
        self._deadlines: list[tuple[float, int, str]] = []
        self._queued: dict[str, int] = {}
        self._seq = itertools.count()
        self._rank: dict[str, int] = {}                # join order, for expiring in that order
        # Connection sightings (not journaled: a restarted chief has seen no connection yet).
        self._watches: dict[str, int] = {}
        self._watch_broken: dict[str, float] = {}
        self._conn_lost: dict[str, float] = {}
        self._dirty: dict[str, None] = {}              # members changed since the journal's last write
        self._max_gap_s: float | None = None           # see bridge_pauses_over
        self._last_check: float | None = None
        self._settle_until = float("-inf")          # a lease after a bridged pause: see _heard
        self._heard: set[str] = set()                  # members heard from since that pause: no cuts
        self.pauses_bridged = 0
        # How far behind the chief's own server is in taking calls (its event loop's lag, chief/aio.py):
        # a heartbeat that waited that long in the chief's queue was sent in time, so a lease is judged
        # that much later. Without it an overloaded chief expires members for its own backlog, they
        # join again, and the joins and view changes deepen the backlog (bench/chief_grpc.py).
        self.backlog_s = 0.0
        self._backlog_warned = 0.0
        self._servers_hold_s: float | None = None      # see hold_when_servers_silent
        self._servers_silent_since: float | None = None
        self.isolations_held = 0

    def _new_id(self, role: Role) -> str:
        n = self._next_id[role]
        self._next_id[role] = n + 1
        return f"{role.value}-{n}"

    def join(self, role: Role, address: str = "", host: str = "", member_id: str = "") -> Member:
        now = self._clock()
        old = self._members.get(member_id) if member_id else None
        if member_id:
            self._clear_sightings(member_id)
        if old is not None and old.live and old.role is role:
            old.lease_until = now + self.lease_seconds
            self._dirty[member_id] = None
            return old
        if old is not None and old.state is MemberState.LEFT:
            log.info("member %s left for good; a join asking for that id gets a new one", member_id)
        if not member_id or old is not None and (old.role is not role or old.state is MemberState.LEFT):
            member_id = self._new_id(role)
            while member_id in self._members:
                member_id = self._new_id(role)
        m = Member(member_id, role, address, host, now, now + self.lease_seconds,
                   state=MemberState.IDLE if role is Role.WORKER else MemberState.ALIVE,
                   counters=old.counters if old is not None else Counters())
        self._add(m)
        self._live_changed()
        self._dirty[member_id] = None
        log.info("member %s joined (%s%s)", member_id, role.value, f" at {address}" if address else "")
        return m

    def _add(self, m: Member) -> None:
        self._rank.setdefault(m.member_id, len(self._rank))
        self._members[m.member_id] = m
        if m.live:
            self._queue(m)

    def _queue(self, m: Member) -> None:
        """(Re)files ``m``'s lease deadline; any earlier entry of it is skipped when it comes due."""
        seq = next(self._seq)
        self._queued[m.member_id] = seq
        heapq.heappush(self._deadlines, (m.lease_until, seq, m.member_id))

    def _due(self, now: float, hold_servers: bool) -> list[Member]:
        """Live members whose lease has passed (judged ``backlog_s`` later), in join order; pops their
        entries (and stale ones) and files renewed leases again."""
        due, held = [], []
        heap = self._deadlines
        while heap and heap[0][0] + self.backlog_s < now:
            _, seq, mid = heapq.heappop(heap)
            if self._queued.get(mid) != seq:
                continue                               # superseded by a later entry of the same member
            m = self._members[mid]
            if not m.live:
                del self._queued[mid]
            elif m.lease_until + self.backlog_s >= now:
                self._queue(m)                         # renewed since it was filed
            elif hold_servers and m.role is Role.PS:
                held.append(m)
            else:
                del self._queued[mid]
                due.append(m)
        for m in held:
            self._queue(m)                             # still lapsed: due again at the next check
        return sorted(due, key=lambda m: self._rank[m.member_id])

    def heartbeat(self, member_id: str, counters: Counters | None = None) -> bool:
        """Renews the lease; False if the member is unknown or no longer alive."""
        m = self._members.get(member_id)
        if m is None or not m.live:
            return False
        now = self._clock()
        self._bridge_gap(now)          # a heartbeat read on waking is news from after the pause
        m.lease_until = now + self.lease_seconds
        if now < self._settle_until:
            self._heard.add(member_id)
        if counters is not None:
            m.counters = counters
        self._dirty[member_id] = None
        self._clear_sightings(member_id)         # it is alive, whatever its sockets did
        return True

    def leave(self, member_id: str, counters: Counters | None = None) -> Member:
        m = self._members.get(member_id)
        if m is None:
            raise NotFound(f"unknown member {member_id!r}")
        if counters is not None:
            m.counters = counters
        self._dirty[member_id] = None
        if m.live:
            m.state = MemberState.LEFT
            self._live_changed()
            log.info("member %s left", member_id)
        return m

    def expire(self) -> list[Member]:
        """Marks every member whose lease has passed as EXPIRED and returns them; also a worker whose
        data connection dropped and that has had no view watch open for ``lease / 6`` since (a live
        worker has one open nearly all the time: it re-opens it as soon as one is answered)."""
        now = self._clock()
        self._bridge_gap(now)
        self._warn_backlog(now)
        hold_servers = self._servers_silent(now)
        lapsed = self._due(now, hold_servers)
        for m in lapsed:
            log.info("member %s expired (no heartbeat for %.1fs)", m.member_id, self.lease_seconds)
        unwatched = []
        for k in list(self._conn_lost):                # the few workers a server saw drop their connection
            m = self._members.get(k)
            if m is None or not m.live:
                del self._conn_lost[k]                 # gone already: nothing left to judge
            elif m.lease_until + self.backlog_s >= now and self._lost_unwatched(k, now):
                unwatched.append(m)
        for m in unwatched:
            log.info("member %s expired (a parameter server saw its data connection drop and it has "
                     "not watched the view since: the process is gone)", m.member_id)
        gone = sorted(lapsed + unwatched, key=lambda m: self._rank[m.member_id]) if unwatched else lapsed
        for m in gone:
            m.state = MemberState.EXPIRED
            self._live_changed()
            self._dirty[m.member_id] = None
        return gone

    def _warn_backlog(self, now: float) -> None:
        if self.backlog_s > self.lease_seconds / 4 and now - self._backlog_warned > 60:
            self._backlog_warned = now
            log.warning("the chief is %.1fs behind in taking calls: leases are judged that much later. At this "
                        "many members (%d live) it needs a longer --lease-seconds (fewer heartbeats) or a faster "
                        "host", self.backlog_s, sum(1 for m in self._members.values() if m.live))

    def bridge_pauses_over(self, max_gap_s: float) -> None:
        """Lease checks (:meth:`expire`) are expected at most ``max_gap_s`` apart (the chief's ticker); a
        longer gap means the chief itself stood still, and every live lease is extended by it."""
        if not max_gap_s > 0:
            raise InvalidArgument(f"the gap that counts as a pause must be > 0 seconds, got {max_gap_s}")
        self._max_gap_s = max_gap_s

    def hold_when_servers_silent(self, hold_s: float) -> None:
        """When every live server's lease lapses at once, wait up to ``hold_s`` more before expiring any
        (the chief is more likely cut off itself than every server gone at the same moment)."""
        if not hold_s > 0:
            raise InvalidArgument(f"the hold for silent servers must be > 0 seconds, got {hold_s}")
        self._servers_hold_s = hold_s

    def _servers_silent(self, now: float) -> bool:
        """Whether to hold off expiring servers now: all of them silent past their lease, within the hold."""
        if self._servers_hold_s is None:
            return False
        servers = self.alive(Role.PS)
        if servers and all(m.lease_until < now for m in servers):
            if self._servers_silent_since is None:
                self._servers_silent_since = min(m.lease_until for m in servers)
                self.isolations_held += 1
                log.warning("no parameter server heard from for a lease: the chief is likely cut off itself; "
                            "holding off expiring them for up to %.1fs", self._servers_hold_s)
            if now - self._servers_silent_since <= self._servers_hold_s:
                return True
            self._servers_silent_since = None        # held long enough: they expire as usual
            return False
        if self._servers_silent_since is not None:
            # a server was heard from again (or joined): the others get a lease from now, as they could
            # not have been heard before
            self._servers_silent_since = None
            for m in servers:
                if m.lease_until < now + self.lease_seconds:
                    m.lease_until = now + self.lease_seconds
                    self._dirty[m.member_id] = None
            log.info("a parameter server was heard from again: the hold is over; every server has a lease from now")
        return False

    def _bridge_gap(self, now: float) -> None:
        last, self._last_check = self._last_check, now
        if self._max_gap_s is None or last is None or now - last <= self._max_gap_s:
            return
        gap = now - last
        self._settle_until = now + self.lease_seconds
        self._heard = set()
        extended = 0
        for m in self._members.values():
            if m.live:
                # never past a full lease from now: a member renewed since the wake keeps its own lease
                m.lease_until = max(m.lease_until, min(m.lease_until + gap, now + self.lease_seconds))
                self._dirty[m.member_id] = None
                extended += 1
        for seen in (self._watch_broken, self._conn_lost):     # sightings age only while the chief runs
            for k in seen:
                seen[k] += gap
        self.pauses_bridged += 1
        log.warning("the chief made no progress for %.1fs (paused, starved or migrated); extended %d lease(s) "
                    "by that much rather than expire members for its own silence", gap, extended)

    def _lost_unwatched(self, member_id: str, now: float) -> bool:
        at = self._conn_lost.get(member_id)
        return at is not None and not self.watching(member_id) and now - at >= self.lease_seconds / 6

    def cut_lease(self, member_id: str, left_s: float) -> bool:
        """Its connection broke: the lease ends in ``left_s`` unless a heartbeat renews it first."""
        m = self._members.get(member_id)
        if m is None or not m.live:
            return False
        now = self._clock()
        self._bridge_gap(now)          # a pause not yet seen by a lease check is seen now
        if now < self._settle_until and member_id in self._heard:
            log.debug("member %s: connection closed within a lease of the chief's own pause, and heard from "
                      "since: lease not cut", member_id)
            return False
        until = now + left_s
        if until < m.lease_until:
            m.lease_until = until
            self._queue(m)                             # earlier than its entry: filed again
            self._dirty[member_id] = None
            log.debug("member %s: connection closed; lease cut to %.2fs", member_id, left_s)
        return True

    def watch_opened(self, member_id: str) -> None:
        """The member watches the view (again): an earlier broken watch was a blip."""
        self._watches[member_id] = self._watches.get(member_id, 0) + 1
        self._watch_broken.pop(member_id, None)

    def watching(self, member_id: str) -> bool:
        """Whether the member has a view watch open now."""
        return self._watches.get(member_id, 0) > 0

    def watch_closed(self, member_id: str, answered: bool) -> bool:
        """A view watch ended. Unanswered (it broke off), the lease is cut to a third; True if a
        parameter server saw the member's data connection drop too (recently, with no sign of life
        since): the caller ends it now."""
        left = self._watches.get(member_id, 0) - 1
        if left > 0:
            self._watches[member_id] = left
        else:
            self._watches.pop(member_id, None)
        if answered or not self.cut_lease(member_id, self.lease_seconds / 3):
            return False
        self._watch_broken[member_id] = self._clock()
        return self._recent(self._conn_lost, member_id)

    def connection_lost(self, member_id: str) -> bool:
        """A parameter server saw the worker drop its data connection: its lease is cut to a third.
        True if its view watch broke off too (recently, with no sign of life since): the caller ends
        it now."""
        m = self._members.get(member_id)
        if m is None or not m.live or m.role is not Role.WORKER:
            return False
        if not self.cut_lease(member_id, self.lease_seconds / 3):
            return False                   # within a lease of the chief's own pause: not a sighting
        self._conn_lost[member_id] = self._clock()
        return self._recent(self._watch_broken, member_id)

    def _recent(self, seen: dict[str, float], member_id: str) -> bool:
        at = seen.get(member_id)
        return at is not None and self._clock() - at <= self.lease_seconds / 3

    def _clear_sightings(self, member_id: str) -> None:
        self._watch_broken.pop(member_id, None)
        self._conn_lost.pop(member_id, None)

    def expire_now(self, member_id: str, why: str) -> Member | None:
        """Ends a live member's lease at once (the chief could not reach it); None if it was not live."""
        m = self._members.get(member_id)
        if m is None or not m.live:
            return None
        m.state = MemberState.EXPIRED
        self._live_changed()
        self._dirty[member_id] = None
        log.info("member %s expired (%s)", member_id, why)
        return m

    def get(self, member_id: str) -> Member:
        m = self._members.get(member_id)
        if m is None:
            raise NotFound(f"unknown member {member_id!r}")
        return m

    def find(self, member_id: str) -> Member | None:
        return self._members.get(member_id)

    def set_busy(self, member_id: str, busy: bool) -> bool:
        """ALIVE <-> IDLE for a live worker; True if the state changed."""
        m = self.get(member_id)
        new = MemberState.ALIVE if busy else MemberState.IDLE
        if not m.live or m.state is new:
            return False
        m.state = new
        self._dirty[member_id] = None
        log.debug("member %s is %s", member_id, new.value)
        return True

    def _live_changed(self) -> None:
        self._alive = None
        self.live_version += 1

    def alive(self, role: Role | None = None) -> list[Member]:
        """Members holding a lease (ALIVE or IDLE), in the order they joined (a new list each call)."""
        if self._alive is None:
            live = [m for m in self._members.values() if m.live]
            self._alive = {None: live, **{r: [m for m in live if m.role is r] for r in Role}}
        return list(self._alive[role])

    def all(self, role: Role | None = None) -> Iterable[Member]:
        return [m for m in self._members.values() if role is None or m.role is role]

    # ------------------------------------------------------------ persistence

    def to_dict(self) -> dict:
        """JSON-able state. Clock values are stored relative to now (the clock may not survive a restart)."""
        now = self._clock()
        return {
            **self.meta(),
            "members": [{"member_id": m.member_id, "role": m.role.value, "address": m.address, "host": m.host,
                         "joined_ago": now - m.joined_at, "lease_left": m.lease_until - now,
                         "state": m.state.value, "counters": m.counters.to_dict()}
                        for m in self._members.values()],
        }

    def take_changed(self) -> list[dict]:
        """The members changed since the last call, as journal rows with the clock's own times (the
        journal turns them into times relative to its last write when it loads them); clears the list."""
        rows = [{"member_id": m.member_id, "role": m.role.value, "address": m.address, "host": m.host,
                 "joined_at": m.joined_at, "lease_until": m.lease_until, "state": m.state.value,
                 "counters": m.counters.to_dict()}
                for m in (self._members[k] for k in self._dirty)]
        self._dirty = {}
        return rows

    def meta(self) -> dict:
        """:meth:`to_dict` without the members (a journal row of its own, see take_changed)."""
        return {"lease_seconds": self.lease_seconds, "next_id": {r.value: n for r, n in self._next_id.items()}}

    @staticmethod
    def entry_from_row(row: dict, now: float) -> dict:
        """A :meth:`take_changed` row as a :meth:`to_dict` entry at clock time ``now``."""
        e = {k: v for k, v in row.items() if k not in ("joined_at", "lease_until")}
        e["joined_ago"] = now - row["joined_at"]
        e["lease_left"] = row["lease_until"] - now
        return {k: e[k] for k in ("member_id", "role", "address", "host", "joined_ago", "lease_left", "state",
                                  "counters")}

    @classmethod
    def from_dict(cls, d: dict, clock: Callable[[], float], fresh_leases: bool = False) -> "Membership":
        """Inverse of :meth:`to_dict`; ``fresh_leases`` grants every live member a full lease from now."""
        ms = cls(float(d["lease_seconds"]), clock)
        now = clock()
        ms._next_id = {Role(r): int(n) for r, n in d["next_id"].items()}
        for e in d["members"]:
            m = Member(e["member_id"], Role(e["role"]), e["address"], e["host"], now - float(e["joined_ago"]),
                       now + float(e["lease_left"]), MemberState(e["state"]), Counters(**e["counters"]))
            if fresh_leases and m.live:
                m.lease_until = now + ms.lease_seconds
            ms._add(m)
        return ms
