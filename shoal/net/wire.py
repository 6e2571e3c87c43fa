"""The raw-framed data plane: method names, chunking and payload decoding.

Both sides use this module, so the server's decoder and the client's encoder
cannot drift apart. Frames themselves are built by :mod:`shoal.net.frames`.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterator

import grpc
import numpy as np
import torch
from google.protobuf.message import Message

from shoal.net import frames
from shoal.errors import InvalidArgument

DATA_SERVICE = "shoal.ParameterServerData"
INIT = f"/{DATA_SERVICE}/Init"
PUSH = f"/{DATA_SERVICE}/Push"
PULL = f"/{DATA_SERVICE}/Pull"
PUSH_ONE = f"/{DATA_SERVICE}/PushOne"
PULL_ONE = f"/{DATA_SERVICE}/PullOne"
REPLICATE = f"/{DATA_SERVICE}/Replicate"
REPLICATE_ONE = f"/{DATA_SERVICE}/ReplicateOne"
INSTALL = f"/{DATA_SERVICE}/Install"
OPEN_CHANNEL = f"/{DATA_SERVICE}/OpenChannel"
LOOKUP_ROWS = f"/{DATA_SERVICE}/LookupRows"    # embedding rows by id (shoal/state/tables.py)

# Pull payload encodings (weights, not gradients: no error feedback needed).
PULL_ITEMSIZE = {"none": 4, "fp16": 2, "bf16": 2}


def decode_chunk(tag: str, payload: memoryview, numel: int) -> torch.Tensor:
    """Decodes one pushed gradient chunk into a 1-D fp32 tensor of ``numel`` elements."""
    if tag in ("", "none"):
        return frames.fp32_from(payload, numel)
    from shoal import codecs  # imported lazily: the registry pulls in lz4

    try:
        return codecs.decode_tagged(tag, payload, numel)
    except codecs.CodecError as exc:
        raise InvalidArgument(str(exc)) from exc


def decode_sparse_chunk(tag: str, payload: memoryview, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pushed chunk in a sparse codec (``is_sparse(tag)``) as ``(indices, values)``: int64 strictly
    increasing inside ``[0, numel)``, fp32; nothing is scattered into a dense buffer."""
    from shoal import codecs

    try:
        return codecs.decode_tagged_entries(tag, payload, numel)
    except codecs.CodecError as exc:
        raise InvalidArgument(str(exc)) from exc


@functools.lru_cache(maxsize=64)
def is_sparse(tag: str) -> bool:
    """Whether chunks pushed in gradient codec ``tag`` decode to zeros outside a few elements (top-k)."""
    if tag in ("", "none"):
        return False
    from shoal import codecs

    try:
        return codecs.get_codec(codecs.parse_tag(tag)[0]).sparse
    except codecs.CodecError:
        return False


@functools.lru_cache(maxsize=64)
def exact_dtype(tag: str) -> str:
    """The narrower dtype (``"bfloat16"``, ``"float16"``) that holds every value a chunk pushed in codec
    ``tag`` decodes to, exactly (a cast codec's wire dtype); ``""`` for the others (fp32, scaled, sparse)."""
    if tag in ("", "none"):
        return ""
    from shoal import codecs

    try:
        dtype = getattr(codecs.get_codec(codecs.parse_tag(tag)[0]), "wire_dtype", None)
    except codecs.CodecError:
        return ""
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "")


def pull_itemsize(tag: str) -> int:
    """Bytes per element of a pull codec; InvalidArgument for an unknown one."""
    size = PULL_ITEMSIZE.get(tag)
    if size is None:
        raise InvalidArgument(f"unknown pull codec {tag!r}; known: {', '.join(sorted(PULL_ITEMSIZE))}")
    return size


def encode_weights(tag: str, data: torch.Tensor) -> memoryview:
    """The bytes of the fp32 CPU tensor ``data`` in a pull codec (for ``none``, a view of ``data``)."""
    pull_itemsize(tag)
    if tag == "fp16":
        data = data.to(torch.float16)
    elif tag == "bf16":
        data = data.to(torch.bfloat16).view(torch.int16)
    return memoryview(data.contiguous().numpy()).cast("B")


def decode_weights(tag: str, payload: memoryview, numel: int, out: torch.Tensor) -> None:
    """Writes pulled weights (``none``/``fp16``/``bf16``) into the fp32 tensor ``out``."""
    size = pull_itemsize(tag)
    if len(payload) != numel * size or out.numel() != numel:
        raise InvalidArgument(f"pull payload of {len(payload)} bytes does not hold {numel} {tag} values")
    if tag == "none":
        out.copy_(frames.fp32_from(payload, numel))
    elif tag == "fp16":
        out.copy_(torch.from_numpy(np.frombuffer(payload, dtype=np.float16, count=numel)))
    else:
        raw = torch.from_numpy(np.frombuffer(payload, dtype=np.int16, count=numel))
        out.copy_(raw.view(torch.bfloat16))


def iter_chunks(raw: bytes, tag: str, chunk_bytes: int,
                header: Callable[[int, int], Message]) -> Iterator[bytes]:
    """Frames ``raw`` (fixed-size elements of ``tag``) in chunks of about ``chunk_bytes``.

    ``header(offset, numel)`` builds each frame's header. An empty payload still
    yields one frame so the receiver learns the version.
    """
    size = PULL_ITEMSIZE.get(tag, 4)
    total = len(raw) // size
    per = max(1, chunk_bytes // size)
    view = memoryview(raw)
    off = 0
    while True:
        n = min(per, total - off)
        yield frames.pack(header(off, n), view[off * size:(off + n) * size])
        off += n
        if off >= total:
            return


class DataStubs:
    """Callables of the data plane with identity serializers: bytes in, bytes out."""

    def __init__(self, channel: grpc.Channel):
        self.init = channel.stream_unary(INIT)
        self.push = channel.stream_unary(PUSH)
        self.pull = channel.unary_stream(PULL)
        self.push_one = channel.unary_unary(PUSH_ONE)
        self.pull_one = channel.unary_unary(PULL_ONE)
        self.replicate = channel.stream_unary(REPLICATE)
        self.replicate_one = channel.unary_unary(REPLICATE_ONE)
        self.install = channel.stream_unary(INSTALL)
        self.open_channel = channel.unary_unary(OPEN_CHANNEL)
        self.lookup_rows = channel.unary_unary(LOOKUP_ROWS)
