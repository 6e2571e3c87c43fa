"""Data-plane framing and all tensor <-> bytes conversion.

A frame is ``[u32 little-endian header length][protobuf header][raw payload]``.
Payloads are decoded in place with ``np.frombuffer``: no per-element encoding and
no copy beyond the one gRPC makes when it hands us the message.
"""
from __future__ import annotations

import struct
import warnings
from typing import TypeVar

import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from shoal.errors import InvalidArgument

_LEN = struct.Struct("<I")
M = TypeVar("M", bound=Message)

# torch.from_numpy over a read-only buffer warns on every call; our decoders
# only read such tensors (or copy them into owned storage), so silence it once.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def pack(header: Message, payload: bytes | memoryview = b"") -> bytes:
    """One frame: header length, header, payload (one copy of the payload)."""
    head = header.SerializeToString()
    return b"".join((_LEN.pack(len(head)), head, payload))


def unpack(frame: bytes, header_type: type[M]) -> tuple[M, memoryview]:
    """Splits a frame into its parsed header and a zero-copy view of the payload."""
    if len(frame) < _LEN.size:
        raise InvalidArgument(f"frame of {len(frame)} bytes is shorter than its length prefix")
    (head_len,) = _LEN.unpack_from(frame)
    if _LEN.size + head_len > len(frame):
        raise InvalidArgument(f"frame header length {head_len} exceeds the frame ({len(frame)} bytes)")
    view = memoryview(frame)
    header = header_type()
    try:
        header.ParseFromString(view[_LEN.size:_LEN.size + head_len])
    except DecodeError as exc:
        raise InvalidArgument(f"corrupt {header_type.__name__}: {exc}") from exc
    return header, view[_LEN.size + head_len:]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().numpy()).cast("B")


def fp32_from(buf: bytes | memoryview, numel: int) -> torch.Tensor:
    """A read-only fp32 tensor over ``buf`` (no copy); validates the size."""
    if len(buf) != numel * 4:
        raise InvalidArgument(f"payload of {len(buf)} bytes does not hold {numel} fp32 values")
    return torch.from_numpy(np.frombuffer(buf, dtype=np.float32, count=numel))
