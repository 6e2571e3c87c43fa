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


def test_a_late_report_of_a_task_held_by_someone_else_is_ignored():
    q = TaskQueue()
    q.configure(DatasetSpec(40, 10, batches_per_task=1))
    t = q.take("a", 1)[0]
    q.complete("b", t.task_id)                   # b lost its lease; a holds the task now
    assert q.done_count == 0 and q.held_by("a") == [t]
    with pytest.raises(InvalidArgument, match="not held by anyone"):
        q.complete("a", 10_000)                  # an id that never existed
    q.complete("a", t.task_id)
    q.complete("a", t.task_id)   # a retried report is harmless
    assert q.done_count == 1


def test_requeued_task_resumes_at_its_first_unpushed_batch():
    q = TaskQueue()
    q.configure(DatasetSpec(size=64, batch_size=8, epochs=1, batches_per_task=4))
    t = q.take("a", 1)[0]
    q.progress("a", t.task_id, t.start + 16)           # two of four batches pushed
    q.progress("b", t.task_id, t.stop)                 # not b's task: ignored
    back = q.release("a")
    assert [(x.task_id, x.start, x.stop) for x in back] == [(t.task_id, t.start + 16, t.stop)]
    again = q.take("b", 1)[0]
    assert again.task_id == t.task_id and again.start == t.start + 16 and again.attempt == 2


def test_a_fully_pushed_task_of_a_dead_worker_counts_as_done():
    q = TaskQueue()
    q.configure(DatasetSpec(size=16, batch_size=8, epochs=1, batches_per_task=2))
    t = q.take("a", 1)[0]
    q.progress("a", t.task_id, t.stop)
    assert q.release("a") == [] and q.finished


def test_dropped_batches_come_back_and_hold_the_epoch_open():
    q = TaskQueue()
    q.configure(DatasetSpec(size=32, batch_size=8, epochs=2, batches_per_task=4))
    t = q.take("a", 1)[0]
    q.complete("a", t.task_id)
    extra = q.requeue_batch("a", 0, 8, 16)
    assert q.completed_epochs == 0 and q.total == 3
    got = q.take("b", 1)[0]
    assert (got.task_id, got.epoch, got.start, got.stop) == (extra.task_id, 0, 8, 16)
    q.complete("b", got.task_id)
    assert q.completed_epochs == 1
    with pytest.raises(InvalidArgument, match="not part of this job"):
        q.requeue_batch("a", 0, 30, 40)
