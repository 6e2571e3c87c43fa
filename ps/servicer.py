"""gRPC servicer of a parameter server: translates frames to :class:`ps.shard.Shard` calls.

Hosts the shards the chief assigned to this process. No training logic lives
here: admission, rounds and optimizer steps are the shard's.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterator

import grpc
import torch

from shoal.ps.consistency import rule_for
from shoal.ps.shard import Shard
from shoal import frames, tokens
from shoal.ps.ledger import BatchKey
from shoal.config import JobConfig, OptimizerSpec
from shoal.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.rpc import grpc_errors
from shoal.wire import DATA_SERVICE, decode_chunk, iter_chunks

log = logging.getLogger(__name__)


class ShardHost:
    """The shards of one ps process, keyed by shard id, plus their byte counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.job: JobConfig | None = None
        self.assigned: set[int] = set()
        self.shards: dict[int, Shard] = {}
        self.live_workers: frozenset[str] = frozenset()
        self.secret: bytes = b""
        self.completed_epochs = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self._restoring: set[int] = set()             # shards being loaded from a checkpoint
        self._restored = threading.Condition(self._lock)

    def assign(self, shard: int, job: JobConfig, restoring: bool = False) -> None:
        """``restoring``: the shard is loaded from a checkpoint next; an Init waits for it (see :meth:`install`)."""
        with self._lock:
            self.job = job
            self.assigned.add(shard)
            if restoring:
                self._restoring.add(shard)

    def install(self, s: Shard) -> None:
        """Puts a shard restored from a checkpoint in place and wakes the Inits that waited for it."""
        with self._lock:
            s.set_live_workers(self.live_workers)
            self.shards[s.shard_id] = s
            self._restoring.discard(s.shard_id)
            self._restored.notify_all()

    def get(self, shard: int) -> Shard:
        s = self.shards.get(shard)
        if s is None:
            if shard in self.assigned:
                raise FailedPrecondition(f"shard {shard} is not initialised yet")
            raise NotFound(f"this parameter server does not hold shard {shard} (holds {sorted(self.assigned)})")
        return s

    def create(self, shard: int, values: torch.Tensor, optimizer: OptimizerSpec, fingerprint: str,
               restore_wait_s: float = 300.0) -> tuple[Shard, bool]:
        with self._lock:
            if not self._restored.wait_for(lambda: shard not in self._restoring, timeout=restore_wait_s):
                raise Unavailable(f"shard {shard} is still being restored from a checkpoint")
            existing = self.shards.get(shard)
            if existing is not None:
                if existing.fingerprint != fingerprint:
                    raise FailedPrecondition(
                        f"shard {shard} holds model layout {existing.fingerprint}, not {fingerprint}")
                return existing, False
            if shard not in self.assigned or self.job is None:
                raise Unavailable(f"shard {shard} is not assigned to this parameter server (yet)")
            s = Shard(shard, values, optimizer, rule_for(self.job), fingerprint)
            s.set_live_workers(self.live_workers)
            self.shards[shard] = s
            log.info("shard %d initialised: %d elements, %s, mode %s", shard, s.numel,
                     optimizer.name, self.job.mode)
            return s, True

    def set_view(self, workers: frozenset[str], completed_epochs: int) -> None:
        with self._lock:
            self.live_workers = workers
            self.completed_epochs = max(self.completed_epochs, completed_epochs)
            shards = list(self.shards.values())
        for s in shards:
            s.set_live_workers(workers)

    def count(self, inbound: int = 0, outbound: int = 0) -> None:
        with self._lock:
            self.bytes_in += inbound
            self.bytes_out += outbound


class DataServicer:
    """Raw-framed Init / Push / Pull (identity serializers: requests and replies are bytes)."""

    def __init__(self, host: ShardHost, pull_chunk_bytes: int = 1 << 20):
        self.host = host
        self.pull_chunk_bytes = pull_chunk_bytes

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(DATA_SERVICE, {
            "Init": grpc.stream_unary_rpc_method_handler(self.Init),
            "Push": grpc.stream_unary_rpc_method_handler(self.Push),
            "Pull": grpc.unary_stream_rpc_method_handler(self.Pull),
            "PushOne": grpc.unary_unary_rpc_method_handler(self.PushOne),
            "PullOne": grpc.unary_unary_rpc_method_handler(self.PullOne),
        })

    @grpc_errors
    def Init(self, request_iterator: Iterator[bytes], context) -> bytes:
        first, values, nbytes = None, None, 0
        for frame in request_iterator:
            nbytes += len(frame)
            head, payload = frames.unpack(frame, pb.InitHeader)
            if first is None:
                first = head
                if head.numel < 0:
                    raise InvalidArgument(f"negative shard size {head.numel}")
                values = torch.empty(head.numel, dtype=torch.float32)
            elif (head.shard, head.numel, head.layout_fingerprint) != (first.shard, first.numel, first.layout_fingerprint):
                raise InvalidArgument("Init frames disagree on shard, size or layout")
            n = len(payload) // 4
            if head.offset < 0 or head.offset + n > first.numel:
                raise InvalidArgument(f"Init chunk [{head.offset}, {head.offset + n}) outside shard of {first.numel}")
            values[head.offset:head.offset + n] = frames.fp32_from(payload, n)
        if first is None:
            raise InvalidArgument("Init carried no frames")
        self.host.count(inbound=nbytes)
        spec = OptimizerSpec(first.optimizer.name or "sgd", dict(first.optimizer.hparams))
        shard, created = self.host.create(first.shard, values, spec, first.layout_fingerprint)
        if shard.numel != first.numel:
            raise FailedPrecondition(f"shard {first.shard} has {shard.numel} elements, Init sent {first.numel}")
        return pb.InitReply(created=created, version=shard.version).SerializeToString()

    @grpc_errors
    def Push(self, request_iterator: Iterator[bytes], context) -> bytes:
        first, shard, grad, covered, nbytes, owned = None, None, None, 0, 0, False
        for frame in request_iterator:
            nbytes += len(frame)
            head, payload = frames.unpack(frame, pb.PushHeader)
            if first is None:
                first = head
                shard = self.host.get(head.shard)
                if head.layout_fingerprint != shard.fingerprint:
                    raise FailedPrecondition(f"push for layout {head.layout_fingerprint}; shard {head.shard} "
                                             f"holds {shard.fingerprint}")
            elif (head.shard, head.key, head.version, head.worker_id) != (first.shard, first.key, first.version, first.worker_id):
                raise InvalidArgument("Push frames disagree on shard, key, version or worker")
            if head.offset != covered or head.numel < 0 or head.offset + head.numel > shard.numel:
                raise InvalidArgument(f"push chunk [{head.offset}, {head.offset + head.numel}) does not continue "
                                      f"at {covered} inside shard {head.shard} of {shard.numel} elements")
            chunk = decode_chunk(head.codec, payload, head.numel)
            if head.offset == 0 and head.numel == shard.numel:
                grad = chunk          # one chunk covers the shard: use it without a copy
                owned = head.codec not in ("", "none")   # decoded codecs return fresh tensors
            else:
                if grad is None:
                    grad = torch.empty(shard.numel, dtype=torch.float32)
                    owned = True
                grad[head.offset:head.offset + head.numel] = chunk
            covered += head.numel
        if first is None:
            raise InvalidArgument("Push carried no frames")
        if covered != shard.numel:
            raise InvalidArgument(f"push covers {covered} of shard {first.shard}'s {shard.numel} elements")
        self.host.count(inbound=nbytes)
        r = shard.push(first.worker_id, first.version, grad, first.key, self._batch_of(first), owned=owned)
        return pb.PushReply(accepted=r.accepted, version=r.version, reason=r.reason,
                            duplicate=r.duplicate).SerializeToString()

    def _batch_of(self, head: pb.PushHeader) -> BatchKey | None:
        """Checks a push's claim to its data: a task token the chief signed, a batch inside it."""
        if not head.has_batch:
            return None
        if self.host.secret and not tokens.verify(self.host.secret, head.token, head.worker_id, head.task_id,
                                                  head.attempt, head.data_epoch, head.task_start, head.task_stop):
            raise PermissionDenied(f"worker {head.worker_id} does not hold task {head.task_id} "
                                   f"(attempt {head.attempt}): its token does not verify")
        if not head.task_start <= head.batch_start < head.batch_stop <= head.task_stop:
            raise InvalidArgument(f"batch [{head.batch_start}, {head.batch_stop}) lies outside task "
                                  f"{head.task_id} [{head.task_start}, {head.task_stop})")
        if head.data_epoch < self.host.completed_epochs:
            raise FailedPrecondition(f"epoch {head.data_epoch} is over (the job has completed "
                                     f"{self.host.completed_epochs} epoch(s))")
        return BatchKey(head.data_epoch, head.batch_start)

    def PushOne(self, request: bytes, context) -> bytes:
        """Unary Push of a single frame: several times cheaper per call than a stream in gRPC Python."""
        return self.Push(iter((request,)), context)

    @grpc_errors
    def Pull(self, request: bytes, context) -> Iterator[bytes]:
        return iter(self._pull_frames(request, self.pull_chunk_bytes))

    @grpc_errors
    def PullOne(self, request: bytes, context) -> bytes:
        """Unary Pull: the whole shard in one frame, built once per version (one copy of the weights)."""
        req, shard = self._pull_ready(request)
        codec = req.codec or "none"

        def build(version: int, raw: memoryview) -> bytes:
            head = pb.PullHeader(shard=req.shard, version=version, offset=0, numel=shard.numel, codec=codec,
                                 shard_numel=shard.numel)
            return frames.pack(head, raw)

        _, frame = shard.snapshot(codec, build)
        self.host.count(outbound=len(frame))
        return frame

    def _pull_ready(self, request: bytes) -> tuple[pb.PullRequest, Shard]:
        req = pb.PullRequest.FromString(request)
        shard = self.host.get(req.shard)
        if req.layout_fingerprint and req.layout_fingerprint != shard.fingerprint:
            raise FailedPrecondition(f"pull for layout {req.layout_fingerprint}; shard holds {shard.fingerprint}")
        if req.min_version > shard.version:
            shard.wait_version(req.min_version, req.timeout_seconds or 30.0)
        return req, shard

    def _pull_frames(self, request: bytes, chunk_bytes: int) -> list[bytes]:
        req, shard = self._pull_ready(request)
        codec = req.codec or "none"
        version, raw = shard.snapshot(codec)
        out = list(iter_chunks(raw, codec, chunk_bytes,
                               lambda off, n: pb.PullHeader(shard=req.shard, version=version, offset=off,
                                                            numel=n, codec=codec, shard_numel=shard.numel)))
        self.host.count(outbound=sum(len(f) for f in out))
        return out


class StatusServicer(pb_grpc.ParameterServerServicer):
    def __init__(self, host: ShardHost):
        self.host = host

    @grpc_errors
    def Status(self, request, context):
        job = self.host.job
        shard_ids = sorted(self.host.assigned)
        if not shard_ids:
            return pb.ShardStatus(shard=-1, mode=job.mode if job else "")
        sid = shard_ids[0]
        s = self.host.shards.get(sid)
        if s is None:
            return pb.ShardStatus(shard=sid, initialized=False, mode=job.mode if job else "")
        return pb.ShardStatus(shard=sid, initialized=True, version=s.version, numel=s.numel,
                              mode=job.mode if job else "", pushes_applied=s.stats.pushes_applied,
                              pushes_dropped=s.stats.pushes_dropped, bytes_in=self.host.bytes_in,
                              bytes_out=self.host.bytes_out, round_pending=s.round_pending,
                              ledger=[pb.LedgerEpoch(epoch=e.epoch, applied=e.applied, max_count=e.max_count)
                                      for e in s.ledger_summary()], worker_clocks=s.worker_clocks())
