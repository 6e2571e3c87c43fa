"""A codec, its error feedback and the optional lz4 layer, named by one wire tag.

A tag is ``<codec>`` or ``<codec>+lz4`` (``topk``, ``sign+lz4``). Payloads are
self-describing given ``numel`` (``topk`` carries its own ``k``), so the tag
alone is enough to decode.
"""
from __future__ import annotations

import functools
from collections.abc import Hashable

import torch

from .base import Buffer, Codec, CodecError, check_numel, get_codec
from .feedback import ErrorFeedback
from .lossless import lz4_pack, lz4_unpack

LZ4_SUFFIX = "+lz4"


class Compressor:
    """Encodes gradients per key with error feedback (for biased codecs) and optional lz4."""

    def __init__(self, name: str, lz4: bool = False, error_feedback: bool = True, **options: object):
        self.codec: Codec = get_codec(name, **options)
        self.lz4 = bool(lz4)
        self.feedback: ErrorFeedback | None = (
            ErrorFeedback(self.codec) if error_feedback and self.codec.biased else None)

    @property
    def name(self) -> str:
        """The codec's name."""
        return self.codec.name

    @property
    def tag(self) -> str:
        """The wire tag: the codec name, plus ``+lz4`` when lz4 is on."""
        return self.name + (LZ4_SUFFIX if self.lz4 else "")

    def compress(self, key: Hashable, grad: torch.Tensor) -> bytes:
        """The payload for ``grad`` (1-D fp32), using and updating ``key``'s residual."""
        payload = self.feedback.encode(key, grad) if self.feedback is not None else self.codec.encode(grad)
        return lz4_pack(payload) if self.lz4 else payload

    def decompress(self, buf: Buffer, numel: int) -> torch.Tensor:
        """The 1-D fp32 CPU tensor of ``numel`` elements in ``buf``; :class:`CodecError` if malformed."""
        numel = check_numel(numel)
        if self.lz4:
            buf = lz4_unpack(buf, max_size=self.codec.encoded_size_bound(numel))
        return self.codec.decode(buf, numel)

    def decompress_entries(self, buf: Buffer, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sparse codec's ``(indices, values)`` (see :meth:`decompress`), never scattered into zeros."""
        numel = check_numel(numel)
        if not self.codec.sparse:
            raise CodecError(f"codec {self.codec.name} is not sparse: its payloads decode to every element")
        if self.lz4:
            buf = lz4_unpack(buf, max_size=self.codec.encoded_size_bound(numel))
        return self.codec.decode_entries(buf, numel)

    def reset(self) -> None:
        """Forgets all error-feedback residuals."""
        if self.feedback is not None:
            self.feedback.reset()

    def __repr__(self) -> str:
        return f"Compressor({self.codec!r}, lz4={self.lz4}, error_feedback={self.feedback is not None})"


def parse_tag(tag: str) -> tuple[str, bool]:
    """``(codec name, lz4)`` for a wire tag; :class:`CodecError` if it names no codec."""
    if not isinstance(tag, str):
        raise CodecError(f"codec tag must be a string, got {type(tag).__name__}")
    lz4 = tag.endswith(LZ4_SUFFIX)
    name = tag[:-len(LZ4_SUFFIX)] if lz4 else tag
    get_codec(name)  # raises for unknown names
    return name, lz4


def compressor_from_tag(tag: str, error_feedback: bool = True, **options: object) -> Compressor:
    """A :class:`Compressor` for a tag such as ``topk`` or ``sign+lz4``."""
    name, lz4 = parse_tag(tag)
    return Compressor(name, lz4=lz4, error_feedback=error_feedback, **options)


@functools.lru_cache(maxsize=32)
def _decoder(tag: str) -> Compressor:
    return compressor_from_tag(tag, error_feedback=False)


def decode_tagged(tag: str, buf: Buffer, numel: int) -> torch.Tensor:
    """Decodes a payload sent under ``tag``; :class:`CodecError` for a bad tag or payload."""
    if not isinstance(tag, str):
        raise CodecError(f"codec tag must be a string, got {type(tag).__name__}")
    return _decoder(tag).decompress(buf, numel)


def decode_tagged_entries(tag: str, buf: Buffer, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse payload's ``(indices, values)`` (int64 strictly increasing, fp32); :class:`CodecError`
    for a bad tag or payload, or a codec that is not sparse."""
    if not isinstance(tag, str):
        raise CodecError(f"codec tag must be a string, got {type(tag).__name__}")
    return _decoder(tag).decompress_entries(buf, numel)
