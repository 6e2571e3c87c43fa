"""The observability flags every role shares: ``--tensorboard``, ``--metrics-port``, ``--alert-*``.

A role's own process reads them from its arguments; a worker's training script
reads them from the environment (``$SHOAL_TENSORBOARD``, ``$SHOAL_METRICS_PORT``,
``$SHOAL_ALERT_<NAME>``), which ``shoal worker`` and ``shoal local`` set. The job
file may carry them too::

    logging:
      tensorboard: runs/tb
    alerts:
      loss_spike: 3       # a loss above 3x its running median
      grad_spike: 10      # a gradient norm above 10x its running median
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from shoal.observe.alerts import AlertConfig
from shoal.settings.config import from_sources, load_yaml
from shoal.errors import InvalidArgument


def add_args(p: argparse.ArgumentParser, tensorboard: bool = True, alerts: bool = False) -> None:
    if tensorboard:
        p.add_argument("--tensorboard", default=None, metavar="DIR",
                       help="write TensorBoard event files under DIR, one run per role "
                            "(view with: tensorboard --logdir DIR)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0: any free port, logged)")
    if alerts:
        p.add_argument("--alert-loss-spike", type=float, default=None, metavar="X",
                       help="alert when the loss exceeds X times its running median (default 3; 0: off)")
        p.add_argument("--alert-grad-spike", type=float, default=None, metavar="X",
                       help="alert when the gradient norm exceeds X times its running median (default 10; 0: off)")


def _sections(args: argparse.Namespace) -> tuple[dict, dict]:
    path = getattr(args, "config", None)
    data = load_yaml(path) if path else {}
    out = []
    for key in ("logging", "alerts"):
        section = data.get(key) or {}
        if not isinstance(section, dict):
            raise InvalidArgument(f"config {path}: {key!r} must be a mapping, got {type(section).__name__}")
        out.append({str(k).replace("-", "_"): v for k, v in section.items()})
    return out[0], out[1]


def tensorboard_dir(args: argparse.Namespace) -> str:
    """``--tensorboard``, else ``$SHOAL_TENSORBOARD``, else the job file's ``logging.tensorboard``; "" when none."""
    if getattr(args, "tensorboard", None):
        return args.tensorboard
    if os.environ.get("SHOAL_TENSORBOARD"):
        return os.environ["SHOAL_TENSORBOARD"]
    logging_section, _ = _sections(args)
    unknown = set(logging_section) - {"tensorboard"}
    if unknown:
        raise InvalidArgument(f"unknown setting(s) {', '.join(sorted(unknown))} under logging; known: tensorboard")
    return str(logging_section.get("tensorboard") or "")


def metrics_port(args: argparse.Namespace) -> int | None:
    from shoal.observe.metrics import from_env_or

    port = from_env_or(getattr(args, "metrics_port", None))
    if port is not None and not 0 <= port <= 65535:
        raise InvalidArgument(f"--metrics-port must be a port number (0: any free one), got {port}")
    return port


def alert_config(args: argparse.Namespace) -> AlertConfig:
    _, section = _sections(args)
    return from_sources(AlertConfig, yaml_values=section, env_prefix="SHOAL_ALERT_",
                        cli={"loss_spike": getattr(args, "alert_loss_spike", None),
                             "grad_spike": getattr(args, "alert_grad_spike", None)})


def alert_env(cfg: AlertConfig) -> dict[str, str]:
    """The environment that hands ``cfg`` to a worker's training script."""
    return {f"SHOAL_ALERT_{f.name.upper()}": str(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def worker_env(args: argparse.Namespace) -> dict[str, Any]:
    """What ``shoal worker`` puts in the script's environment."""
    env = alert_env(alert_config(args))
    tb = tensorboard_dir(args)
    if tb:
        env["SHOAL_TENSORBOARD"] = tb
    port = metrics_port(args)
    if port is not None:
        env["SHOAL_METRICS_PORT"] = str(port)
    return env


def run_name(mode: str, now: float | None = None) -> str:
    """The folder one ``shoal local`` run writes its TensorBoard runs into: ``<mode>-<UTC time>``."""
    import time

    return f"{mode}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}"


def local_role_flags(cfg, role: str, index: int) -> list[str]:
    """Extra flags ``shoal local`` gives one role (``chief``, ``ps``): its metrics port and TensorBoard dir."""
    out: list[str] = []
    if role == "chief" and cfg.tensorboard:
        out += ["--tensorboard", cfg.tensorboard]
    port = _local_port(cfg, role, index)
    if port is not None:
        out += ["--metrics-port", str(port)]
    return out


def local_worker_env(cfg, index: int, run_dir) -> dict[str, str]:
    env = alert_env(cfg.alerts)
    if cfg.tensorboard:
        env["SHOAL_TENSORBOARD"] = cfg.tensorboard
    port = _local_port(cfg, "worker", index)
    if port is not None:
        env["SHOAL_METRICS_PORT"] = str(port)
    return env


def _local_port(cfg, role: str, index: int) -> int | None:
    """``--metrics-port 0``: every role any free port; ``N``: the chief N, ps k N+1+k, worker k N+1+ps+k."""
    base = cfg.metrics_port
    if base is None or base == 0:
        return base
    return base + {"chief": 0, "ps": 1 + index, "worker": 1 + cfg.num_ps + index}[role]
