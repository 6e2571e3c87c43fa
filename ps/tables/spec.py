"""What a table is: :class:`TableSpec`, validated on construction.

A spec is plain data (it travels in checkpoints, snapshot headers and the
protocol as :meth:`TableSpec.to_dict`). Every error quotes the bad value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from shoal.errors import InvalidArgument

_INT64_MAX = (1 << 63) - 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: its shape, row optimizer, initialiser and eviction policy.

    ``num_embeddings=None`` makes a dynamic table (any int64 id, rows created on
    first update); a number makes a fixed one (ids ``0 <= id < num_embeddings``).
    ``hyper`` holds the row optimizer's hyper-parameters (see
    :data:`shoal.ps.tables.optimizers.ROW_OPTIMIZERS`); missing ones take the
    optimizer's defaults (PyTorch's, where PyTorch has the optimizer).
    Initial rows are ``normal(0, init_std)`` drawn from ``(seed, id)`` alone.
    Eviction (dynamic or fixed: an evicted row of a fixed table returns to its
    initial value): a row not updated in the last ``evict_after_steps`` of the
    table's steps, or updated fewer than ``evict_min_count`` times, is dropped
    at an eviction pass (:meth:`RowTable.evict`).
    """

    name: str
    dim: int
    num_embeddings: int | None
    optimizer: str = "sgd"
    hyper: Mapping[str, float] = field(default_factory=dict)
    init_std: float = 1.0
    seed: int = 0
    evict_after_steps: int | None = None
    evict_min_count: int = 0

    def __post_init__(self) -> None:
        from shoal.ps.tables.optimizers import row_optimizer

        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"table name must be a non-empty string, got {self.name!r}")
        if not _is_int(self.dim) or self.dim < 1:
            raise InvalidArgument(f"table {self.name!r}: dim must be an int >= 1, got {self.dim!r}")
        if self.num_embeddings is not None and (
                not _is_int(self.num_embeddings) or not 1 <= self.num_embeddings <= _INT64_MAX):
            raise InvalidArgument(f"table {self.name!r}: num_embeddings must be None (dynamic) "
                                  f"or an int >= 1, got {self.num_embeddings!r}")
        opt = row_optimizer(self.optimizer)
        if not isinstance(self.hyper, Mapping):
            raise InvalidArgument(f"table {self.name!r}: hyper must be a mapping, got {self.hyper!r}")
        object.__setattr__(self, "hyper", MappingProxyType(opt.check_hyper(dict(self.hyper), self.name)))
        if not isinstance(self.init_std, (int, float)) or isinstance(self.init_std, bool) \
                or not math.isfinite(self.init_std) or self.init_std < 0:
            raise InvalidArgument(f"table {self.name!r}: init_std must be a finite float >= 0, "
                                  f"got {self.init_std!r}")
        object.__setattr__(self, "init_std", float(self.init_std))
        if not _is_int(self.seed) or not 0 <= self.seed < (1 << 64):
            raise InvalidArgument(f"table {self.name!r}: seed must be an int in [0, 2**64), got {self.seed!r}")
        if self.evict_after_steps is not None and (not _is_int(self.evict_after_steps)
                                                   or self.evict_after_steps < 1):
            raise InvalidArgument(f"table {self.name!r}: evict_after_steps must be None or an int >= 1, "
                                  f"got {self.evict_after_steps!r}")
        if not _is_int(self.evict_min_count) or self.evict_min_count < 0:
            raise InvalidArgument(f"table {self.name!r}: evict_min_count must be an int >= 0, "
                                  f"got {self.evict_min_count!r}")

    def __hash__(self) -> int:            # the generated one would hash the hyper mapping, which cannot
        return hash((self.name, self.dim, self.num_embeddings, self.optimizer, tuple(sorted(self.hyper.items())),
                     self.init_std, self.seed, self.evict_after_steps, self.evict_min_count))

    @property
    def dynamic(self) -> bool:
        return self.num_embeddings is None

    @property
    def evicts(self) -> bool:
        return self.evict_after_steps is not None or self.evict_min_count > 0

    def resolved_hyper(self, override: Mapping[str, float] | None = None) -> dict[str, float]:
        """The optimizer's defaults, then this spec's ``hyper``, then ``override`` (checked)."""
        from shoal.ps.tables.optimizers import row_optimizer

        opt = row_optimizer(self.optimizer)
        out = dict(opt.defaults)
        out.update(self.hyper)
        if override:
            out.update(opt.check_hyper(dict(override), self.name))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dim": self.dim, "num_embeddings": self.num_embeddings,
                "optimizer": self.optimizer, "hyper": dict(self.hyper), "init_std": self.init_std,
                "seed": self.seed, "evict_after_steps": self.evict_after_steps,
                "evict_min_count": self.evict_min_count}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TableSpec":
        known = {"name", "dim", "num_embeddings", "optimizer", "hyper", "init_std", "seed",
                 "evict_after_steps", "evict_min_count"}
        extra = sorted(set(d) - known)
        if extra:
            raise InvalidArgument(f"table spec has unknown fields {extra}; known: {sorted(known)}")
        return cls(**dict(d))
