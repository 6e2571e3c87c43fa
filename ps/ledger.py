"""The exactly-once ledger of one shard: which batch of which epoch was applied, by which push.

A batch is named by ``(epoch, first sample index)``, so it keeps its name when
a task is re-queued or a dropped batch is handed to another worker. Each
application is counted; the counts are what tests and ``shoal status`` read
to prove every batch reached the shard exactly once.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchKey:
    epoch: int
    start: int


@dataclass(frozen=True)
class EpochLedger:
    epoch: int
    applied: int       # distinct batches applied
    max_count: int     # applications of the most-applied batch (1 when exactly-once holds)


class Ledger:
    def __init__(self) -> None:
        self._by_epoch: dict[int, dict[int, tuple[int, str]]] = collections.defaultdict(dict)

    def owner(self, batch: BatchKey) -> str | None:
        """The push key that applied ``batch``, or None if it was not applied."""
        entry = self._by_epoch.get(batch.epoch, {}).get(batch.start)
        return entry[1] if entry else None

    def record(self, batch: BatchKey, push_key: str) -> None:
        count, _ = self._by_epoch[batch.epoch].get(batch.start, (0, ""))
        self._by_epoch[batch.epoch][batch.start] = (count + 1, push_key)

    def summary(self) -> list[EpochLedger]:
        return [EpochLedger(e, len(b), max((c for c, _ in b.values()), default=0))
                for e, b in sorted(self._by_epoch.items())]

    def starts(self, epoch: int) -> dict[int, int]:
        """Batch start -> application count, for one epoch."""
        return {s: c for s, (c, _) in self._by_epoch.get(epoch, {}).items()}
