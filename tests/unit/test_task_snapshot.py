"""The task queue's snapshot costs what is in flight, not the dataset (issue 17): done ids are a
bitmap (chief/idset.py), the open epoch's untouched tasks a count, hand-out counts kept only for
tasks not done. It round-trips exactly,
older snapshots (plain lists) still load, and a malformed one is an error, never a wrong queue."""
import json
import random

import pytest
from hypothesis import given, settings, strategies as st

from shoal.chief import idset
from shoal.chief.journal import Journal, JournalUnreadable
from shoal.chief.tasks import DatasetSpec, TaskQueue


def through_json(d):
    return json.loads(json.dumps(d))


def old_format(q: TaskQueue) -> dict:
    """The snapshot a chief of state format 2 wrote: every todo task listed, plain id lists."""
    d = q.to_dict()
    d.pop("fresh")
    d["todo"] = [[t.task_id, t.epoch, t.start, t.stop, t.attempt] for t in q.pending()]
    d["done"] = sorted(q._done)
    d["attempts"] = [[k, v] for k, v in sorted(q._attempts.items())] + [[k, 1] for k in sorted(q._done)]
    return through_json(d)                            # (it kept the count of done tasks too)


def run_ops(q: TaskQueue, rng: random.Random, steps: int) -> None:
    """Random hand-outs, reports, progress, releases and dropped batches by three workers."""
    for _ in range(steps):
        w = rng.choice("abc")
        held = q.held_by(w)
        r = rng.random()
        if r < 0.45:
            q.take(w, rng.randint(1, 3))
        elif r < 0.75 and held:
            q.complete(w, rng.choice(held).task_id)
        elif r < 0.85 and held:
            t = held[0]
            q.progress(w, t.task_id, rng.randint(t.start, t.stop))
        elif r < 0.93:
            q.release(w)
        elif held:
            t = held[0]
            q.requeue_batch(w, t.epoch, t.start, min(t.stop, t.start + q.spec.batch_size))


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 5000), max_size=300))
def test_an_id_set_round_trips(ids):
    text = idset.encode(ids)
    assert isinstance(text, str) and idset.decode(text) == ids


@pytest.mark.parametrize("bad", ["not base64!", "AAAA", 7, ["x"]])
def test_an_id_set_that_is_not_one_is_a_value_error(bad):
    with pytest.raises(ValueError):
        idset.decode(bad)


def test_an_id_set_bigger_than_the_limit_is_refused_without_unpacking_it(monkeypatch):
    text = idset.encode({0, 80_000})
    monkeypatch.setattr(idset, "MAX_IDS", 64_000)
    with pytest.raises(ValueError, match="more than 64000 ids"):
        idset.decode(text)
    with pytest.raises(ValueError):
        idset.encode({-1, 3})


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), steps=st.integers(0, 120), epochs=st.integers(1, 3))
def test_a_restored_queue_hands_out_what_the_original_would(seed, steps, epochs):
    """Restored at any point, through JSON, in the new and in the old format, the queue is the same
    queue: same pending tasks in the same order, same counts, and the same future."""
    rng = random.Random(seed)
    q = TaskQueue()
    q.configure(DatasetSpec(size=rng.randint(1, 90), batch_size=rng.randint(1, 4), epochs=epochs,
                            batches_per_task=rng.randint(1, 3), seed=seed))
    run_ops(q, rng, steps)
    new = TaskQueue.from_dict(through_json(q.to_dict()))
    assert new.to_dict() == q.to_dict()
    old = TaskQueue.from_dict(old_format(q))          # the same queue, its todo listed
    future = rng.random()
    for back in (q, new, old):
        assert back.pending() == q.pending() and back._done == q._done and back._attempts == q._attempts
        assert {w: back.held_by(w) for w in "abc"} == {w: q.held_by(w) for w in "abc"}
        assert (back.total, back.done_count, back.depth, back.completed_epochs, back.finished) == \
            (q.total, q.done_count, q.depth, q.completed_epochs, q.finished)
    for back in (new, old):                           # and the same future
        run_ops(back, random.Random(future), 60)
    run_ops(q, random.Random(future), 60)
    for back in (new, old):
        assert back.pending() == q.pending() and back._done == q._done and back._attempts == q._attempts
        assert {w: back.held_by(w) for w in "abc"} == {w: q.held_by(w) for w in "abc"}


def snapshot_bytes(size: int) -> int:
    q = TaskQueue()
    q.configure(DatasetSpec(size=size, batch_size=1, batches_per_task=1, epochs=2, seed=1))
    for i in range(size + size // 2):                 # the first epoch done, half of the second
        for t in q.take(f"w{i % 50}", 1):
            q.complete(f"w{i % 50}", t.task_id)
    for w in range(50):
        q.take(f"w{w}", 2)                            # 100 tasks in flight
    return len(json.dumps(q.to_dict()))


def test_a_done_task_keeps_no_hand_out_count():
    """A done task is never handed out again, so its count is dropped (a snapshot lists only the
    counts of tasks not done); an older snapshot's counts of done tasks are dropped on load."""
    q = TaskQueue()
    q.configure(DatasetSpec(size=40, batch_size=4, batches_per_task=1))
    a, b = q.take("a", 2)
    q.complete("a", a.task_id)
    q.progress("a", b.task_id, b.stop)
    q.release("a")                                    # all pushed: done without its report
    (c,) = q.take("b", 1)
    assert q._attempts == {c.task_id: 1} and q._done == {a.task_id, b.task_id}
    assert q.to_dict()["attempts"] == [[c.task_id, 1]]
    assert TaskQueue.from_dict(old_format(q))._attempts == {c.task_id: 1}


def test_a_snapshot_grows_with_what_is_in_flight_not_with_the_dataset():
    small, large = snapshot_bytes(2_000), snapshot_bytes(200_000)
    # 100x the tasks: the lists (what is in flight) are as long, the done bitmap has a bit per id
    assert large < 8_000 + 200_000 * 2 // 8 * 4 // 3 and large < 20 * small, (small, large)
    q = TaskQueue()
    q.configure(DatasetSpec(size=200_000, batch_size=1, batches_per_task=1, seed=1))
    q.take("w", 1)
    assert len(json.dumps(q.to_dict())) < 1_000     # an opened epoch of 200 000 tasks is a count


@pytest.mark.parametrize("fresh", [-1, 5, 10**6, "x"])
def test_a_count_of_untouched_tasks_the_epoch_cannot_have_is_refused(fresh):
    q = TaskQueue()
    q.configure(DatasetSpec(size=40, batch_size=4, batches_per_task=1))
    q.take("a", 6)                                    # 4 of the epoch's 10 tasks untouched
    d = through_json(q.to_dict())
    assert d["fresh"] == 4
    with pytest.raises((ValueError, TypeError)):
        TaskQueue.from_dict({**d, "fresh": 11 if fresh == 5 else fresh})
    q2 = TaskQueue()
    q2.configure(DatasetSpec(size=40, batch_size=4, batches_per_task=1))
    with pytest.raises(ValueError):                   # no epoch opened yet: nothing can be untouched
        TaskQueue.from_dict({**through_json(q2.to_dict()), "fresh": 3})


def test_a_journal_whose_snapshot_has_a_corrupt_bitmap_is_unreadable_naming_the_file(tmp_path, clock):
    from shoal.chief.server import ChiefServer
    from shoal.chief.state import ChiefState
    from shoal.settings.config import JobConfig
    from tests.unit.test_journal_changes import LAYOUT, SPEC

    s = ChiefState(JobConfig(num_shards=1), clock)
    s.join_ps("h:1")
    s.take_tasks(s.join_worker(LAYOUT).member_id, SPEC, 2)
    j = Journal(tmp_path / "chief.db")
    d = s.journal_snapshot()
    d["tasks"]["done"] = "@@not a bitmap@@"
    j.write(d, "corrupted")
    j.close()
    with pytest.raises(JournalUnreadable, match="chief.db holds a state this chief cannot read"):
        ChiefServer(JobConfig(num_shards=1), journal=tmp_path / "chief.db")
