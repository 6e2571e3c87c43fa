"""How many workers the job wants: pure state, driven by the chief's ticker with (now, load).

Targets:

- ``queue``: enough workers that each has about ``tasks_per_worker`` of the data tasks not yet done
  (queued plus held), so a long queue scales out and a draining one scales in.
- ``step_rate``: enough workers to reach ``step_rate`` steps a second for the whole job, at the rate
  one worker managed over the last window.

Bounded by ``min_workers``/``max_workers``. No decision before the job has data (the first worker
describes it): the count is not published until then. Hysteresis: the load must ask for more
without a break for ``scale_out_after_s`` before the count rises, and for fewer for ``cooldown_s``
before it falls (a worker started costs its start-up; flapping costs it twice); the count taken is
what the load asks for at that moment. Once every task is done the count falls to ``min_workers``
at once. Each change is a :class:`Decision` with its reason (logged by the chief, kept for ``shoal
status``). The published count is what ``shoal local --autoscale``, or whatever sets the workers'
Job parallelism on Kubernetes, follows (``shoal_autoscale_desired_workers``).
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
    cooldown_s: float = 30.0          # scale in only after the load asked for fewer this long
    scale_out_after_s: float = 5.0    # scale out only after the load asked for more this long

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
        if self.scale_out_after_s < 0:
            raise InvalidArgument(f"autoscaling.scale_out_after must be >= 0, got {self.scale_out_after_s}")

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> "AutoscalePolicy":
        """From a job file's validated ``autoscaling`` section (``cooldown`` in seconds)."""
        values = dict(section)
        if "cooldown" in values:
            values["cooldown_s"] = values.pop("cooldown")
        if "scale_out_after" in values:
            values["scale_out_after_s"] = values.pop("scale_out_after")
        return cls(**values)


@dataclass(frozen=True)
class Decision:
    """One change of the desired count: when (the chief's clock), from what (None: the first), why."""

    at: float
    before: int | None
    after: int
    reason: str

    def line(self) -> str:
        was = "first decision" if self.before is None else f"was {self.before}"
        return f"{self.after} worker(s) wanted ({was}): {self.reason}"


class Autoscaler:
    """``observe(now, pending_tasks, workers, steps, total_tasks, finished)`` -> the desired worker count
    (also ``desired``; None until the job has data). ``decisions``: the latest changes, newest last."""

    KEEP = 20

    def __init__(self, policy: AutoscalePolicy):
        self.policy = policy
        self.desired: int | None = None
        self.decisions: deque[Decision] = deque(maxlen=self.KEEP)
        self.made = 0                     # decisions ever made
        self._asking = 0                  # +1: the load asks for more, -1: for fewer, 0: for what we have
        self._since = 0.0
        self._steps: deque[tuple[float, int, int]] = deque()     # (now, total steps, workers)

    def wanted(self, now: float, pending_tasks: int, workers: int, steps: int) -> tuple[int, str]:
        """What the load asks for right now, before hysteresis, within the bounds, and why."""
        p = self.policy
        if p.target == "queue":
            raw = math.ceil(pending_tasks / p.tasks_per_worker)
            why = f"{pending_tasks} task(s) not done, {p.tasks_per_worker:g} a worker"
        else:
            raw, why = self._for_rate(now, workers, steps)
        return max(p.min_workers, min(p.max_workers, raw)), why

    def _for_rate(self, now: float, workers: int, steps: int) -> tuple[int, str]:
        self._steps.append((now, steps, workers))
        while self._steps and now - self._steps[0][0] > RATE_WINDOW_S:
            self._steps.popleft()
        t0, s0, _ = self._steps[0]
        samples = list(self._steps)
        # worker-seconds in the window: each interval's length times the workers at its end
        worker_s = sum((t - tp) * w for (tp, _, _), (t, _, w) in zip(samples, samples[1:]))
        if now - t0 < 1.0 or steps <= s0 or worker_s <= 0:      # not measured yet: keep what we have
            return (self.desired if self.desired is not None else workers), "step rate not measured yet"
        per_worker = (steps - s0) / worker_s
        return (math.ceil(self.policy.step_rate / per_worker),
                f"{per_worker:.2f} steps/s a worker, {self.policy.step_rate:g} wanted in all")

    def observe(self, now: float, pending_tasks: int, workers: int, steps: int, total_tasks: int = -1,
                finished: bool = False) -> int | None:
        """``total_tasks`` 0: the job has no data yet (no decision); -1: not known (taken as some)."""
        if total_tasks == 0:
            return self.desired
        if finished:
            if self.desired is not None and self.desired != self.policy.min_workers:
                self._decide(now, self.policy.min_workers, "every task is done")
            return self.desired
        want, why = self.wanted(now, pending_tasks, workers, steps)
        if self.desired is None:
            self._decide(now, want, why)
            return self.desired
        asking = (want > self.desired) - (want < self.desired)
        if asking != self._asking:
            self._asking, self._since = asking, now
        if asking:
            hold = self.policy.scale_out_after_s if asking > 0 else self.policy.cooldown_s
            if now - self._since >= hold:
                self._decide(now, want, f"{why}, for {now - self._since:.0f}s")
        return self.desired

    def _decide(self, now: float, want: int, why: str) -> None:
        self.decisions.append(Decision(now, self.desired, want, why))
        self.made += 1
        self.desired, self._asking = want, 0
