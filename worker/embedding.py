"""Embedding tables that live on the parameter servers: drop-in modules that hold no weight.

    emb = ShardedEmbedding(2**26, 16)                     # was: nn.Embedding(2**26, 16, sparse=True)
    bag = ShardedEmbeddingBag(None, 16, mode="sum")       # a dynamic table: any int64 id (hashed features)

The constructor and forward are those of :class:`torch.nn.Embedding` /
:class:`torch.nn.EmbeddingBag`; the table itself is never allocated on a
worker. :func:`shoal.worker.DistributedOptimizer` (its :class:`Trainer`) finds
these modules, declares their tables to the shards (row ``i`` lives on shard
``shoal.state.tables.partition_of(i, num_shards)``) and serves them: a forward pulls
the unique rows the batch touches (one lookup per shard holding some), backward
leaves the gradient of those rows only, and ``step()`` pushes it with the dense
gradient, under the same idempotency key. The extra keywords:

- ``optimizer``: the row optimizer on the servers, ``"sgd"``, ``"adagrad"``, ``"adam"`` (SparseAdam's
  lazy moments) or ``"ftrl"``; None takes it from the user's torch optimizer (Adagrad -> adagrad,
  Adam/SparseAdam -> adam, else sgd) with its ``lr``. ``hyper``: its hyper-parameters (``lr``,
  ``eps``, ``alpha``, ``beta``, ``l1``, ``l2``, ...), over those taken from the user's optimizer.
- ``init_std`` (default 1.0, nn.Embedding's N(0, 1)) and ``seed``: row ``i`` starts at
  ``normal(0, init_std)`` drawn from ``(seed, i)`` alone, so untouched rows cost no memory.
- ``evict_after_steps`` / ``evict_min_count``: rows not updated in that many of the table's steps,
  or updated fewer times, are dropped at eviction passes (a dynamic table's memory stays bounded).
- ``dtype_on_wire``: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"`` for looked-up rows.

Not supported (an error says so): ``padding_idx``, ``max_norm``, ``scale_grad_by_freq``; a forward
outside a job (no DistributedOptimizer/Trainer serves the module yet).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from shoal.errors import FailedPrecondition, InvalidArgument

ROW_OPTIMIZERS = ("sgd", "adagrad", "adam", "ftrl")
WIRE_DTYPES = ("float32", "float16", "bfloat16")


class _Served(torch.nn.Module):
    """What both modules share: the table's declaration and the router that serves it."""

    def _setup(self, num_embeddings: int | None, embedding_dim: int, padding_idx: Any, max_norm: Any,
               scale_grad_by_freq: bool, optimizer: str | None, hyper: Mapping[str, float] | None,
               init_std: float, seed: int, evict_after_steps: int | None, evict_min_count: int,
               dtype_on_wire: str) -> None:
        kind = type(self).__name__
        for name, value, default in (("padding_idx", padding_idx, None), ("max_norm", max_norm, None),
                                     ("scale_grad_by_freq", scale_grad_by_freq, False)):
            if value != default:
                raise InvalidArgument(f"{kind}: {name}={value!r} is not supported by tables on the parameter "
                                      f"servers (leave it at {default!r})")
        if num_embeddings is not None and (isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int)
                                           or num_embeddings < 1):
            raise InvalidArgument(f"{kind}: num_embeddings must be None (dynamic) or an int >= 1, "
                                  f"got {num_embeddings!r}")
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise InvalidArgument(f"{kind}: embedding_dim must be an int >= 1, got {embedding_dim!r}")
        if optimizer is not None and optimizer not in ROW_OPTIMIZERS:
            raise InvalidArgument(f"{kind}: unknown row optimizer {optimizer!r}; known: {', '.join(ROW_OPTIMIZERS)}")
        if dtype_on_wire not in WIRE_DTYPES:
            raise InvalidArgument(f"{kind}: dtype_on_wire must be one of {', '.join(WIRE_DTYPES)}, "
                                  f"got {dtype_on_wire!r}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq = None, None, 2.0, False
        self.sparse = True
        self.row_optimizer = optimizer
        self.hyper = dict(hyper or {})
        self.init_std = float(init_std)
        self.seed = int(seed)
        self.evict_after_steps = evict_after_steps
        self.evict_min_count = int(evict_min_count)
        self.dtype_on_wire = dtype_on_wire
        self._router: Any = None         # set by the Trainer (worker/tables.py)
        self.table_name = ""             # the module's path in the model, set by the Trainer

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the unique ids, each id's index into them); records the rows for backward."""
        if self._router is None:
            raise FailedPrecondition(f"{type(self).__name__} {self.table_name or ''}({self.num_embeddings}, "
                                     f"{self.embedding_dim}) lives on the parameter servers: wrap the optimizer "
                                     f"in shoal.worker.DistributedOptimizer (or build a Trainer) before the forward")
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgument(f"{type(self).__name__} {self.table_name}: ids must be int64 or int32, got {ids.dtype}")
        uniq, inverse = torch.unique(ids.reshape(-1).to(torch.int64).cpu(), return_inverse=True)
        rows = self._router.lookup(self, uniq)
        if torch.is_grad_enabled() and self.training:
            rows.requires_grad_(True)
            self._router.record(self, uniq, rows)
        return rows, inverse.view(ids.shape)

    def prefetch(self, input: torch.Tensor) -> None:
        """Starts pulling the rows of a coming batch's ids (``input`` as the forward will get it) in the
        background, so that forward finds them pulled: in async/ssp call it before this batch's forward
        (the rows are then a step old at most); in sync after ``step()`` (a prefetch from before the step's
        update is not used)."""
        if self._router is None:
            raise FailedPrecondition(f"{type(self).__name__} {self.table_name}: prefetch needs the parameter "
                                     f"servers: wrap the optimizer in shoal.worker.DistributedOptimizer first")
        self._router.prefetch(self, input)

    def extra_repr(self) -> str:
        n = "dynamic" if self.num_embeddings is None else self.num_embeddings
        return f"{n}, {self.embedding_dim}, on the parameter servers"


class ShardedEmbedding(_Served):
    """:class:`torch.nn.Embedding` whose table lives on the parameter servers (module docstring)."""

    def __init__(self, num_embeddings: int | None, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = True, _weight: Any = None, _freeze: bool = False, device: Any = None,
                 dtype: Any = None, *, optimizer: str | None = None, hyper: Mapping[str, float] | None = None,
                 init_std: float = 1.0, seed: int = 0, evict_after_steps: int | None = None,
                 evict_min_count: int = 0, dtype_on_wire: str = "float32"):
        super().__init__()
        if _weight is not None:
            raise InvalidArgument("ShardedEmbedding holds no weight: _weight cannot be given")
        self._setup(num_embeddings, embedding_dim, padding_idx, max_norm, scale_grad_by_freq, optimizer, hyper,
                    init_std, seed, evict_after_steps, evict_min_count, dtype_on_wire)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``nn.Embedding``'s forward: the rows of ``input``'s ids, pulled from the servers (unique ids, one
        pull per shard); the backward pass pushes only those rows' gradients."""
        rows, inverse = self._rows(input)
        return F.embedding(inverse.to(rows.device), rows)


class ShardedEmbeddingBag(_Served):
    """:class:`torch.nn.EmbeddingBag` whose table lives on the parameter servers (module docstring)."""

    def __init__(self, num_embeddings: int | None, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                 sparse: bool = True, _weight: Any = None, include_last_offset: bool = False,
                 padding_idx: int | None = None, device: Any = None, dtype: Any = None, *,
                 optimizer: str | None = None, hyper: Mapping[str, float] | None = None, init_std: float = 1.0,
                 seed: int = 0, evict_after_steps: int | None = None, evict_min_count: int = 0,
                 dtype_on_wire: str = "float32"):
        super().__init__()
        if _weight is not None:
            raise InvalidArgument("ShardedEmbeddingBag holds no weight: _weight cannot be given")
        if mode not in ("sum", "mean", "max"):
            raise InvalidArgument(f"ShardedEmbeddingBag: mode must be sum, mean or max, got {mode!r}")
        self._setup(num_embeddings, embedding_dim, padding_idx, max_norm, scale_grad_by_freq, optimizer, hyper,
                    init_std, seed, evict_after_steps, evict_min_count, dtype_on_wire)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``nn.EmbeddingBag``'s forward (``offsets``, ``per_sample_weights`` and ``mode`` as there), over the
        rows of ``input``'s ids pulled from the servers; the backward pass pushes only those rows' gradients."""
        rows, inverse = self._rows(input)
        return F.embedding_bag(inverse.to(rows.device), rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights, include_last_offset=self.include_last_offset)


def find_tables(model: torch.nn.Module) -> list[tuple[str, _Served]]:
    """The served tables of ``model`` with their paths (the table names), in module order."""
    return [(name or type(m).__name__, m) for name, m in model.named_modules() if isinstance(m, _Served)]


def table_options(module: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Settles how the parameter servers serve a user's ``nn.Embedding``/``nn.EmbeddingBag`` built on the
    ``meta`` device (whose own initialisation never runs): the extra keywords of :class:`ShardedEmbedding`
    (``optimizer``, ``hyper``, ``init_std``, ``seed``, ``evict_after_steps``, ``evict_min_count``,
    ``dtype_on_wire``). Returns the module::

        self.table = table_options(nn.EmbeddingBag(rows, 16, mode="sum", sparse=True, device="meta"), init_std=0.05)
    """
    known = {"optimizer", "hyper", "init_std", "seed", "evict_after_steps", "evict_min_count", "dtype_on_wire"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidArgument(f"unknown table option(s) {unknown}; known: {sorted(known)}")
    module.shoal_table_options = dict(options)
    return module


def swap_meta_embeddings(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, _Served]]:
    """Replaces each ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)`` built on the ``meta`` device by the
    served module of the same configuration; returns ``(path, its old weight, new module)`` for each."""
    out = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, (torch.nn.Embedding, torch.nn.EmbeddingBag)) or child.weight.device.type != "meta":
                continue
            path = f"{parent_name}.{child_name}" if parent_name else child_name
            if not child.sparse:
                raise InvalidArgument(f"{path}: an {type(child).__name__} on the meta device is served by the "
                                      f"parameter servers only with sparse=True")
            n, d = child.weight.shape
            options = getattr(child, "shoal_table_options", {})
            if isinstance(child, torch.nn.Embedding):
                new: _Served = ShardedEmbedding(n, d, child.padding_idx, child.max_norm,
                                                scale_grad_by_freq=child.scale_grad_by_freq, **options)
            else:
                new = ShardedEmbeddingBag(n, d, child.max_norm, scale_grad_by_freq=child.scale_grad_by_freq,
                                          mode=child.mode, include_last_offset=child.include_last_offset,
                                          padding_idx=child.padding_idx, **options)
            new.train(child.training)
            setattr(parent, child_name, new)
            out.append((path, child.weight, new))
    return out
