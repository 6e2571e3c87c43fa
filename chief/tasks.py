"""Dynamic data sharding: each epoch of a dataset cut into tasks handed out on request.

A task is a range of sample indices covering ``batches_per_task`` batches.
States of a task: todo -> doing (held by one worker) -> done. A worker that
leaves or loses its lease has its unfinished tasks put back at the front of
the queue. Epoch ``e + 1`` is handed out only once epoch ``e`` has no todo
tasks left, so epochs stay ordered while the last tasks of one are in flight.
"""
from __future__ import annotations

import collections
import logging
import random
from dataclasses import dataclass

from shoal.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetSpec:
    size: int
    batch_size: int
    epochs: int = 1
    batches_per_task: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("size", "batch_size", "epochs", "batches_per_task"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"dataset {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Task:
    task_id: int
    epoch: int
    start: int
    stop: int


class TaskQueue:
    def __init__(self) -> None:
        self.spec: DatasetSpec | None = None
        self._todo: collections.deque[Task] = collections.deque()
        self._doing: dict[int, tuple[str, Task]] = {}
        self._done: set[int] = set()
        self._next_epoch = 0
        self._tasks_per_epoch = 0

    def configure(self, spec: DatasetSpec) -> None:
        """The first worker describes the dataset; later ones must describe the same."""
        if self.spec is None:
            self.spec = spec
            span = spec.batch_size * spec.batches_per_task
            self._tasks_per_epoch = -(-spec.size // span)
            log.info("dataset: %d samples, batch %d, %d epoch(s), %d tasks per epoch",
                     spec.size, spec.batch_size, spec.epochs, self._tasks_per_epoch)
        elif spec != self.spec:
            raise FailedPrecondition(f"dataset differs from the job's: job has {self.spec}, worker sent {spec}")

    @property
    def total(self) -> int:
        return self._tasks_per_epoch * (self.spec.epochs if self.spec else 0)

    @property
    def done_count(self) -> int:
        return len(self._done)

    @property
    def depth(self) -> int:
        return len(self._todo)

    @property
    def finished(self) -> bool:
        return self.spec is not None and len(self._done) == self.total

    def _open_epoch(self) -> None:
        spec = self.spec
        assert spec is not None
        e = self._next_epoch
        span = spec.batch_size * spec.batches_per_task
        order = list(range(self._tasks_per_epoch))
        random.Random(spec.seed * 1_000_003 + e).shuffle(order)
        for i in order:
            start = i * span
            self._todo.append(Task(e * self._tasks_per_epoch + i, e, start, min(spec.size, start + span)))
        self._next_epoch += 1

    def take(self, member: str, max_tasks: int) -> list[Task]:
        if self.spec is None:
            raise FailedPrecondition("no dataset configured")
        out: list[Task] = []
        while len(out) < max_tasks:
            if not self._todo:
                if self._next_epoch >= self.spec.epochs:
                    break
                self._open_epoch()
            t = self._todo.popleft()
            self._doing[t.task_id] = (member, t)
            out.append(t)
        return out

    def complete(self, member: str, task_id: int) -> None:
        held = self._doing.get(task_id)
        if held is None:
            if task_id in self._done:
                return  # a retried report
            raise InvalidArgument(f"task {task_id} is not held by anyone")
        if held[0] != member:
            raise FailedPrecondition(f"task {task_id} is held by {held[0]}, not {member}")
        del self._doing[task_id]
        self._done.add(task_id)

    def release(self, member: str) -> list[Task]:
        """Puts the member's unfinished tasks back at the front of the queue."""
        back = [t for m, t in self._doing.values() if m == member]
        for t in sorted(back, key=lambda t: t.task_id, reverse=True):
            del self._doing[t.task_id]
            self._todo.appendleft(t)
        if back:
            log.info("re-queued %d task(s) of %s", len(back), member)
        return back

    def held_by(self, member: str) -> list[Task]:
        return [t for m, t in self._doing.values() if m == member]
