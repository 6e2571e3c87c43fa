"""gRPC servicer of the chief: one lock, one state call per RPC, proto in and out."""
from __future__ import annotations

import logging
import threading
import time

from shoal.chief.membership import Role
from shoal.chief.state import ChiefState
from shoal import convert
from shoal.errors import InvalidArgument
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.rpc import grpc_errors

log = logging.getLogger(__name__)

MAX_VIEW_WAIT_S = 30.0


class ChiefServicer(pb_grpc.ChiefServicer):
    def __init__(self, state: ChiefState):
        self.state = state
        self._cond = threading.Condition()

    def tick(self) -> None:
        """Called periodically: expires leases and wakes view watchers on change."""
        with self._cond:
            before = self.state.epoch
            self.state.tick()
            if self.state.epoch != before:
                self._cond.notify_all()

    def _view(self) -> pb.ClusterView:
        return convert.view_to_pb(self.state.view())

    @grpc_errors
    def Join(self, request, context):
        with self._cond:
            if request.role == pb.WORKER:
                m = self.state.join_worker(convert.layout_from_pb(request.layout), request.host, request.member_id)
                shard = -1
            elif request.role == pb.PS:
                if not request.address:
                    raise InvalidArgument("a parameter server must give the address it serves on")
                m, shard = self.state.join_ps(request.address, request.host, request.member_id)
            else:
                raise InvalidArgument(f"unknown role {request.role}")
            self._cond.notify_all()
            return pb.JoinReply(member_id=m.member_id, lease_seconds=self.state.job.lease_seconds,
                                view=self._view(), shard=shard,
                                job_secret=self.state.secret if request.role == pb.PS else b"")

    @grpc_errors
    def Heartbeat(self, request, context):
        with self._cond:
            known = self.state.heartbeat(request.member_id, convert.counters_from_pb(request.counters),
                                         {p.task_id: p.next_start for p in request.progress},
                                         request.step_seconds)
            return pb.HeartbeatReply(epoch=self.state.epoch, known=known)

    @grpc_errors
    def Leave(self, request, context):
        with self._cond:
            self.state.leave(request.member_id, convert.counters_from_pb(request.counters))
            self._cond.notify_all()
            return pb.Empty()

    @grpc_errors
    def GetView(self, request, context):
        deadline = time.monotonic() + min(max(request.timeout_seconds, 0.0), MAX_VIEW_WAIT_S)
        with self._cond:
            while self.state.epoch <= request.after_epoch and context.is_active():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 1.0))
            return self._view()

    @grpc_errors
    def GetTasks(self, request, context):
        spec = convert.dataset_from_pb(request.dataset) if request.HasField("dataset") else None
        dropped = tuple((b.epoch, b.start, b.stop) for b in request.dropped)
        with self._cond:
            before = self.state.epoch
            tasks, finished = self.state.take_tasks(request.member_id, spec, request.max_tasks,
                                                    tuple(request.done_task_ids), dropped)
            if self.state.epoch != before:
                self._cond.notify_all()
            return pb.TaskReply(tasks=[convert.task_to_pb(t, self.state.sign(request.member_id, t)) for t in tasks],
                                finished=finished, epoch=self.state.epoch)

    @grpc_errors
    def ReportMetrics(self, request, context):
        with self._cond:
            self.state.report(request.member_id, dict(request.values))
            return pb.Empty()

    @grpc_errors
    def GetJobStats(self, request, context):
        with self._cond:
            s = self.state
            workers = list(s.members.all(Role.WORKER))
            return pb.JobStats(totals=convert.counters_to_pb(s.totals()), metrics=s.metrics,
                               workers_seen=len(workers), workers_live=len(s.members.alive(Role.WORKER)),
                               tasks_done=s.tasks.done_count, tasks_total=s.tasks.total,
                               job=convert.job_to_pb(s.job), queue_depth=s.tasks.depth,
                               completed_epochs=s.tasks.completed_epochs,
                               epochs=s.tasks.spec.epochs if s.tasks.spec else 0,
                               batches_per_epoch=s.tasks.spec.batches_per_epoch if s.tasks.spec else 0)
