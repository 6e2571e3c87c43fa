"""Alerts on a training run: pure detectors, fed one observation at a time, that say when to alert.

- ``loss_spike``: a loss above ``loss_spike`` times the running median of the recent losses and
  more than ``deviations`` robust standard deviations (1.4826 x the median absolute deviation)
  above it, so the batch-to-batch noise of a small loss is not a spike;
- ``nonfinite_loss``: a NaN or infinite loss;
- ``grad_spike``: the same for the gradient norm, with ``grad_spike``;
- ``worker_behind``: a worker the chief flags as a straggler (step time above twice the median);
- ``pushes_refused``: a shard refusing a worker's pushes that hold NaN/Inf (the chief's
  ``RefusedPushes``, from the servers' counts);
- ``worker_lost``: a worker dropped without leaving (its lease ran out, its process died: the chief's
  watcher, chief/telemetry.py).

Each is reported once per occurrence: an alert fires on the first anomalous step and
re-arms when a step is normal again, so a loss that stays high is one alert, not one
per step. Nothing here logs, sleeps or touches a socket: the worker's telemetry thread
and the chief's watcher feed them and act on what they return.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from shoal.errors import InvalidArgument

KINDS = ("loss_spike", "nonfinite_loss", "grad_spike", "worker_behind", "pushes_refused", "worker_lost")


@dataclass(frozen=True)
class AlertConfig:
    """Thresholds (the job file's ``alerts:`` section, ``$SHOAL_ALERT_<NAME>``, ``--alert-<name>``).

    ``loss_spike`` and ``grad_spike`` are factors over the running median of the last
    ``window`` steps (0 turns a check off); a spike must also lie ``deviations`` robust
    standard deviations above that median; no alert before ``warmup`` steps were seen.
    """

    loss_spike: float = 3.0
    grad_spike: float = 10.0
    window: int = 100
    warmup: int = 20
    deviations: float = 6.0

    def __post_init__(self) -> None:
        for name in ("loss_spike", "grad_spike"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value) or (value != 0 and value <= 1):
                raise InvalidArgument(f"alert threshold {name} must be a factor above 1 (0: off), got {value!r}")
        for name in ("window", "warmup"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"alert {name} must be a whole number of steps, got {getattr(self, name)!r}")
        if not isinstance(self.deviations, (int, float)) or not self.deviations >= 0:
            raise InvalidArgument(f"alert deviations must be >= 0, got {self.deviations!r}")
        if self.window < 3:
            raise InvalidArgument(f"alert window must be >= 3 steps, got {self.window}")
        if self.warmup < 0:
            raise InvalidArgument(f"alert warmup must be >= 0 steps, got {self.warmup}")


@dataclass(frozen=True)
class Alert:
    kind: str
    member: str
    step: int
    value: float
    threshold: float = 0.0       # the value it went above (0 for non-finite and behind)

    def message(self) -> str:
        what = {"loss_spike": "loss jumped to", "nonfinite_loss": "loss is", "grad_spike": "gradient norm jumped to",
                "worker_behind": "is behind: step time",
                "pushes_refused": "pushes refused for NaN/Inf:", "worker_lost": "lost: dropped without leaving,"}[self.kind]
        limit = f" (limit {self.threshold:.4g})" if self.threshold else ""
        return f"{self.member} step {self.step}: {what} {self.value:.4g}{limit}"


class SpikeDetector:
    """One series (loss, gradient norm): alerts when a value exceeds ``factor`` x the running median."""

    def __init__(self, kind: str, factor: float, window: int, warmup: int, deviations: float = 0.0):
        self.kind, self.factor, self.warmup, self.deviations = kind, factor, warmup, deviations
        self._recent: deque[float] = deque(maxlen=window)
        self._seen = 0
        self._firing = False

    def observe(self, member: str, step: int, value: float) -> Alert | None:
        if not self.factor or value is None:
            return None
        if not math.isfinite(value):
            return None              # the non-finite check owns these
        self._seen += 1
        limit = self._limit()
        anomalous = self._seen > self.warmup and len(self._recent) >= 3 and value > limit
        if not anomalous:
            self._recent.append(value)    # a spike stays out of the median it is judged against
        fire = anomalous and not self._firing
        self._firing = anomalous
        return Alert(self.kind, member, step, value, limit) if fire else None


    def _limit(self) -> float:
        if len(self._recent) < 3:
            return math.inf
        median = statistics.median(self._recent)
        mad = statistics.median(abs(v - median) for v in self._recent)
        return max(self.factor * median, median + self.deviations * 1.4826 * mad)


class TrainingAlerts:
    """A worker's detectors: loss spike, non-finite loss, gradient-norm spike."""

    def __init__(self, cfg: AlertConfig | None = None):
        cfg = cfg or AlertConfig()
        self.cfg = cfg
        self.loss = SpikeDetector("loss_spike", cfg.loss_spike, cfg.window, cfg.warmup, cfg.deviations)
        self.grad = SpikeDetector("grad_spike", cfg.grad_spike, cfg.window, cfg.warmup, cfg.deviations)
        self._nonfinite = False

    def observe(self, member: str, step: int, loss: float | None = None,
                grad_norm: float | None = None) -> list[Alert]:
        out: list[Alert] = []
        if loss is not None:
            bad = not math.isfinite(loss)
            if bad and not self._nonfinite:
                out.append(Alert("nonfinite_loss", member, step, loss))
            self._nonfinite = bad
            alert = self.loss.observe(member, step, loss)
            if alert:
                out.append(alert)
        if grad_norm is not None:
            alert = self.grad.observe(member, step, grad_norm)
            if alert:
                out.append(alert)
        return out


class BehindDetector:
    """Workers the chief flags as stragglers: one alert when a worker becomes one, again only after it recovered."""

    def __init__(self) -> None:
        self._behind: set[str] = set()

    def observe(self, flags: dict[str, tuple[bool, int, float]]) -> list[Alert]:
        """``flags``: member -> (straggler, steps, step seconds) for every live worker."""
        out = []
        for member, (behind, steps, step_s) in sorted(flags.items()):
            if behind and member not in self._behind:
                out.append(Alert("worker_behind", member, steps, step_s))
        self._behind = {m for m, (behind, _, _) in flags.items() if behind}
        return out


def metric_key(alert: Alert) -> str:
    """The chief's job-metrics key that carries an alert to ``shoal status`` and the run summary."""
    return f"alert/{alert.kind}/{alert.member}"


def count_key(alert: Alert) -> str:
    """The job-metrics key that carries how many alerts of this kind the member raised (lines it printed)."""
    return f"alert_count/{alert.kind}/{alert.member}"


def count_lines(job_metrics: dict) -> int:
    """How many alert lines the job's members printed: the sum of their counts (one ``alert/`` key per
    member and kind when a member reports no count)."""
    counted = {k.split("/", 1)[1] for k in job_metrics if k.startswith("alert_count/")}
    return int(sum(v for k, v in job_metrics.items() if k.startswith("alert_count/"))
               + sum(1 for k in job_metrics if k.startswith("alert/") and k.split("/", 1)[1] not in counted))
