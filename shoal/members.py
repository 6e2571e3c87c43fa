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
