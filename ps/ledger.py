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
        # an epoch's entry is made only to hold a batch (record, from_rows): none is empty
        return [EpochLedger(e, len(b), max(c for c, _ in b.values())) for e, b in sorted(self._by_epoch.items())]

    def starts(self, epoch: int) -> dict[int, int]:
        """Batch start -> application count, for one epoch."""
        return {s: c for s, (c, _) in self._by_epoch.get(epoch, {}).items()}

    # ------------------------------------------------------------ checkpoints

    def to_rows(self) -> list[list[int]]:
        """``[epoch, start, count]`` for every applied batch (JSON-able; push keys are not kept)."""
        return [[e, s, c] for e, batches in sorted(self._by_epoch.items()) for s, (c, _) in sorted(batches.items())]

    @classmethod
    def from_rows(cls, rows, owner: str = "checkpoint") -> "Ledger":
        """Inverse of :meth:`to_rows`; every batch is owned by ``owner``."""
        ledger = cls()
        for e, s, c in rows:
            ledger._by_epoch[int(e)][int(s)] = (int(c), owner)
        return ledger


def ledger_to_extra(ledger: Ledger) -> dict:
    """What a shard checkpoint keeps of its ledger (in ``ShardState.extra``)."""
    return {"ledger": ledger.to_rows(),
            "ledger_summary": [[e.epoch, e.applied, e.max_count] for e in ledger.summary()]}


def ledger_from_extra(extra: dict) -> Ledger:
    """The ledger saved in a shard checkpoint's ``extra``.

    A shard re-sliced from several saved shards (``extra["resliced_from"]``) gets the
    batches that every one of them applied, with the lowest count: a batch that only
    some of them had is trained again, never skipped.
    """
    if "ledger" in extra:
        return Ledger.from_rows(extra["ledger"])
    sources = [{(int(e), int(s)): int(c) for e, s, c in src.get("extra", {}).get("ledger", [])}
               for src in extra.get("resliced_from", [])]
    if not sources:
        return Ledger()
    common = set(sources[0]).intersection(*sources[1:])
    return Ledger.from_rows([e, s, min(src[(e, s)] for src in sources)] for e, s in sorted(common))
