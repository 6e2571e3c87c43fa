"""Which worker each sync round waited for, and how long: what straggler detection in sync mode goes by.

Pure, with an injected clock; a shard (ps/shard.py) calls :meth:`RoundTimer.arrived` for each gradient
its open round takes and :meth:`RoundTimer.closed` when the round is applied. A round opens when the
one before it closes (every worker pulls the new version then and computes its next gradient), so a
worker's arrival, counted from the open, is its step time as the round sees it. The last arrival is
the worker the round waited for; the one before it is how long the others needed.

:meth:`RoundTimer.blame` sums the recent window per worker: how many rounds waited for it last, and
the median ratio of its time to the others' in those rounds. The chief (chief/stragglers.py) reads it
from every server's heartbeat.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

WINDOW = 32          # rounds remembered


@dataclass(frozen=True)
class Blame:
    """Over the last ``rounds`` timed rounds: how many waited for ``worker`` last, the median ratio of its
    time to the others' in those, and the seconds the rounds spent waiting for it alone."""

    worker: str
    rounds: int
    last: int
    ratio: float
    waited_s: float


class RoundTimer:
    def __init__(self, clock: Callable[[], float] = time.monotonic, window: int = WINDOW):
        self._clock = clock
        self._opened: float | None = None
        self._arrivals: dict[str, float] = {}
        self._rounds: deque[tuple[str, float, float]] = deque(maxlen=window)   # (last worker, its time, others')
        self._lock = threading.Lock()      # blame() is read from the heartbeat thread

    def arrived(self, worker: str) -> None:
        now = self._clock()
        if self._opened is None:
            self._opened = now
        self._arrivals.setdefault(worker, now)

    def closed(self) -> None:
        now = self._clock()
        if len(self._arrivals) >= 2 and self._opened is not None:
            order = sorted(self._arrivals.items(), key=lambda kv: kv[1])
            (last, t_last), (_, t_prev) = order[-1], order[-2]
            with self._lock:
                self._rounds.append((last, t_last - self._opened, t_prev - self._opened))
        self._arrivals = {}
        self._opened = now

    def reset(self) -> None:
        """The round was discarded (the shard moved): the next arrival opens the next one."""
        self._arrivals, self._opened = {}, None

    def blame(self) -> list[Blame]:
        with self._lock:
            rounds = list(self._rounds)
        out = []
        for w in sorted({r[0] for r in rounds}):
            mine = [r for r in rounds if r[0] == w]
            ratios = [t / max(others, 1e-3) for _, t, others in mine]
            out.append(Blame(w, len(rounds), len(mine), statistics.median(ratios),
                             sum(t - others for _, t, others in mine)))
        return out
