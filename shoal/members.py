"""Who is in a job: member roles, lifecycle states and counters, as every role sees them.

The chief owns the membership (``shoal.chief.membership``); workers and
parameter servers read members from the cluster view. Lifecycle
(``MemberState``): IDLE <-> ALIVE while the lease is renewed; LEFT (graceful)
and EXPIRED (lease ended) are final for that member id.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Role(str, enum.Enum):
    WORKER = "worker"
    PS = "ps"


def id_order(member_id: str) -> tuple:
    """Sort key for member ids by their number: ``worker-10`` after ``worker-9``."""
    head, _, tail = member_id.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (member_id, -1)


def ranks(member_ids) -> dict[str, int]:
    """Each id's place among ``member_ids`` in :func:`id_order`."""
    return {m: i for i, m in enumerate(sorted(set(member_ids), key=id_order))}


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

    def to_dict(self) -> dict[str, int]:
        """The fields by name: ``dataclasses.asdict`` without its deep copy, which cost the chief's
        snapshot of 10 000 members half of its time (bench/chief_snapshot.py)."""
        return {"steps": self.steps, "samples": self.samples, "bytes_pushed": self.bytes_pushed,
                "bytes_pulled": self.bytes_pulled}


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
