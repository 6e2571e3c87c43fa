"""The worker's task feed against the chief's servicer, with replies lost on the way."""
import time

import grpc
import pytest

from shoal.chief.servicer import ChiefServicer
from shoal.chief.state import ChiefState
from shoal.chief.tasks import DatasetSpec
from shoal.settings.config import JobConfig
from shoal.state.convert import layout_to_pb
from shoal.state.layout import ModelLayout, TensorSpec
from shoal.proto import shoal_pb2 as pb
from shoal.worker.data import TaskFeed


class Cancelled(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "CANCELLED"


class LossyStub:
    """Serves every GetTasks, but the replies of the calls numbered in ``lose`` never arrive
    (as when a chief that is stopping cancels a call it already served)."""

    def __init__(self, servicer, lose):
        self.servicer, self.lose, self.calls = servicer, set(lose), 0

    def GetTasks(self, req, timeout=None):
        self.calls += 1
        reply = self.servicer.GetTasks(req, None)
        if self.calls in self.lose:
            raise Cancelled()
        return reply


@pytest.mark.timeout(30)     # a stranded task leaves the feed polling for ever
def test_a_lost_reply_strands_no_task():
    svc = ChiefServicer(ChiefState(JobConfig(num_shards=1), time.monotonic))
    layout = layout_to_pb(ModelLayout([TensorSpec("w", (2, 2))]))
    w = svc.Join(pb.JoinRequest(role=pb.WORKER, layout=layout), None).member_id
    stub = LossyStub(svc, lose={2, 5})
    feed = TaskFeed(stub, lambda: w, DatasetSpec(size=64, batch_size=8, epochs=2, batches_per_task=2),
                    prefetch=2, poll_s=0.01)
    seen = []
    for task, token in feed:
        seen.append((task.epoch, task.task_id))
        feed.mark_done(task)
    feed.close()
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 8        # every task once, none stranded
    assert svc.state.tasks.finished and stub.calls > 8
