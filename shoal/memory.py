"""Process-wide allocator tuning for large tensor messages.

glibc serves allocations above its mmap threshold (at most 32 MB) with fresh
``mmap`` pages and returns them on free, so every multi-megabyte message buffer
page-faults its way in again. Measured here: building a 32 MB frame took 34 ms
with the defaults and 3.7 ms with the heap kept (``bench/RESULTS.md``). Keeping
large blocks on the heap trades resident memory (it stays at its peak) for
bandwidth, which is the right trade for parameter servers and workers.

Threads other than the main one allocate from arenas of their own, and those
grow by at most 64 MB heaps: a 32 MB buffer there is still a fresh ``mmap``
each time (a 32 MB push received on a data-channel thread took 8193 page faults,
one per page). So all threads share the main arena (``M_ARENA_MAX`` 1): the
large buffers are reused, at the price of one lock around malloc, which is
light next to tensor work (Python's small objects have their own allocator).
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
_done = False


def tune_malloc(mmap_threshold: int = 1 << 30, trim_threshold: int = 2**31 - 1) -> bool:
    """Keeps blocks up to ``mmap_threshold`` bytes on the heap; True if glibc took the settings."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold))
              and bool(libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
              and bool(libc.mallopt(M_ARENA_MAX, 1)))
    except (OSError, AttributeError):
        ok = False          # not glibc (musl, macOS): nothing to tune
    _done = ok
    log.debug("malloc tuning %s", "applied" if ok else "not available")
    return ok
