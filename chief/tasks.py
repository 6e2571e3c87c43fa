"""Dynamic data sharding: each epoch of a dataset cut into tasks handed out on request.

A task is a range of sample indices covering ``batches_per_task`` batches.
States of a task: todo -> doing (held by one worker) -> done. A worker that
leaves or loses its lease has its unfinished tasks put back at the front of
the queue, resuming at the first batch it had not reported as pushed. A batch
that a parameter server dropped (a late gradient in a sync round) comes back
as a one-batch task. Epoch ``e + 1`` is handed out only once epoch ``e`` has no
todo tasks left, so epochs stay ordered while the last tasks of one are in
flight. Every hand-out of a task gets a new ``attempt`` number, so a push from
a worker that no longer holds the task can be told apart.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import random

from shoal.chief import idset
from shoal.dataset import DatasetSpec, Task
from shoal.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)


class TaskQueue:
    def __init__(self) -> None:
        self.spec: DatasetSpec | None = None
        self._todo: collections.deque[Task] = collections.deque()     # re-queued tasks: handed out first
        # then the open epoch's untouched tasks: its task indices in hand-out order, from _pos on. They
        # follow from the seed, so a snapshot names them by count, and a Task is made only when taken.
        self._order: list[int] = []
        self._pos = 0
        self._doing: dict[int, tuple[str, Task]] = {}
        self._held: dict[str, dict[int, Task]] = {}     # member -> its tasks in _doing (GetTasks asks per call)
        self._progress: dict[int, int] = {}          # task id -> first sample not yet pushed
        self._done: set[int] = set()
        self._attempts: collections.Counter[int] = collections.Counter()
        self._open_per_epoch: collections.Counter[int] = collections.Counter()
        self._next_epoch = 0
        self._tasks_per_epoch = 0
        self._next_extra = 0
        self._extra = 0
        # With a journal (chief/journal.py), every call that changes the queue is recorded, and replayed
        # on the last snapshot when the chief restarts: the queue is deterministic (its shuffles are seeded).
        self.ops: list[list] | None = None

    def configure(self, spec: DatasetSpec) -> None:
        """The first worker describes the dataset; later ones must describe the same."""
        if self.spec is None:
            self.spec = spec
            span = spec.batch_size * spec.batches_per_task
            self._tasks_per_epoch = -(-spec.size // span)
            self._next_extra = self._tasks_per_epoch * spec.epochs
            log.info("dataset: %d samples, batch %d, %d epoch(s), %d tasks per epoch",
                     spec.size, spec.batch_size, spec.epochs, self._tasks_per_epoch)
        elif spec != self.spec:
            raise FailedPrecondition(f"dataset differs from the job's: job has {self.spec}, worker sent {spec}")
        else:
            return
        self._record("configure", dataclasses.asdict(spec))

    def _record(self, *op) -> None:
        if self.ops is not None:
            self.ops.append(list(op))

    def take_ops(self) -> list[list]:
        """The calls recorded since the last take (starts recording on the first)."""
        ops, self.ops = self.ops or [], []
        return ops

    def replay(self, ops: list[list]) -> None:
        """Applies recorded calls (:meth:`take_ops`) again, in order, without logging them twice."""
        disabled, log.disabled = log.disabled, True
        try:
            for name, *args in ops:
                if name == "configure":
                    [spec] = args
                    self.configure(DatasetSpec(**spec))
                elif name in ("take", "complete", "progress", "requeue_batch", "release"):
                    getattr(self, name)(*args)
                else:
                    raise InvalidArgument(f"unknown task queue operation {name!r} in the journal")
        finally:
            log.disabled = disabled

    @property
    def total(self) -> int:
        return self._tasks_per_epoch * (self.spec.epochs if self.spec else 0) + self._extra

    @property
    def done_count(self) -> int:
        return len(self._done)

    @property
    def depth(self) -> int:
        return len(self._todo) + self._fresh

    @property
    def _fresh(self) -> int:
        return len(self._order) - self._pos

    def pending(self) -> list[Task]:
        """The todo tasks in the order they will be handed out (a list as long as the queue: for tests
        and debugging)."""
        e = self._next_epoch - 1
        return [*self._todo, *(self._task_at(e, i) for i in self._order[self._pos:])]

    @property
    def finished(self) -> bool:
        return self.spec is not None and len(self._done) == self.total

    @property
    def epochs_open(self) -> int:
        """How many data epochs have been opened (cut into tasks); only the last may still have todo tasks."""
        return self._next_epoch

    @property
    def completed_epochs(self) -> int:
        """How many leading epochs have every task (re-queued batches included) done."""
        n = 0
        while n < self._next_epoch and self._open_per_epoch[n] == 0:
            n += 1
        return n

    def _epoch_order(self, e: int) -> list[int]:
        """Epoch ``e``'s task indices in the order it hands them out: a seeded shuffle, the same every time."""
        assert self.spec is not None
        order = list(range(self._tasks_per_epoch))
        random.Random(self.spec.seed * 1_000_003 + e).shuffle(order)
        return order

    def _task_at(self, e: int, i: int) -> Task:
        """Task ``i`` of epoch ``e``: batches ``[i * span, (i + 1) * span)`` of the dataset."""
        assert self.spec is not None
        span = self.spec.batch_size * self.spec.batches_per_task
        return Task(e * self._tasks_per_epoch + i, e, i * span, min(self.spec.size, i * span + span))

    def _open_epoch(self) -> None:
        e = self._next_epoch
        self._order, self._pos = self._epoch_order(e), 0
        self._open_per_epoch[e] += len(self._order)
        self._next_epoch += 1

    def take(self, member: str, max_tasks: int) -> list[Task]:
        if self.spec is None:
            raise FailedPrecondition("no dataset configured")
        out: list[Task] = []
        while len(out) < max_tasks:
            if self._todo:
                t = self._todo.popleft()
            elif self._pos < len(self._order):
                t = self._task_at(self._next_epoch - 1, self._order[self._pos])
                self._pos += 1
            elif self._next_epoch < self.spec.epochs:
                self._open_epoch()
                continue
            else:
                break
            self._attempts[t.task_id] += 1
            t = dataclasses.replace(t, attempt=self._attempts[t.task_id])
            self._hold(member, t)
            out.append(t)
        if out:
            self._record("take", member, max_tasks)
        return out

    def _hold(self, member: str, t: Task) -> None:
        self._unhold(t.task_id)
        self._doing[t.task_id] = (member, t)
        self._held.setdefault(member, {})[t.task_id] = t

    def _unhold(self, task_id: int) -> None:
        held = self._doing.pop(task_id, None)
        if held is None:
            return
        mine = self._held[held[0]]
        del mine[task_id]
        if not mine:
            del self._held[held[0]]

    def complete(self, member: str, task_id: int) -> None:
        """Marks a held task done. A late report from a member whose lease ended (the task was
        re-queued, maybe handed to someone else) is ignored: the shards' ledgers keep its batches
        from counting twice when the task runs again."""
        held = self._doing.get(task_id)
        if held is None and task_id in self._done:
            return                              # a retried report
        if (held is None and 0 <= task_id < self._next_extra) or (held is not None and held[0] != member):
            log.info("ignoring a late report of task %d from %s (re-queued after its lease ended)", task_id, member)
            return
        if held is None:
            raise InvalidArgument(f"task {task_id} is not held by anyone")
        t = held[1]
        self._unhold(task_id)
        self._progress.pop(task_id, None)
        self._done.add(task_id)
        del self._attempts[task_id]             # a done task is never handed out again
        self._open_per_epoch[t.epoch] -= 1
        self._record("complete", member, task_id)

    def progress(self, member: str, task_id: int, next_start: int) -> None:
        """The member pushed every batch of the task before ``next_start``. Progress never goes back, and
        progress at the task's start (a heartbeat before the first push) changes nothing and is not
        journaled: a release resumes from the start anyway."""
        held = self._doing.get(task_id)
        if held is not None and held[0] == member and next_start <= held[1].stop:
            now = self._progress.get(task_id, held[1].start)
            if next_start > now:
                self._progress[task_id] = next_start
                self._record("progress", member, task_id, next_start)

    def requeue_batch(self, member: str, epoch: int, start: int, stop: int) -> Task:
        """A batch a shard dropped goes back to the front of the queue as its own task."""
        if self.spec is None or not (0 <= start < stop <= self.spec.size) or not 0 <= epoch < self._next_epoch:
            raise InvalidArgument(f"dropped batch epoch {epoch} [{start}, {stop}) is not part of this job")
        t = Task(self._next_extra, epoch, start, stop)
        self._next_extra += 1
        self._extra += 1
        self._open_per_epoch[epoch] += 1
        self._todo.appendleft(t)
        self._record("requeue_batch", member, epoch, start, stop)
        log.debug("batch [%d, %d) of epoch %d from %s re-queued as task %d", start, stop, epoch, member, t.task_id)
        return t

    def release(self, member: str) -> list[Task]:
        """Puts the member's unfinished tasks back at the front of the queue, from their progress."""
        back = []
        if member in self._held:
            self._record("release", member)
        for t in list(self._held.get(member, {}).values()):
            self._unhold(t.task_id)
            resume = self._progress.pop(t.task_id, t.start)
            if resume >= t.stop:                      # everything was pushed: it only missed the report
                self._done.add(t.task_id)
                del self._attempts[t.task_id]
                self._open_per_epoch[t.epoch] -= 1
                continue
            back.append(dataclasses.replace(t, start=resume))
        for t in sorted(back, key=lambda t: t.task_id, reverse=True):
            self._todo.appendleft(t)
        if back:
            log.info("re-queued %d task(s) of %s", len(back), member)
        return back

    def held_by(self, member: str) -> list[Task]:
        """The member's tasks, in the order it took them: a lookup, not a scan of every held task."""
        return list(self._held.get(member, {}).values())

    # ------------------------------------------------------------ persistence

    def to_dict(self) -> dict:
        """Every field as JSON-able values (int keys become ``[key, value]`` pairs); see :meth:`from_dict`.

        Its size follows what is in flight, not the dataset: the open epoch's untouched tasks are a
        count (``fresh``), the done ids a bitmap (chief/idset.py), and hand-out counts are kept only
        for tasks not done; only re-queued tasks, held ones and their counts are listed."""
        def task(t: Task) -> list[int]:
            return [t.task_id, t.epoch, t.start, t.stop, t.attempt]

        return {
            "spec": dataclasses.asdict(self.spec) if self.spec is not None else None,
            "todo": [task(t) for t in self._todo],
            "fresh": self._fresh,
            "doing": [[m, task(t)] for m, t in self._doing.values()],
            "progress": [[k, v] for k, v in sorted(self._progress.items())],
            "done": idset.encode(self._done),
            "attempts": [[k, v] for k, v in sorted(self._attempts.items())],
            "open_per_epoch": [[k, v] for k, v in sorted(self._open_per_epoch.items())],
            "next_epoch": self._next_epoch,
            "tasks_per_epoch": self._tasks_per_epoch,
            "next_extra": self._next_extra,
            "extra": self._extra,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TaskQueue":
        """Inverse of :meth:`to_dict`; also reads the lists an older chief wrote (no ``fresh``, plain
        ``done`` and ``attempts`` lists). Raises ValueError (or KeyError, TypeError) on a malformed one."""
        q = cls()
        q.spec = DatasetSpec(**d["spec"]) if d["spec"] is not None else None
        q._open_per_epoch = collections.Counter({int(k): int(v) for k, v in d["open_per_epoch"]})
        q._next_epoch = int(d["next_epoch"])
        q._tasks_per_epoch = int(d["tasks_per_epoch"])
        q._next_extra = int(d["next_extra"])
        q._extra = int(d["extra"])
        q._todo = collections.deque(Task(*t) for t in d["todo"])
        fresh = int(d.get("fresh", 0))
        if fresh:
            if q.spec is None or not 0 < q._next_epoch <= q.spec.epochs or not 0 < fresh <= q._tasks_per_epoch:
                raise ValueError(f"{fresh} untouched tasks of epoch {q._next_epoch - 1}, which does not have them")
            q._order = q._epoch_order(q._next_epoch - 1)
            q._pos = len(q._order) - fresh
        for m, t in d["doing"]:
            q._hold(m, Task(*t))
        q._progress = {int(k): int(v) for k, v in d["progress"]}
        done = d["done"]
        q._done = {int(k) for k in done} if isinstance(done, list) else idset.decode(done)
        # an older chief kept the count of every task it handed out, done ones included
        q._attempts = collections.Counter({int(k): int(v) for k, v in d["attempts"] if int(k) not in q._done})
        return q
