"""A job's dataset as the chief cuts it: its spec, and the data tasks handed to workers.

A task is a range of sample indices covering ``batches_per_task`` batches of
one epoch; each hand-out gets a new ``attempt`` number. The chief's queue of
tasks is ``shoal.chief.tasks.TaskQueue``.
"""
from __future__ import annotations

from dataclasses import dataclass

from shoal.errors import InvalidArgument


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

    @property
    def batches_per_epoch(self) -> int:
        return -(-self.size // self.batch_size)

    def batch_starts(self) -> range:
        return range(0, self.size, self.batch_size)


@dataclass(frozen=True)
class Task:
    task_id: int
    epoch: int
    start: int
    stop: int
    attempt: int = 0
