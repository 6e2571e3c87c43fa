"""Sets of task ids as compressed bitmaps, for the chief's snapshots (chief/tasks.py).

A long job's task queue holds every task id it has finished, and how often each was handed
out. As JSON lists those grow to megabytes (a snapshot of 100 000 tasks was 2 MB, and writing
it stopped the chief for a third of a second). Ids are small dense ints (``task_id`` counts
from 0), so a bitmap holds them in one bit each, and zlib folds the runs that finished epochs
leave into a few bytes: a set of 100 000 ids is about 16 KB at most, and encoding it is one
numpy pass rather than a Python loop per id.
"""
from __future__ import annotations

import base64
import zlib
from typing import Collection

import numpy as np

# Refuse to unpack a bitmap of more ids than this from a journal or a checkpoint (a corrupt or
# hostile file must not allocate the host away): 2**32 ids is far beyond any dataset's task count.
MAX_IDS = 1 << 32


def encode(ids: Collection[int]) -> str:
    """``ids`` (non-negative ints) as text: base64 of a zlib-compressed little-endian bitmap."""
    if not ids:
        return ""
    arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
    if arr.min() < 0:
        raise ValueError("ids must be non-negative")
    bits = np.zeros(int(arr.max()) + 1, dtype=bool)
    bits[arr] = True
    return base64.b64encode(zlib.compress(np.packbits(bits, bitorder="little").tobytes(), 1)).decode("ascii")


def decode(text: str) -> set[int]:
    """The inverse of :func:`encode`. Raises ValueError on text that is not such a bitmap."""
    if not isinstance(text, str):
        raise ValueError(f"an id set is a string, got {type(text).__name__}")
    if not text:
        return set()
    try:
        z = zlib.decompressobj()
        packed = z.decompress(base64.b64decode(text, validate=True), MAX_IDS // 8)
    except (zlib.error, ValueError) as exc:
        raise ValueError(f"not an id set: {exc}") from exc
    if z.unconsumed_tail or not z.eof:
        raise ValueError(f"not an id set: more than {MAX_IDS} ids, or cut short")
    bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())
