"""The cluster view the chief publishes: members, shard routes, and the job, under an epoch.

Every change the chief makes to what the view shows bumps ``epoch``; workers
and parameter servers follow the newest epoch they have seen.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from shoal.settings.config import JobConfig
from shoal.members import Member


@dataclass(frozen=True)
class Route:
    shard: int
    member_id: str
    address: str
    backup_id: str = ""
    backup_address: str = ""
    backup_complete: bool = False       # its primary reported the backup's copy whole (promotable)


@dataclass(frozen=True)
class View:
    epoch: int
    members: tuple[Member, ...]
    routes: tuple[Route, ...]
    ready: bool
    job: JobConfig
    fingerprint: str
    completed_epochs: int = 0
    stragglers: frozenset[str] = frozenset()
    step_seconds: Mapping[str, float] = field(default_factory=dict)
    job_id: str = ""            # the job that publishes it and its chief's generation (chief/identity.py)
    generation: int = 0
    excluded: frozenset[str] = frozenset()     # workers sync rounds close without (chief/stragglers.py)
    job_phase: str = ""            # chief/lifecycle.py's Phase once the job ended ("finished", "closing")
    job_result: str = ""
    job_exit_code: int = 0
