import pytest

from shoal.chief.tasks import DatasetSpec, TaskQueue
from shoal.errors import FailedPrecondition, InvalidArgument


def drain(q, member="w", n=3):
    seen = []
    while True:
        got = q.take(member, n)
        if not got:
            return seen
        for t in got:
            q.complete(member, t.task_id)
        seen += got


def test_every_sample_of_every_epoch_is_covered_once():
    q = TaskQueue()
    q.configure(DatasetSpec(size=103, batch_size=8, epochs=3, batches_per_task=2, seed=5))
    tasks = drain(q)
    assert q.finished and len(tasks) == q.total == 3 * 7
    for e in range(3):
        covered = sorted(i for t in tasks if t.epoch == e for i in range(t.start, t.stop))
        assert covered == list(range(103))
    epochs = [t.epoch for t in tasks]
    assert epochs == sorted(epochs)                     # epochs handed out in order
    first = [t.task_id for t in tasks if t.epoch == 0]
    assert first != sorted(first)                        # shuffled within an epoch


def test_dataset_must_match_and_be_valid():
    q = TaskQueue()
    q.configure(DatasetSpec(100, 10))
    with pytest.raises(FailedPrecondition, match="dataset differs"):
        q.configure(DatasetSpec(100, 20))
    with pytest.raises(InvalidArgument, match="batch_size must be >= 1, got 0"):
        DatasetSpec(100, 0)


def test_completing_a_task_held_by_someone_else_is_refused():
    q = TaskQueue()
    q.configure(DatasetSpec(40, 10, batches_per_task=1))
    t = q.take("a", 1)[0]
    with pytest.raises(FailedPrecondition, match="held by a"):
        q.complete("b", t.task_id)
    q.complete("a", t.task_id)
    q.complete("a", t.task_id)   # a retried report is harmless
    assert q.done_count == 1
