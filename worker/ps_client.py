"""Client of one parameter shard's data plane: Init, Push, Pull.

Push and Pull take the ps's raw TCP data channel when it offers one
(:mod:`shoal.net.tcp_client`), else gRPC with raw frames; Init always goes
over gRPC (once per job). Both transports fail with ``grpc.RpcError`` codes,
so callers handle them alike.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Callable, TypeVar

import grpc
import numpy as np
import torch

from shoal.net import frames
from shoal.settings.config import OptimizerSpec
from shoal.errors import InvalidArgument
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import open_channel
from shoal.net.wire import DataStubs, decode_weights, pull_itemsize
from shoal.state.tables import decode_rows
from shoal.net import tcp_client
from shoal.net.tcp_channel import ChannelError
from shoal.net.tcp_client import TcpDataChannel, negotiate

log = logging.getLogger(__name__)

T = TypeVar("T")
TRANSPORTS = ("tcp", "grpc")


def _cancelled_once_closed(method: Callable[..., T]) -> Callable[..., T]:
    """A call on a client that was closed (the view moved its shard: :meth:`ShardClient.close`) fails as
    CANCELLED, which the worker takes for a failover, also when it started before the close."""
    @functools.wraps(method)
    def call(self: "ShardClient", *args, **kwargs):
        if self.closed:
            raise ChannelError(grpc.StatusCode.CANCELLED, f"shard {self.shard}: the client of "
                                             f"{self.address} was closed (the shard moved)")
        try:
            return method(self, *args, **kwargs)
        except ValueError:              # gRPC: "Cannot invoke RPC on closed channel!"
            if not self.closed:
                raise
            raise ChannelError(grpc.StatusCode.CANCELLED, f"shard {self.shard}: the client of "
                                             f"{self.address} was closed (the shard moved)") from None
    return call
TCP_CHUNK_BYTES = 16 << 20     # the TCP channel needs no small frames; chunks only bound encoding memory


class ShardClient:
    """Talks to the process currently serving ``shard`` at ``address``.

    ``transport``: ``tcp`` (default) uses the ps's TCP data channel when it
    offers one and can be reached, else gRPC; ``grpc`` never tries it.
    ``member_id`` names this worker to the ps's data channel.
    """

    def __init__(self, shard: int, address: str, numel: int, fingerprint: str,
                 chunk_bytes: int = 1 << 20, transport: str = "tcp", member_id: Callable[[], str] = lambda: "",
                 credential: Callable[[], str] = lambda: ""):
        if transport not in TRANSPORTS:
            raise InvalidArgument(f"unknown data transport {transport!r}; known: {', '.join(TRANSPORTS)}")
        self.shard = shard
        self.address = address
        self.numel = numel
        self.fingerprint = fingerprint
        self.grpc_chunk_bytes = chunk_bytes
        self.transport = transport
        self.member_id = member_id
        self.credential = credential     # this worker's credential: a ps takes pushes only from the worker they name
        self.channel = open_channel(address, credential)
        self._stubs = DataStubs(self.channel)
        self._tcp: TcpDataChannel | None = None
        self._negotiated = transport == "grpc"
        self._lock = threading.Lock()
        self._scratch = bytearray()
        self.closed = False

    @property
    def chunk_bytes(self) -> int:
        """How large the chunks of a push should be (fp32 bytes) for the transport in use (before the
        first call: the one asked for)."""
        if self._negotiated:
            return TCP_CHUNK_BYTES if self._tcp is not None else self.grpc_chunk_bytes
        return TCP_CHUNK_BYTES if self.transport == "tcp" else self.grpc_chunk_bytes

    @property
    def uses_tcp(self) -> bool:
        return self._data_channel() is not None

    @property
    def tcp(self) -> TcpDataChannel | None:
        """The TCP data channel in use (None: gRPC carries the data)."""
        return self._data_channel()

    def close(self) -> None:
        """Closes both transports; calls in flight on them fail at once with CANCELLED."""
        self.closed = True
        if self._tcp is not None:
            self._tcp.close()
        self.channel.close()

    def retire(self) -> None:
        """The view moved the shard away: its data connections close as their calls end (see
        :meth:`TcpDataChannel.retire`); :meth:`close` follows after a grace."""
        if self._tcp is not None:
            self._tcp.retire()

    def _data_channel(self) -> TcpDataChannel | None:
        """The TCP data channel, negotiated on first use: None if the ps offers none or it cannot be reached
        (then gRPC carries the data). A ps that does not answer raises (the caller fails over)."""
        if self._negotiated:
            return self._tcp
        with self._lock:
            if not self._negotiated:
                self._tcp = negotiate(self._stubs, self.address, self.member_id, f"shard {self.shard}",
                                      credential=self.credential)
                self._negotiated = True
            return self._tcp

    @_cancelled_once_closed
    def status(self, timeout_s: float = 10) -> pb.ShardStatus:
        """The shard's state on this server (its version, its optimizer, ...)."""
        stub = pb_grpc.ParameterServerStub(self.channel)
        return stub.Status(pb.StatusRequest(shard=self.shard, by_shard=True), timeout=timeout_s)

    @_cancelled_once_closed
    def init(self, values: torch.Tensor, optimizer: OptimizerSpec, timeout_s: float = 60,
             flat_start: int = 0, tables_json: str = "") -> pb.InitReply:
        """``flat_start``: the shard's first element in the flat model (where the param groups fall).
        ``tables_json``: the embedding tables whose partition this shard holds (shoal/state/tables.py)."""
        opt = pb.OptimizerConfig(name=optimizer.name, hparams=dict(optimizer.hparams), spec_json=optimizer.to_json())
        raw = frames.tensor_bytes(values)
        per = max(1, self.grpc_chunk_bytes // 4)

        def gen():
            off = 0
            while True:
                n = min(per, self.numel - off)
                head = pb.InitHeader(layout_fingerprint=self.fingerprint, shard=self.shard, numel=self.numel,
                                     offset=off, optimizer=opt, flat_start=flat_start, tables_json=tables_json)
                yield frames.pack(head, raw[off * 4:(off + n) * 4])
                off += n
                if off >= self.numel:
                    return

        return pb.InitReply.FromString(self._stubs.init(gen(), timeout=timeout_s))

    @_cancelled_once_closed
    def push(self, chunks: list[tuple[int, int, str, bytes]], *, worker: str, version: int, key: str,
             view_epoch: int, samples: int, timeout_s: float = 60, **batch: object) -> tuple[pb.PushReply, int]:
        """Pushes encoded chunks ``(offset, numel, codec_tag, payload)``; returns the reply and bytes sent.

        ``batch`` holds the PushHeader fields naming the data (task, token, batch range).
        """
        def header(off: int, n: int, tag: str) -> pb.PushHeader:
            return pb.PushHeader(worker_id=worker, shard=self.shard, layout_fingerprint=self.fingerprint,
                                 version=version, codec=tag, offset=off, numel=n, key=key,
                                 view_epoch=view_epoch, samples=samples, **batch)

        tcp = self._data_channel()
        if tcp is not None:
            parts = [(header(off, n, tag).SerializeToString(), payload) for off, n, tag, payload in chunks]
            return tcp.call(lambda sock: tcp_client.push(sock, parts), timeout_s)
        framed = [frames.pack(header(off, n, tag), payload) for off, n, tag, payload in chunks]
        sent = sum(len(f) for f in framed)
        if len(framed) == 1:   # one frame: a unary call costs a fraction of a stream's overhead
            reply = pb.PushReply.FromString(self._stubs.push_one(framed[0], timeout=timeout_s))
        else:
            reply = pb.PushReply.FromString(self._stubs.push(iter(framed), timeout=timeout_s))
        return reply, sent

    @_cancelled_once_closed
    def lookup_rows(self, table: str, ids: np.ndarray, min_version: int = 0, dtype: str = "float32",
                    timeout_s: float = 60) -> tuple[np.ndarray, int]:
        """The rows (fp32, ``(len(ids), dim)``) of unique ``ids`` of ``table`` this shard holds, once it is at
        ``min_version``; and the shard's version they are at. Over gRPC (the job token and TLS of the channel)."""
        head = pb.RowsHeader(shard=self.shard, table=table, count=len(ids), min_version=min_version,
                             timeout_seconds=timeout_s * 0.9, layout_fingerprint=self.fingerprint,
                             dtype="" if dtype == "float32" else dtype)
        reply = self._stubs.lookup_rows(frames.pack(head, np.ascontiguousarray(ids, dtype=np.int64).tobytes()),
                                        timeout=timeout_s)
        rh, payload = frames.unpack(reply, pb.RowsHeader)
        if rh.count != len(ids):
            raise RuntimeError(f"shard {self.shard}: a lookup of {len(ids)} rows of {table!r} got {rh.count}")
        return decode_rows(payload, rh.dtype, rh.count, rh.dim), rh.version

    @_cancelled_once_closed
    def pull(self, out: torch.Tensor, min_version: int = 0, codec: str = "none",
             timeout_s: float = 60, since: int | None = None, wait_s: float | None = None) -> tuple[int, int]:
        """Fills ``out`` (this shard's fp32 slice) with the weights; returns (version, bytes received).

        ``since``: ``out`` holds the weights at that version, so over the TCP channel the ps may send
        only the elements changed since. ``wait_s``: how long the ps waits for ``min_version`` before
        it answers DEADLINE_EXCEEDED (default: most of ``timeout_s``, which also bounds the transfer).
        If the call fails, ``out`` may be partly written."""
        itemsize = pull_itemsize(codec)
        wait_s = timeout_s * 0.9 if wait_s is None else min(wait_s, timeout_s * 0.9)
        req = pb.PullRequest(shard=self.shard, min_version=min_version, timeout_seconds=wait_s,
                             codec=codec, layout_fingerprint=self.fingerprint, since_version=since
                             ).SerializeToString()
        tcp = self._data_channel()
        if tcp is not None:
            return self._pull_tcp(tcp, req, out, codec, itemsize, timeout_s)
        version, got, covered = -1, 0, 0
        if self.numel * itemsize <= self.grpc_chunk_bytes:
            frames_in = [self._stubs.pull_one(req, timeout=timeout_s)]
        else:
            frames_in = self._stubs.pull(req, timeout=timeout_s)
        for frame in frames_in:
            got += len(frame)
            head, payload = frames.unpack(frame, pb.PullHeader)
            if head.shard_numel != self.numel or head.offset != covered:
                raise RuntimeError(f"shard {self.shard}: pull frame [{head.offset}, +{head.numel}) "
                                   f"does not fit a shard of {self.numel} at {covered}")
            decode_weights(head.codec, payload, head.numel, out[head.offset:head.offset + head.numel])
            covered += head.numel
            version = head.version
        if covered != self.numel:
            raise RuntimeError(f"shard {self.shard}: pull returned {covered} of {self.numel} elements")
        return version, got

    def _pull_tcp(self, tcp: TcpDataChannel, req: bytes, out: torch.Tensor, codec: str, itemsize: int,
                  timeout_s: float) -> tuple[int, int]:
        """fp32 weights land in ``out`` straight from the socket; fp16/bf16 and deltas go through a
        reused buffer."""
        can_land = codec == "none" and out.is_contiguous() and out.dtype == torch.float32 and out.device.type == "cpu"
        direct = False

        def into(head: pb.PullHeader, nbytes: int) -> memoryview:
            nonlocal direct
            direct = can_land and not head.delta
            if direct:
                return frames.tensor_bytes(out)
            if len(self._scratch) < nbytes:
                self._scratch = bytearray(nbytes)
            return memoryview(self._scratch)[:nbytes]

        head, got, body = tcp.call(lambda sock: tcp_client.pull(sock, req, self.numel, itemsize, into), timeout_s)
        if head.delta:
            apply_delta(head.codec or "none", body, head.changed, out)
        elif not direct:
            decode_weights(head.codec or "none", body, self.numel, out)
        return head.version, got


def apply_delta(codec: str, body: memoryview, changed: int, out: torch.Tensor) -> None:
    """Writes a delta pull's values into ``out`` at its indices (checked to lie inside ``out``)."""
    idx = torch.from_numpy(np.frombuffer(body, dtype=np.int32, count=changed)).long()
    if changed and not (0 <= int(idx.min()) and int(idx.max()) < out.numel()):
        raise RuntimeError(f"a delta pull names elements outside [0, {out.numel()})")
    values = torch.empty(changed, dtype=torch.float32)
    decode_weights(codec, body[4 * changed:], changed, values)
    if out.device.type == "cpu" and out.is_contiguous():
        out.numpy()[idx.numpy()] = values.numpy()          # NumPy's scatter: a third of index_put's time
    else:
        out[idx.to(out.device)] = values.to(out.device)


def is_uninitialised(exc: grpc.RpcError) -> bool:
    return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not initialised" in (exc.details() or "")
