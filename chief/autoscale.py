"""How many workers the job wants: pure state, driven by the chief's ticker with (now, load).

Targets:

- ``queue``: enough workers that each has about ``tasks_per_worker`` of the data tasks not yet done
  (queued plus held), so a long queue scales out and a draining one scales in.
- ``step_rate``: enough workers to reach ``step_rate`` steps a second for the whole job, at the rate
  one worker managed over the last window.

Bounded by ``min_workers``/``max_workers``. Hysteresis: a higher count is taken at once (work is
waiting), a lower one only after it has been asked for without a break for ``cooldown_s`` (a worker
started costs its start-up; flapping costs it twice). The published count is what a Kubernetes
HorizontalPodAutoscaler (custom metric ``shoal_autoscale_desired_workers``) or ``shoal local
--autoscale`` follows.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

from shoal.errors import InvalidArgument

TARGETS = ("queue", "step_rate")
DESIRED_WORKERS = "autoscale_desired_workers"      # in JobStats.metrics and `shoal status`
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class AutoscalePolicy:
    min_workers: int = 1
    max_workers: int = 4
    target: str = "queue"
    tasks_per_worker: float = 4.0
    step_rate: float = 0.0            # steps a second for the whole job (target step_rate)
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise InvalidArgument(f"autoscaling.min_workers must be >= 1, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            raise InvalidArgument(f"autoscaling.max_workers {self.max_workers} is below min_workers "
                                  f"{self.min_workers}")
        if self.target not in TARGETS:
            raise InvalidArgument(f"autoscaling.target {self.target!r} is not one of {', '.join(TARGETS)}")
        if not self.tasks_per_worker > 0:
            raise InvalidArgument(f"autoscaling.tasks_per_worker must be > 0, got {self.tasks_per_worker}")
        if self.target == "step_rate" and not self.step_rate > 0:
            raise InvalidArgument(f"autoscaling.step_rate must be > 0 with target step_rate, got {self.step_rate}")
        if self.cooldown_s < 0:
            raise InvalidArgument(f"autoscaling.cooldown must be >= 0, got {self.cooldown_s}")

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> "AutoscalePolicy":
        """From a job file's validated ``autoscaling`` section (``cooldown`` in seconds)."""
        values = dict(section)
        if "cooldown" in values:
            values["cooldown_s"] = values.pop("cooldown")
        return cls(**values)


class Autoscaler:
    """``observe(now, pending_tasks, workers, steps)`` -> the desired worker count (also ``desired``)."""

    def __init__(self, policy: AutoscalePolicy):
        self.policy = policy
        self.desired = policy.min_workers
        self._lower_since: float | None = None
        self._steps: deque[tuple[float, int, int]] = deque()     # (now, total steps, workers)

    def wanted(self, now: float, pending_tasks: int, workers: int, steps: int) -> int:
        """What the load asks for right now, before hysteresis, within the bounds."""
        p = self.policy
        if p.target == "queue":
            raw = math.ceil(pending_tasks / p.tasks_per_worker)
        else:
            raw = self._for_rate(now, workers, steps)
        return max(p.min_workers, min(p.max_workers, raw))

    def _for_rate(self, now: float, workers: int, steps: int) -> int:
        self._steps.append((now, steps, workers))
        while self._steps and now - self._steps[0][0] > RATE_WINDOW_S:
            self._steps.popleft()
        t0, s0, _ = self._steps[0]
        samples = list(self._steps)
        # worker-seconds in the window: each interval's length times the workers at its end
        worker_s = sum((t - tp) * w for (tp, _, _), (t, _, w) in zip(samples, samples[1:]))
        if now - t0 < 1.0 or steps <= s0 or worker_s <= 0:
            return self.desired              # not measured yet: keep what we have
        per_worker = (steps - s0) / worker_s
        return math.ceil(self.policy.step_rate / per_worker)

    def observe(self, now: float, pending_tasks: int, workers: int, steps: int) -> int:
        want = self.wanted(now, pending_tasks, workers, steps)
        if want >= self.desired:
            self._lower_since = None
            self.desired = want
        elif self._lower_since is None:
            self._lower_since = now
        elif now - self._lower_since >= self.policy.cooldown_s:
            self.desired = want
            self._lower_since = None
        return self.desired
