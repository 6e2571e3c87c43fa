"""Client of one parameter shard's data plane: Init, Push, Pull over raw frames."""
from __future__ import annotations

import logging

import grpc
import torch

from shoal import frames
from shoal.config import OptimizerSpec
from shoal.proto import shoal_pb2 as pb
from shoal.rpc import open_channel
from shoal.wire import PULL_ITEMSIZE, DataStubs, decode_weights

log = logging.getLogger(__name__)


class ShardClient:
    """Talks to the process currently serving ``shard`` at ``address``."""

    def __init__(self, shard: int, address: str, numel: int, fingerprint: str,
                 chunk_bytes: int = 1 << 20):
        self.shard = shard
        self.address = address
        self.numel = numel
        self.fingerprint = fingerprint
        self.chunk_bytes = chunk_bytes
        self.channel = open_channel(address)
        self._stubs = DataStubs(self.channel)

    def close(self) -> None:
        self.channel.close()

    def init(self, values: torch.Tensor, optimizer: OptimizerSpec, timeout_s: float = 60) -> pb.InitReply:
        opt = pb.OptimizerConfig(name=optimizer.name, hparams=dict(optimizer.hparams))
        raw = frames.tensor_bytes(values)
        per = max(1, self.chunk_bytes // 4)

        def gen():
            off = 0
            while True:
                n = min(per, self.numel - off)
                head = pb.InitHeader(layout_fingerprint=self.fingerprint, shard=self.shard, numel=self.numel,
                                     offset=off, optimizer=opt)
                yield frames.pack(head, raw[off * 4:(off + n) * 4])
                off += n
                if off >= self.numel:
                    return

        return pb.InitReply.FromString(self._stubs.init(gen(), timeout=timeout_s))

    def push(self, chunks: list[tuple[int, int, str, bytes]], *, worker: str, version: int, key: str,
             view_epoch: int, samples: int, timeout_s: float = 60, **batch: object) -> tuple[pb.PushReply, int]:
        """Pushes encoded chunks ``(offset, numel, codec_tag, payload)``; returns the reply and bytes sent.

        ``batch`` holds the PushHeader fields naming the data (task, token, batch range).
        """
        sent = 0

        def gen():
            nonlocal sent
            for off, n, tag, payload in chunks:
                head = pb.PushHeader(worker_id=worker, shard=self.shard, layout_fingerprint=self.fingerprint,
                                     version=version, codec=tag, offset=off, numel=n, key=key,
                                     view_epoch=view_epoch, samples=samples, **batch)
                frame = frames.pack(head, payload)
                sent += len(frame)
                yield frame

        if len(chunks) == 1:   # one frame: a unary call costs a fraction of a stream's overhead
            reply = pb.PushReply.FromString(self._stubs.push_one(next(gen()), timeout=timeout_s))
        else:
            reply = pb.PushReply.FromString(self._stubs.push(gen(), timeout=timeout_s))
        return reply, sent

    def pull(self, out: torch.Tensor, min_version: int = 0, codec: str = "none",
             timeout_s: float = 60) -> tuple[int, int]:
        """Fills ``out`` (this shard's fp32 slice) with the weights; returns (version, bytes received)."""
        req = pb.PullRequest(shard=self.shard, min_version=min_version, timeout_seconds=timeout_s * 0.9,
                             codec=codec, layout_fingerprint=self.fingerprint).SerializeToString()
        version, got, covered = -1, 0, 0
        if self.numel * PULL_ITEMSIZE.get(codec, 4) <= self.chunk_bytes:
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


def is_uninitialised(exc: grpc.RpcError) -> bool:
    return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "not initialised" in (exc.details() or "")

