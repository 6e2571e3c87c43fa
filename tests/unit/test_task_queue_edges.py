"""Edges of the task queue found by mutation testing: the last batch of the dataset, epochs that
do not exist, and an epoch's count of open tasks when a dying worker had pushed everything."""
import pytest

from shoal.chief.tasks import DatasetSpec, TaskQueue
from shoal.errors import InvalidArgument


def queue(size=64, batch=8, epochs=2, per_task=2):
    q = TaskQueue()
    q.configure(DatasetSpec(size=size, batch_size=batch, epochs=epochs, batches_per_task=per_task))
    return q


def test_the_first_and_last_batch_of_the_dataset_can_be_dropped_and_trained_again():
    q = queue(size=60)                        # the last batch is short: [56, 60)
    [t] = q.take("w", 1)
    back = q.requeue_batch("w", 0, 56, 60)
    assert (back.epoch, back.start, back.stop) == (0, 56, 60)
    assert q.take("v", 1)[0].task_id == back.task_id      # at the front of the queue
    first = q.requeue_batch("w", 0, 0, 8)     # and the first one
    assert (first.start, first.stop) == (0, 8) and first.task_id == back.task_id + 1      # each its own task
    assert q.total == 4 * 2 + 2


@pytest.mark.parametrize("epoch,start,stop", [(-1, 0, 8), (1, 0, 8), (0, 56, 65), (0, -8, 0), (0, -1, 8), (0, 8, 8)])
def test_a_dropped_batch_outside_the_job_is_refused(epoch, start, stop):
    q = queue()
    q.take("w", 1)                           # epoch 0 is open, epoch 1 is not yet
    with pytest.raises(InvalidArgument, match=f"dropped batch epoch {epoch}"):
        q.requeue_batch("w", epoch, start, stop)
    assert q.total == 8 and q.depth == 3


def test_a_released_task_that_was_all_pushed_closes_once_and_the_epoch_waits_for_the_rest():
    q = queue(size=32, epochs=1)              # two tasks
    a, b = q.take("w", 2)
    q.progress("w", a.task_id, a.stop)        # every batch of a pushed; the report never came
    back = q.release("w")
    assert [t.task_id for t in back] == [b.task_id] and q.done_count == 1
    assert q.completed_epochs == 0            # b is still to do
    [again] = q.take("v", 1)
    q.complete("v", again.task_id)
    assert q.completed_epochs == 1 and q.finished


def test_a_late_report_of_a_requeued_task_is_ignored_and_an_unknown_task_is_refused():
    q = queue(size=32, epochs=1)
    held = q.take("w", 2)
    q.release("w")                            # w's lease lapsed: both back in the queue, held by nobody
    assert sorted(t.task_id for t in held) == [0, 1]
    for t in held:
        q.complete("w", t.task_id)            # the reports arrive late: ignored, nothing raised
    assert q.done_count == 0 and q.depth == 2
    for bogus in (-1, 2, 99):
        with pytest.raises(InvalidArgument, match=f"task {bogus} is not held by anyone"):
            q.complete("w", bogus)
