"""Turns a shard's gradient slice into encoded wire chunks (the compression hook)."""
from __future__ import annotations

import torch

from shoal.net import frames
from shoal.errors import InvalidArgument


class GradientEncoder:
    """Encodes gradient chunks with the job's codec; ``none`` sends raw fp32."""

    def __init__(self, name: str = "none"):
        """``name`` is a codec tag (``bf16``, ``sign+lz4``), optionally ``topk:RATIO`` (e.g. ``topk:0.05``)."""
        self.name = name
        name, _, ratio = name.partition(":")
        options: dict[str, float] = {}
        if ratio:
            try:
                options["ratio"] = float(ratio)
            except ValueError:
                raise InvalidArgument(f"compression {self.name!r}: {ratio!r} is not a number") from None
        if name == "none":
            self._compressor = None
            self.tag = "none"
        else:
            from shoal import codecs

            try:
                self._compressor = codecs.compressor_from_tag(name, **options)
            except codecs.CodecError as exc:
                raise InvalidArgument(str(exc)) from exc
            self.tag = self._compressor.tag

    @property
    def sparse(self) -> bool:
        """The codec sends a few elements a step and holds the rest back (top-k)."""
        return self._compressor is not None and self._compressor.codec.sparse

    def encode(self, shard: int, grad: torch.Tensor, chunk_bytes: int) -> list[tuple[int, int, str, bytes]]:
        """``[(offset, numel, tag, payload)]`` covering ``grad`` in chunks of about ``chunk_bytes`` (fp32)."""
        numel = grad.numel()
        per = max(1, chunk_bytes // 4)
        out = []
        off = 0
        while True:
            n = min(per, numel - off)
            piece = grad[off:off + n]
            if self._compressor is None:
                payload = frames.tensor_bytes(piece)
            else:
                payload = self._compressor.compress((shard, off), piece)
            out.append((off, n, self.tag, payload))
            off += n
            if off >= numel:
                return out
