"""Promises of the task queue (chief/tasks.py) that a cosmic-ray run left untested (bench/RESULTS.md,
make mutate): the hand-out order a journal relies on, progress that is not journaled when it changes
nothing, dense task ids, and what ``pending()`` shows."""
import logging

import pytest

from shoal.chief.tasks import DatasetSpec, TaskQueue
from shoal.errors import InvalidArgument


def queue(size=64, batch=8, epochs=2, per_task=2, seed=0) -> TaskQueue:
    q = TaskQueue()
    q.configure(DatasetSpec(size=size, batch_size=batch, epochs=epochs, batches_per_task=per_task, seed=seed))
    return q


def brief(tasks):
    return [(t.task_id, t.epoch, t.start, t.stop) for t in tasks]


@pytest.mark.parametrize("seed,order", [
    (0, [7, 8, 1, 5, 3, 4, 2, 0, 9, 6, 16, 18, 19, 17, 15, 13, 10, 14, 11, 12]),
    (7, [0, 6, 9, 7, 5, 1, 4, 8, 3, 2, 15, 19, 10, 11, 17, 16, 18, 14, 13, 12]),
])
def test_the_hand_out_order_of_a_seed_and_an_epoch_never_changes(seed, order):
    """A snapshot names the open epoch's untouched tasks by a count and recomputes their order from the
    seed (TaskQueue.from_dict), so a chief restarted from a journal, by this version or a later one (or
    on another Python), must shuffle exactly as the one that wrote it, or it hands some tasks out twice
    and others never. The orders below were written by the chief at 84faae8."""
    q = queue(size=80, batch=4, epochs=2, per_task=2, seed=seed)       # 10 tasks an epoch
    assert [t.task_id for t in q.take("w", 20)] == order


def test_progress_only_moves_forward_and_is_journaled_only_when_it_does():
    """Heartbeats carry each held task's progress every beat: one that changes nothing (still at the
    task's start, the same as before, behind it, or beyond the task) records no journal operation."""
    q = TaskQueue()
    q.take_ops()                                      # record from here
    q.configure(DatasetSpec(size=128, batch_size=8, epochs=1, batches_per_task=4))
    q.take("w", 2)
    t = next(t for t in q.held_by("w") if t.start > 0)
    assert [op[0] for op in q.take_ops()] == ["configure", "take"]
    q.progress("w", t.task_id, t.start)               # a heartbeat before the first push
    q.progress("w", t.task_id, t.start - 8)           # before the task
    q.progress("w", t.task_id, t.stop + 8)            # beyond it
    q.progress("v", t.task_id, t.start + 8)           # not v's task
    assert q.take_ops() == [] and q.to_dict()["progress"] == []
    q.progress("w", t.task_id, t.start + 16)
    q.progress("w", t.task_id, t.start + 16)          # the next heartbeat says the same
    q.progress("w", t.task_id, t.start + 8)           # and a stale one says less
    assert q.take_ops() == [["progress", "w", t.task_id, t.start + 16]]
    assert q.to_dict()["progress"] == [[t.task_id, t.start + 16]]
    q.progress("w", t.task_id, t.stop)                # every batch pushed
    assert q.take_ops() == [["progress", "w", t.task_id, t.stop]]
    assert q.release("w") == [q.pending()[0]] and q.done_count == 1    # t is done; the other goes back


def test_a_retried_report_is_quiet_and_a_late_one_says_so(caplog):
    """A retried report of a done task is harmless and says nothing; only a report of a task the member
    no longer holds (its lease ended, the task was re-queued) is logged as late."""
    q = queue(size=64, batch=8, epochs=1, per_task=2)
    a, b = q.take("w", 2)
    q.complete("w", a.task_id)
    with caplog.at_level(logging.INFO, logger="shoal.chief.tasks"):
        q.complete("w", a.task_id)                  # the reply was lost: the same report again
        assert caplog.records == []
        q.release("w")
        caplog.clear()
        q.complete("w", b.task_id)                  # b went back to the queue: a late report
    assert [r.getMessage() for r in caplog.records] == \
        [f"ignoring a late report of task {b.task_id} from w (re-queued after its lease ended)"]
    assert q.done_count == 1


def test_a_report_before_any_dataset_is_configured_is_refused():
    q = TaskQueue()
    with pytest.raises(InvalidArgument, match="task 0 is not held by anyone"):
        q.complete("w", 0)


def test_pending_shows_what_take_hands_out_in_that_order():
    q = queue(size=64, batch=8, epochs=2, per_task=2)   # 4 tasks an epoch
    assert q.pending() == [] and q.depth == 0 and q.epochs_open == 0
    first = q.take("w", 1)[0]
    q.requeue_batch("w", 0, 8, 16)
    q.requeue_batch("w", 0, 0, 8)                       # re-queued batches first, the newest at the front
    pending = q.pending()
    assert q.depth == len(pending) == 2 + 3 and q.epochs_open == 1
    assert [t.epoch for t in pending] == [0] * 5 and first.task_id not in [t.task_id for t in pending]
    assert brief(q.take("v", 5)) == brief(pending)
    assert q.depth == 0 and q.pending() == [] and q.epochs_open == 1
    q.take("v", 1)
    assert q.epochs_open == 2 and [t.epoch for t in q.pending()] == [1, 1, 1]


def test_task_ids_are_dense_and_unique_re_queued_batches_included():
    """Done ids are kept as a bitmap (chief/idset.py) and a report is checked against the ids handed out
    so far: every task of the job, a dropped batch's included, has its own id in 0..total-1."""
    q = queue(size=64, batch=8, epochs=2, per_task=2)   # 4 tasks an epoch, 8 in all
    seen = {}
    while not q.finished:
        got = q.take("w", 1)
        for t in got:
            seen.setdefault(t.task_id, brief([t])[0])
            if len(seen) in (2, 6):                     # one dropped batch in each epoch
                q.requeue_batch("w", t.epoch, t.start, t.start + 8)
            q.complete("w", t.task_id)
    assert q.total == 10 and sorted(seen) == list(range(10))
    assert {seen[8][1], seen[9][1]} == {0, 1} and all(seen[i][3] - seen[i][2] == 8 for i in (8, 9))


def test_a_release_puts_the_tasks_back_in_task_id_order_at_the_front_and_says_so(caplog):
    q = queue(size=64, batch=8, epochs=1, per_task=1)   # 8 one-batch tasks
    held = q.take("w", 3)
    q.take("v", 1)
    with caplog.at_level(logging.INFO, logger="shoal.chief.tasks"):
        assert q.release("x") == []                     # holds nothing: nothing to say
        back = q.release("w")
    assert [r.getMessage() for r in caplog.records] == ["re-queued 3 task(s) of w"]
    assert brief(back) == brief(held)                   # nothing was pushed: each from its start
    want = sorted(brief(held))
    assert brief(q.pending()[:3]) == want and brief(q.take("u", 3)) == want


def test_replaying_a_journal_logs_nothing(caplog):
    q = TaskQueue()
    q.take_ops()
    q.configure(DatasetSpec(size=64, batch_size=8, epochs=1, batches_per_task=2))
    q.take("w", 2)
    q.release("w")
    ops = q.take_ops()
    with caplog.at_level(logging.DEBUG, logger="shoal.chief.tasks"):
        again = TaskQueue()
        again.replay(ops)
    assert again.to_dict() == q.to_dict()
    assert [r for r in caplog.records if r.name == "shoal.chief.tasks"] == []
    assert not logging.getLogger("shoal.chief.tasks").disabled


@pytest.mark.parametrize("epochs", [1, 3])
def test_a_snapshot_may_hold_any_count_of_untouched_tasks_the_last_epoch_can_have(epochs):
    """from_dict refuses only counts an epoch cannot have: every task of the open epoch untouched is
    one it can (the validator's bound, whatever take() happens to leave), in the last epoch too."""
    q = queue(size=40, batch=4, epochs=epochs, per_task=1)      # 10 tasks an epoch
    while q.epochs_open < epochs:
        for t in q.take("w", 1):
            q.complete("w", t.task_id)
    d = q.to_dict()
    assert d["next_epoch"] == epochs and 0 < d["fresh"] < 10
    with pytest.raises(ValueError, match=f"^11 untouched tasks of epoch {epochs - 1}, which does not have them"):
        TaskQueue.from_dict({**d, "fresh": 11})
    first = (epochs - 1) * 10
    for fresh in (1, 10):                             # the epoch's last task untouched, or all of them
        ids = [t.task_id for t in TaskQueue.from_dict({**d, "fresh": fresh}).pending()]
        assert len(ids) == fresh and set(ids) <= set(range(first, first + 10))
    assert sorted(ids) == list(range(first, first + 10))
