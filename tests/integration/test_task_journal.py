"""Every task hand-out is journaled before the reply, the second one to a busy worker included.

The first hand-out also makes the worker busy (the view changes, which is journaled anyway); a
second hand-out to a worker that is already busy changes nothing but the task queue. A chief that
skipped that write and then restarted from its journal would hand the task out twice or lose it.
"""
import time

from shoal.chief.journal import Journal
from shoal.chief.servicer import ChiefServicer
from shoal.chief.state import ChiefState
from shoal.settings.config import JobConfig
from shoal.state.convert import layout_to_pb
from shoal.state.layout import ModelLayout, TensorSpec
from shoal.proto import shoal_pb2 as pb

DATASET = pb.DatasetSpec(size=64, batch_size=8, epochs=1, batches_per_task=2)     # 4 tasks


def chief(path):
    journal = Journal(path)
    return ChiefServicer(ChiefState(JobConfig(num_shards=1), time.monotonic), journal), journal


def restarted(path):
    """The state a chief restarted from the journal at ``path`` resumes with."""
    journal = Journal(path)
    try:
        return ChiefState.from_dict(journal.load(), time.monotonic, recover=True)
    finally:
        journal.close()


def held(state, member):
    return sorted((t.task_id, t.attempt, t.start, t.stop) for t in state.tasks.held_by(member))


def test_a_second_hand_out_to_a_busy_worker_is_in_the_journal_before_the_reply(tmp_path):
    svc, journal = chief(tmp_path / "chief.db")
    svc.Join(pb.JoinRequest(role=pb.PS, address="h:1"), None)
    layout = layout_to_pb(ModelLayout([TensorSpec("w", (2, 2))]))
    w = svc.Join(pb.JoinRequest(role=pb.WORKER, layout=layout), None).member_id
    first = svc.GetTasks(pb.TaskRequest(member_id=w, max_tasks=1, dataset=DATASET), None).tasks
    assert len(first) == 1
    epoch, writes = svc.state.epoch, journal.writes
    # the worker is busy now: a second request (it reports what it holds) changes no view
    second = svc.GetTasks(pb.TaskRequest(member_id=w, max_tasks=1, reports_held=True,
                                         held_task_ids=[first[0].task_id]), None).tasks
    assert len(second) == 1 and second[0].task_id != first[0].task_id
    assert svc.state.epoch == epoch                                    # nothing but the queue changed
    assert journal.writes == writes + 1
    journal.close()                                                    # the chief dies here

    state = restarted(tmp_path / "chief.db")
    want = sorted((t.task_id, t.attempt, t.start, t.stop) for t in (*first, *second))
    assert held(state, w) == want                                      # both still doing, for this worker
    assert state.tasks.depth == 2 and state.tasks.done_count == 0
    # the restarted chief hands out the two tasks nobody holds, never one of the held ones again
    rest, _ = state.take_tasks(w, None, 4, known=frozenset(t[0] for t in want))
    assert sorted(t.task_id for t in rest) == sorted({0, 1, 2, 3} - {t[0] for t in want})


def test_a_finished_task_and_a_new_hand_out_in_one_request_are_both_journaled(tmp_path):
    svc, journal = chief(tmp_path / "chief.db")
    svc.Join(pb.JoinRequest(role=pb.PS, address="h:1"), None)
    layout = layout_to_pb(ModelLayout([TensorSpec("w", (2, 2))]))
    w = svc.Join(pb.JoinRequest(role=pb.WORKER, layout=layout), None).member_id
    a = svc.GetTasks(pb.TaskRequest(member_id=w, max_tasks=2, dataset=DATASET), None).tasks
    b = svc.GetTasks(pb.TaskRequest(member_id=w, max_tasks=1, done_task_ids=[a[0].task_id], reports_held=True,
                                    held_task_ids=[a[1].task_id]), None).tasks
    journal.close()
    state = restarted(tmp_path / "chief.db")
    assert held(state, w) == sorted((t.task_id, t.attempt, t.start, t.stop) for t in (a[1], *b))
    assert state.tasks.done_count == 1
