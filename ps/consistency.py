"""Consistency rules: when a push is admitted and when an open round closes.

Pure functions of a :class:`PushContext`; :class:`shoal.ps.shard.Shard` holds
the state and carries out the decisions.

- ``async``: every admitted push is applied at once.
- ``sync``: one update per round from the gradients of the busy workers,
  averaged. A push computed on an older version is dropped (stale). With
  ``backup_workers = b`` the round closes after ``len(live) - b`` gradients and
  the late ones are dropped (Chen et al. 2016); the worker re-queues them.
- ``ssp``: applied at once, but a worker whose clock (pushes applied) is more
  than ``staleness`` ahead of the slowest busy worker waits until it is not.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import AbstractSet, Mapping

from shoal.settings.config import JobConfig
from shoal.errors import InvalidArgument


class Action(str, enum.Enum):
    ACCUMULATE = "accumulate"   # add to the open round
    DROP = "drop"               # not applied; the reply says why
    WAIT = "wait"               # not yet: retry when the state changes


@dataclass(frozen=True)
class Admission:
    action: Action
    reason: str = ""


@dataclass(frozen=True)
class PushContext:
    worker: str
    push_version: int
    shard_version: int
    contributors: AbstractSet[str] = frozenset()
    live: AbstractSet[str] = frozenset()
    clocks: Mapping[str, int] = field(default_factory=dict)


ACCEPT = Admission(Action.ACCUMULATE)


class Rule:
    name = "base"

    def admit(self, ctx: PushContext) -> Admission:
        raise NotImplementedError

    def round_complete(self, contributors: AbstractSet[str], live: AbstractSet[str]) -> bool:
        """Async-style rules apply every admitted push at once."""
        return bool(contributors)

    @staticmethod
    def _not_ahead(ctx: PushContext) -> None:
        if ctx.push_version > ctx.shard_version:
            raise InvalidArgument(f"push computed on version {ctx.push_version}, shard is at {ctx.shard_version}")


class AsyncRule(Rule):
    name = "async"

    def admit(self, ctx: PushContext) -> Admission:
        self._not_ahead(ctx)
        return ACCEPT


class SSPRule(Rule):
    name = "ssp"

    def __init__(self, staleness: int):
        if staleness < 0:
            raise InvalidArgument(f"--staleness must be >= 0, got {staleness}")
        self.staleness = staleness

    def admit(self, ctx: PushContext) -> Admission:
        self._not_ahead(ctx)
        others = [ctx.clocks.get(w, 0) for w in ctx.live if w != ctx.worker]
        if not others:
            return ACCEPT
        mine, slowest = ctx.clocks.get(ctx.worker, 0), min(others)
        if mine - slowest > self.staleness:
            return Admission(Action.WAIT, f"worker {ctx.worker} at clock {mine} is more than {self.staleness} "
                                          f"ahead of the slowest live worker ({slowest})")
        return ACCEPT


class SyncRule(Rule):
    name = "sync"

    def __init__(self, backup_workers: int = 0):
        self.backup_workers = backup_workers

    def admit(self, ctx: PushContext) -> Admission:
        self._not_ahead(ctx)
        if ctx.push_version < ctx.shard_version:
            return Admission(Action.DROP, f"stale: round {ctx.push_version} closed, shard at {ctx.shard_version}")
        if ctx.worker in ctx.contributors:
            return Admission(Action.DROP, f"worker {ctx.worker} already pushed in round {ctx.shard_version}")
        return ACCEPT

    def round_complete(self, contributors, live):
        if not contributors:
            return False
        if not live or live <= contributors:
            return True
        return len(contributors & live) >= max(1, len(live) - self.backup_workers)


def rule_for(job: JobConfig) -> Rule:
    if job.mode == "sync":
        return SyncRule(job.backup_workers)
    if job.mode == "async":
        return AsyncRule()
    return SSPRule(job.staleness)
