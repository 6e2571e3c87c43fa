"""gRPC servicer of a parameter server: translates frames to :class:`ps.shard.Shard` calls.

Serves the shards of a :class:`~shoal.ps.host.ShardHost`. No training logic
lives here: admission, rounds and optimizer steps are the shard's, roles and
replication the host's.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

import grpc
import torch

from shoal.ps.host import ShardHost
from shoal.ps.replication import NoInstall, install_from_frames
from shoal.ps.update_wire import update_from_frames
from shoal.ps.shard import Shard
from shoal.ps.update import count_nonfinite
from shoal.security import auth, tokens
from shoal.net import frames
from shoal.ps.ledger import BatchKey
from shoal.settings.config import OptimizerSpec
from shoal.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted, Unavailable
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import grpc_errors, request_seconds
from shoal.ps.sparse import SparseGrad
from shoal.net.wire import DATA_SERVICE, decode_chunk, decode_sparse_chunk, exact_dtype, is_sparse, iter_chunks
from shoal.state.tables import ROWS_CODEC, encode_rows, ids_from, specs_from_json, unpack_rows

log = logging.getLogger(__name__)

MAX_PULL_WAIT_S = 3600.0     # the longest a pull may wait for a version
MAX_INSTALL_BYTES = 1 << 40  # a shard's copy (weights and optimizer state) is far below this
MAX_SHARD_NUMEL = 1 << 36    # elements of one shard (256 GiB of fp32): a larger Init is refused unread


def ps_guard(host: ShardHost) -> auth.Guard:
    """Role checks on a ps: credentials verify with the chief's public key."""
    return auth.Guard(lambda: host.verify_key)


class DataServicer:
    """Raw-framed Init / Push / Pull (identity serializers: requests and replies are bytes)."""

    def __init__(self, host: ShardHost, pull_chunk_bytes: int = 1 << 20):
        self.host = host
        self.guard = ps_guard(host)
        self.pull_chunk_bytes = pull_chunk_bytes
        self.offer = pb.DataChannelOffer()     # set by the ps once its TCP data channel listens

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(DATA_SERVICE, {
            "Init": grpc.stream_unary_rpc_method_handler(self.Init),
            "Push": grpc.stream_unary_rpc_method_handler(self.Push),
            "Pull": grpc.unary_stream_rpc_method_handler(self.Pull),
            "PushOne": grpc.unary_unary_rpc_method_handler(self.PushOne),
            "PullOne": grpc.unary_unary_rpc_method_handler(self.PullOne),
            "Replicate": grpc.stream_unary_rpc_method_handler(self.Replicate),
            "ReplicateOne": grpc.unary_unary_rpc_method_handler(self.ReplicateOne),
            "Install": grpc.stream_unary_rpc_method_handler(self.Install),
            "OpenChannel": grpc.unary_unary_rpc_method_handler(self.OpenChannel),
            "LookupRows": grpc.unary_unary_rpc_method_handler(self.LookupRows),
        })

    def OpenChannel(self, request: bytes, context) -> bytes:
        """Where this ps takes the raw TCP data channel (port 0: it has none)."""
        return self.offer.SerializeToString()

    # ------------------------------------------------------------ from this shard's primary

    @grpc_errors
    def Replicate(self, request_iterator: Iterator[bytes], context) -> bytes:
        self.guard.require(context, auth.PS)
        sizes: list[int] = []

        def counted():
            for frame in request_iterator:
                sizes.append(len(frame))
                yield frame

        try:
            head, update = update_from_frames(counted(), lambda h: self.host.check_sender(h.shard, h.primary_id,
                                                                                          h.shard_numel))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        self.host.count(inbound=sum(sizes))
        return pb.ReplicateReply(version=self.host.replicate(head, update)).SerializeToString()

    def ReplicateOne(self, request: bytes, context) -> bytes:
        return self.Replicate(iter((request,)), context)

    @grpc_errors
    def Install(self, request_iterator: Iterator[bytes], context) -> bytes:
        self.guard.require(context, auth.PS)
        try:
            head, data = install_from_frames(request_iterator, self._check_install)
        except NoInstall as exc:            # nothing arrived and nothing changes: no refusal to warn about
            raise Unavailable(str(exc)) from None
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        self.host.count(inbound=len(data))
        return pb.ReplicateReply(version=self.host.install_copy(head, data)).SerializeToString()

    def _check_install(self, head: pb.InstallHeader) -> None:
        self.host.check_sender(head.shard, head.primary_id)
        if not 0 < head.total_bytes <= MAX_INSTALL_BYTES:
            raise InvalidArgument(f"a copy of {head.total_bytes} bytes (at most {MAX_INSTALL_BYTES})")

    def _check_init(self, head: pb.InitHeader) -> None:
        """Before a shard's memory is reserved: a size in range, a shard this ps serves, not another layout."""
        if not 0 <= head.numel <= MAX_SHARD_NUMEL:
            raise InvalidArgument(f"a shard of {head.numel} elements (at most {MAX_SHARD_NUMEL})")
        existing = self.host.shards.get(head.shard)
        if existing is not None and (existing.numel, existing.fingerprint) != (head.numel, head.layout_fingerprint):
            raise FailedPrecondition(f"shard {head.shard} holds model layout {existing.fingerprint} of "
                                     f"{existing.numel} elements, not {head.layout_fingerprint} of {head.numel}")
        if existing is None and head.shard not in self.host.assigned:
            raise Unavailable(f"shard {head.shard} is not assigned to this parameter server (yet)")

    @grpc_errors
    def Init(self, request_iterator: Iterator[bytes], context) -> bytes:
        first, values, nbytes = None, None, 0
        for frame in request_iterator:
            nbytes += len(frame)
            head, payload = frames.unpack(frame, pb.InitHeader)
            if first is None:
                first = head
                self._check_init(head)
                try:
                    values = torch.empty(head.numel, dtype=torch.float32)
                except (RuntimeError, MemoryError):
                    raise ResourceExhausted(f"cannot allocate shard {head.shard} of {head.numel} elements") from None
            elif (head.shard, head.numel, head.layout_fingerprint) != (first.shard, first.numel, first.layout_fingerprint):
                raise InvalidArgument("Init frames disagree on shard, size or layout")
            n = len(payload) // 4
            if head.offset < 0 or head.offset + n > first.numel:
                raise InvalidArgument(f"Init chunk [{head.offset}, {head.offset + n}) outside shard of {first.numel}")
            values[head.offset:head.offset + n] = frames.fp32_from(payload, n)
        if first is None:
            raise InvalidArgument("Init carried no frames")
        bad = count_nonfinite(values)
        if bad:
            raise InvalidArgument(f"Init of shard {first.shard}: the initial weights hold {bad} non-finite "
                                  f"value(s) (NaN/Inf)")
        self.host.count(inbound=nbytes)
        spec = OptimizerSpec.from_json(first.optimizer.spec_json) if first.optimizer.spec_json else \
            OptimizerSpec(first.optimizer.name or "sgd", dict(first.optimizer.hparams))
        tables = specs_from_json(first.tables_json)
        shard, created = self.host.create(first.shard, values, spec, first.layout_fingerprint,
                                          flat_start=first.flat_start)
        if shard.numel != first.numel:
            raise FailedPrecondition(f"shard {first.shard} has {shard.numel} elements, Init sent {first.numel}")
        if tables:
            made = shard.declare_tables(tables, self.host.job.num_shards)
            if made:
                log.info("shard %d holds partition %d of table(s) %s", first.shard, first.shard, ", ".join(made))
        return pb.InitReply(created=created, version=shard.version).SerializeToString()

    @grpc_errors
    def Push(self, request_iterator: Iterator[bytes], context) -> bytes:
        push, nbytes = PushAssembly(self, lambda member: self.guard.speaks_for(context, member)), 0
        for frame in request_iterator:
            nbytes += len(frame)
            head, payload = frames.unpack(frame, pb.PushHeader)
            push.check(head)
            push.place_encoded(head, payload)
        return push.finish(nbytes).SerializeToString()

    def batches_of(self, head: pb.PushHeader) -> tuple[BatchKey, ...]:
        """Checks a push's claim to its data: for each batch it names (several when the gradient was
        accumulated over micro-batches), a task token the chief signed and a batch inside that task."""
        if not head.has_batch:
            if head.more_batches:
                raise InvalidArgument("a push names more_batches but no first batch (has_batch is false)")
            if self.host.job is not None and self.host.job.require_batch:
                raise PermissionDenied(f"a push of {head.worker_id} names no batch: a worker pushes only for "
                                       f"a batch of a task it holds")
            return ()
        named = [(pb.Task(task_id=head.task_id, epoch=head.data_epoch, start=head.task_start, stop=head.task_stop,
                          attempt=head.attempt, token=head.token), head.batch_start, head.batch_stop)]
        named += [(b.task, b.batch_start, b.batch_stop) for b in head.more_batches]
        keys = []
        for t, start, stop in named:
            if self.host.verify_key and not tokens.verify(self.host.verify_key, t.token, head.worker_id, t.task_id,
                                                          t.attempt, t.epoch, t.start, t.stop):
                raise PermissionDenied(f"worker {head.worker_id} does not hold task {t.task_id} "
                                       f"(attempt {t.attempt}): its token does not verify")
            if not t.start <= start < stop <= t.stop:
                raise InvalidArgument(f"batch [{start}, {stop}) lies outside task {t.task_id} [{t.start}, {t.stop})")
            keys.append(BatchKey(t.epoch, start))
        if len(set(keys)) != len(keys):
            raise InvalidArgument(f"a push names a batch twice: {[(k.epoch, k.start) for k in keys]}")
        if all(k.epoch < self.host.completed_epochs for k in keys):
            raise FailedPrecondition(f"epoch {keys[0].epoch} is over (the job has completed "
                                     f"{self.host.completed_epochs} epoch(s))")
        return tuple(keys)

    def PushOne(self, request: bytes, context) -> bytes:
        """Unary Push of a single frame: several times cheaper per call than a stream in gRPC Python."""
        return self.Push(iter((request,)), context)

    @grpc_errors
    def Pull(self, request: bytes, context) -> Iterator[bytes]:
        return iter(self._pull_frames(request, self.pull_chunk_bytes))

    @grpc_errors
    def PullOne(self, request: bytes, context) -> bytes:
        """Unary Pull: the whole shard in one frame, built once per version (one copy of the weights)."""
        req, shard = self.pull_ready(request)
        codec = req.codec or "none"

        def build(version: int, raw: memoryview) -> bytes:
            head = pb.PullHeader(shard=req.shard, version=version, offset=0, numel=shard.numel, codec=codec,
                                 shard_numel=shard.numel)
            return frames.pack(head, raw)

        _, frame = shard.snapshot(codec, build)
        self.host.count(outbound=len(frame))
        return frame

    @grpc_errors
    def LookupRows(self, request: bytes, context) -> bytes:
        """Rows of one table by id (request: a RowsHeader and the ids as raw int64; reply: the rows in the
        dtype asked for), once the shard is at ``min_version``."""
        head, payload = frames.unpack(request, pb.RowsHeader)
        ids = ids_from(payload, head.count)
        if head.dtype not in ("", "float32", "float16", "bfloat16"):
            raise InvalidArgument(f"unknown row dtype {head.dtype!r}; known: float32, float16, bfloat16")
        shard = self.host.get(head.shard)
        if head.layout_fingerprint and head.layout_fingerprint != shard.fingerprint:
            raise FailedPrecondition(f"lookup for layout {head.layout_fingerprint}; shard holds {shard.fingerprint}")
        if head.min_version > shard.version:
            shard.wait_version(head.min_version, request_seconds(head.timeout_seconds, "LookupRows timeout_seconds",
                                                                 30.0, MAX_PULL_WAIT_S))
        version, rows = shard.lookup_rows(head.table, ids)
        out = frames.pack(pb.RowsHeader(shard=head.shard, table=head.table, count=len(ids), version=version,
                                        dtype=head.dtype, dim=rows.shape[1]), encode_rows(rows, head.dtype))
        self.host.count(inbound=len(request), outbound=len(out))
        return out

    def pull_ready(self, request: bytes) -> tuple[pb.PullRequest, Shard]:
        req = pb.PullRequest.FromString(request)
        shard = self.host.get(req.shard)
        if req.layout_fingerprint and req.layout_fingerprint != shard.fingerprint:
            raise FailedPrecondition(f"pull for layout {req.layout_fingerprint}; shard holds {shard.fingerprint}")
        if req.min_version > shard.version:
            shard.wait_version(req.min_version, request_seconds(req.timeout_seconds, "Pull timeout_seconds", 30.0,
                                                                MAX_PULL_WAIT_S))
        return req, shard

    def _pull_frames(self, request: bytes, chunk_bytes: int) -> list[bytes]:
        req, shard = self.pull_ready(request)
        codec = req.codec or "none"
        version, raw = shard.snapshot(codec)
        out = list(iter_chunks(raw, codec, chunk_bytes,
                               lambda off, n: pb.PullHeader(shard=req.shard, version=version, offset=off,
                                                            numel=n, codec=codec, shard_numel=shard.numel)))
        self.host.count(outbound=sum(len(f) for f in out))
        return out


class PushAssembly:
    """One push's chunks gathered into the shard's gradient, each header checked against the first.

    Both transports use it: gRPC hands it encoded chunks, the TCP channel asks
    where a raw fp32 chunk's bytes go and receives them there. While every chunk
    so far is sparse (top-k) their entries are kept as they are, and a push that
    is sparse throughout reaches the shard as a :class:`~shoal.ps.sparse.SparseGrad`
    (applied to those elements only where exact); the first dense chunk scatters
    them into a dense gradient.
    """

    def __init__(self, servicer: DataServicer, speaks_for: Callable[[str], bool] = lambda member: True):
        self.servicer = servicer
        self.speaks_for = speaks_for     # whether the caller may push as this worker (its credential)
        self.first: pb.PushHeader | None = None
        self.shard: Shard | None = None
        self.grad: torch.Tensor | None = None
        self.covered = 0
        self.owned = False
        self.sparse = True     # every chunk so far came in a sparse codec (top-k)
        self.exact: str | None = None   # the narrower dtype every chunk so far is exact in ("": none)
        self.entries: list[tuple[torch.Tensor, torch.Tensor]] = []   # theirs, shard-indexed, while sparse
        self.rows: tuple | None = None   # the embedding rows' gradients (a last frame in codec "rows")

    def check(self, head: pb.PushHeader) -> None:
        if self.first is None:
            if not self.speaks_for(head.worker_id):
                raise PermissionDenied(f"this caller's credential does not name worker {head.worker_id!r}: "
                                       f"a push is accepted only from the worker it names")
            shard = self.servicer.host.get(head.shard)
            if head.layout_fingerprint != shard.fingerprint:
                raise FailedPrecondition(f"push for layout {head.layout_fingerprint}; shard {head.shard} "
                                         f"holds {shard.fingerprint}")
            self.first, self.shard = head, shard
        elif (head.shard, head.key, head.version, head.worker_id) != \
                (self.first.shard, self.first.key, self.first.version, self.first.worker_id):
            raise InvalidArgument("Push frames disagree on shard, key, version or worker")
        if head.codec == ROWS_CODEC:
            if self.rows is not None or self.covered != self.shard.numel or head.offset != self.covered \
                    or head.numel != 0:
                raise InvalidArgument(f"a push's rows come once, after all {self.shard.numel} elements of shard "
                                      f"{head.shard}, at offset {self.shard.numel} with numel 0")
            return
        self.sparse = self.sparse and is_sparse(head.codec)
        dtype = exact_dtype(head.codec)
        self.exact = dtype if self.exact is None or self.exact == dtype else ""
        numel = self.shard.numel
        if head.offset != self.covered or head.numel < 0 or head.offset + head.numel > numel:
            raise InvalidArgument(f"push chunk [{head.offset}, {head.offset + head.numel}) does not continue "
                                  f"at {self.covered} inside shard {head.shard} of {numel} elements")

    def place_encoded(self, head: pb.PushHeader, payload: memoryview) -> None:
        """Adds a chunk as it came on the wire (checked by :meth:`check`)."""
        if head.codec == ROWS_CODEC:
            self.rows = tuple(unpack_rows(payload))
            return
        if self.sparse and self.grad is None:
            idx, values = decode_sparse_chunk(head.codec, payload, head.numel)
            self.entries.append((idx.add_(head.offset) if head.offset else idx, values))
            self.covered += head.numel
            return
        self.place(head, decode_chunk(head.codec, payload, head.numel), fresh=head.codec not in ("", "none"))

    def place(self, head: pb.PushHeader, chunk: torch.Tensor, fresh: bool) -> None:
        """Adds a decoded chunk; ``fresh``: nobody else holds it, so the shard may keep it."""
        if head.offset == 0 and head.numel == self.shard.numel:
            self.grad, self.owned = chunk, fresh     # one chunk covers the shard: no copy
        else:
            self._gradient()[head.offset:head.offset + head.numel] = chunk
        self.covered += head.numel

    def raw_target(self, head: pb.PushHeader) -> memoryview:
        """The bytes a raw fp32 chunk fills, inside a gradient of the shard's own; counts it placed."""
        view = frames.tensor_bytes(self._gradient()[head.offset:head.offset + head.numel])
        self.covered += head.numel
        return view

    def _gradient(self) -> torch.Tensor:
        if self.grad is None:
            self.grad, self.owned = torch.empty(self.shard.numel, dtype=torch.float32), True
            if self.covered:        # the sparse chunks before this one: [0, covered) in full
                self.grad[:self.covered] = SparseGrad.join(self.entries, self.covered).dense()
            self.entries = []
        return self.grad

    def finish(self, nbytes: int) -> pb.PushReply:
        """Offers the gathered gradient to the shard (all chunks present) and says what it did."""
        first, shard = self.first, self.shard
        if first is None:
            raise InvalidArgument("Push carried no frames")
        if self.covered != shard.numel:
            raise InvalidArgument(f"push covers {self.covered} of shard {first.shard}'s {shard.numel} elements")
        self.servicer.host.count(inbound=nbytes)
        grad = self.grad if self.grad is not None else SparseGrad.join(self.entries, shard.numel) \
            if self.entries else torch.empty(0, dtype=torch.float32)
        batches = self.servicer.batches_of(first)
        over = tuple(k for k in batches if k.epoch < self.servicer.host.completed_epochs)
        if over:        # a group that reaches into an epoch already over: not applied, the rest goes back
            return pb.PushReply(accepted=False, version=shard.version, duplicate=True,
                                reason=f"batch {over[0].epoch}/{over[0].start} belongs to an epoch that is over",
                                applied_before=[pb.BatchRange(epoch=k.epoch, start=k.start) for k in over])
        r = shard.push(first.worker_id, first.version, grad, first.key, batches=batches,
                       owned=self.owned, sparse=self.sparse, hparams=dict(first.hparams), exact=self.exact or "",
                       rows=self.rows or ())
        return pb.PushReply(accepted=r.accepted, version=r.version, reason=r.reason, duplicate=r.duplicate,
                            applied_before=[pb.BatchRange(epoch=k.epoch, start=k.start) for k in r.applied])


class StatusServicer(pb_grpc.ParameterServerServicer):
    def __init__(self, host: ShardHost):
        self.host = host

    @grpc_errors
    def Status(self, request, context):
        job = self.host.job
        mode = job.mode if job else ""
        shard_ids = sorted(self.host.assigned)
        sid = request.shard if request.by_shard else (shard_ids[0] if shard_ids else -1)
        if sid < 0:
            return pb.ShardStatus(shard=-1, mode=mode)
        s = self.host.shards.get(sid)
        if s is None or self.host.roles.get(sid) != "primary":
            return pb.ShardStatus(shard=sid, initialized=False, mode=mode)
        r = self.host.replicators.get(sid)
        return pb.ShardStatus(shard=sid, initialized=True, version=s.version, numel=s.numel,
                              mode=mode, pushes_applied=s.stats.pushes_applied,
                              pushes_dropped=s.stats.pushes_dropped, bytes_in=self.host.bytes_in,
                              bytes_out=self.host.bytes_out, round_pending=s.round_pending,
                              ledger=[pb.LedgerEpoch(epoch=e.epoch, applied=e.applied, max_count=e.max_count)
                                      for e in s.ledger_summary()], worker_clocks=s.worker_clocks(),
                              backup=r.backup if r else "", backup_state=r.state if r else "none",
                              promotions=self.host.promotions, nonfinite_refused=s.nonfinite_counts(),
                              guard_refused=s.guard_counts(), rolled_back=s.guard.refusals.rolled_back,
                              expelled=sorted(s.guard.refusals.expelled),
                              tables=[pb.TableStatus(**t) for t in s.table_status()],
                              optimizer=pb.OptimizerConfig(name=s.optimizer_spec.name,
                                                           hparams=dict(s.optimizer_spec.hparams),
                                                           spec_json=s.optimizer_spec.to_json()))
