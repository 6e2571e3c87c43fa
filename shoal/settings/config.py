"""Settings: frozen dataclasses validated on construction.

The CLI (argparse), the YAML file (``--config``) and ``SHOAL_*`` environment
variables all map onto these classes; nothing else passes settings around.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from shoal.errors import InvalidArgument

MODES = ("sync", "async", "ssp")
RECOVERY = ("consistent", "fast")
# What a server does with a gradient or replicated update holding NaN/Inf (never applied, whichever):
# refuse it and fail the worker after a few in a row, skip it quietly (counted), or fail the worker at once.
NONFINITE = ("refuse", "skip", "stop")
# What a server does with a push whose gradient norm is beyond --grad-norm-factor times the running median
GRAD_NORM_POLICY = ("refuse", "clip")


@dataclass(frozen=True)
class JobConfig:
    """How the job trains; owned by the chief and published in the cluster view."""

    mode: str = "sync"
    backup_workers: int = 0
    staleness: int = 0
    num_shards: int = 1
    lease_seconds: float = 3.0
    replicas: int = 0                 # copies of each shard: 1 or 2; 0 picks 2 when there are 2+ shards
    recovery: str = "consistent"      # when a shard loses every copy: consistent (checkpoint) or fast
    # a gradient with NaN/Inf is never applied; skip (default: its batch counts as skipped, the run goes
    # on, as a GradScaler skips a step), refuse (the worker fails after a few in a row) or stop (at once)
    nonfinite: str = "skip"
    # the update guard (ps/guard.py, docs/update-safety.md): what a server checks before it applies a push
    lr_factor: float = 10.0           # a push's learning rate at most this times the job's configured one
    grad_norm_factor: float = 100.0   # a push's gradient norm at most this times the running median; 0: off
    grad_norm_policy: str = "refuse"  # beyond it: refuse (the batch is trained again) | clip (scaled down)
    grad_norm_warmup: int = 20        # accepted pushes per shard before the median is trusted
    expel_after: int = 10             # guard refusals in a row that expel a worker; 0: never
    require_batch: bool = False       # every push names a batch of a task its sender holds (shoal local --secure)


    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgument(f"--mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.backup_workers < 0:
            raise InvalidArgument(f"--backup-workers must be >= 0, got {self.backup_workers}")
        if self.backup_workers and self.mode != "sync":
            raise InvalidArgument(f"--backup-workers {self.backup_workers} needs --mode sync, not {self.mode!r}")
        if self.staleness < 0:
            raise InvalidArgument(f"--staleness must be >= 0, got {self.staleness}")
        if self.num_shards < 1:
            raise InvalidArgument(f"--num-shards must be >= 1, got {self.num_shards}")
        if not self.lease_seconds > 0:
            raise InvalidArgument(f"--lease-seconds must be > 0, got {self.lease_seconds}")
        if self.replicas == 0:
            object.__setattr__(self, "replicas", 2 if self.num_shards >= 2 else 1)
        if self.replicas not in (1, 2):
            raise InvalidArgument(f"--replicas must be 1 or 2, got {self.replicas}")
        if self.recovery not in RECOVERY:
            raise InvalidArgument(f"--recovery {self.recovery!r} is not one of {', '.join(RECOVERY)}")
        if self.nonfinite not in NONFINITE:
            raise InvalidArgument(f"--nonfinite {self.nonfinite!r} is not one of {', '.join(NONFINITE)}")
        if not (math.isfinite(self.lr_factor) and self.lr_factor >= 1):
            raise InvalidArgument(f"--lr-factor must be a finite number >= 1, got {self.lr_factor}")
        if not (math.isfinite(self.grad_norm_factor) and (self.grad_norm_factor == 0 or self.grad_norm_factor > 1)):
            raise InvalidArgument(f"--grad-norm-factor must be 0 (off) or a finite number > 1, got "
                                  f"{self.grad_norm_factor}")
        if self.grad_norm_policy not in GRAD_NORM_POLICY:
            raise InvalidArgument(f"--grad-norm-policy {self.grad_norm_policy!r} is not one of "
                                  f"{', '.join(GRAD_NORM_POLICY)}")
        if self.grad_norm_warmup < 1:
            raise InvalidArgument(f"--grad-norm-warmup must be >= 1, got {self.grad_norm_warmup}")
        if self.expel_after < 0:
            raise InvalidArgument(f"--expel-after must be >= 0 (0: never), got {self.expel_after}")


OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {
    # worker_*: what the workers apply before compressing (worker/momentum.py), set by the Trainer
    # when the codec is top-k: a momentum (worker_momentum, with momentum 0), or Adam's direction
    # (worker_beta2 > 0, with worker_momentum its beta1 and worker_eps its eps)
    "sgd": {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0, "dampening": 0.0, "nesterov": 0.0,
            "worker_momentum": 0.0, "worker_beta2": 0.0, "worker_eps": 1e-8},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
}


# torch.optim classes a shard cannot run over flat slices of the model, and why
UNSUPPORTED_TORCH_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "it re-evaluates the loss through a closure, which the parameter servers do not have",
    "SparseAdam": "it needs sparse gradients; shoal pushes dense (or top-k encoded) ones",
    "Adafactor": "it factors each matrix's statistics over rows and columns; a shard holds flat slices",
    "Muon": "it orthogonalises whole 2-D matrices; a shard holds flat slices",
}


@dataclass(frozen=True)
class ParamGroupSpec:
    """One param group of a torch optimizer: its hyper-parameters and the flat model ranges it covers."""

    hparams: Mapping[str, Any]
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        clean: dict[str, Any] = {}
        for key, value in dict(self.hparams).items():
            if key == "params":
                continue
            if isinstance(value, list):
                value = tuple(value)
            ok = value is None or isinstance(value, (bool, int, float, str)) or (
                isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value))
            if not ok:
                raise InvalidArgument(f"param group hyper-parameter {key!r} = {value!r} cannot be sent to the "
                                      f"parameter servers (numbers, booleans, strings or tuples of numbers only)")
            clean[key] = value
        if "lr" in clean and isinstance(clean["lr"], (int, float)) and not clean["lr"] >= 0:
            raise InvalidArgument(f"learning rate must be >= 0, got {clean['lr']}")
        ranges = tuple((int(a), int(b)) for a, b in self.ranges)
        if any(not 0 <= a < b for a, b in ranges):
            raise InvalidArgument(f"param group ranges must be non-empty and non-negative, got {ranges}")
        object.__setattr__(self, "hparams", clean)
        object.__setattr__(self, "ranges", ranges)


@dataclass(frozen=True)
class OptimizerSpec:
    """A server-side optimizer by name with its hyper-parameters.

    ``name`` is a registered name (``sgd``, ``adam``, ``adamw``) with float ``hparams``
    over the whole model, or the name of a ``torch.optim`` class (``RMSprop``) with
    ``groups``: the user's param groups, each with its hyper-parameters and flat ranges.
    """

    name: str = "sgd"
    hparams: Mapping[str, float] = field(default_factory=dict)
    groups: tuple[ParamGroupSpec, ...] = ()
    # flat ranges of the model's buffers (BatchNorm statistics): never stepped by the optimizer; a
    # push carries each buffer's change since the worker's last pull, which the shard adds (averaged
    # over a sync round)
    buffers: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        buffers = tuple((int(a), int(b)) for a, b in self.buffers)
        if any(not 0 <= a < b for a, b in buffers):
            raise InvalidArgument(f"buffer ranges must be non-empty and non-negative, got {buffers}")
        object.__setattr__(self, "buffers", buffers)
        if self.name not in OPTIMIZER_DEFAULTS:
            _check_torch_class(self.name)
            if self.hparams:
                raise InvalidArgument(f"optimizer {self.name!r}: hyper-parameters go in its param groups")
            if not self.groups:
                raise InvalidArgument(f"optimizer {self.name!r} has no param groups")
            object.__setattr__(self, "groups", tuple(self.groups))
            return
        if self.groups:
            raise InvalidArgument(f"optimizer {self.name!r} takes hyper-parameters, not param groups")
        known = OPTIMIZER_DEFAULTS[self.name]
        bad = sorted(set(self.hparams) - set(known))
        if bad:
            raise InvalidArgument(f"optimizer {self.name!r} has no hyper-parameter {', '.join(bad)}; "
                                  f"known: {', '.join(sorted(known))}")
        try:
            merged = {**known, **{k: float(v) for k, v in self.hparams.items()}}
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"optimizer {self.name!r}: hyper-parameters must be numbers ({exc})") from None
        if not merged["lr"] > 0:
            raise InvalidArgument(f"learning rate must be > 0, got {merged['lr']}")
        for key, (low, high) in _HPARAM_RANGES.items():
            value = merged.get(key)
            if value is not None and not (low <= value < high):
                raise InvalidArgument(f"optimizer {self.name!r}: {key} must be in [{low:g}, {high:g}), got {value:g}")
        object.__setattr__(self, "hparams", merged)

    @property
    def torch_class(self) -> bool:
        """True for a ``torch.optim`` class with param groups (not a registered name)."""
        return bool(self.groups)

    def to_json(self) -> str:
        """The groups form for the wire and checkpoints; ``""`` for a registered name without buffers."""
        if not self.groups and not self.buffers:
            return ""
        return json.dumps({"class": self.name, "hparams": dict(self.hparams), "groups": [
            {"hparams": dict(g.hparams), "ranges": [list(r) for r in g.ranges]} for g in self.groups],
            "buffers": [list(r) for r in self.buffers]})

    @property
    def saved_name(self) -> str:
        """What checkpoints and replicas store as the optimizer: the registered name, or the JSON spec."""
        return self.to_json() or self.name

    @classmethod
    def from_saved(cls, name: str, hparams: Mapping[str, float]) -> "OptimizerSpec":
        """The inverse of :attr:`saved_name` (with the registered name's hyper-parameters)."""
        return cls.from_json(name) if name.startswith("{") else cls(name, dict(hparams))

    @classmethod
    def from_json(cls, text: str) -> "OptimizerSpec":
        try:
            obj = json.loads(text)
            return cls(str(obj["class"]), dict(obj.get("hparams", {})),
                       tuple(ParamGroupSpec(g["hparams"], tuple(map(tuple, g["ranges"]))) for g in obj["groups"]),
                       tuple(map(tuple, obj.get("buffers", ()))))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"malformed optimizer spec: {exc}") from None


def _check_torch_class(name: str) -> None:
    import torch.optim

    why = UNSUPPORTED_TORCH_OPTIMIZERS.get(name)
    if why:
        raise InvalidArgument(f"optimizer torch.optim.{name} cannot run on the parameter servers: {why}")
    cls = getattr(torch.optim, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or name == "Optimizer":
        raise InvalidArgument(f"unknown optimizer {name!r}; known: {', '.join(sorted(OPTIMIZER_DEFAULTS))} "
                              f"or a torch.optim class name (e.g. RMSprop)")


# [low, high) of the hyper-parameters torch.optim checks (and the workers' shares of them); a value
# out of range is the worker's clear error instead of a failed Init on the server (or, for the
# workers' shares, a silent divergence)
_HPARAM_RANGES: dict[str, tuple[float, float]] = {
    "momentum": (0.0, math.inf), "dampening": (0.0, math.inf), "weight_decay": (0.0, math.inf),
    "nesterov": (0.0, 2.0), "beta1": (0.0, 1.0), "beta2": (0.0, 1.0), "eps": (0.0, math.inf),
    "worker_momentum": (0.0, math.inf), "worker_beta2": (0.0, 1.0), "worker_eps": (0.0, math.inf),
}


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Reads a YAML config: a mapping of setting names (dashes or underscores)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"cannot read config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"config {path} must be a mapping, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def from_sources(cls: type, *, cli: Mapping[str, Any] | None = None,
                 yaml_values: Mapping[str, Any] | None = None, env_prefix: str = "SHOAL_"):
    """Builds ``cls`` from YAML < environment < explicit CLI values (later wins)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, val in (yaml_values or {}).items():
        if key not in fields:
            raise InvalidArgument(f"unknown setting {key!r} in config; known: {', '.join(fields)}")
        values[key] = val
    for name, f in fields.items():
        env = os.environ.get(env_prefix + name.upper())
        if env is not None:
            values[name] = _coerce(name, env, f.type)
    for key, val in (cli or {}).items():
        if val is not None and key in fields:
            values[key] = val
    return cls(**values)


def _coerce(name: str, raw: str, typ: Any) -> Any:
    kind = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            return raw.lower() in ("1", "true", "yes", "on")
    except ValueError as exc:
        raise InvalidArgument(f"SHOAL_{name.upper()}={raw!r} is not a valid {kind}") from exc
    return raw
