"""The batch the training loop is on: what a push says about its data (task, token, range)."""
from __future__ import annotations

from dataclasses import dataclass

from shoal.dataset import Task


@dataclass(frozen=True)
class BatchContext:
    """The batch the training loop is on: what a push says about its data."""

    task: Task
    token: bytes
    start: int
    stop: int

    def header_fields(self) -> dict:
        t = self.task
        return dict(has_batch=True, task_id=t.task_id, attempt=t.attempt, token=self.token, data_epoch=t.epoch,
                    task_start=t.start, task_stop=t.stop, batch_start=self.start, batch_stop=self.stop)
