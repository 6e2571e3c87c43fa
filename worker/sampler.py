"""A ``torch.utils.data.Sampler`` that hands the user's DataLoader the samples of the chief's tasks.

    sampler = DistributedSampler(train_set, batch_size=32, epochs=10, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler, num_workers=2)
    for epoch in range(10):
        sampler.set_epoch(epoch)        # optional: each iteration is the next epoch
        for x, y in loader: ...

Each iteration of the sampler is one epoch of the job: it yields, batch by
batch, the sample indices of the data tasks the chief hands this worker for
that epoch (a task is a range of positions in the epoch; with ``shuffle`` the
positions go through the epoch's own seeded permutation of the samples, the
same on every worker, so each epoch visits every sample once in a fresh order).
The iteration ends when the chief starts handing out the next epoch, or when
the job's data is done.

A loop written for DDP or Horovod assumes every epoch has batches, so an
iteration is never empty while the job has data left. A worker that finds its
epoch all handed out waits for a task of it to come back or for the next
epoch's first task, and trains that one task in this iteration; the next
iteration goes on with the rest of that epoch (``sampler.epoch`` says which),
so the loop's count stays with the job's. A worker that joins a running job
follows it the same way from its first iteration: it neither repeats nor
skips epochs. Once the job's data is done, an iteration that has nothing
to train (the loop asks for more epochs than the job has left for it) ends the
worker: it leaves the job and exits 0 with one log line, as the job is over.

The exactly-once ledger needs to know which batch each push trains on, while
the DataLoader asks for indices ahead of training (``num_workers``,
``prefetch_factor``). So the sampler records each batch it hands out, in order,
and every ``optimizer.step()`` takes the oldest record: the DataLoader keeps
batches in sampler order, so the step trains exactly that batch. The sampler's
``batch_size`` must therefore equal the DataLoader's (a step whose batch does
not match is the DataLoader's ``drop_last`` or a loop that skips steps: the
sampler then hands the batches it cannot account for back to the chief). A
task's short last batch is handed out last in its iteration, so the
DataLoader's grouping of indices into batches stays aligned with the tasks. A
lone short batch that came back (a skipped step, a dropped sync gradient) joins
it when both fit in one batch: the DataLoader makes one batch of them, and that
step's push names both. Otherwise it waits for the next iteration, and after
the last epoch it goes back to the chief for a worker still training.
A step after several backward passes (gradient accumulation) takes as many
records, one per pass, from one task or several.
"""
from __future__ import annotations

import collections
import logging
import sys
import threading
from typing import Iterator, Sized

import torch
from torch.utils.data import BatchSampler, Sampler

from shoal.dataset import DatasetSpec, Task
from shoal.errors import FailedPrecondition, InvalidArgument
from shoal.worker.data import TaskFeed
from shoal.worker.optimizer import active_trainer
from shoal.worker.exchange import BatchContext
from shoal.worker.trainer import Trainer, stop_requested

log = logging.getLogger(__name__)

_WAIT_S = 0.05


class DistributedSampler(Sampler[int]):
    """Sample indices of the tasks the chief assigns this worker, one epoch per iteration."""

    def __init__(self, dataset: Sized, *, batch_size: int, epochs: int, shuffle: bool = True, seed: int = 0,
                 batches_per_task: int = 4, prefetch: int = 2, trainer: Trainer | None = None):
        self.size = len(dataset)
        self.spec = DatasetSpec(self.size, batch_size, epochs, batches_per_task, seed)
        self.batch_size, self.epochs, self.shuffle, self.seed = batch_size, epochs, shuffle, seed
        self.prefetch = prefetch
        self._trainer = trainer
        self._feed: TaskFeed | None = None
        self._epoch: int | None = None          # set_epoch's, for the next iteration
        self._next = 0                          # the epoch of the next iteration without set_epoch
        self._records: collections.deque[BatchContext] = collections.deque()
        self._later: collections.deque[tuple[Task, bytes]] = collections.deque()   # for a later epoch
        self._remaining: dict[int, int] = {}    # task id -> batches handed out, not yet stepped
        self._perms: dict[int, torch.Tensor] = {}
        self._checked = False                   # the DataLoader's batch size, checked at the first batch
        self._released: set[int] = set()        # short tasks held back whose prefetch slot is free already
        self._iterated = False                  # the first iteration follows the job's current epoch
        self.epoch = 0                          # the epoch of the current (or last) iteration

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration trains (as torch's DistributedSampler)."""
        if not 0 <= epoch < self.epochs:
            raise InvalidArgument(f"set_epoch({epoch}): the job trains epochs 0..{self.epochs - 1} "
                                  f"(DistributedSampler(epochs={self.epochs}))")
        self._epoch = epoch

    def __len__(self) -> int:
        """The samples of a whole epoch: an upper bound on this worker's share of it."""
        return self.size

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[int]:
        explicit = self._epoch is not None
        epoch = self._epoch if explicit else self._next
        self._epoch = None
        feed = self._attach()
        if epoch >= self.epochs:
            self._past_the_end(epoch, feed)
            return
        self._next = epoch + 1
        self._settle_unstepped()
        first, self._iterated = not self._iterated, True
        self.epoch = epoch
        partial: list[tuple[Task, bytes]] = []
        yielded = early = False
        while True:
            item = self._take(epoch, feed, holding=bool(partial), empty=not (yielded or partial))
            if item is None:
                break
            task, token = item
            if task.epoch > epoch:               # nothing of this epoch was left for this worker:
                epoch = self.epoch = task.epoch  # this one task now, the rest of its epoch next iteration
                self._next, early = epoch, True
                if first:                        # a worker that joined a running job
                    log.info("the job is at epoch %d: this worker's loop trains it now", epoch)
            self._check_batch_size()
            if (task.stop - task.start) % self.batch_size:
                partial.append(item)             # short batches go last: DataLoader batches stay aligned
                if task.task_id not in self._released:
                    self._released.add(task.task_id)
                    feed.release()               # a task held back must not keep the feed from fetching
            else:
                yielded = True
                yield from self._hand_out(task, token, feed)
            if early:
                break
        if not (yielded or partial) and feed.ended.is_set():
            self._job_over(epoch, feed)          # only the end of the job's data leaves an iteration empty
            return
        yield from self._hand_out_short(partial, feed)
        if epoch == self.epochs - 1 and not early:
            self._last_iteration_over(feed)

    def _check_batch_size(self) -> None:
        """The DataLoader's ``batch_size`` must be this sampler's (each step names the batch it trains):
        checked at the first batch, from the torch ``BatchSampler`` that iterates this sampler."""
        if self._checked:
            return
        self._checked = True
        frame = sys._getframe(2)                 # _check_batch_size <- __iter__ <- the one iterating it
        owner = frame.f_locals.get("self") if frame is not None else None
        if isinstance(owner, BatchSampler) and owner.batch_size != self.batch_size:
            raise InvalidArgument(f"the DataLoader's batch_size is {owner.batch_size} but the sampler's is "
                                  f"{self.batch_size}: give both the same (or use shoal.worker.distribute, "
                                  f"which takes it from the DataLoader)")

    def _past_the_end(self, epoch: int, feed: TaskFeed) -> None:
        """The loop asks for epoch ``epoch``, past the job's last: a worker that joined late, or one whose
        loop ran a task ahead of the job, has nothing left to train (its last epoch's iteration is over
        and handed back whatever came after it)."""
        self._job_over(epoch, feed)

    def _job_over(self, epoch: int, feed: TaskFeed) -> None:
        """The job's data is done and this worker's loop asks for more: as in a job whose every epoch is
        trained, the worker leaves and the process ends with exit 0. A loop run in another thread than the
        main one (a program that trains beside other work, or several trainers in one process) is not the
        process's to end: its iteration ends empty instead, the trainer closed."""
        log.info("the job's data is %s (%d epoch(s)): nothing left for this worker's loop (its epoch %d); "
                 "leaving the job", "done" if feed.ended.is_set() else "handed out", self.epochs, epoch)
        self._trainer.close()
        if threading.current_thread() is threading.main_thread():
            raise SystemExit(0)

    def _last_iteration_over(self, feed: TaskFeed) -> None:
        """The job's last epoch is over here, and the user's loop with it: a task that reached this worker
        after the iteration ended (a batch another worker's sync round dropped, re-queued by the chief)
        would never be trained. It goes back to the chief for the workers still iterating, and so does
        any that comes later."""
        later, self._later = list(self._later), collections.deque()
        feed.stop_fetching(later)

    def _hand_out_short(self, partial: list[tuple[Task, bytes]], feed: TaskFeed) -> Iterator[int]:
        """The tasks that end in a short batch, at the end of the iteration: first the full batches of
        each (they keep the DataLoader's batches aligned with the tasks), then their short last batches,
        which the DataLoader makes one batch of while they fit in one: that step's push names each of
        them. A task whose short batch does not fit waits for the next iteration (never this one: taking
        it again here would loop for ever)."""
        partial = sorted(partial, key=lambda item: item[0].start - item[0].stop)
        tails, joined, deferred = [], 0, []
        for task, token in partial:
            short = (task.stop - task.start) % self.batch_size
            if joined + short <= self.batch_size:
                joined += short
                tails.append((task, token, task.stop - short))
            else:
                deferred.append((task, token))
        for task, _, tail in tails:              # a tail's step must not finish its task before it is handed out
            self._remaining[task.task_id] = self._remaining.get(task.task_id, 0) + 1
        for task, token, tail in tails:
            if tail > task.start:
                yield from self._hand_out(task, token, feed, release=False, stop=tail)
        for i, (task, token, tail) in enumerate(tails):
            yield from self._hand_out(task, token, feed, join=i > 0, release=False, start=tail, counted=True)
        self._later.extendleft(reversed(deferred))

    def _take(self, epoch: int, feed: TaskFeed, holding: bool, empty: bool = False) -> tuple[Task, bytes] | None:
        """The next task of ``epoch`` (or an earlier one) for this worker; None when the epoch is over here.

        ``holding``: a task is held back to go last (its short batch). ``empty``: nothing was handed out
        in this iteration yet: it waits for a task rather than end empty, and a task of a later epoch
        (returned, not kept for later) is what it trains."""
        if self._later and (empty or self._later[0][0].epoch <= epoch):
            return self._later.popleft()
        if self._later:
            return None
        while True:
            if stop_requested():
                self._trainer.hand_back()        # SIGTERM: leave between two batches
            item = feed.poll(_WAIT_S)
            if item is None:
                return None
            if item is ...:
                # tasks are in flight elsewhere: wait for one to come back, unless this worker's own
                # work would wait with it (batches the DataLoader may hold until this iteration ends,
                # or the task held back to go last): the job cannot finish before they are trained
                # An epoch the chief has moved past has nothing left to hand out: over here (unless
                # nothing was handed out yet: the next epoch's first task is then this iteration's).
                if feed.starved.is_set() and (self._records or holding or
                                              (not empty and feed.epochs_open > epoch + 1)):
                    return None
                continue
            if item[0].epoch > epoch and not empty:
                self._later.append(item)
                return None
            return item

    def _hand_out(self, task: Task, token: bytes, feed: TaskFeed, join: bool = False, release: bool = True,
                  start: int | None = None, stop: int | None = None, counted: bool = False) -> Iterator[int]:
        """Records the task's batches (those in ``[start, stop)``, by default all) and yields their sample
        indices. ``join``: one short batch that the DataLoader puts in one batch with the short batch
        before it: one record of both. ``counted``: its batches were counted in ``_remaining`` already."""
        order = self._permutation(task.epoch)
        start = task.start if start is None else start
        stop = task.stop if stop is None else stop
        batches = [BatchContext(task, token, b, min(stop, b + self.batch_size))
                   for b in range(start, stop, self.batch_size)]
        if join and self._records:
            last = self._records.pop()
            self._records.append((*(last if isinstance(last, tuple) else (last,)), *batches))
        else:
            self._records.extend(batches)
        if not counted:
            self._remaining[task.task_id] = self._remaining.get(task.task_id, 0) + len(batches)
        if release:
            feed.release()                       # the feed may fetch the next task meanwhile
        self._released.discard(task.task_id)
        yield from order[start:stop].tolist()

    def _permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                perm = torch.randperm(self.size, generator=g)
            else:
                perm = torch.arange(self.size)
            self._perms = {epoch: perm}          # one epoch at a time is all a worker trains
        return perm

    # ------------------------------------------------------------ the trainer's side

    def _attach(self) -> TaskFeed:
        if self._feed is not None:
            return self._feed
        trainer = self._trainer or active_trainer()
        if trainer is None:
            raise FailedPrecondition("DistributedSampler: wrap the optimizer with shoal.worker.DistributedOptimizer "
                                     "(or pass trainer=) before iterating the DataLoader")
        if trainer._feed is not None:
            raise FailedPrecondition("this worker already takes data from another sampler or Trainer.batches()")
        self._trainer = trainer
        feed = TaskFeed(trainer.chief.stub, lambda: trainer.member_id, self.spec, self.prefetch,
                        rejoin=trainer.chief.join, call_timeout_s=trainer.chief.call_timeout_s)
        # TaskFeed takes a slot per task until it is released: here, once its indices are handed out
        trainer._feed = feed
        trainer._batch_source = self._next_batch
        trainer._batch_done = self._stepped
        self._feed = feed
        return feed

    def _next_batch(self) -> "BatchContext | tuple[BatchContext, ...] | None":
        """What the DataLoader's next batch holds: one batch of a task, or several short ones joined."""
        return self._records.popleft() if self._records else None

    def _stepped(self, batch: BatchContext) -> None:
        """``optimizer.step()`` pushed ``batch``: a task whose batches are all pushed is done."""
        left = self._remaining.get(batch.task.task_id, 0) - 1
        if left > 0:
            self._remaining[batch.task.task_id] = left
            return
        self._remaining.pop(batch.task.task_id, None)
        self._trainer._task_finished(batch.task)
        self._feed.mark_done(batch.task, release=False)

    def _settle_unstepped(self) -> None:
        """Batches handed out in an earlier iteration but never stepped (``drop_last``, a ``break``)
        go back to the chief, to be trained by whoever takes them next; those whose gradients are
        accumulating for the next push (its backward passes so far) stay for that push."""
        acc = self._trainer.accumulation
        kept = [self._records.popleft() for _ in range(min(len(self._records), acc.passes if acc else 0))]
        if self._records:
            log.info("%d batch(es) handed to the DataLoader were not trained (drop_last or a loop that stopped "
                     "early); handing them back to the chief", len(self._records))
        while self._records:
            record = self._records.popleft()
            for b in record if isinstance(record, tuple) else (record,):
                self._feed.drop(b.task.epoch, b.start, b.stop, b.task.task_id)
                self._stepped(b)
        self._records.extend(kept)
