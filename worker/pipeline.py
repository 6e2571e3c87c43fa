"""Pipelined push and pull: which shard's push goes next, how many are unanswered at once, and the
pull that starts the moment a shard's own push is answered.

A step's pushes fill each worker's uplink and the servers' downlinks; its pulls fill the reverse
directions. Sent all at once, every push shares the uplink until the last byte, so no pull can start
before nearly all of them end: one direction idles while the other works (bench/RESULTS.md, "On an
emulated 1 Gbit/s network"). With a push window of W, at most W pushes are unanswered at once; each
ends W-times sooner and its shard's pull comes down while the next pushes go up. With more shards
than servers (``--num-shards``), each shard is a block that moves on its own (its own push key,
version, ledger and round), so a smaller block means a shorter pipeline fill.

What is built here is a pipeline of shards, not of sub-shard blocks: a block is a shard, and its
size is set by the number of shards (the chief's ``--num-shards``). Every invariant the servers keep
per shard (exactly-once by push key, re-sends after a failover, delta pulls, sync rounds,
checkpoints) therefore holds per block with no change on the servers.

:func:`push_order` staggers the order by worker rank so workers do not all push to the same server
at once: the servers are taken in turn, one shard of each, starting at server ``rank % servers``.
Within a server, lower shards (the first layers) go first, so their pulls land first.

:class:`PushWindow` is the pure state of one step's pushes; :class:`Pipeline` drives it with a thread
pool (the worker's): ``launch`` queues a push, a push's answer frees its slot, releases the next one
and calls ``on_answer`` (which starts that shard's pull).

``window = 0`` sends every push at once (the behaviour before this module, and the default: on one
host's loopback, where the CPU and not the link is the bottleneck, holding pushes back only loses;
``SHOAL_PUSH_WINDOW`` or ``Trainer(push_window=...)`` turns it on).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable, Mapping, Sequence

from shoal.errors import InvalidArgument
from shoal.members import ranks

DEFAULT_PUSH_WINDOW = 0          # every push at once (see the module docstring)


def window_from(value: int | None) -> int:
    """The push window asked for (None: ``$SHOAL_PUSH_WINDOW``, else :data:`DEFAULT_PUSH_WINDOW`)."""
    if value is None:
        raw = os.environ.get("SHOAL_PUSH_WINDOW", "")
        try:
            value = int(raw) if raw.strip() else DEFAULT_PUSH_WINDOW
        except ValueError:
            raise InvalidArgument(f"SHOAL_PUSH_WINDOW must be a whole number >= 0, got {raw!r}") from None
    if value < 0:
        raise InvalidArgument(f"push window must be >= 0 (0: every push at once), got {value}")
    return value


def worker_rank(member_id: str, workers: Sequence[str]) -> int:
    """This worker's place among the job's workers (ids compared by their number, ``worker-10`` after
    ``worker-9``); 0 when it is not among them (the view has not caught up)."""
    return ranks(workers).get(member_id, 0)


def push_order(shards: Sequence[int], server_of: Mapping[int, Hashable], rank: int) -> list[int]:
    """The order one step's pushes go in: one shard of each server in turn, the servers in the order of
    their lowest shard rotated by ``rank``, and each server's shards lowest first.

    Two servers A (shards 0, 2) and B (1, 3): rank 0 pushes 0 1 2 3, rank 1 pushes 1 0 3 2. At any
    moment ranks 0 and 1 push to different servers, and in sync each pair of rounds (0 and 1, then
    2 and 3) can close while the next pair is being pushed.
    """
    if not shards:
        return []
    per: dict[Hashable, list[int]] = {}
    for k in sorted(shards):
        per.setdefault(server_of.get(k, k), []).append(k)
    servers = sorted(per, key=lambda s: per[s][0])
    start = rank % len(servers)
    servers = servers[start:] + servers[:start]
    out: list[int] = []
    for i in range(max(len(v) for v in per.values())):
        out.extend(per[s][i] for s in servers if i < len(per[s]))
    return out


class PushWindow:
    """One step's pushes: which may go now. Pure state (no threads, no clock).

    ``ready(k)``: shard k's gradient is complete. ``answered(k)``: its push got its reply. Both return
    the shards whose push should start now, in ``order``: among the ready ones not yet started, the
    earliest in ``order``, while fewer than ``window`` are unanswered (``window = 0``: no limit).
    A shard is started once per step; readying it twice is an error.
    """

    def __init__(self, order: Sequence[int], window: int):
        if window < 0:
            raise InvalidArgument(f"push window must be >= 0, got {window}")
        self.window = window
        self._rank = {k: i for i, k in enumerate(order)}
        self._waiting: list[int] = []
        self.in_flight: set[int] = set()
        self.started: list[int] = []        # in the order they were started
        self.done: set[int] = set()

    def ready(self, shard: int) -> list[int]:
        if shard in self._waiting or shard in self.in_flight or shard in self.done:
            raise ValueError(f"shard {shard} is already in this step's pushes")
        self._waiting.append(shard)
        return self._release()

    def answered(self, shard: int) -> list[int]:
        if shard not in self.in_flight:
            raise ValueError(f"shard {shard} has no push in flight")
        self.in_flight.discard(shard)
        self.done.add(shard)
        return self._release()

    @property
    def waiting(self) -> list[int]:
        return sorted(self._waiting, key=self._place)

    def _place(self, k: int) -> tuple[int, int]:
        return (self._rank.get(k, len(self._rank)), k)

    def _release(self) -> list[int]:
        out = []
        while self._waiting and (self.window == 0 or len(self.in_flight) < self.window):
            k = min(self._waiting, key=self._place)
            self._waiting.remove(k)
            self.in_flight.add(k)
            self.started.append(k)
            out.append(k)
        return out


class Pipeline:
    """Drives a :class:`PushWindow` per step on ``pool``.

    ``launch(k, push, order)`` queues shard k's push (a callable returning its reply) and returns a
    Future of that reply (the first launch of a step takes the step's order, :func:`push_order`);
    when a push is answered its ``on_answer(k, reply)`` runs on the pool thread that sent it, then the
    window releases the next push. A push that raises fails its Future and frees its slot too.
    """

    def __init__(self, pool: ThreadPoolExecutor, window: int,
                 on_answer: Callable[[int, object], None] | None = None):
        self._pool = pool
        self.window = window
        self._on_answer = on_answer
        self._lock = threading.Lock()
        self._state: _Step | None = None

    @property
    def active(self) -> bool:
        """A step's pushes are being scheduled (from its first :meth:`launch` to :meth:`end`)."""
        return self._state is not None

    def launch(self, shard: int, push: Callable[[], object], order: Callable[[], Sequence[int]]) -> Future:
        """Queues shard's push; the first launch of a step (or a shard launched again: a step whose
        pushes were never collected, e.g. a skipped batch) begins a new step in ``order()``."""
        future: Future = Future()
        with self._lock:
            step = self._state
            if step is None or shard in step.window.started or shard in step.window.waiting:
                step = self._state = _Step(PushWindow(order(), self.window))
            step.jobs[shard] = (push, future)
            go = step.window.ready(shard)
        self._start(step, go)
        return future

    def end(self) -> list[int]:
        """Ends the step; returns the order its pushes were started in."""
        with self._lock:
            step, self._state = self._state, None
            return list(step.window.started) if step is not None else []

    def _start(self, step: "_Step", shards: list[int]) -> None:
        for k in shards:
            with self._lock:
                push, future = step.jobs.pop(k)
            self._pool.submit(self._run, step, k, push, future)

    def _run(self, step: "_Step", shard: int, push: Callable[[], object], future: Future) -> None:
        try:
            reply = push()
            if self._on_answer is not None:
                self._on_answer(shard, reply)
        except BaseException as exc:      # noqa: BLE001 - handed to the waiter through the Future
            self._finish(step, shard)
            future.set_exception(exc)
            return
        self._finish(step, shard)
        future.set_result(reply)

    def _finish(self, step: "_Step", shard: int) -> None:
        with self._lock:
            go = step.window.answered(shard)
        self._start(step, go)


class _Step:
    """One step's window and the pushes queued in it (shard -> (push, its Future))."""

    def __init__(self, window: PushWindow):
        self.window = window
        self.jobs: dict[int, tuple[Callable[[], object], Future]] = {}
