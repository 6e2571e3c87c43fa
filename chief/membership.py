"""Members of the job and their leases, driven by an injected clock.

Lifecycle of a member (``MemberState``)::

    IDLE  --takes a task-----> ALIVE   (workers join IDLE: they hold no data yet)
    ALIVE --runs out of tasks-> IDLE    (sync rounds do not wait for idle workers)
    ALIVE/IDLE --heartbeat----> unchanged, lease renewed
    ALIVE/IDLE --leave--------> LEFT    (graceful: its tasks were returned first)
    ALIVE/IDLE --lease ends---> EXPIRED (crashed or cut off; it must join again)

LEFT and EXPIRED are final for that member id; a process that comes back joins
again (optionally asking for its old id, which it gets back if it has expired).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

from shoal.errors import InvalidArgument, NotFound

log = logging.getLogger(__name__)


class Role(str, enum.Enum):
    WORKER = "worker"
    PS = "ps"


class MemberState(str, enum.Enum):
    ALIVE = "alive"
    IDLE = "idle"
    LEFT = "left"
    EXPIRED = "expired"


@dataclass
class Counters:
    steps: int = 0
    samples: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0


@dataclass
class Member:
    member_id: str
    role: Role
    address: str
    host: str
    joined_at: float
    lease_until: float
    state: MemberState = MemberState.ALIVE
    counters: Counters = field(default_factory=Counters)

    @property
    def live(self) -> bool:
        return self.state in (MemberState.ALIVE, MemberState.IDLE)


class Membership:
    def __init__(self, lease_seconds: float, clock: Callable[[], float]):
        if not lease_seconds > 0:
            raise InvalidArgument(f"lease must be > 0 seconds, got {lease_seconds}")
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._members: dict[str, Member] = {}
        self._next_id = {Role.WORKER: 0, Role.PS: 0}

    def _new_id(self, role: Role) -> str:
        n = self._next_id[role]
        self._next_id[role] = n + 1
        return f"{role.value}-{n}"

    def join(self, role: Role, address: str = "", host: str = "", member_id: str = "") -> Member:
        now = self._clock()
        old = self._members.get(member_id) if member_id else None
        if old is not None and old.live and old.role is role:
            old.lease_until = now + self.lease_seconds
            return old
        if not member_id or old is not None and old.role is not role:
            member_id = self._new_id(role)
            while member_id in self._members:
                member_id = self._new_id(role)
        m = Member(member_id, role, address, host, now, now + self.lease_seconds,
                   state=MemberState.IDLE if role is Role.WORKER else MemberState.ALIVE,
                   counters=old.counters if old is not None else Counters())
        self._members[member_id] = m
        log.info("member %s joined (%s%s)", member_id, role.value, f" at {address}" if address else "")
        return m

    def heartbeat(self, member_id: str, counters: Counters | None = None) -> bool:
        """Renews the lease; False if the member is unknown or no longer alive."""
        m = self._members.get(member_id)
        if m is None or not m.live:
            return False
        m.lease_until = self._clock() + self.lease_seconds
        if counters is not None:
            m.counters = counters
        return True

    def leave(self, member_id: str, counters: Counters | None = None) -> Member:
        m = self._members.get(member_id)
        if m is None:
            raise NotFound(f"unknown member {member_id!r}")
        if counters is not None:
            m.counters = counters
        if m.live:
            m.state = MemberState.LEFT
            log.info("member %s left", member_id)
        return m

    def expire(self) -> list[Member]:
        """Marks every member whose lease has passed as EXPIRED and returns them."""
        now = self._clock()
        gone = [m for m in self._members.values() if m.live and m.lease_until < now]
        for m in gone:
            m.state = MemberState.EXPIRED
            log.info("member %s expired (no heartbeat for %.1fs)", m.member_id, self.lease_seconds)
        return gone

    def cut_lease(self, member_id: str, left_s: float) -> bool:
        """Its connection broke: the lease ends in ``left_s`` unless a heartbeat renews it first."""
        m = self._members.get(member_id)
        if m is None or not m.live:
            return False
        until = self._clock() + left_s
        if until < m.lease_until:
            m.lease_until = until
            log.debug("member %s: connection closed; lease cut to %.2fs", member_id, left_s)
        return True

    def expire_now(self, member_id: str, why: str) -> Member | None:
        """Ends a live member's lease at once (the chief could not reach it); None if it was not live."""
        m = self._members.get(member_id)
        if m is None or not m.live:
            return None
        m.state = MemberState.EXPIRED
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
        log.debug("member %s is %s", member_id, new.value)
        return True

    def alive(self, role: Role | None = None) -> list[Member]:
        """Members holding a lease (ALIVE or IDLE)."""
        return [m for m in self._members.values() if m.live and (role is None or m.role is role)]

    def all(self, role: Role | None = None) -> Iterable[Member]:
        return [m for m in self._members.values() if role is None or m.role is role]

    # ------------------------------------------------------------ persistence

    def to_dict(self) -> dict:
        """JSON-able state. Clock values are stored relative to now (the clock may not survive a restart)."""
        now = self._clock()
        return {
            "lease_seconds": self.lease_seconds,
            "next_id": {r.value: n for r, n in self._next_id.items()},
            "members": [{"member_id": m.member_id, "role": m.role.value, "address": m.address, "host": m.host,
                         "joined_ago": now - m.joined_at, "lease_left": m.lease_until - now,
                         "state": m.state.value, "counters": dataclasses.asdict(m.counters)}
                        for m in self._members.values()],
        }

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
            ms._members[m.member_id] = m
        return ms
