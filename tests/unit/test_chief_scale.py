"""Costs of the chief that must not grow with the cluster (issue 17; bench/chief_scale.py measures them).

A task request (``GetTasks``) and a worker's expiry look up that worker's own tasks: they must not
walk every task held by every worker (that made each request O(workers), a cluster's requests
O(workers^2) per second). Driven by a fake clock, no sockets.
"""
import random

from shoal.chief.state import ChiefState
from shoal.chief.tasks import DatasetSpec, TaskQueue
from shoal.settings.config import JobConfig
from shoal.state.layout import ModelLayout, TensorSpec

LAYOUT = ModelLayout([TensorSpec("w", (4, 3))])


class ScanCounting(dict):
    """The queue's held-task table, counting every walk over it."""

    scans = 0

    def _walk(self, it):
        type(self).scans += 1
        return it

    def values(self):
        return self._walk(super().values())

    def items(self):
        return self._walk(super().items())

    def keys(self):
        return self._walk(super().keys())

    def __iter__(self):
        return self._walk(super().__iter__())


def test_task_requests_and_expiry_find_a_workers_tasks_without_walking_everyone_elses(clock):
    s = ChiefState(JobConfig(lease_seconds=3.0), clock)
    ws = [s.join_worker(LAYOUT).member_id for _ in range(50)]
    spec = DatasetSpec(size=200, batch_size=1, batches_per_task=1)
    held = {w: s.take_tasks(w, spec, 1)[0][0] for w in ws}
    ScanCounting.scans = 0
    s.tasks._doing = ScanCounting(s.tasks._doing)

    # a finished task reported, a new one handed out
    got, _ = s.take_tasks(ws[7], None, 1, done=(held[ws[7]].task_id,),
                          known=frozenset({held[ws[7]].task_id}))
    assert len(got) == 1 and got[0] != held[ws[7]]
    # a worker whose reply was lost gets its task again (it reports holding none)
    assert s.take_tasks(ws[8], None, 1, known=frozenset())[0] == [held[ws[8]]]
    # a worker's lease lapses: its task goes back to the front of the queue
    clock.advance(2.0)
    for w in ws:
        if w != ws[9]:
            s.heartbeat(w)
    clock.advance(2.0)
    assert [m.member_id for m in s.tick()] == [ws[9]]
    assert s.take_tasks(ws[7], None, 1, done=(got[0].task_id,))[0][0].task_id == held[ws[9]].task_id
    assert ScanCounting.scans == 0


def test_the_per_worker_index_agrees_with_the_held_tasks_through_any_sequence_and_a_restart():
    rng = random.Random(17)
    q = TaskQueue()
    q.configure(DatasetSpec(size=300, batch_size=1, epochs=3, batches_per_task=2))
    members = [f"worker-{i}" for i in range(6)]
    for step in range(600):
        m = rng.choice(members)
        mine = q.held_by(m)
        r = rng.random()
        if r < 0.5:
            q.take(m, rng.randint(1, 3))
        elif r < 0.8 and mine:
            q.complete(m, rng.choice(mine).task_id)
        elif r < 0.9:
            if mine:
                t = rng.choice(mine)
                q.progress(m, t.task_id, rng.randint(t.start, t.stop))
            q.release(m)
        else:
            q = TaskQueue.from_dict(q.to_dict())
        for x in members:
            assert q.held_by(x) == [t for owner, t in q._doing.values() if owner == x], step
