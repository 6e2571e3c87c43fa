"""Checkpoint storage, write side: shard states, optimizer-state flattening, atomic commits.

A checkpoint is ``<root>/ckpt-<step:012d>/`` with one ``shard-<k:05d>.pt`` per
shard and a ``manifest.json`` written last. Everything is first written into
``<root>/.tmp-ckpt-<step>-<random>/`` (each file fsynced), then the directory
is renamed into place and the root fsynced, so a reader sees either a whole
checkpoint or none. The read side lives in :mod:`shoal.state.checkpoint`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from shoal.settings.config import OptimizerSpec
from shoal.errors import FailedPrecondition, InvalidArgument, ShoalError
from shoal.state.layout import ModelLayout, TensorSpec

if TYPE_CHECKING:
    import torch

# torch (and shoal.state.optim, which needs it) is imported inside the functions that touch tensors: the
# chief commits manifests and prunes directories through this module and never loads torch.

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
CKPT_RE = re.compile(r"^ckpt-(\d{12,})$")
TMP_RE = re.compile(r"^\.tmp-ckpt-(\d+)-")


@dataclass
class ShardState:
    """Everything needed to rebuild one shard: its slice, optimizer state, version, extras."""

    shard: int
    start: int                      # range [start, stop) in the flat model vector
    stop: int
    values: torch.Tensor            # 1-D fp32, length stop - start
    optimizer: str                  # registered name (sgd|adam|adamw) or OptimizerSpec.to_json() (torch class)
    hparams: dict[str, float]
    opt_state: dict                 # torch ``optimizer.state_dict()`` over the single flat param
    version: int = 0
    extra: dict = field(default_factory=dict)   # JSON-able, e.g. applied-key ledger counts


def ckpt_dir_name(step: int) -> str:
    return f"ckpt-{step:012d}"


def shard_file_name(k: int) -> str:
    return f"shard-{k:05d}.pt"


# ---------------------------------------------------------------- optimizer state

def opt_state_to_flat(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Splits a one-parameter optimizer ``state_dict()`` into element-wise tensors and scalars.

    1-D (or larger) tensors such as ``momentum_buffer``, ``exp_avg`` or ``exp_avg_sq``
    become flat fp32 tensors; 0-dim tensors and numbers (``step``) become floats;
    ``None`` entries (SGD without momentum) are dropped.
    """
    import torch

    states = dict(state_dict.get("state", {}))
    groups = list(state_dict.get("param_groups", []))
    if len(states) > 1 or len(groups) > 1 or any(len(g.get("params", ())) != 1 for g in groups):
        raise InvalidArgument("optimizer state must cover exactly one (flat) parameter")
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, float] = {}
    for key, val in next(iter(states.values()), {}).items():
        if val is None:
            continue
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            tensors[key] = val.detach().reshape(-1).to(torch.float32)
        elif isinstance(val, (torch.Tensor, int, float)):
            scalars[key] = float(val)
        else:
            raise InvalidArgument(f"optimizer state entry {key!r} has unsupported type {type(val).__name__}")
    return tensors, scalars


def opt_state_from_flat(name: str, tensors: Mapping[str, torch.Tensor], scalars: Mapping[str, float],
                        hparams: Mapping[str, float]) -> dict:
    """The inverse of :func:`opt_state_to_flat`: a ``state_dict`` for ``optimizer.load_state_dict``.

    The param group comes from a probe optimizer of the same kind, so it carries
    every key this torch version expects. ``max_exp_avg_sq`` (amsgrad) is kept
    when present and simply absent otherwise. Empty tensors and scalars give the
    state of a fresh optimizer.
    """
    import torch

    from shoal.state.optim import OPTIMIZERS

    spec = OptimizerSpec.from_saved(name, dict(hparams))
    if spec.torch_class:        # the shard's own param groups hold the hyper-parameters
        group: dict[str, Any] = {"params": [0]}
    else:
        cls, kwargs = OPTIMIZERS[spec.name](dict(spec.hparams))
        group = cls([torch.nn.Parameter(torch.zeros(1))], **kwargs).state_dict()["param_groups"][0]
    if "max_exp_avg_sq" in tensors and "amsgrad" in group:
        group["amsgrad"] = True
    lengths = {t.numel() for t in tensors.values()}
    if len(lengths) > 1:
        raise InvalidArgument(f"optimizer tensors differ in length: {sorted(lengths)}")
    entry: dict[str, torch.Tensor] = {k: t.detach().reshape(-1).to(torch.float32).clone()
                                      for k, t in tensors.items()}
    entry.update({k: torch.tensor(float(v), dtype=torch.float32) for k, v in scalars.items()})
    return {"state": {0: entry} if entry else {}, "param_groups": [group]}


# ---------------------------------------------------------------- files

def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its elements (torch.save of a view saves the whole storage)."""
    import torch

    t = t.detach().to("cpu", torch.float32)
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.contiguous().clone()


def layout_to_json(layout: ModelLayout) -> list[list]:
    return [[s.name, list(s.shape), s.dtype] for s in layout.specs]


def check_tiling(ranges: Mapping[int, tuple[int, int]], num_shards: int, numel: int) -> None:
    """Shards ``0..num_shards-1`` present, in order, tiling ``[0, numel)`` exactly."""
    if sorted(ranges) != list(range(num_shards)):
        missing = sorted(set(range(num_shards)) - set(ranges))
        extra = sorted(set(ranges) - set(range(num_shards)))
        raise InvalidArgument(f"checkpoint needs shards 0..{num_shards - 1}: missing {missing}, unexpected {extra}")
    pos = 0
    for k in range(num_shards):
        start, stop = ranges[k]
        if start != pos or stop < start:
            raise InvalidArgument(f"shard {k} covers [{start}, {stop}) but the next range must start at {pos}")
        pos = stop
    if pos != numel:
        raise InvalidArgument(f"shards cover [0, {pos}) but the model has {numel} elements")


# ---------------------------------------------------------------- writer

class PendingCheckpoint:
    """One checkpoint being written into its temporary directory."""

    def __init__(self, writer: "CheckpointWriter", step: int, tmp: Path):
        self.writer = writer
        self.step = step
        self.tmp = tmp
        self._shards: dict[int, dict[str, Any]] = {}
        self._closed = False

    def write_shard(self, state: ShardState) -> None:
        """Saves one shard to ``shard-<k:05d>.pt`` (fsynced) and records its sha256 and size."""
        import torch

        self._check_open()
        _validate_state(state)
        if state.shard in self._shards:
            raise InvalidArgument(f"shard {state.shard} was already written to checkpoint step {self.step}")
        tensors, scalars = opt_state_to_flat(state.opt_state)
        n = state.stop - state.start
        bad = [k for k, t in tensors.items() if t.numel() != n]
        if bad:
            raise InvalidArgument(f"shard {state.shard}: optimizer tensors {bad} do not have {n} elements")
        payload = {"format": FORMAT, "shard": state.shard, "start": state.start, "stop": state.stop,
                   "values": _compact(state.values), "optimizer": state.optimizer,
                   "hparams": {k: float(v) for k, v in state.hparams.items()},
                   "opt_tensors": {k: _compact(t) for k, t in tensors.items()}, "opt_scalars": scalars,
                   "version": int(state.version), "extra": state.extra}
        path = self.tmp / shard_file_name(state.shard)
        with open(path, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        self._shards[state.shard] = {"shard": state.shard, "start": state.start, "stop": state.stop,
                                     "file": path.name, "sha256": sha256_file(path),
                                     "bytes": path.stat().st_size, "version": int(state.version)}

    def entry(self, k: int) -> dict[str, Any]:
        """The manifest entry of shard ``k`` written by :meth:`write_shard` (a copy)."""
        return dict(self._shards[k])

    def add_entry(self, entry: Mapping[str, Any]) -> None:
        """Records a shard file another process wrote into :attr:`tmp` (e.g. a parameter server).

        The file must exist with the recorded size; its sha256 is checked on every load.
        """
        self._check_open()
        keys = ("shard", "start", "stop", "file", "sha256", "bytes", "version")
        missing = [k for k in keys if k not in entry]
        if missing:
            raise InvalidArgument(f"shard entry lacks {', '.join(missing)}")
        e = {k: entry[k] for k in keys}
        k = int(e["shard"])
        if k in self._shards:
            raise InvalidArgument(f"shard {k} was already written to checkpoint step {self.step}")
        if e["file"] != shard_file_name(k):
            raise InvalidArgument(f"shard {k} must be written to {shard_file_name(k)}, not {e['file']!r}")
        path = self.tmp / e["file"]
        size = path.stat().st_size if path.is_file() else -1
        if size != int(e["bytes"]):
            raise InvalidArgument(f"shard {k}: {path} has {size} bytes, the writer reported {e['bytes']}")
        self._shards[k] = e

    def commit(self, layout: ModelLayout, num_shards: int, meta: Mapping[str, Any], replace: bool = False) -> Path:
        """Writes the manifest, renames the directory into place and prunes old checkpoints.

        Raises InvalidArgument (nothing committed, still pending) when a shard is
        missing or the ranges do not tile the model, and FailedPrecondition when a
        checkpoint for this step already exists, unless ``replace``: then whatever
        lies there (a corrupt or partial checkpoint, or one of another history that
        reached the same step) is moved aside, never deleted, once this one is
        complete on disk.
        """
        self._check_open()
        check_tiling({k: (e["start"], e["stop"]) for k, e in self._shards.items()}, num_shards, layout.numel)
        manifest = {"format": FORMAT, "step": self.step, "num_shards": num_shards,
                    "layout": layout_to_json(layout), "layout_fingerprint": layout.fingerprint,
                    "shards": [self._shards[k] for k in range(num_shards)], "meta": dict(meta),
                    "created": time.time()}
        try:
            text = json.dumps(manifest, indent=1, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"checkpoint meta is not JSON-able: {exc}") from exc
        final = self.writer.root / ckpt_dir_name(self.step)
        if final.exists() and not replace:
            raise FailedPrecondition(f"checkpoint {final} already exists")
        self._write_manifest(text)
        if final.exists():
            self.writer.set_aside(final)
        os.rename(self.tmp, final)
        fsync_dir(self.writer.root)
        self._closed = True
        self.writer.known_valid(final)
        log.info("committed checkpoint %s (%d shard(s), %d elements)", final, num_shards, layout.numel)
        self.writer.prune(keep_also=final)
        return final

    def abort(self) -> None:
        """Removes the temporary directory; the pending checkpoint cannot be used afterwards."""
        if not self._closed:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._closed = True
            log.info("aborted checkpoint step %d (%s)", self.step, self.tmp)

    def _write_manifest(self, text: str) -> None:
        path = self.tmp / MANIFEST
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp)

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition(f"checkpoint step {self.step} was already committed or aborted")


def _validate_state(state: ShardState) -> None:
    import torch

    if state.shard < 0 or not 0 <= state.start <= state.stop:
        raise InvalidArgument(f"shard {state.shard} has a bad range [{state.start}, {state.stop})")
    v = state.values
    if v.dim() != 1 or v.dtype != torch.float32 or v.numel() != state.stop - state.start:
        raise InvalidArgument(f"shard {state.shard}: values must be 1-D float32 with {state.stop - state.start} "
                              f"elements, got {tuple(v.shape)} {v.dtype}")
    try:
        OptimizerSpec.from_saved(state.optimizer, state.hparams)
    except InvalidArgument as exc:
        raise InvalidArgument(f"shard {state.shard}: {exc}") from None


# ---------------------------------------------------------------- validation (the read side builds on it)

def validate_checkpoint(path: Path) -> tuple[dict[str, Any], ModelLayout]:
    """The full check of a checkpoint directory (manifest, layout, shard table, every file's size and
    sha256); returns its manifest (shard entries sorted) and layout. FailedPrecondition says what is wrong."""
    manifest = _read_manifest(path)
    layout = _layout_from(path, manifest)
    entries = _shard_table(path, manifest, layout)
    for entry in entries:
        _verify_file(path, entry)
    try:        # the fields a Checkpoint reads as numbers (shoal.state.checkpoint)
        int(manifest["step"]), int(manifest["num_shards"]), float(manifest["created"])
        if not isinstance(manifest["meta"], dict):
            raise TypeError(f"meta is {type(manifest['meta']).__name__}, not an object")
    except (TypeError, ValueError) as exc:     # e.g. a step or creation time that is not a number
        raise FailedPrecondition(f"checkpoint {path}: bad field in {MANIFEST}: {exc}") from exc
    return {**manifest, "shards": entries}, layout


def _open_fully(path: Path) -> None:
    """The read side's full validation (manifest, layout, every file's size and sha256)."""
    validate_checkpoint(path)


def _shard_table(path: Path, manifest: dict[str, Any], layout: ModelLayout) -> list[dict[str, Any]]:
    """The manifest's shard entries, sorted by shard, checked to tile the model."""
    entries = manifest["shards"]
    keys = ("shard", "start", "stop", "file", "sha256", "bytes", "version")
    try:
        if not all(isinstance(e, dict) and all(k in e for k in keys) for e in entries):
            raise InvalidArgument(f"every entry needs {', '.join(keys)}")
        if len(entries) != int(manifest["num_shards"]):
            raise InvalidArgument(f"{len(entries)} entries for {manifest['num_shards']} shard(s)")
        check_tiling({int(e["shard"]): (int(e["start"]), int(e["stop"])) for e in entries},
                     int(manifest["num_shards"]), layout.numel)
    except (InvalidArgument, TypeError, ValueError) as exc:
        raise FailedPrecondition(f"checkpoint {path}: bad shard table in {MANIFEST}: {exc}") from exc
    return sorted(entries, key=lambda e: int(e["shard"]))


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"checkpoint {path}: unreadable {MANIFEST}: {exc}") from exc
    required = ("format", "step", "num_shards", "layout", "layout_fingerprint", "shards", "meta", "created")
    if not isinstance(manifest, dict) or any(k not in manifest for k in required):
        raise FailedPrecondition(f"checkpoint {path}: {MANIFEST} lacks one of {', '.join(required)}")
    if manifest["format"] != FORMAT:
        raise FailedPrecondition(f"checkpoint {path}: format {manifest['format']!r} is not {FORMAT}")
    return manifest


def _layout_from(path: Path, manifest: dict[str, Any]) -> ModelLayout:
    try:
        layout = ModelLayout(TensorSpec(str(n), tuple(int(d) for d in shape), str(dt))
                             for n, shape, dt in manifest["layout"])
    except (InvalidArgument, TypeError, ValueError) as exc:
        raise FailedPrecondition(f"checkpoint {path}: bad layout in {MANIFEST}: {exc}") from exc
    if layout.fingerprint != manifest["layout_fingerprint"]:
        raise FailedPrecondition(f"checkpoint {path}: layout fingerprint {manifest['layout_fingerprint']} "
                                 f"does not match its layout ({layout.fingerprint})")
    return layout


def _verify_file(ckpt: Path, entry: dict[str, Any]) -> None:
    name = str(entry.get("file", ""))
    file = ckpt / name
    if os.path.basename(name) != name or not file.is_file():
        raise FailedPrecondition(f"checkpoint {ckpt}: shard file {name!r} is missing")
    size = file.stat().st_size
    if size != entry.get("bytes"):
        raise FailedPrecondition(f"checkpoint {ckpt}: {name} has {size} bytes, manifest says {entry.get('bytes')} "
                                 f"(truncated?)")
    digest = sha256_file(file)
    if digest != entry.get("sha256"):
        raise FailedPrecondition(f"checkpoint {ckpt}: {name} sha256 {digest[:12]}... does not match the "
                                 f"manifest ({str(entry.get('sha256'))[:12]}...): corrupt")


class CheckpointWriter:
    """Writes checkpoints under ``root`` and keeps the newest ``keep`` valid ones.

    ``validate(path)`` raises (FailedPrecondition) for a checkpoint that cannot be
    restored; by default the read side's full check. Pruning runs it at most once
    per directory (checkpoints this writer committed are known valid), so a
    corrupt checkpoint never counts towards ``keep``.
    """

    def __init__(self, root: str | Path, keep: int = 3, validate: Callable[[Path], None] = _open_fully):
        if keep < 1:
            raise InvalidArgument(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self._validate = validate
        self._valid: dict[str, bool] = {}

    def begin(self, step: int, replace: bool = False) -> PendingCheckpoint:
        """Starts checkpoint ``step`` in a fresh temporary directory under the root.

        FailedPrecondition if a checkpoint for ``step`` exists, unless ``replace``
        (see :meth:`PendingCheckpoint.commit`).
        """
        if step < 0:
            raise InvalidArgument(f"checkpoint step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        if (self.root / ckpt_dir_name(step)).exists() and not replace:
            raise FailedPrecondition(f"checkpoint {self.root / ckpt_dir_name(step)} already exists")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-ckpt-{step}-", dir=self.root))
        return PendingCheckpoint(self, step, tmp)

    def known_valid(self, path: Path) -> None:
        self._valid[path.name] = True

    def is_valid(self, path: Path) -> bool:
        """Whether ``path`` validates (cached per directory name)."""
        if path.name not in self._valid:
            try:
                self._validate(path)
                self._valid[path.name] = True
            except (ShoalError, OSError, ValueError) as exc:
                log.warning("checkpoint %s is not valid (%s); it does not count towards the %d kept",
                            path, exc, self.keep)
                self._valid[path.name] = False
        return self._valid[path.name]

    def set_aside(self, path: Path) -> Path:
        """Renames a checkpoint directory out of the way (``<name>.set-aside-<n>``), never deleting it."""
        n = 0
        while (aside := path.with_name(f"{path.name}.set-aside-{n}")).exists():
            n += 1
        os.rename(path, aside)
        self._valid.pop(path.name, None)
        log.warning("moved %s aside to %s: a new checkpoint of step %d takes its place", path, aside.name,
                    _step_of(path))
        return aside

    def prune(self, keep_also: Path | None = None) -> None:
        """Deletes checkpoints older than the oldest of the newest ``keep`` valid ones (never
        ``keep_also``), and temporary directories left by crashed writes of steps up to the
        newest checkpoint. A corrupt checkpoint newer than that is left alone: it is never a
        reason to delete a valid one."""
        complete = list_checkpoints(self.root)
        kept = 0
        for i, path in enumerate(complete):
            if (keep_also is not None and path == keep_also) or self.is_valid(path):
                kept += 1
            if kept == self.keep:
                for old in complete[i + 1:]:
                    if keep_also is None or old != keep_also:
                        _remove_checkpoint(old)
                        self._valid.pop(old.name, None)
                break
        newest = _step_of(complete[0]) if complete else -1
        for tmp in self.root.glob(".tmp-ckpt-*"):
            m = TMP_RE.match(tmp.name)
            if m and int(m.group(1)) <= newest and tmp.is_dir():
                log.info("removing temporary checkpoint directory %s left by an earlier write", tmp)
                shutil.rmtree(tmp, ignore_errors=True)


def _remove_checkpoint(path: Path) -> None:
    """Manifest first, so a crash mid-delete leaves an incomplete (ignored) directory."""
    log.info("pruning checkpoint %s", path)
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def _step_of(path: Path) -> int:
    m = CKPT_RE.match(path.name)
    assert m is not None
    return int(m.group(1))


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints (final directories holding a manifest) under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if CKPT_RE.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=_step_of, reverse=True)


# ---------------------------------------------------------------- failed checkpoints
