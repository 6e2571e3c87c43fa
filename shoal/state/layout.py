"""Model layout and its byte-balanced partition over parameter shards.

A model's parameters, in ``named_parameters()`` order, are flattened into one
fp32 vector. :class:`ShardPlan` cuts that vector into ``num_shards`` contiguous
ranges of (almost) equal bytes: a large tensor is split across shards and small
ones are packed together. A tensor maps to one or more :class:`Segment` s.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from shoal.errors import InvalidArgument

if TYPE_CHECKING:   # torch is imported where a tensor is made, so the chief (layouts, no tensors) never loads it
    import torch

SUPPORTED_DTYPES = ("float32",)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise InvalidArgument(
                f"parameter {self.name!r} has dtype {self.dtype!r}; shoal keeps fp32 master "
                f"weights (supported: {', '.join(SUPPORTED_DTYPES)})")
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(f"parameter {self.name!r} has a negative dimension: {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return f"{self.name}{list(self.shape)}:{self.dtype}"


class ModelLayout:
    """The ordered parameter specs of a model, with offsets into the flat vector."""

    def __init__(self, specs: Iterable[TensorSpec]):
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise InvalidArgument("parameter names must be unique")
        offsets, total = [], 0
        for spec in self.specs:
            offsets.append(total)
            total += spec.numel
        self.offsets: tuple[int, ...] = tuple(offsets)
        self.numel: int = total
        canon = ";".join(s.describe() for s in self.specs)
        self.fingerprint: str = hashlib.sha256(canon.encode()).hexdigest()[:16]

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> "ModelLayout":
        return cls(TensorSpec(name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
                   for name, p in module.named_parameters())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelLayout) and self.specs == other.specs

    def __hash__(self) -> int:
        return hash(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def diff(self, other: "ModelLayout") -> list[str]:
        """Human-readable differences from ``self`` (the reference) to ``other``."""
        mine = {s.name: s for s in self.specs}
        theirs = {s.name: s for s in other.specs}
        out = [f"missing parameter {n}" for n in mine if n not in theirs]
        out += [f"unexpected parameter {n}" for n in theirs if n not in mine]
        for name, spec in mine.items():
            o = theirs.get(name)
            if o is not None and (o.shape, o.dtype) != (spec.shape, spec.dtype):
                out.append(f"{name}: expected {list(spec.shape)} {spec.dtype}, got {list(o.shape)} {o.dtype}")
        if not out and [s.name for s in self.specs] != [s.name for s in other.specs]:
            out.append("same parameters in a different order")
        return out

    def refusal(self, other: "ModelLayout") -> str:
        """Why ``other`` (a joining worker's model) is refused, in one line the worker can act on: the first
        difference, with the job's shape and the worker's (the chief logs every one, :meth:`diff`). A
        joiner has passed the job's authentication (its token, when the job has one) before it hears it."""
        out = self.diff(other)
        more = f" (and {len(out) - 1} more difference(s): the chief's log lists them)" if len(out) > 1 else ""
        return f"model layout differs from the job's: {out[0] if out else 'the same parameters'}{more}"

    def flatten(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copies ``tensors`` (in layout order) into one flat fp32 vector."""
        if len(tensors) != len(self.specs):
            raise InvalidArgument(f"expected {len(self.specs)} tensors, got {len(tensors)}")
        if out is None:
            import torch

            out = torch.empty(self.numel, dtype=torch.float32, device=tensors[0].device if tensors else "cpu")
        for spec, off, t in zip(self.specs, self.offsets, tensors):
            if tuple(t.shape) != spec.shape:
                raise InvalidArgument(f"{spec.name}: expected shape {list(spec.shape)}, got {list(t.shape)}")
            out[off:off + spec.numel].copy_(t.detach().reshape(-1))
        return out

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter (no copy)."""
        if flat.numel() != self.numel:
            raise InvalidArgument(f"flat vector has {flat.numel()} elements, layout needs {self.numel}")
        return [flat[off:off + s.numel].view(s.shape) for s, off in zip(self.specs, self.offsets)]


@dataclass(frozen=True)
class Segment:
    """Part of one tensor that lives in one shard."""

    shard: int
    shard_offset: int   # element offset inside the shard
    flat_offset: int    # element offset in the flat model vector
    length: int


class ShardPlan:
    """Contiguous, byte-balanced ranges of the flat vector, one per shard."""

    def __init__(self, numel: int, num_shards: int):
        if num_shards < 1:
            raise InvalidArgument(f"num_shards must be >= 1, got {num_shards}")
        self.numel = numel
        self.num_shards = num_shards
        base, extra = divmod(numel, num_shards)
        bounds, start = [], 0
        for k in range(num_shards):
            stop = start + base + (1 if k < extra else 0)
            bounds.append((start, stop))
            start = stop
        self.ranges: tuple[tuple[int, int], ...] = tuple(bounds)

    def shard_numel(self, shard: int) -> int:
        start, stop = self.ranges[shard]
        return stop - start

    def segments(self, flat_start: int, length: int) -> list[Segment]:
        """Splits the flat range ``[flat_start, flat_start + length)`` by shard."""
        out, pos, end = [], flat_start, flat_start + length
        for k, (start, stop) in enumerate(self.ranges):
            if pos >= end:
                break
            if stop <= pos or start == stop:
                continue
            take = min(stop, end) - pos
            out.append(Segment(k, pos - start, pos, take))
            pos += take
        return out

    def slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-shard views of a flat vector."""
        return [flat[a:b] for a, b in self.ranges]
