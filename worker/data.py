"""Batches from the chief's data tasks, prefetched so training never waits on the chief.

:class:`TaskFeed` keeps up to ``prefetch`` tasks in hand, reports finished ones
with the next request, and ends when the chief says every task is done.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import grpc
import torch
from torch.utils.data import Dataset, default_collate

from shoal.state import convert
from shoal.dataset import DatasetSpec, Task
from shoal.proto import shoal_pb2 as pb
from shoal.errors import Unreachable
from shoal.net.rpc import RETRYABLE, with_retries

log = logging.getLogger(__name__)

_END = object()
_POLL_S = 0.25            # how often a waiting iterator looks whether it was interrupted


class TaskFeed:
    """Background fetcher of tasks; iterate it for :class:`Task` objects."""

    def __init__(self, stub, member_id: Callable[[], str], spec: DatasetSpec, prefetch: int = 2,
                 poll_s: float = 0.05, rejoin: Callable[[], object] | None = None, wait_s: float = 120.0,
                 chief: str = "", call_timeout_s: Callable[[], float] = lambda: 10.0):
        self._stub = stub
        self._member_id = member_id
        self._spec = convert.dataset_to_pb(spec)
        self._prefetch = max(1, prefetch)
        self._poll_s = poll_s
        self._rejoin = rejoin
        self._wait_s = wait_s                    # an unreachable chief: give up (Unreachable) after this long
        # one GetTasks: about a lease (ChiefClient.call_timeout_s), so a chief that stopped answering fails
        # it within a lease and it is tried again, while training goes on with the tasks in hand
        self._call_timeout_s = call_timeout_s
        self._chief = chief or "the chief"
        self._ready: queue.Queue = queue.Queue()
        self._done: list[int] = []
        self._dropped: list[pb.BatchRange] = []
        self._unacked: dict[tuple[int, int], int] = {}
        self._held: set[int] = set()             # handed to this worker, done not yet acknowledged
        self._done_lock = threading.Lock()
        self._space = threading.Semaphore(self._prefetch)
        self._stop = threading.Event()
        self._interrupted = threading.Event()
        # set while the chief has no task for this worker and the job is not finished (tasks are in
        # flight elsewhere); cleared when a task or the end arrives
        self.starved = threading.Event()
        self.epochs_open = 0         # data epochs the chief has started handing out (newest reply)
        self.ended = threading.Event()   # the chief said every task of the job is done
        # cleared once the worker takes no more tasks (its last epoch's iteration ended): the feed
        # then only reports, and hands back whatever still arrives
        self._fetching = True
        self._queue_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="task-feed", daemon=True)
        self._thread.start()

    def _request(self, max_tasks: int) -> pb.TaskReply:
        with self._done_lock:
            done, self._done = self._done, []
            dropped, self._dropped = self._dropped, []
            held = sorted(self._held)
        req = pb.TaskRequest(member_id=self._member_id(), dataset=self._spec, max_tasks=max_tasks,
                             done_task_ids=done, dropped=dropped, held_task_ids=held, reports_held=True)
        try:
            try:
                # A retried request is safe even if the lost one was served: the chief hands again any
                # task it counts as this worker's that the request does not list as held.
                reply = self._get_tasks(req)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND or self._rejoin is None:
                    raise
                log.warning("the chief dropped this worker (%s); joining again", exc.details())
                self._rejoin()
                req.member_id = self._member_id()
                reply = self._get_tasks(req)
            with self._done_lock:
                for b in dropped:
                    self._unacked.pop((b.epoch, b.start), None)
                self._held.difference_update(done)
                self._held.update(t.task_id for t in reply.tasks)
            return reply
        except grpc.RpcError:
            with self._done_lock:
                self._done = done + self._done
                self._dropped = dropped + self._dropped
            raise

    def _get_tasks(self, req: pb.TaskRequest) -> pb.TaskReply:
        t0 = time.monotonic()
        try:
            return with_retries(lambda: self._stub.GetTasks(req, timeout=self._call_timeout_s()), "get tasks from chief",
                                deadline_s=self._wait_s)
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE:
                raise
            raise Unreachable(f"gave up after {time.monotonic() - t0:.0f}s waiting for {self._chief} to hand out "
                              f"data tasks ({exc.code().name})") from exc

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._space.acquire()
                if self._stop.is_set():
                    return
                reply = self._request(1 if self._fetching else 0)
                self.epochs_open = max(self.epochs_open, reply.data_epochs_open)
                if reply.tasks:
                    self.starved.clear()
                    with self._queue_lock:
                        items = [(convert.task_from_pb(t), t.token) for t in reply.tasks]
                        if self._fetching:
                            for item in items:
                                self._ready.put(item)
                            continue
                    self._give_back(items)
                    continue
                self._space.release()
                if reply.finished:
                    self.starved.clear()
                    self.ended.set()
                    self._ready.put(_END)
                    return
                self.starved.set()
                # tasks are in flight elsewhere and may come back; a worker done taking tasks only reports
                self._stop.wait(self._poll_s if self._fetching else _POLL_S)
        except Exception as exc:  # noqa: BLE001 - hand the failure to the training thread
            self._ready.put(exc)

    def mark_done(self, task: Task, release: bool = True) -> None:
        """Reports ``task`` done with the next request; ``release``: its prefetch slot too (else call
        :meth:`release`, e.g. once a sampler has handed out its indices, before they are trained)."""
        with self._done_lock:
            self._done.append(task.task_id)
        if release:
            self._space.release()

    def stop_fetching(self, also: list[tuple[Task, bytes]] = ()) -> list[Task]:
        """This worker takes no more tasks (its last epoch's iteration ended: a task that came now would
        wait for a loop that is over). Tasks already queued, and any that arrive later, go back to the
        chief for a worker still training, with ``also`` (tasks the caller took and will not train);
        finished tasks and dropped batches are still reported."""
        with self._queue_lock:
            self._fetching = False
            items, keep = list(also), []
            while True:
                try:
                    item = self._ready.get_nowait()
                except queue.Empty:
                    break
                (keep if item is _END or isinstance(item, Exception) else items).append(item)
            for item in keep:
                self._ready.put(item)
        self._give_back(items)
        return [task for task, _ in items]

    def _give_back(self, items: list[tuple[Task, bytes]]) -> None:
        """Whole tasks this worker will not train: each goes back as a dropped range, and is done here."""
        for task, _ in items:
            log.info("handing task %d (epoch %d, samples [%d, %d)) back to the chief: this worker's last epoch "
                     "is over", task.task_id, task.epoch, task.start, task.stop)
            self.drop(task.epoch, task.start, task.stop, task.task_id)
            self.mark_done(task)

    def release(self) -> None:
        """Frees one prefetch slot: the feed may fetch another task."""
        self._space.release()

    def poll(self, timeout_s: float):
        """The next ``(task, token)``, None at the end of the job's data, or ``...`` if none came in time."""
        try:
            item = self._ready.get(timeout=timeout_s)
        except queue.Empty:
            return ...
        if item is _END:
            self._ready.put(_END)          # the end stays the end for later calls
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def drop(self, epoch: int, start: int, stop: int, task_id: int) -> None:
        """A shard dropped this batch (a late sync gradient): hand it out again."""
        with self._done_lock:
            self._dropped.append(pb.BatchRange(epoch=epoch, start=start, stop=stop))
            self._unacked[(epoch, start)] = task_id

    def progress_holds(self) -> dict[int, int]:
        """Per task, the first dropped batch the chief has not heard of yet.

        Progress reported for a task must not pass it: if this worker dies
        before the drop reaches the chief, the task resumes there and the
        batch is trained again instead of being lost.
        """
        with self._done_lock:
            holds: dict[int, int] = {}
            for (_, start), task_id in self._unacked.items():
                holds[task_id] = min(start, holds.get(task_id, start))
            return holds

    def flush(self) -> None:
        """Reports finished tasks and dropped batches now (before leaving the job)."""
        with self._done_lock:
            pending = bool(self._done or self._dropped)
        if pending:
            self._request(0)

    def interrupt(self) -> None:
        """Ends the iteration at once, even while it waits for tasks (safe from a signal handler)."""
        self._interrupted.set()

    def close(self) -> None:
        self._stop.set()
        self._space.release()
        self._thread.join(timeout=5)

    def __iter__(self) -> Iterator[tuple[Task, bytes]]:
        """Yields ``(task, token)``; ends when the whole job's data is done."""
        while not self._interrupted.is_set():
            try:
                item = self._ready.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item


def batches_of(data: Any, task: Task, batch_size: int) -> Iterator[tuple[int, int, Any]]:
    """``(start, stop, batch)`` for each batch of one task, from tensors or a map-style dataset."""
    for start in range(task.start, task.stop, batch_size):
        stop = min(task.stop, start + batch_size)
        if isinstance(data, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in data):
            yield start, stop, tuple(t[start:stop] for t in data)
        elif isinstance(data, torch.Tensor):
            yield start, stop, data[start:stop]
        else:
            yield start, stop, default_collate([data[i] for i in range(start, stop)])


def dataset_size(data: Dataset | Sequence[torch.Tensor] | torch.Tensor) -> int:
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        sizes = {len(t) for t in data}
        if len(sizes) != 1:
            raise ValueError(f"tensors of a dataset tuple must have the same length, got {sorted(sizes)}")
        return sizes.pop()
    return len(data)  # type: ignore[arg-type]
