"""What a shard answers without changing it: its weights (whole or a delta since a version), a wait
for a version, its clocks and ledger, and its embedding tables' rows (a mixin of
:class:`shoal.ps.shard.Shard`, whose lock, version, weights and change log it reads)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from shoal.errors import DeadlineExceeded
from shoal.net.wire import encode_weights, pull_itemsize


class ShardReads:
    """The read side of :class:`shoal.ps.shard.Shard`: every method takes the shard's lock."""

    def declare_tables(self, specs: list[dict], num_shards: int) -> list[str]:
        """Holds partition ``shard_id`` of each table in ``specs`` (those held already must match)."""
        with self._cond:
            return self.tables.declare(specs, num_shards)

    def lookup_rows(self, table: str, ids: np.ndarray) -> tuple[int, np.ndarray]:
        """``(version, rows)`` of unique ``ids`` of ``table`` (rows never updated: their initial value)."""
        with self._cond:
            self._check_not_fenced()
            return self.version, self.tables.lookup(table, ids)

    def table_status(self) -> list[dict]:
        """Rows, bytes and bytes per row of each table's partition here (shoal status, metrics)."""
        with self._cond:
            return self.tables.status()

    def wait_version(self, min_version: int, timeout_s: float) -> int:
        """Blocks until ``version >= min_version``; DeadlineExceeded after ``timeout_s``; a refusal as soon
        as the copy is fenced (:meth:`fence`), whatever version it holds."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.version >= min_version or self.fenced, timeout=timeout_s)
            self._check_not_fenced()
            if not ok:
                raise DeadlineExceeded(f"shard {self.shard_id} still at version {self.version} "
                                       f"after {timeout_s:.1f}s (waiting for {min_version})")
            return self.version

    def snapshot(self, codec: str = "none",
                 build: Callable[[int, memoryview], bytes] | None = None) -> tuple[int, bytes]:
        """The current weights in ``codec`` (none|fp16|bf16), cached per version.

        ``build(version, raw_view)`` turns the encoded view into what is cached
        (e.g. one whole frame), so the weights are copied once per version; the
        view is only valid during the call.
        """
        with self._cond:
            self._check_not_fenced()
            key = (codec, build is not None)
            cached = self._snapshots.get(key)
            if cached is not None and cached[0] == self.version:
                return cached
            view = encode_weights(codec, self._param.detach())
            out = build(self.version, view) if build is not None else bytes(view)
            self._snapshots[key] = (self.version, out)
            return self.version, out

    def delta(self, codec: str, since: int) -> tuple[int, np.ndarray, bytes] | None:
        """``(version, indices, values in codec)`` of the elements changed after version ``since``; None
        when a full pull is the answer (the log does not cover ``since``, or the delta would not be
        much smaller than the weights)."""
        itemsize = pull_itemsize(codec)
        with self._cond:
            self._check_not_fenced()
            idx = self.changes.changed_since(since, self.version)
            if idx is None or len(idx) * (4 + itemsize) > self.numel * itemsize // 2:
                return None
            values = self._param.detach().index_select(0, torch.from_numpy(idx))
            return self.version, idx, bytes(encode_weights(codec, values))

    def worker_clocks(self) -> dict[str, int]:
        with self._cond:
            return dict(self._clocks)

    def ledger_summary(self):
        with self._cond:
            return self.ledger.summary()

    def values(self) -> torch.Tensor:
        """A copy of the current weights."""
        with self._cond:
            return self._param.detach().clone()
