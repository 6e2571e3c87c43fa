"""Conversions between protobuf messages and the plain core objects.

Core state never sees a protobuf message; servicers and clients call these.
"""
from __future__ import annotations

from shoal.settings.config import JobConfig
from shoal.dataset import DatasetSpec, Task
from shoal.state.layout import ModelLayout, TensorSpec
from shoal.members import Counters, Role
from shoal.proto import shoal_pb2 as pb
from shoal.view import View

ROLE_TO_PB = {Role.WORKER: pb.WORKER, Role.PS: pb.PS}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}


def layout_to_pb(layout: ModelLayout) -> pb.ModelLayout:
    return pb.ModelLayout(tensors=[pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype)
                                   for s in layout.specs])


def layout_from_pb(msg: pb.ModelLayout) -> ModelLayout:
    return ModelLayout(TensorSpec(t.name, tuple(t.shape), t.dtype or "float32") for t in msg.tensors)


def counters_to_pb(c: Counters) -> pb.Counters:
    return pb.Counters(steps=c.steps, samples=c.samples, bytes_pushed=c.bytes_pushed, bytes_pulled=c.bytes_pulled)


def counters_from_pb(msg: pb.Counters) -> Counters:
    return Counters(msg.steps, msg.samples, msg.bytes_pushed, msg.bytes_pulled)


def job_to_pb(job: JobConfig) -> pb.JobConfig:
    return pb.JobConfig(mode=job.mode, backup_workers=job.backup_workers, staleness=job.staleness,
                        num_shards=job.num_shards, lease_seconds=job.lease_seconds, replicas=job.replicas,
                        recovery=job.recovery, nonfinite=job.nonfinite,
                        guard=pb.UpdateGuard(lr_factor=job.lr_factor, grad_norm_factor=job.grad_norm_factor,
                                             grad_norm_policy=job.grad_norm_policy,
                                             grad_norm_warmup=job.grad_norm_warmup, expel_after=job.expel_after,
                                             require_batch=job.require_batch))


def job_from_pb(msg: pb.JobConfig) -> JobConfig:
    return JobConfig(mode=msg.mode, backup_workers=msg.backup_workers, staleness=msg.staleness,
                     num_shards=msg.num_shards, lease_seconds=msg.lease_seconds, replicas=msg.replicas,
                     recovery=msg.recovery or "consistent", nonfinite=msg.nonfinite or "skip",
                     **guard_from_pb(msg.guard) if msg.HasField("guard") else {})


def guard_from_pb(msg: pb.UpdateGuard) -> dict:
    """The update guard's settings of a JobConfig message (an older chief sends none: the defaults)."""
    return dict(lr_factor=msg.lr_factor, grad_norm_factor=msg.grad_norm_factor,
                grad_norm_policy=msg.grad_norm_policy or "refuse", grad_norm_warmup=msg.grad_norm_warmup,
                expel_after=msg.expel_after, require_batch=msg.require_batch)


def view_to_pb(view: View) -> pb.ClusterView:
    return pb.ClusterView(
        epoch=view.epoch,
        members=[pb.MemberInfo(member_id=m.member_id, role=ROLE_TO_PB[m.role], address=m.address, host=m.host,
                               state=m.state.value, counters=counters_to_pb(m.counters),
                               step_seconds=view.step_seconds.get(m.member_id, 0.0),
                               straggler=m.member_id in view.stragglers,
                               excluded=m.member_id in view.excluded) for m in view.members],
        shards=[pb.ShardRoute(shard=r.shard, primary_id=r.member_id, primary_address=r.address,
                                    backup_id=r.backup_id, backup_address=r.backup_address,
                                    backup_complete=r.backup_complete) for r in view.routes],
        ready=view.ready, job=job_to_pb(view.job), layout_fingerprint=view.fingerprint,
        completed_epochs=view.completed_epochs, job_id=view.job_id, generation=view.generation,
        job_phase=view.job_phase, job_result=view.job_result, job_exit_code=view.job_exit_code)


def dataset_to_pb(spec: DatasetSpec) -> pb.DatasetSpec:
    return pb.DatasetSpec(size=spec.size, batch_size=spec.batch_size, epochs=spec.epochs,
                          batches_per_task=spec.batches_per_task, seed=spec.seed)


def dataset_from_pb(msg: pb.DatasetSpec) -> DatasetSpec:
    return DatasetSpec(msg.size, msg.batch_size, msg.epochs, msg.batches_per_task, msg.seed)


def task_to_pb(t: Task, token: bytes = b"") -> pb.Task:
    return pb.Task(task_id=t.task_id, epoch=t.epoch, start=t.start, stop=t.stop, attempt=t.attempt, token=token)


def task_from_pb(msg: pb.Task) -> Task:
    return Task(msg.task_id, msg.epoch, msg.start, msg.stop, msg.attempt)
