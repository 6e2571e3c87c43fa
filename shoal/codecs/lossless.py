"""A lossless lz4 layer over any codec's payload.

Byte layout: one standard LZ4 frame (``lz4.frame``, fast level, 64 KiB
independent blocks) that stores the content size and an xxHash32 content
checksum, so truncation, trailing bytes and corruption are all detected.
"""
from __future__ import annotations

import lz4.frame

from .base import Buffer, CodecError, as_bytes


def lz4_pack(payload: Buffer) -> bytes:
    """``payload`` compressed into one LZ4 frame."""
    return lz4.frame.compress(as_bytes(payload), content_checksum=True, store_size=True)


def lz4_unpack(buf: Buffer, max_size: int | None = None) -> bytes:
    """The payload inside the LZ4 frame ``buf``; :class:`CodecError` if it is corrupt.

    ``max_size`` bounds the decompressed size, so a tiny hostile frame cannot
    make the receiver allocate gigabytes.
    """
    view = as_bytes(buf)
    decompressor = lz4.frame.LZ4FrameDecompressor()
    limit = -1 if max_size is None else max_size + 1
    try:
        out = decompressor.decompress(view, max_length=limit)
    except RuntimeError as exc:
        raise CodecError(f"corrupt lz4 frame: {exc}") from exc
    if max_size is not None and len(out) > max_size:
        raise CodecError(f"lz4 frame decompresses to more than the {max_size} bytes allowed")
    if not decompressor.eof:
        raise CodecError(f"truncated lz4 frame ({view.nbytes} bytes)")
    if decompressor.unused_data:
        raise CodecError(f"{len(decompressor.unused_data)} stray bytes after the lz4 frame")
    return out
