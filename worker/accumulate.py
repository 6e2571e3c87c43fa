"""Gradient accumulation over micro-batches: one push for the batches of several backward passes.

A push names the batches its gradient was summed over (a *group*): the first in the
:class:`~shoal.proto.shoal_pb2.PushHeader`'s own fields, the others in ``more_batches``, each with
its task's token, so a group may span two tasks. Every shard records each batch of the group in its
exactly-once ledger, or, if any of them was applied before, refuses the whole push and says which
(``PushReply.applied_before``): a summed gradient is never applied in part. The worker then hands
back to the chief every batch of the group that some shard did not take, so each is trained again
and reaches every shard exactly once.

:class:`Accumulation` counts the backward passes since the last push for
:func:`shoal.worker.DistributedOptimizer`, which decides from it when ``step()`` pushes and how many
of the sampler's batches the push names (one ``backward()`` per batch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from shoal.state import convert
from shoal.errors import FailedPrecondition, InvalidArgument
from shoal.proto import shoal_pb2 as pb

if TYPE_CHECKING:
    from shoal.worker.batch import BatchContext

Group = tuple["BatchContext", ...]


def header_fields(group: Group) -> dict:
    """The PushHeader fields naming ``group`` ({} for a push outside a task)."""
    if not group:
        return {}
    fields = group[0].header_fields()
    if len(group) > 1:
        fields["more_batches"] = [pb.PushBatch(task=convert.task_to_pb(b.task, b.token), batch_start=b.start,
                                               batch_stop=b.stop) for b in group[1:]]
    return fields


def to_hand_back(group: Group, replies: Iterable[pb.PushReply]) -> list["BatchContext"]:
    """The batches of a pushed ``group`` that some shard did not apply and that need training again.

    A dropped push (a late gradient in a sync round, a shard that started over) applied none of them.
    A duplicate applied none either, but the batches it names in ``applied_before`` (or, when it names
    none, all of them: the key was applied before, the gradient was non-finite, the epoch is over) are
    not trained again.
    """
    back: dict[tuple[int, int], "BatchContext"] = {}
    for r in replies:
        if r.accepted:
            continue
        if r.duplicate and not r.applied_before:
            continue
        done = {(b.epoch, b.start) for b in r.applied_before}
        for b in group:
            if (b.task.epoch, b.start) not in done:
                back[(b.task.epoch, b.start)] = b
    return [b for b in group if (b.task.epoch, b.start) in back]


class Accumulation:
    """Backward passes since the last push, counted by a hook on every parameter.

    ``every``: ``None`` pushes whatever the passes summed at each ``step()``; ``k`` makes ``step()``
    (and ``zero_grad()``) wait for the k-th pass (Horovod's ``backward_passes_per_step``).
    ``overlap``: the Trainer pushes each shard during backward(), so a second pass before a step
    is an error (its gradient would miss the push already under way).
    """

    def __init__(self, params: Sequence[torch.Tensor], every: int | None, overlap: bool):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise InvalidArgument(f"backward_passes_per_step must be a whole number >= 1 (or None: every "
                                  f"step() pushes what the backward passes before it summed), got {every!r}")
        if overlap and every is not None and every > 1:
            raise InvalidArgument(f"backward_passes_per_step={every} needs overlap=False: overlap pushes each "
                                  f"shard's gradient during backward()")
        self.every = every
        self.overlap = overlap
        self._counts: dict[int, int] = {}
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._count)

    def _count(self, p: torch.Tensor) -> None:
        n = self._counts[id(p)] = self._counts.get(id(p), 0) + 1
        if n > 1 and self.overlap:
            raise FailedPrecondition("a second backward() before step(): gradient accumulation over micro-batches "
                                     "needs overlap=False (overlap pushes each gradient during backward())")

    @property
    def passes(self) -> int:
        """Backward passes since the last push (or the last reset)."""
        return max(self._counts.values(), default=0)

    def due(self) -> bool:
        """Whether ``step()`` pushes now: always without ``every``, else once the k-th pass is done."""
        if self.every is None:
            return True
        if self.passes > self.every:
            raise FailedPrecondition(f"step() after {self.passes} backward passes with backward_passes_per_step="
                                     f"{self.every}: call step() after every backward(), or raise "
                                     f"backward_passes_per_step")
        return self.passes == self.every

    def accumulating(self) -> bool:
        """Between two pushes of ``every`` passes: ``zero_grad()`` keeps the gradients."""
        return self.every is not None and 0 < self.passes < self.every

    def reset(self) -> int:
        """Starts counting again; returns the passes counted."""
        n = self.passes
        self._counts.clear()
        return n
