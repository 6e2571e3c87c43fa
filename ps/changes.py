"""Which elements of a shard changed after which version: what a delta pull sends.

A worker that holds a shard's weights at version ``s`` can ask for only the
elements that changed since. That pays when updates are sparse: top-k pushes
into an optimizer that leaves an element with a zero gradient untouched
(plain SGD: no momentum, no weight decay). Every other update (a dense
gradient, or Adam, whose moments move every element) marks the whole shard
changed at its version, which costs nothing: the next pull is a full one.

An update the sparse server path applied (:mod:`shoal.ps.sparse`) hands the
log the indices it touched, so nothing scans the shard; a dense gradient from
top-k pushes (a backup's, or a round with a dense push in it) is scanned for
its nonzero elements.

A delta pull since a recent version is answered from the indices the updates
after it recorded (:data:`RECENT_ENTRIES` of them at most are kept), with no
scan either; a pull since an older one scans the per-element versions.

The log is conservative: an element marked changed that did not is harmless
(it is sent again); an element that changed is never missed. A pull since a
version the log does not cover (before this copy started tracking, or after
it, on a server that went back) is answered in full.
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from shoal.settings.config import OptimizerSpec
from shoal.ps.sparse import sorted_union

DENSE_FRACTION = 0.25   # a sparse update touching more than this share of the shard counts as dense
RECENT_ENTRIES = 0.25   # indices of the latest updates kept for delta pulls, as a share of the shard


def leaves_zeros_alone(spec: OptimizerSpec) -> bool:
    """Whether the optimizer leaves an element whose gradient is zero unchanged."""
    h = dict(spec.hparams)
    if spec.torch_class:
        return False
    return spec.name == "sgd" and not h.get("momentum", 0.0) and not h.get("weight_decay", 0.0)


class ChangeLog:
    def __init__(self, numel: int, version: int, optimizer: OptimizerSpec):
        self.numel = numel
        self.tracks = leaves_zeros_alone(optimizer)
        # A pull since an earlier version is answered in full. A new copy (created, restored, or
        # copied from a primary) answers its first pull in full: a worker's weights "at version v"
        # may be another copy's v (a shard that restarted empty starts over at 0).
        self.full_after = version + 1
        self._base = version               # versions are stored as int32 offsets from this
        self._changed: torch.Tensor | None = None   # per element: the version (offset) it last changed at
        self._recent: collections.deque[tuple[int, np.ndarray]] = collections.deque()  # (version, indices)
        self._recent_entries = 0

    def record(self, version: int, grad: torch.Tensor | None, sparse: bool,
               touched: torch.Tensor | None = None) -> None:
        """An update to ``version`` was applied. ``touched``: the indices it changed, exactly (the sparse
        path, :mod:`shoal.ps.sparse`, applied it to those only): recorded as they are, no scan. Else
        ``grad`` is the dense gradient it stepped with (None: not known, the whole shard counts as
        changed) and ``sparse`` says it is zero outside a few elements (the pushes were top-k)."""
        if version - self._base >= 2 ** 31 - 1:
            self.full_after = version
            return
        if touched is not None:
            idx = touched.numpy()
        elif self.tracks and sparse and grad is not None:
            idx = np.flatnonzero(grad.numpy() != 0)     # a bool mask: 6x faster than on floats
        else:
            self.full_after = version
            return
        if len(idx) > DENSE_FRACTION * self.numel:
            self.full_after = version
            return
        if self._changed is None:
            self._changed = torch.zeros(self.numel, dtype=torch.int32)
        self._changed.numpy()[idx] = version - self._base
        self._remember(version, idx)

    def _remember(self, version: int, idx: np.ndarray) -> None:
        if self._recent and self._recent[-1][0] != version - 1:
            self._recent.clear()
            self._recent_entries = 0
        self._recent.append((version, idx.astype(np.int32)))
        self._recent_entries += len(idx)
        while self._recent_entries > RECENT_ENTRIES * self.numel:
            self._recent_entries -= len(self._recent.popleft()[1])

    def changed_since(self, since: int, version: int) -> np.ndarray | None:
        """Indices (int32, increasing) of the elements that changed after ``since`` up to ``version``, or
        None when only a full pull is right (``since`` outside what the log covers)."""
        if since < self.full_after or since > version:
            return None
        if since == version or self._changed is None:
            return np.empty(0, dtype=np.int32)
        if self._recent and self._recent[0][0] <= since + 1 and self._recent[-1][0] == version:
            parts = [idx for v, idx in self._recent if v > since]
            return parts[0].copy() if len(parts) == 1 else sorted_union(parts)
        return np.flatnonzero(self._changed.numpy() > since - self._base).astype(np.int32)
