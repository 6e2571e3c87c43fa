"""The sampler's last epoch: a task that comes back after a worker's loop ended goes to one still training.

Found on a GPU (sync, 2 workers, fast steps): a batch a sync round dropped was re-queued by the chief
after the worker holding the epoch's short task had ended its last iteration. That worker's feed
fetched it anyway, the loop that would have trained it was over, and the job ended one batch short
with exit 0.
"""
import time
import types

import pytest

from harness import wait_until
from shoal.chief.servicer import ChiefServicer
from shoal.chief.state import ChiefState
from shoal.settings.config import JobConfig
from shoal.state.convert import layout_to_pb
from shoal.dataset import DatasetSpec
from shoal.state.layout import ModelLayout, TensorSpec
from shoal.proto import shoal_pb2 as pb
from shoal.worker.data import TaskFeed
from shoal.worker.sampler import DistributedSampler

SIZE, BATCH = 60, 8          # 8 batches; the last task's last batch is short (4 samples)
SPEC = DatasetSpec(size=SIZE, batch_size=BATCH, epochs=1, batches_per_task=2)


class Stub:
    def __init__(self, servicer):
        self.servicer = servicer

    def GetTasks(self, req, timeout=None):
        return self.servicer.GetTasks(req, None)


def chief_with_workers(n):
    """A chief's servicer (no gRPC) with ``n`` workers joined; returns it, a stub and their names."""
    svc = ChiefServicer(ChiefState(JobConfig(num_shards=1), time.monotonic))
    layout = layout_to_pb(ModelLayout([TensorSpec("w", (2, 2))]))
    names = [svc.Join(pb.JoinRequest(role=pb.WORKER, layout=layout), None).member_id for _ in range(n)]
    return svc, Stub(svc), names


def fake_trainer(stub, member):
    t = types.SimpleNamespace(chief=types.SimpleNamespace(stub=stub, join=None, call_timeout_s=lambda: 5.0),
                              member_id=member, _feed=None,
                              accumulation=None,
                              finished=[])
    t._task_finished = t.finished.append
    return t


@pytest.mark.timeout(60)
def test_a_batch_dropped_after_another_workers_last_epoch_ended_is_trained_by_a_worker_still_in_it():
    svc, stub, (a, b) = chief_with_workers(2)
    # B takes the first two tasks and sits on them, as a worker training slower would
    feed_b = TaskFeed(stub, lambda: b, SPEC, prefetch=2, poll_s=0.01)
    held = [feed_b.poll(5.0) for _ in range(2)]
    assert all(isinstance(item, tuple) for item in held)
    # A's sampler gets the other two; its last epoch ends once nothing more is free (B holds the rest)
    trainer_a = fake_trainer(stub, a)
    sampler = DistributedSampler(range(SIZE), batch_size=BATCH, epochs=1, shuffle=False,
                                 batches_per_task=2, trainer=trainer_a)
    indices = list(sampler)
    assert len(indices) == SIZE - sum(t.stop - t.start for t, _ in held)
    while (batch := sampler._next_batch()) is not None:      # A's loop steps every batch it was given
        sampler._stepped(batch)
    # B's sync round drops one batch of its first task; B's feed is full, so it reports the drop
    # without asking for a task, and the chief re-queues the batch for whoever asks first
    first, _ = held[0]
    feed_b.drop(first.epoch, first.start, first.start + BATCH, first.task_id)
    feed_b.flush()
    time.sleep(0.3)                      # A's feed polls every 50 ms: six chances to take it
    dropped = (first.start, first.start + BATCH)
    assert dropped not in [(t.start, t.stop) for t in svc.state.tasks.held_by(a)], \
        "a worker whose last epoch is over took the re-queued batch"
    for task, _ in held:
        feed_b.mark_done(task)
    item = feed_b.poll(5.0)
    assert isinstance(item, tuple), "the dropped batch never reached the worker still training"
    task, _ = item
    assert (task.epoch, task.start, task.stop) == (0, first.start, first.start + BATCH)
    feed_b.mark_done(task)
    wait_until(lambda: svc.state.tasks.held_by(a) == [], what="A to report its tasks done")
    wait_until(lambda: svc.state.tasks.finished, what="the job's data to be done")
    feed_b.close()
    trainer_a._feed.close()


@pytest.mark.timeout(60)
def test_tasks_queued_when_the_last_epoch_ends_go_back_to_the_chief():
    svc, stub, (a, b) = chief_with_workers(2)
    feed = TaskFeed(stub, lambda: a, SPEC, prefetch=3, poll_s=0.01)
    wait_until(lambda: feed._ready.qsize() == 3, what="three tasks prefetched")
    back = feed.stop_fetching()
    assert len(back) == 3
    wait_until(lambda: svc.state.tasks.held_by(a) == [], what="the chief to take the tasks back")
    got = svc.GetTasks(pb.TaskRequest(member_id=b, max_tasks=8), None).tasks
    assert sorted((t.start, t.stop) for t in got) == sorted([(t.start, t.stop) for t in back] + [(48, 60)])
    feed.close()


def loop(sampler, loader, skip=lambda record: False):
    """Steps every DataLoader batch as a training loop would; checks each batch holds exactly the
    samples of the record it is pushed under. ``skip(record)``: the step was skipped (handed back)."""
    seen = []
    for (batch,) in loader:
        record = sampler._next_batch()
        group = record if isinstance(record, tuple) else (record,)
        assert sorted(batch.tolist()) == sorted(i for b in group for i in range(b.start, b.stop))
        for b in group:
            if skip(b):
                sampler._feed.drop(b.task.epoch, b.start, b.stop, b.task.task_id)
            sampler._stepped(b)
        seen.append(tuple((b.task.epoch, b.start, b.stop) for b in group))
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size,joined", [(60, True), (62, False)])
def test_a_short_batch_handed_back_joins_the_next_epochs_short_batch_or_waits_an_iteration(size, joined):
    """Epoch 0's short batch is skipped (a GradScaler overflow) and comes back while epoch 1 has its own
    short batch. Two short batches cannot both end one iteration; before, the sampler took the second
    again and again and the worker spun for ever (a sync job stalled on a GPU). When they fit in one
    batch (4 + 4 of 8) the DataLoader makes one batch of them and its push names both; otherwise
    (6 + 6) the lone one waits for the next iteration, and after the last one it goes back to the
    chief for a worker still training. No batch is trained twice."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    spec = DatasetSpec(size=size, batch_size=BATCH, epochs=3, batches_per_task=2)
    svc, stub, (a,) = chief_with_workers(1)
    trainer = fake_trainer(stub, a)
    sampler = DistributedSampler(range(size), batch_size=BATCH, epochs=3, shuffle=False, batches_per_task=2,
                                 trainer=trainer)
    assert sampler.spec == spec
    loader = DataLoader(TensorDataset(torch.arange(size)), batch_size=BATCH, sampler=sampler)
    short = (size // BATCH * BATCH, size)
    trained = loop(sampler, loader, skip=lambda b: (b.task.epoch, b.start, b.stop) == (0, *short))
    assert trained[-1] == ((0, *short),)
    epoch1 = loop(sampler, loader)
    if joined:
        assert epoch1[-1] == ((1, *short), (0, *short))      # one DataLoader batch, one push naming both
        epoch2 = loop(sampler, loader)
    else:
        assert epoch1[-1] == ((1, *short),)
        epoch2 = loop(sampler, loader)
        assert epoch2[-1] == ((2, *short),)
    done = [b for g in trained[:-1] + epoch1 + epoch2 for b in g]
    assert len(done) == len(set(done))
    for e in range(3):
        expected = set(range(0, size, BATCH)) - ({short[0]} if e == 0 and not joined else set())
        assert {s for ep, s, _ in done if ep == e} == expected
    if not joined:          # handed back: the chief holds it for whoever asks next
        wait_until(lambda: [(t.epoch, t.start, t.stop) for t in svc.state.tasks.held_by(a)] == [],
                   what="the worker to report everything")
        todo = [(t.epoch, t.start, t.stop) for t in svc.state.tasks.pending()]
        assert todo == [(0, *short)]
    trainer._feed.close()
