"""Consistency rules: when a push is admitted and when an open round closes.

Pure functions of the shard's version, the round's contributors and the live
workers; :class:`ps.shard.Shard` holds the state and applies the decisions.

- ``async``: every admitted push is applied at once.
- ``sync``: one update per round from the gradients of the live workers,
  averaged. A push computed on an older version is dropped (stale). With
  ``backup_workers = b`` the round closes after ``len(live) - b`` gradients.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import AbstractSet

from shoal.config import JobConfig
from shoal.errors import InvalidArgument


class Action(str, enum.Enum):
    ACCUMULATE = "accumulate"   # add to the open round
    DROP = "drop"               # not applied; the reply says why


@dataclass(frozen=True)
class Admission:
    action: Action
    reason: str = ""


class Rule:
    name = "base"

    def admit(self, push_version: int, shard_version: int, worker: str,
              contributors: AbstractSet[str]) -> Admission:
        raise NotImplementedError

    def round_complete(self, contributors: AbstractSet[str], live: AbstractSet[str]) -> bool:
        raise NotImplementedError


class AsyncRule(Rule):
    name = "async"

    def admit(self, push_version, shard_version, worker, contributors):
        if push_version > shard_version:
            raise InvalidArgument(f"push computed on version {push_version}, shard is at {shard_version}")
        return Admission(Action.ACCUMULATE)

    def round_complete(self, contributors, live):
        return bool(contributors)


class SyncRule(Rule):
    name = "sync"

    def __init__(self, backup_workers: int = 0):
        self.backup_workers = backup_workers

    def admit(self, push_version, shard_version, worker, contributors):
        if push_version > shard_version:
            raise InvalidArgument(f"push computed on version {push_version}, shard is at {shard_version}")
        if push_version < shard_version:
            return Admission(Action.DROP, f"stale: round {push_version} closed, shard at {shard_version}")
        if worker in contributors:
            return Admission(Action.DROP, f"worker {worker} already pushed in round {shard_version}")
        return Admission(Action.ACCUMULATE)

    def round_complete(self, contributors, live):
        if not contributors:
            return False
        if not live:
            return True
        if live <= contributors:
            return True
        return len(contributors & live) >= max(1, len(live) - self.backup_workers)


def rule_for(job: JobConfig) -> Rule:
    if job.mode == "sync":
        return SyncRule(job.backup_workers)
    if job.mode == "async":
        return AsyncRule()
    raise InvalidArgument(f"mode {job.mode!r} is not supported by this parameter server yet")
