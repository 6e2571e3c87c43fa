"""A table partition's checkpoint: :class:`TableSnapshot`, full or incremental, to and from bytes.

Layout of :meth:`TableSnapshot.to_bytes` (little-endian)::

    b"SHTS" | u32 version (1) | u32 header_len | header (JSON, utf-8) | arrays, back to back

The JSON header holds the spec (``TableSpec.to_dict``), the partition, the
marks (``since``/``upto``), the optimizer's step count ``t`` and, for each
array, ``[name, dtype, shape, offset, nbytes]``. Arrays are raw C-order
buffers read back with ``np.frombuffer`` (no pickle).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from shoal.errors import InvalidArgument

_MAGIC = b"SHTS"
_VERSION = 1
_HEAD = struct.Struct("<4sII")


@dataclass(eq=False)
class TableSnapshot:
    """Rows (with their optimizer state and counters) of one partition, plus deletions.

    ``since is None``: a full snapshot (every stored row, no deletions).
    Otherwise the rows changed after mark ``since`` and the ids evicted after it
    (an id both evicted and stored again appears in both; restore applies the
    deletions first). ``upto`` is the last mark issued when it was taken: an
    incremental one may follow it in a restore chain if its ``since <= upto``.
    """

    spec: dict[str, Any]
    partition: int
    num_partitions: int
    since: int | None
    upto: int
    t: int                                   # the optimizer's step count (applies so far)
    ids: np.ndarray                          # (n,) int64, sorted
    rows: np.ndarray                         # (n, dim) float32
    state: dict[str, np.ndarray]             # name -> (n, dim) float32
    count: np.ndarray                        # (n,) int64: updates applied to the row
    last_step: np.ndarray                    # (n,) int64: the step of its last update
    deleted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # (m,) int64, sorted

    @property
    def full(self) -> bool:
        return self.since is None

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays it carries (what :meth:`to_bytes` writes, less a small header)."""
        return sum(a.nbytes for _, a in self._arrays())

    def _arrays(self) -> list[tuple[str, np.ndarray]]:
        out = [("ids", self.ids), ("rows", self.rows), ("count", self.count), ("last_step", self.last_step),
               ("deleted", self.deleted)]
        out += [("state." + k, v) for k, v in sorted(self.state.items())]
        return out

    def _layout(self) -> tuple[bytes, list[np.ndarray], int]:
        arrays, meta, off = [], [], 0
        for name, a in self._arrays():
            a = np.ascontiguousarray(a)
            meta.append([name, a.dtype.str, list(a.shape), off, a.nbytes])
            arrays.append(a)
            off += a.nbytes
        header = json.dumps({"spec": self.spec, "partition": self.partition,
                             "num_partitions": self.num_partitions, "since": self.since, "upto": self.upto,
                             "t": self.t, "arrays": meta}, sort_keys=True).encode()
        return _HEAD.pack(_MAGIC, _VERSION, len(header)) + header, arrays, off

    def to_bytes(self) -> bytes:
        head, arrays, size = self._layout()
        return b"".join([head, *(a.reshape(-1).view(np.uint8).data for a in arrays)])

    def write_to(self, f: BinaryIO) -> int:
        """Write what :meth:`to_bytes` returns to the binary file ``f`` without a copy in memory; returns the bytes."""
        head, arrays, size = self._layout()
        f.write(head)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data)
        return len(head) + size

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "TableSnapshot":
        mv = memoryview(data)
        if len(mv) < _HEAD.size:
            raise InvalidArgument(f"table snapshot is {len(mv)} bytes, shorter than its {_HEAD.size}-byte head")
        magic, version, hlen = _HEAD.unpack_from(mv, 0)
        if magic != _MAGIC or version != _VERSION:
            raise InvalidArgument(f"not a table snapshot (magic {bytes(magic)!r}, version {version}); "
                                  f"expected {_MAGIC!r} version {_VERSION}")
        try:
            h = json.loads(bytes(mv[_HEAD.size:_HEAD.size + hlen]))
        except ValueError as e:
            raise InvalidArgument(f"table snapshot header is not JSON: {e}") from None
        base = _HEAD.size + hlen
        arrays: dict[str, np.ndarray] = {}
        need = {"spec", "partition", "num_partitions", "since", "upto", "t", "arrays"}
        if not isinstance(h, dict) or need - set(h):
            raise InvalidArgument(f"table snapshot header lacks {sorted(need - set(h or {}))}")
        for name, dtype, shape, off, nb in h["arrays"]:
            if base + off + nb > len(mv):
                raise InvalidArgument(f"table snapshot truncated: array {name!r} needs bytes "
                                      f"{base + off}..{base + off + nb} of {len(mv)}")
            arrays[name] = np.frombuffer(mv[base + off:base + off + nb], dtype=np.dtype(dtype)).reshape(shape)
        missing = sorted({"ids", "rows", "count", "last_step", "deleted"} - set(arrays))
        if missing:
            raise InvalidArgument(f"table snapshot lacks the arrays {missing}")
        state = {k[len("state."):]: v for k, v in arrays.items() if k.startswith("state.")}
        return cls(spec=h["spec"], partition=h["partition"], num_partitions=h["num_partitions"],
                   since=h["since"], upto=h["upto"], t=h["t"], ids=arrays["ids"], rows=arrays["rows"],
                   state=state, count=arrays["count"], last_step=arrays["last_step"], deleted=arrays["deleted"])
