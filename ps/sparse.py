"""The sparse server path: a top-k push applied to the elements it names, never scattered into zeros.

A push whose every chunk came in a sparse codec (top-k) reaches the shard as a
:class:`SparseGrad` (strictly increasing int64 indices and their fp32 values).
The shard applies it to those elements only where that is exactly what the
dense step would do (:meth:`shoal.state.optim.ShardOptimizer.step_sparse`), and its
change log then records the indices it was handed, without a ``!= 0`` scan.

Where the sparse step is exact, bit for bit:

- plain SGD, a registered ``sgd`` with ``momentum`` 0 and ``weight_decay`` 0
  (``p += -lr * g`` leaves an element whose gradient is zero unchanged). That
  includes momentum correction (``worker/momentum.py``): with top-k the
  workers keep SGD's velocity, or Adam's moments, and the shard runs this
  plain SGD. Buffers (``spec.buffers``: ``p += g``) are sparse-exact too.
- The touched elements go through the same torch kernel the dense step runs
  (``index_select``, ``add_(values, alpha=-lr)``, ``index_copy_``), so they
  round exactly as there; the untouched ones the dense step leaves as they are.

Where it is not, the shard builds the dense gradient and takes the dense step,
as before (what the optimizer's semantics demand, not a shortcut missed):

- momentum on the server: the velocity of every element decays each step, so
  every weight moves, a zero gradient or not;
- weight decay (SGD's, or AdamW's decoupled one that momentum correction hands
  to the server's SGD): every weight shrinks each step;
- Adam/AdamW on the server: both moments decay and every weight with a
  nonzero moment moves; the step count is global;
- any ``torch.optim`` class by name, or user param groups: their steps are
  not ours to take apart.

Sync rounds average their workers' gradients. Sparse pushes of a round are
kept as they came (:class:`RoundSum`) and summed over the union of their
indices at the round's close, in push order, as the dense sum would: the
first push's values, then each next one added (an element a push does not
name gets ``+0.0`` added, which turns a ``-0.0`` into ``+0.0`` as the dense sum
does), then divided by the number of workers. A dense push in a round makes
the round dense: the sparse pushes before it are replayed densely, in order.

Replication and checkpoints see the same result: a backup is sent the update's
entries (ps/update_wire.py) and applies them through the same step, sparse or
dense by the same rule, so its bits and its change log are the primary's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from shoal.errors import InvalidArgument


@dataclass(eq=False)
class SparseGrad:
    """A gradient that is zero outside ``indices`` (int64, strictly increasing, in ``[0, numel)``)."""

    indices: torch.Tensor
    values: torch.Tensor      # fp32, one per index
    numel: int

    def __post_init__(self) -> None:
        if len(self.indices) != len(self.values) or (len(self.indices) and not
                                                     0 <= int(self.indices[0]) <= int(self.indices[-1]) < self.numel):
            raise InvalidArgument(f"a sparse gradient of {len(self.values)} value(s) at {len(self.indices)} "
                                  f"index(es) does not lie inside [0, {self.numel})")

    @classmethod
    def join(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], numel: int) -> "SparseGrad":
        """The entries of consecutive chunks, each's indices already shifted to the shard's."""
        if len(parts) == 1:
            return cls(parts[0][0], parts[0][1], numel)
        if not parts:
            return cls(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32), numel)
        return cls(torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts]), numel)

    @functools.cached_property
    def _dense(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32)
        return out.index_copy_(0, self.indices, self.values) if len(self.indices) else out

    def dense(self) -> torch.Tensor:
        """The dense gradient (built once; a replicator and a dense step share it). Not to be modified."""
        return self._dense

    @property
    def nnz(self) -> int:
        return len(self.indices)


def as_dense(grad: torch.Tensor | SparseGrad) -> torch.Tensor:
    return grad.dense() if isinstance(grad, SparseGrad) else grad


class RoundSum:
    """The gradients of one open round, summed as the dense path sums them.

    ``owned``: the first gradient may be kept and modified (the dense path's
    no-copy case). Sparse pushes are kept as they came until the round closes
    (:meth:`average`) or a dense push arrives (then everything turns dense)."""

    def __init__(self, grad: torch.Tensor | SparseGrad, owned: bool):
        self._dense: torch.Tensor | None = None
        self._parts: list[SparseGrad] = []
        if isinstance(grad, SparseGrad):
            self._parts.append(grad)
        else:
            self._dense = grad if owned else grad.to(torch.float32, copy=True)

    def add(self, grad: torch.Tensor | SparseGrad) -> None:
        if isinstance(grad, SparseGrad) and self._dense is None:
            self._parts.append(grad)
            return
        if self._dense is None:                 # the first dense push: replay the sparse ones densely
            self._dense = self._parts[0].dense().clone()
            for p in self._parts[1:]:
                self._dense.add_(p.dense())
            self._parts = []
        self._dense.add_(as_dense(grad))

    def average(self, n: int) -> torch.Tensor | SparseGrad:
        """The round's gradient divided by ``n`` (the workers in it), exactly as the dense path's."""
        if self._dense is not None:
            return self._dense.div_(n) if n > 1 else self._dense
        if len(self._parts) == 1:
            p = self._parts[0]
            return SparseGrad(p.indices, p.values / n, p.numel) if n > 1 else p
        summed = _sum_parts(self._parts)
        if n > 1:
            summed.values.div_(n)
        return summed


def _sum_parts(parts: list[SparseGrad]) -> SparseGrad:
    """Sums sparse gradients over the union of their indices, in order, as the dense ``add_`` chain would."""
    union = sorted_union([p.indices.numpy() for p in parts])
    acc = torch.zeros(len(union), dtype=torch.float32)
    for i, p in enumerate(parts):
        pos = torch.from_numpy(np.searchsorted(union, p.indices.numpy()))
        if i == 0:
            acc.index_copy_(0, pos, p.values)
            continue
        named = torch.zeros(len(union), dtype=torch.bool).index_fill_(0, pos, True)
        acc.masked_fill_(~named & (acc == 0), 0.0)     # x + (+0.0): only -0.0 changes (to +0.0)
        sel = acc.index_select(0, pos)
        sel.add_(p.values)
        acc.index_copy_(0, pos, sel)
    return SparseGrad(torch.from_numpy(union), acc, parts[0].numel)


def sorted_union(parts: list[np.ndarray]) -> np.ndarray:
    """The increasing union of increasing index arrays: a stable sort merges sorted runs in linear time
    (``np.unique`` hashes, 20x slower here)."""
    merged = np.sort(np.concatenate(parts), kind="stable")
    if len(merged) < 2:
        return merged
    keep = np.empty(len(merged), dtype=bool)
    keep[0] = True
    np.not_equal(merged[1:], merged[:-1], out=keep[1:])
    return merged[keep]
