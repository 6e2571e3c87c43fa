"""One partition of one embedding table: :class:`RowTable` (skeleton: signatures fixed, bodies landing next)."""
from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np

from shoal.ps.tables.snapshot import TableSnapshot
from shoal.ps.tables.spec import TableSpec


class RowTable:
    """The rows of partition ``partition`` (of ``num_partitions``) of the table ``spec``."""

    def __init__(self, spec: TableSpec, partition: int, num_partitions: int) -> None:
        self.spec = spec
        self.partition = partition
        self.num_partitions = num_partitions

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """``(n, dim)`` float32 rows of unique int64 ``ids``; a never-updated row is its initial value (not stored)."""
        raise NotImplementedError

    def apply(self, ids: np.ndarray, grads: np.ndarray, step: int,
              hyper: Mapping[str, float] | None = None) -> None:
        """One optimizer step on rows ``ids`` (unique int64) with ``grads`` ((n, dim) float32) at table step ``step``."""
        raise NotImplementedError

    def evict(self, step: int) -> int:
        """Drop rows by the spec's eviction policy at table step ``step``; returns how many."""
        raise NotImplementedError

    @property
    def rows(self) -> int:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    @property
    def bytes_per_row(self) -> int:
        raise NotImplementedError

    def mark(self) -> int:
        raise NotImplementedError

    def snapshot(self, since_mark: int | None = None) -> TableSnapshot:
        raise NotImplementedError

    def restore(self, snapshots: Sequence[TableSnapshot]) -> None:
        raise NotImplementedError

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def iter_export(self, chunk_rows: int = 1 << 20) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def digest(self) -> bytes:
        raise NotImplementedError
