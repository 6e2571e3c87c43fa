"""The job file: one YAML document that describes a whole job, for every role and every generator.

Nested sections (``train``, ``optimizer``, ``compression``, ``cluster``, ``checkpointing``, ``recovery``,
``autoscaling``, ``straggler_detection``, ``logging``, ``alerts``, ``resources``, ``image``, and per-role
``chief``/``ps``/``local``)
map onto the command-line settings (:data:`KEYS`: key path -> the flags' ``dest``, and the
``SHOAL_*`` variable that overrides it). Precedence, lowest first: the file, ``SHOAL_*``
variables, flags. Every value is checked here, so a bad one is one line naming its key path, the
value and what is allowed; the settings dataclasses (``shoal.settings.config``) then check how they combine.

The legacy flat form (``mode: async``, ``staleness: 2`` at the top) still loads.
"""
from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from shoal.settings.config import MODES, OPTIMIZER_DEFAULTS, RECOVERY, OptimizerSpec
from shoal.errors import InvalidArgument

ENV_JOB_FILE = "SHOAL_JOB_FILE"      # a worker's Trainer reads the train/optimizer sections from this file
_DURATION = re.compile(r"^\s*(\d+(\.\d+)?)\s*(ms|s|m|h)\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_RESOURCE_NAME = re.compile(r"^([a-z0-9.-]+/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
_ADDRESS = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:[0-9]{1,5}$")


def _duration(text: Any) -> float | None:
    m = _DURATION.match(str(text))
    return float(m.group(1)) * _UNITS[m.group(3)] if m else None


def _interval_ok(value: Any) -> bool:
    """``500`` model updates or a time ``30s``/``5m``/``1h`` above zero (as ``--checkpoint-interval``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int) or str(value).strip().isdigit():
        return int(value) >= 1
    seconds = _duration(value)
    return seconds is not None and seconds > 0 and str(value).strip()[-2:] != "ms"


@dataclass(frozen=True)
class Key:
    """One setting of the job file: its type, what is allowed, and the flags it stands for."""

    kind: str                               # int, float, str, bool, list, interval, duration
    allowed: str = ""                       # what the error message says is allowed
    check: Callable[[Any], bool] | None = None
    dests: tuple[str, ...] = ()             # argparse dests it fills (first wins the env name)
    commands: tuple[str, ...] = ()          # only for these commands (empty: every command with the dest)
    env: str = ""                           # SHOAL_* variable that overrides it ("" : SHOAL_<DEST>)

    def env_name(self) -> str:
        return self.env or (f"SHOAL_{self.dests[0].upper()}" if self.dests else "")


def _choice(*names: Any) -> tuple[str, Callable[[Any], bool]]:
    return f"one of {', '.join(map(str, names))}", lambda v: v in names


def _at_least(low: float) -> tuple[str, Callable[[Any], bool]]:
    return f">= {low:g}", lambda v: v >= low


_GT0 = ("> 0", lambda v: v > 0 and math.isfinite(v))
_PORT = ("a port number 0-65535", lambda v: 0 <= v <= 65535)
_ADDR = ("HOST:PORT", lambda v: bool(_ADDRESS.match(v)))

KEYS: dict[str, Key] = {
    "train.mode": Key("str", *_choice(*MODES), dests=("mode",)),
    "train.backup_workers": Key("int", *_at_least(0), dests=("backup_workers",)),
    "train.staleness": Key("int", *_at_least(0), dests=("staleness",)),
    "train.batch_size": Key("int", *_at_least(1)),
    "train.epochs": Key("int", *_at_least(1)),
    "train.script": Key("str", "a path to the training script", dests=("script",), commands=("worker", "local")),
    "train.args": Key("list", "a list of the script's own arguments", dests=("script_args",),
                      commands=("worker", "local")),
    "optimizer.name": Key("str", *_choice(*sorted(OPTIMIZER_DEFAULTS))),
    "compression.codec": Key("str", "a codec name (none, fp16, bf16, int8, topk, sign)"),
    "compression.ratio": Key("float", "in (0, 1]", lambda v: 0 < v <= 1),
    "compression.lz4": Key("bool", "true or false"),
    "compression.pull": Key("str", *_choice("none", "fp16", "bf16"), dests=("pull_codec",),
                            commands=("worker", "local")),
    "cluster.ps": Key("int", *_at_least(1), dests=("ps", "num_shards"), env="SHOAL_NUM_SHARDS"),
    "cluster.workers": Key("int", *_at_least(1), dests=("workers",), commands=("local",)),
    "cluster.replicas": Key("int", "1 or 2", lambda v: v in (1, 2), dests=("replicas",)),
    "cluster.lease_seconds": Key("float", *_GT0, dests=("lease_seconds",)),
    "cluster.chief": Key("str", *_ADDR, dests=("chief",), commands=("ps", "worker", "status")),
    "cluster.transport": Key("str", *_choice("tcp", "grpc"), dests=("transport",), commands=("worker", "local")),
    "cluster.port": Key("int", *_PORT),         # the chief's port in generated deployments (default 7070)
    "checkpointing.dir": Key("str", "a directory path", dests=("checkpoint_dir",)),
    "checkpointing.interval": Key("interval", "a number of updates (500) or a time (30s, 5m, 1h) above zero",
                                  _interval_ok, dests=("checkpoint_interval",)),
    "checkpointing.keep": Key("int", *_at_least(1), dests=("keep_checkpoints",)),
    "checkpointing.storage": Key("str", "a size like 10Gi (the deployments' volume)",
                                 lambda v: bool(_QUANTITY.match(v))),
    "recovery": Key("str", *_choice(*RECOVERY), dests=("recovery",)),
    "autoscaling.min_workers": Key("int", *_at_least(1)),
    "autoscaling.max_workers": Key("int", *_at_least(1)),
    "autoscaling.target": Key("str", *_choice("queue", "step_rate")),
    "autoscaling.tasks_per_worker": Key("float", *_GT0),
    "autoscaling.step_rate": Key("float", *_GT0),
    "autoscaling.cooldown": Key("duration", "a time like 30s or 2m", lambda v: v >= 0),
    "autoscaling.scale_out_after": Key("duration", "a time like 5s or 1m", lambda v: v >= 0),
    "straggler_detection.factor": Key("float", "> 1", lambda v: v > 1),
    "straggler_detection.action": Key("str", *_choice("flag", "backup", "evict")),
    # read by every role itself (cli/observe.py: flags and SHOAL_* variables win over them)
    "logging.tensorboard": Key("str", "a directory path"),
    "alerts.loss_spike": Key("float", "above 1 (a factor; 0: off)", lambda v: v == 0 or v > 1),
    "alerts.grad_spike": Key("float", "above 1 (a factor; 0: off)", lambda v: v == 0 or v > 1),
    "alerts.window": Key("int", *_at_least(3)),
    "alerts.warmup": Key("int", *_at_least(0)),
    "alerts.deviations": Key("float", *_at_least(0)),
    "name": Key("str", "a DNS label: lower-case letters, digits and '-', at most 40 characters",
                lambda v: bool(re.match(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$", v))),
    "image": Key("str", "a container image reference like shoal:latest", lambda v: bool(_IMAGE.match(v))),
    "log_level": Key("str", *_choice("debug", "info", "warning", "error")),
    "chief.bind": Key("str", *_ADDR, dests=("bind",), commands=("chief",)),
    "chief.journal": Key("str", "a file path", dests=("journal",), commands=("chief",)),
    "chief.end_drain": Key("duration", "a time like 30s or 2m", lambda v: v >= 0, dests=("end_drain",),
                           commands=("chief",)),
    "ps.bind": Key("str", *_ADDR, dests=("bind",), commands=("ps",)),
    "ps.advertise": Key("str", "a host name", dests=("advertise",), commands=("ps",)),
    "ps.data_port": Key("int", *_PORT, dests=("data_port",), commands=("ps",)),
    "ps.data_channel": Key("bool", "true or false"),
    "local.summary": Key("str", "a file path", dests=("summary",), commands=("local",)),
    "local.run_dir": Key("str", "a directory path", dests=("run_dir",), commands=("local",)),
    "local.restart": Key("bool", "true or false"),
    "local.restart_backoff": Key("float", *_at_least(0), dests=("restart_backoff",), commands=("local",)),
    "local.drain_seconds": Key("float", *_at_least(0), dests=("drain_seconds",), commands=("local",)),
}
# free-form sections: optimizer hyper-parameters (checked by OptimizerSpec), resources (Kubernetes quantities)
_OPEN_SECTIONS = ("optimizer", "resources")
_LEGACY_FLAT = {"mode": "train.mode", "backup_workers": "train.backup_workers", "staleness": "train.staleness",
                "lease_seconds": "cluster.lease_seconds", "replicas": "cluster.replicas", "num_shards": "cluster.ps"}
_SECTIONS = sorted({k.split(".")[0] for k in KEYS} | set(_OPEN_SECTIONS))


_KIND_WORDS = {"int": "an integer", "float": "a number", "duration": ""}


def _coerce(path: str, key: Key, value: Any, source: str) -> Any:
    """The value as ``key.kind``, or InvalidArgument naming ``path``, the value and what is allowed."""
    def bad(reason: str = "") -> InvalidArgument:
        what = f"{_KIND_WORDS.get(key.kind, '')} {key.allowed}".strip()
        where = f"{source}{path})" if source.startswith("$") else f"{source}{path}"
        return InvalidArgument(f"{where}: {value!r} is {reason or 'not allowed'}; allowed: {what}")

    out: Any = value
    if key.kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad("not an integer")
        try:
            out = int(value)
        except ValueError:
            raise bad("not an integer") from None
    elif key.kind in ("float", "duration"):
        if key.kind == "duration" and isinstance(value, str) and _duration(value) is not None:
            out = _duration(value)
        elif isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise bad("not a number")
        else:
            try:
                out = float(value)
            except ValueError:
                raise bad("not a number") from None
            if not math.isfinite(out):
                raise bad("not finite")
    elif key.kind == "bool":
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            out = value.lower() in ("1", "true", "yes", "on")
        elif not isinstance(value, bool):
            raise bad("not true or false")
    elif key.kind == "list":
        if isinstance(value, str):
            out = value.split()
        elif not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise bad("not a list of strings")
        out = [str(v) for v in out]
    elif key.kind == "interval":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad("not a number of updates or a time")
        out = str(value).strip()
    elif not isinstance(value, str):
        raise bad(f"not a string but a {type(value).__name__}")
    if key.check is not None and not key.check(out):
        raise bad()
    return out


def _flatten(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``{"train": {"mode": "sync"}}`` -> ``{"train.mode": "sync"}``; unknown keys are errors."""
    flat: dict[str, Any] = {}
    for raw_name, value in data.items():
        name = str(raw_name).replace("-", "_")
        if name in _LEGACY_FLAT:
            flat[_LEGACY_FLAT[name]] = value
        elif name in KEYS:
            flat[name] = value
        elif name in _SECTIONS:
            if not isinstance(value, dict):
                raise InvalidArgument(f"{source}{name}: {value!r} is a {type(value).__name__}; allowed: a mapping "
                                      f"of {', '.join(_known_in(name))}")
            for sub_raw, sub_value in value.items():
                sub = f"{name}.{str(sub_raw).replace('-', '_')}"
                if sub not in KEYS and name not in _OPEN_SECTIONS:
                    raise InvalidArgument(f"{source}{sub}: unknown setting; {name} has {', '.join(_known_in(name))}")
                flat[sub] = sub_value
        else:
            raise InvalidArgument(f"{source}{name}: unknown setting; known sections: {', '.join(_SECTIONS)}")
    return flat


def _known_in(section: str) -> list[str]:
    return [k.split(".", 1)[1] for k in KEYS if k.startswith(section + ".")]


@dataclass(frozen=True)
class JobFile:
    """A validated job file: ``values`` maps key paths (``checkpointing.interval``) to checked values."""

    values: Mapping[str, Any]
    optimizer: OptimizerSpec | None = None
    resources: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    path: str = ""

    def get(self, path: str, default: Any = None) -> Any:
        return self.values.get(path, default)

    def section(self, name: str) -> dict[str, Any]:
        return {k.split(".", 1)[1]: v for k, v in self.values.items() if k.startswith(name + ".")}

    @property
    def compression(self) -> str | None:
        """The worker's ``--compression`` tag (``topk+lz4:0.01``), or None when the file names no codec."""
        codec = self.get("compression.codec")
        if codec is None:
            return None
        tag = codec + ("+lz4" if self.get("compression.lz4") else "")
        ratio = self.get("compression.ratio")
        return f"{tag}:{ratio:g}" if ratio is not None else tag

    def defaults_for(self, command: str, dests: Mapping[str, Any]) -> dict[str, Any]:
        """What the file sets for ``command``'s flags (argparse dests present in ``dests``)."""
        out: dict[str, Any] = {}
        for path, value in self.values.items():
            key = KEYS.get(path)
            if key is None or (key.commands and command not in key.commands):
                continue
            for dest in key.dests:
                if dest in dests:
                    out[dest] = value
        if "compression" in dests and self.compression is not None and "SHOAL_COMPRESSION" not in os.environ:
            out["compression"] = self.compression
        if "no_data_channel" in dests and self.get("ps.data_channel") is False:
            out["no_data_channel"] = True
        if "no_restart" in dests and self.get("local.restart") is False:
            out["no_restart"] = True
        return out

    def to_dict(self) -> dict[str, Any]:
        """The nested form, as ``shoal config --print`` shows it (optimizer with every hyper-parameter)."""
        nested: dict[str, Any] = {}
        for path, value in self.values.items():
            head, _, tail = path.partition(".")
            if tail:
                nested.setdefault(head, {})[tail] = value
            else:
                nested[head] = value
        if self.optimizer is not None:
            nested["optimizer"] = {"name": self.optimizer.name, **dict(self.optimizer.hparams)}
        if self.resources:
            nested["resources"] = copy.deepcopy({k: dict(v) for k, v in self.resources.items()})
        return nested


def parse_job(data: Any, *, source: str = "", env: Mapping[str, str] | None = None,
              path: str = "") -> JobFile:
    """Validates a job document (a mapping); ``env`` (``SHOAL_*`` variables) overrides what it sets."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source or 'job file: '}must be a mapping of sections (train, cluster, ...), "
                              f"got a {type(data).__name__}")
    flat = _flatten(data, source)
    hparams = {k.split(".", 1)[1]: flat.pop(k) for k in list(flat)
               if k.startswith("optimizer.") and k != "optimizer.name"}
    resources = _resources({k.split(".", 1)[1]: flat.pop(k) for k in list(flat) if k.startswith("resources.")},
                           source)
    from_env: dict[str, str] = {}         # key path -> the SHOAL_* variable that set it: blamed, not the file
    for path_, key in KEYS.items():
        name = key.env_name()
        if env is not None and name and env.get(name) is not None:
            flat[path_] = env[name]
            from_env[path_] = name
    values = {p: _coerce(p, KEYS[p], v, f"${from_env[p]} (overriding the job file's " if p in from_env else source)
              for p, v in flat.items()}
    _check_together(values, source)
    optimizer = None
    if "optimizer.name" in values or hparams:
        name = values.pop("optimizer.name", "sgd")
        for hp in hparams:
            if hp not in OPTIMIZER_DEFAULTS[name]:
                raise InvalidArgument(f"{source}optimizer.{hp}: unknown setting; {name} has name, "
                                      f"{', '.join(sorted(OPTIMIZER_DEFAULTS[name]))}")
        for hp, value in hparams.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(f"{source}optimizer.{hp}: {value!r} is not a number; allowed: a number")
        try:
            optimizer = OptimizerSpec(name, hparams)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{source}optimizer: {exc}") from None
    return JobFile(values, optimizer, resources, path)


def _check_together(values: Mapping[str, Any], source: str) -> None:
    backups = values.get("train.backup_workers", 0)
    if backups and values.get("train.mode", "sync") != "sync":
        raise InvalidArgument(f"{source}train.backup_workers: {backups} needs train.mode sync, "
                              f"not {values.get('train.mode')!r}")
    low, high = values.get("autoscaling.min_workers"), values.get("autoscaling.max_workers")
    if low is not None and high is not None and low > high:
        raise InvalidArgument(f"{source}autoscaling.min_workers: {low} is above autoscaling.max_workers {high}")
    if values.get("autoscaling.target") == "step_rate" and "autoscaling.step_rate" not in values:
        raise InvalidArgument(f"{source}autoscaling.step_rate: missing; allowed: the job's target steps a second "
                              f"(> 0), needed by target: step_rate")


def _resources(raw: Mapping[str, Any], source: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for kind, amounts in raw.items():
        if kind not in ("requests", "limits"):
            raise InvalidArgument(f"{source}resources.{kind}: unknown setting; resources has requests, limits")
        if not isinstance(amounts, dict):
            raise InvalidArgument(f"{source}resources.{kind}: {amounts!r} is not a mapping; allowed: "
                                  f"resource names to quantities, like cpu: \"2\", memory: 4Gi")
        out[kind] = {}
        for name, qty in amounts.items():
            where = f"{source}resources.{kind}.{name}"
            if not _RESOURCE_NAME.match(str(name)):
                raise InvalidArgument(f"{where}: {name!r} is not a resource name; allowed: cpu, memory, "
                                      f"nvidia.com/gpu, ...")
            if isinstance(qty, bool) or not _QUANTITY.match(str(qty)):
                raise InvalidArgument(f"{where}: {qty!r} is not a quantity; allowed: like 2, 500m, 4Gi")
            out[kind][str(name)] = str(qty)
    for name, qty in out.get("requests", {}).items():
        limit = out.get("limits", {}).get(name)
        if limit is not None and _quantity_value(qty) > _quantity_value(limit):
            raise InvalidArgument(f"{source}resources.requests.{name}: {qty!r} is above its limit {limit!r}")
    return out


_SUFFIX = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}


def _quantity_value(text: str) -> float:
    m = _QUANTITY.match(text)
    assert m is not None
    return float(text[: len(text) - len(m.group(2) or "")]) * _SUFFIX[m.group(2) or ""]


def load_job(path: str | Path, env: Mapping[str, str] | None = None) -> JobFile:
    """Reads and validates the job file at ``path``; ``env`` defaults to ``os.environ``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidArgument(f"cannot read job file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise InvalidArgument(f"job file {path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    return parse_job(data, source=f"{path}: ", env=os.environ if env is None else env, path=str(path))


def job_from_env() -> JobFile | None:
    """The job file a launcher named in ``$SHOAL_JOB_FILE`` (what a worker's Trainer reads), or None."""
    path = os.environ.get(ENV_JOB_FILE)
    return load_job(path) if path else None


def dump(job: JobFile) -> str:
    return yaml.safe_dump(job.to_dict(), sort_keys=False, default_flow_style=False)
