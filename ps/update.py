"""What a push gets back and what a shard's step is: the values passed between a shard, its servicer
and its backup (ps/replication.py), and the NaN/Inf check every gradient goes through."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.ps.ledger import BatchKey
from shoal.ps.sparse import SparseGrad, as_dense


def count_nonfinite(t: torch.Tensor) -> int:
    """How many elements of ``t`` are NaN or Inf. One reduction when there are none: a sum is finite
    only if every term is (NaN and Inf propagate); only a non-finite sum, an overflow of finite terms
    included, pays for the exact count."""
    if t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return 0
    return int(t.numel() - torch.isfinite(t).sum())


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    version: int
    reason: str = ""
    duplicate: bool = False
    applied: tuple[BatchKey, ...] = ()    # the named batches that were applied before (a refused duplicate)


@dataclass(frozen=True)
class Update:
    """One optimizer step of a shard: everything a backup needs to take the same step."""

    version: int                               # the version it produces
    grad: torch.Tensor | SparseGrad            # the (averaged) gradient the optimizer steps with
    keys: tuple[str, ...] = ()                 # idempotency keys it settles
    batches: tuple[tuple[BatchKey, str], ...] = ()   # ledger entries: batch -> the push that applied it
    workers: tuple[str, ...] = ()              # whose clocks advance
    sparse: bool = False                       # grad is zero outside a few elements (top-k pushes)
    hparams: tuple[tuple[str, float], ...] = ()  # the hyper-parameters it steps with ("0.lr", ...); () unchanged
    exact: str = ""                            # a narrower dtype that holds every value of grad exactly
    #                                            ("bfloat16", "float16": one push in that codec), "" none
    rows: tuple = ()                           # embedding rows' gradients: (table, unique ids, fp32 (n, dim))
    #                                            each, summed over the round's pushes and averaged (ps/shard_tables.py)

    def dense_grad(self) -> torch.Tensor:
        """The gradient as one dense tensor (what a backup is sent); built once for a sparse one."""
        return as_dense(self.grad)
