"""Straggler detection from what the job waits on, and what is done about a straggler.

Pure: the chief's state feeds it heartbeats (workers' step times, servers' round blame) and reads
the stragglers and what to do with them; the clock is injected.

- **sync**: every worker's step takes as long as the round, so step times say nothing. What a round
  waits on is each worker's own time a step (outside ``trainer.step()``: data, forward, backward),
  which workers report: a worker is a straggler when its own time is ``factor`` times the median of
  the others' and the servers, timing their rounds (ps/round_timing.py), found it the last to push
  in at least ``LAST_SHARE`` of the ``MIN_ROUNDS`` or more they timed (the line says how long they
  waited for it). Nobody is judged before the rounds were timed: a worker's first steps are slow. Round timing alone would not do: with pushes
  overlapping backward, equally fast workers settle into a fixed order, one always last.
- **async / ssp**: a worker is a straggler when its mean step time is ``factor`` times the median of
  the *other* workers' (with two workers: the other one's), so any number of workers works.

Only workers with ``MIN_STEPS`` steps are judged. A worker found a straggler ``HOLD`` observations
in a row is flagged (one line), cleared after ``HOLD`` observations in a row that find it not slow,
and acted on according to ``action``:

- ``flag``: shown in ``shoal status`` and the view; nothing else.
- ``backup``: sync rounds close without it (the servers leave it out of the workers a round waits
  for; a gradient of it that arrives after its round closed is dropped and its batch re-queued, as with
  ``--backup-workers``); in ssp, the others no longer wait for its clock. Never all workers at once.
- ``evict``: it is asked to leave (the reply to its heartbeat): it hands back its task, leaves and
  exits 0; its tasks go back to the queue. One at a time, and never the last worker.

A straggler that is no longer slow (its blame or step time falls back) is cleared, and so is a flag
for a worker that left.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping

from shoal.errors import InvalidArgument

log = logging.getLogger(__name__)

ACTIONS = ("flag", "backup", "evict")
LAST_SHARE = 0.5      # sync: the share of recent rounds that waited for it last
MIN_ROUNDS = 8        # sync: rounds timed before anyone is judged
HOLD = 5              # observations in a row (ticks of the chief) before a flag is raised, or cleared
MIN_STEPS = 20        # a worker is judged only after this many steps: the first ones are slow for reasons of their own


@dataclass(frozen=True)
class StragglerPolicy:
    factor: float = 2.0
    action: str = "flag"

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise InvalidArgument(f"straggler_detection.factor must be > 1, got {self.factor}")
        if self.action not in ACTIONS:
            raise InvalidArgument(f"straggler_detection.action {self.action!r} is not one of {', '.join(ACTIONS)}")

    @classmethod
    def from_section(cls, section: Mapping) -> "StragglerPolicy":
        return cls(**dict(section))


@dataclass(frozen=True)
class RoundBlame:
    """A server's word on one shard's recent sync rounds (ps/round_timing.py's Blame, per shard)."""

    shard: int
    worker: str
    rounds: int
    last: int
    ratio: float
    waited_s: float


class StragglerDetector:
    def __init__(self, policy: StragglerPolicy | None = None, sync: bool = True):
        self.policy = policy or StragglerPolicy()
        self.sync = sync
        self.flagged: dict[str, str] = {}        # worker -> why
        self._streak: dict[str, int] = {}
        self._blame: dict[int, list[RoundBlame]] = {}   # shard -> its primary's latest blame
        self.evicting: dict[str, str] = {}       # worker -> why, until it leaves
        self._own: dict[str, float] = {}         # worker -> its own time a step (sync)
        self._calm: dict[str, int] = {}          # flagged worker -> observations in a row it was not slow

    # ------------------------------------------------------------ input

    def own_time(self, worker: str, seconds: float) -> None:
        """A worker's heartbeat: its recent mean time a step outside ``trainer.step()``."""
        if seconds > 0:
            self._own[worker] = seconds

    def rounds(self, blame: Iterable[RoundBlame]) -> None:
        """A server's heartbeat: the latest blame of each of its primaries' shards."""
        by_shard: dict[int, list[RoundBlame]] = {}
        for b in blame:
            by_shard.setdefault(b.shard, []).append(b)
        self._blame.update(by_shard)

    # ------------------------------------------------------------ decisions

    def _slow_now(self, busy: set[str], step_seconds: Mapping[str, float]) -> dict[str, str]:
        """The busy workers slow right now, and why (one observation)."""
        out: dict[str, str] = {}
        if self.sync:
            for w, why in self._slower(busy, self._own, "own time").items():
                blamed = [(shard, b) for shard, blames in sorted(self._blame.items()) for b in blames
                          if b.worker == w and b.rounds >= MIN_ROUNDS]
                if blamed and blamed[0][1].last >= LAST_SHARE * blamed[0][1].rounds:
                    shard, b = blamed[0]
                    out[w] = (f"{why}; {b.last} of the last {b.rounds} sync rounds of shard {shard} waited for it "
                              f"({b.waited_s:.1f}s in all)")
            return out
        return self._slower(busy, step_seconds, "a step")

    def _slower(self, busy: set[str], seconds: Mapping[str, float], what: str) -> dict[str, str]:
        """Busy workers whose ``seconds`` are ``factor`` times the median of the other busy workers'."""
        factor, out = self.policy.factor, {}
        times = {w: t for w, t in seconds.items() if w in busy and t > 0}
        for w, t in times.items():
            others = [o for v, o in times.items() if v != w]
            if others and t >= factor * statistics.median(others):
                out[w] = f"{t * 1e3:.0f} ms {what}, {t / statistics.median(others):.1f}x the others' median"
        return out

    def observe(self, busy: set[str], step_seconds: Mapping[str, float]) -> list[tuple[int, str]]:
        """One observation (the chief's ticker); returns the lines to log with their levels: a flag raised
        or an eviction (warnings), a flag cleared (info)."""
        slow = self._slow_now(busy, step_seconds)
        lines: list[tuple[int, str]] = []
        for w in list(self._streak):
            if w not in slow:
                del self._streak[w]
        for w, why in slow.items():
            self._streak[w] = self._streak.get(w, 0) + 1
            self._calm.pop(w, None)
            if self._streak[w] >= HOLD and w not in self.flagged:
                self.flagged[w] = why
                lines.append((logging.WARNING, f"straggler {w}: {why}; action {self.policy.action}"))
        for w in list(self.flagged):
            if w in busy and (w in slow or w in self._excluded_now()):
                continue
            self._calm[w] = self._calm.get(w, 0) + 1
            if w not in busy or self._calm[w] >= HOLD:      # fast again for as long as it took to flag it
                del self.flagged[w]
                self._calm.pop(w, None)
                if w in busy:
                    lines.append((logging.INFO, f"straggler {w} is no longer slow"))
        if self.policy.action == "evict":
            lines += [(logging.WARNING, line) for line in self._evict(busy)]
        return lines

    def _excluded_now(self) -> set[str]:
        # under ``backup`` an excluded worker's rounds no longer wait for it, so its blame fades by itself:
        # it stays excluded (and flagged) until it leaves
        return set(self.flagged) if self.policy.action == "backup" else set()

    def _evict(self, busy: set[str]) -> list[str]:
        for w in [w for w in self.evicting if w not in busy]:
            del self.evicting[w]                  # it left
        if self.evicting or len(busy) < 2:
            return []
        for w, why in self.flagged.items():
            self.evicting[w] = why
            return [f"asking straggler {w} to leave (straggler_detection action evict)"]
        return []

    def forget(self, worker: str) -> None:
        """The worker left or was dropped."""
        self.flagged.pop(worker, None)
        self._streak.pop(worker, None)
        self.evicting.pop(worker, None)
        self._own.pop(worker, None)
        self._calm.pop(worker, None)
        for shard, blames in self._blame.items():
            self._blame[shard] = [b for b in blames if b.worker != worker]

    # ------------------------------------------------------------ reads

    def stragglers(self) -> set[str]:
        return set(self.flagged)

    def excluded(self, busy: set[str]) -> set[str]:
        """``backup``: the workers sync rounds close without (never every busy worker)."""
        if self.policy.action != "backup":
            return set()
        out = {w for w in self.flagged if w in busy}
        return out if out != busy else set()

    def leave_reason(self, worker: str) -> str:
        """``evict``: why this worker is asked to leave ("" : it is not)."""
        why = self.evicting.get(worker, "")
        return f"evicted as a straggler: {why}" if why else ""
