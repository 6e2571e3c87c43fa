"""Checkpoints of the parameter shards: write, validate, restore (re-sliced), export.

Write side (re-exported from :mod:`shoal.state.checkpoint_store`): :class:`ShardState`,
:class:`CheckpointWriter` / :class:`PendingCheckpoint`, :func:`opt_state_to_flat`,
:func:`opt_state_from_flat`, :func:`list_checkpoints`.

Read side (here): :func:`load_latest` returns the newest checkpoint whose manifest
parses and whose shard files all match their recorded size and sha256, skipping
broken ones with a warning. A :class:`Checkpoint` can hand out the whole model,
the whole optimizer state, or one shard's state for a *different* shard plan,
since every supported optimizer is element-wise.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from shoal.errors import FailedPrecondition, InvalidArgument, NotFound
from shoal.state.layout import ModelLayout, ShardPlan, TensorSpec
from shoal.state.checkpoint_store import (FORMAT, MANIFEST, CheckpointWriter, PendingCheckpoint, ShardState,
                                       validate_checkpoint,
                                       check_tiling, list_checkpoints, opt_state_from_flat, opt_state_to_flat,
                                       sha256_file)

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that load or build tensors: the chief opens checkpoints
# (manifest, layout, sizes and sha256 of the shard files) through load_latest and never loads torch.

log = logging.getLogger(__name__)

__all__ = ["Checkpoint", "CheckpointWriter", "PendingCheckpoint", "ShardState", "export_state_dict",
           "export_to_file", "list_checkpoints", "load_latest", "open_checkpoint", "opt_state_from_flat",
           "opt_state_to_flat"]

Piece = tuple[int, int, dict[str, Any]]   # (start, stop, loaded shard payload)


class Checkpoint:
    """A validated checkpoint directory; shard files are loaded lazily and cached."""

    def __init__(self, path: Path, manifest: dict[str, Any], layout: ModelLayout):
        self.path = path
        self.step: int = int(manifest["step"])
        self.num_shards: int = int(manifest["num_shards"])
        self.layout = layout
        self.meta: dict[str, Any] = manifest["meta"]
        self.created: float = float(manifest["created"])
        self._entries: list[dict[str, Any]] = manifest["shards"]
        self._payloads: dict[int, dict[str, Any]] = {}

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, step={self.step}, num_shards={self.num_shards})"

    @property
    def versions(self) -> dict[int, int]:
        """Shard index (in the plan the checkpoint was taken with) -> shard version."""
        return {int(e["shard"]): int(e["version"]) for e in self._entries}

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(int(e["start"]), int(e["stop"])) for e in self._entries]

    def check_layout(self, layout: ModelLayout) -> None:
        """FailedPrecondition naming every differing parameter unless ``layout`` matches."""
        diff = self.layout.diff(layout)
        if diff:
            raise FailedPrecondition(f"model does not match checkpoint {self.path} (step {self.step}): "
                                     + "; ".join(diff))

    def flat_values(self) -> torch.Tensor:
        """The whole flat fp32 model vector."""
        import torch

        return torch.cat([self._payload(k)["values"] for k in range(self.num_shards)])

    def flat_optimizer(self) -> tuple[str, dict[str, float], dict[str, torch.Tensor], dict[str, float]]:
        """``(name, hparams, element-wise tensors over the whole model, scalars)``."""
        name, hparams = self._optimizer()
        tensors, scalars = _merge(self._pieces(0, self.layout.numel), 0, self.layout.numel)
        return name, hparams, tensors, scalars

    def shard_state(self, plan: ShardPlan, k: int) -> ShardState:
        """State of shard ``k`` of ``plan``, re-sliced from however many shards were saved.

        ``version`` is the saved shard's when the range is unchanged, else the highest
        version among the saved shards it overlaps. ``extra`` is the saved shard's when
        unchanged, else ``{"resliced_from": [{"shard", "start", "stop", "extra"}, ...]}``.
        """
        import torch

        if plan.numel != self.layout.numel:
            raise InvalidArgument(f"plan covers {plan.numel} elements, checkpoint {self.path} has {self.layout.numel}")
        if not 0 <= k < plan.num_shards:
            raise InvalidArgument(f"shard {k} is outside a plan of {plan.num_shards} shard(s)")
        start, stop = plan.ranges[k]
        name, hparams = self._optimizer()
        pieces = self._pieces(start, stop)
        values = torch.cat([p["values"][max(start, a) - a:min(stop, b) - a] for a, b, p in pieces]) \
            if pieces else torch.empty(0, dtype=torch.float32)
        tensors, scalars = _merge(pieces, start, stop)
        version, extra = self._version_extra(start, stop, pieces)
        return ShardState(k, start, stop, values.clone(), name, hparams,
                          opt_state_from_flat(name, tensors, scalars, hparams), version, extra)

    def shard_extra(self, k: int) -> dict[str, Any]:
        """What saved shard ``k``'s file holds besides its slice (ledger, embedding tables' partitions)."""
        if not 0 <= k < self.num_shards:
            raise InvalidArgument(f"shard {k} is outside checkpoint {self.path}'s {self.num_shards} shard(s)")
        return dict(self._payload(k).get("extra") or {})

    # ------------------------------------------------------------ internals

    def _version_extra(self, start: int, stop: int, pieces: list[Piece]) -> tuple[int, dict]:
        for a, b, p in pieces:
            if (a, b) == (start, stop):
                return int(p["version"]), dict(p["extra"])
        versions = [int(p["version"]) for _, _, p in pieces] or list(self.versions.values())
        sources = [{"shard": int(p["shard"]), "start": a, "stop": b, "extra": p["extra"]} for a, b, p in pieces]
        return max(versions, default=0), {"resliced_from": sources}

    def _optimizer(self) -> tuple[str, dict[str, float]]:
        kinds = {(p["optimizer"], tuple(sorted(p["hparams"].items())))
                 for p in (self._payload(k) for k in range(self.num_shards))}
        if len(kinds) != 1:
            raise FailedPrecondition(f"checkpoint {self.path} mixes optimizers across shards: {sorted(kinds)}")
        name, hparams = kinds.pop()
        return name, dict(hparams)

    def _pieces(self, start: int, stop: int) -> list[Piece]:
        """Saved shards overlapping ``[start, stop)`` (non-empty ones only), in order."""
        return [(a, b, self._payload(k)) for k, (a, b) in enumerate(self.ranges)
                if a < b and a < stop and b > start]

    def _payload(self, k: int) -> dict[str, Any]:
        if k not in self._payloads:
            import torch

            entry = self._entries[k]
            path = self.path / entry["file"]
            try:
                data = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:   # any unpickling failure means a damaged file
                raise FailedPrecondition(f"checkpoint {self.path}: cannot load {entry['file']}: {exc}") from exc
            _check_payload(self.path, entry, data)
            self._payloads[k] = data
        return self._payloads[k]


def _check_payload(ckpt: Path, entry: dict[str, Any], data: Any) -> None:
    import torch

    n = int(entry["stop"]) - int(entry["start"])
    where = (entry["shard"], entry["start"], entry["stop"])
    ok = (isinstance(data, dict) and data.get("format") == FORMAT
          and (data.get("shard"), data.get("start"), data.get("stop")) == where
          and isinstance(data.get("values"), torch.Tensor) and data["values"].numel() == n
          and all(t.numel() == n for t in data.get("opt_tensors", {}).values()))
    if not ok:
        raise FailedPrecondition(f"checkpoint {ckpt}: {entry['file']} does not match its manifest entry")


def _merge(pieces: list[Piece], start: int, stop: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Element-wise optimizer tensors over ``[start, stop)`` and the scalars that go with them.

    A shard that has no entry for a tensor (it never stepped) contributes zeros, the
    value a fresh optimizer starts from. Scalars that differ between the pieces
    (e.g. Adam's ``step`` after uneven async updates) take the value of the piece
    covering the most elements, with a warning.
    """
    import torch

    keys = sorted({k for _, _, p in pieces for k in p["opt_tensors"]})
    tensors: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = []
        for a, b, p in pieces:
            lo, hi = max(start, a) - a, min(stop, b) - a
            t = p["opt_tensors"].get(key)
            parts.append(t[lo:hi] if t is not None else torch.zeros(hi - lo, dtype=torch.float32))
        tensors[key] = torch.cat(parts)
    return tensors, _merge_scalars(pieces, start, stop)


def _merge_scalars(pieces: list[Piece], start: int, stop: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in sorted({k for _, _, p in pieces for k in p["opt_scalars"]}):
        weight: dict[float, int] = {}
        for a, b, p in pieces:
            val = float(p["opt_scalars"].get(key, 0.0))
            weight[val] = weight.get(val, 0) + min(stop, b) - max(start, a)
        out[key] = max(weight, key=lambda v: (weight[v], v))
        if len(weight) > 1:
            log.warning("optimizer scalar %r differs across saved shards in [%d, %d): %s; using %s",
                        key, start, stop, sorted(weight), out[key])
    return out


# ---------------------------------------------------------------- opening and validation

def open_checkpoint(path: str | Path) -> Checkpoint:
    """Opens and fully validates one checkpoint directory; FailedPrecondition says what is wrong."""
    path = Path(path)
    manifest, layout = validate_checkpoint(path)
    return Checkpoint(path, manifest, layout)


def load_latest(root: str | Path) -> Checkpoint | None:
    """The newest checkpoint under ``root`` that validates; broken ones are skipped with a warning."""
    for path in list_checkpoints(root):
        try:
            return open_checkpoint(path)
        except FailedPrecondition as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
    return None


# ---------------------------------------------------------------- export

def export_state_dict(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Parameter and buffer name -> tensor (layout shape, contiguous clone), for
    ``module.load_state_dict(..., strict=True)``: workers put the model's buffers (BatchNorm
    running statistics) after its parameters in the layout. Buffers are stored as fp32; an integer
    one (``num_batches_tracked``) is cast back by ``load_state_dict``.
    """
    views = ckpt.layout.unflatten(ckpt.flat_values())
    return {spec.name: v.contiguous().clone() for spec, v in zip(ckpt.layout.specs, views)}


def export_to_file(ckpt_path_or_root: str | Path, out_path: str | Path) -> Path:
    """Writes :func:`export_state_dict` of a checkpoint dir, or of the latest under a root, with torch.save."""
    return export_checkpoint(ckpt_path_or_root, out_path)[0]


def export_checkpoint(ckpt_path_or_root: str | Path, out_path: str | Path,
                      check: "Callable[[Checkpoint], None] | None" = None,
                      extend: Callable[["Checkpoint", dict, Path], Any] | None = None) -> tuple[Path, "Checkpoint"]:
    """:func:`export_to_file`, also returning the checkpoint it exported (its step, its path). ``check``
    sees the checkpoint before anything is written and may refuse it (raise); ``extend(ckpt, state_dict,
    out)`` may add to the state_dict before it is written (``shoal export``: embedding tables)."""
    import torch

    src = Path(ckpt_path_or_root)
    ckpt = open_checkpoint(src) if (src / MANIFEST).is_file() else load_latest(src)
    if ckpt is None:
        raise NotFound(f"no valid checkpoint under {src}")
    if check is not None:
        check(ckpt)
    out = Path(out_path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    state = export_state_dict(ckpt)
    if extend is not None:
        extend(ckpt, state, out)
    torch.save(state, tmp)
    os.replace(tmp, out)
    log.info("exported %s (step %d, %d parameter(s)) to %s", ckpt.path, ckpt.step, len(ckpt.layout), out)
    return out, ckpt
