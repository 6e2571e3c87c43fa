"""The update guard: what a shard checks in a push before it may touch the model (pure, no locks).

A push is judged in the same pass as its apply (:meth:`shoal.ps.shard.Shard.push`), by three checks,
each one line of reason when it refuses:

- **Hyper-parameters** (:class:`HparamBounds`): what a push may carry (an LR scheduler's values) is
  bounded by the job's optimizer as the shard was built with it: the learning rate within
  ``lr_factor`` of the configured one (of a one-cycle schedule's ``max_lr``, when the group has one),
  so warm-up and decay stay legal and ``1e30`` does not; momentum and betas in ``[0, 1)``;
  dampening, ``alpha`` and ``rho`` in ``[0, 1]``; ``eps`` > 0; weight decay and any other number
  at most ``lr_factor`` times its configured value.
- **Gradient norm** (:class:`NormGuard`): a push whose L2 norm is beyond ``norm_factor`` times the
  median of the last :data:`NORM_WINDOW` accepted norms is refused (or, with ``norm_policy clip``,
  scaled down to that bound). The median is robust: a few huge pushes do not move it. Until
  ``norm_warmup`` pushes were accepted there is no median to trust and only a norm that overflows
  fp32 (beyond 1.8e19) is refused.
- **Non-finite state** (:mod:`shoal.ps.shard` with :meth:`shoal.state.optim.ShardOptimizer.save`): an apply
  that would leave any weight or optimizer state NaN/Inf is rolled back; the shard is left bit for bit
  as before, on the primary and, taking the same update, on its backup.

:class:`Refusals` counts what the guard refused per worker and expels a worker that keeps sending such
pushes: after ``expel_after`` in a row, every later push of that worker fails (PermissionDenied).
Wrong but plausible gradients (a flipped sign, a poisoned batch within the norm bound) get through: see
``docs/update-safety.md`` for where robust aggregation would go.
"""
from __future__ import annotations

import bisect
import collections
import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from shoal.ps.sparse import SparseGrad

NORM_WINDOW = 256          # accepted norms the running median is taken over
FP32_MAX = 3.4028234663852886e38

UNIT_OPEN = ("momentum", "betas")           # [0, 1)
UNIT_CLOSED = ("dampening", "alpha", "rho")  # [0, 1]
LR_CEILINGS = ("lr", "max_lr")               # a group's lr may reach lr_factor times the larger one


def grad_norm(grad: torch.Tensor | SparseGrad) -> float:
    """The L2 norm of a gradient (fp32; ``inf`` when it overflows, i.e. beyond about 1.8e19)."""
    values = grad.values if isinstance(grad, SparseGrad) else grad
    if values.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(values))


def scaled(grad: torch.Tensor | SparseGrad, factor: float, owned: bool) -> torch.Tensor | SparseGrad:
    """``grad`` times ``factor`` (in place when the caller owns it)."""
    if isinstance(grad, SparseGrad):
        return SparseGrad(grad.indices, grad.values * factor, grad.numel)
    return grad.mul_(factor) if owned else grad * factor


class HparamBounds:
    """What a push's hyper-parameters may be, from the values the shard's optimizer was built with
    (``configured``: ``{"<group>.<name>[.<i>]": value}``, as :meth:`ShardOptimizer.hparams` gives)."""

    def __init__(self, configured: Mapping[str, float], lr_factor: float):
        self.configured = dict(configured)
        self.lr_factor = lr_factor

    def why_not(self, hparams: Mapping[str, float]) -> str:
        """'' when every value is in bounds, else why the first one is not (one line, quoting it)."""
        for key, value in hparams.items():
            reason = self._check(key, float(value))
            if reason:
                return f"hyper-parameter {key} = {value!r} is out of bounds: {reason}"
        return ""

    def _check(self, key: str, value: float) -> str:
        parts = key.split(".")
        group, name = parts[0], parts[1] if len(parts) > 1 else key
        if not math.isfinite(value) or value < 0:
            return "not a finite number >= 0"
        if not any(k.startswith(f"{group}.") for k in self.configured):
            return ""          # a param group with nothing on this shard: never applied here
        if name == "lr":
            base = max((self.configured.get(f"{group}.{n}", 0.0) for n in LR_CEILINGS), default=0.0)
            top = self.lr_factor * base
            return "" if value <= top else (f"the job's learning rate is {base:g} and a push may carry at most "
                                             f"{self.lr_factor:g}x that ({top:g}; --lr-factor)")
        if name in UNIT_OPEN:
            return "" if value < 1 else "must lie in [0, 1)"
        if name in UNIT_CLOSED:
            return "" if value <= 1 else "must lie in [0, 1]"
        if name == "eps":
            return "" if value > 0 else "must be > 0"
        base = self.configured.get(key)
        if base is None:
            return ""          # a key the optimizer does not have: refused as such (ShardOptimizer.check_hparams)
        top = self.lr_factor * abs(base)
        return "" if value <= top else (f"the job configured {base:g}; a push may carry at most "
                                        f"{self.lr_factor:g}x that ({top:g}; --lr-factor)")


class NormGuard:
    """The running median of accepted gradient norms, and the bound it sets (``factor`` 0: off)."""

    def __init__(self, factor: float, warmup: int, window: int = NORM_WINDOW):
        self.factor = factor
        self.warmup = warmup
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._sorted: list[float] = []

    def bound(self) -> float:
        """The largest norm a push may have now (``inf`` while warming up or off)."""
        if not self.factor or len(self._sorted) < max(self.warmup, 1):
            return math.inf
        return self.factor * self.median()

    def median(self) -> float:
        s = self._sorted
        if not s:
            return 0.0
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])

    def accept(self, norm: float) -> None:
        """A push of this norm (after clipping) was taken: it joins the window."""
        if not math.isfinite(norm):
            return
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(norm)
        bisect.insort(self._sorted, norm)


@dataclass
class Verdict:
    """What the guard says of one push: ``refuse`` (with ``reason``), or take it scaled by ``scale``."""

    refuse: str = ""
    scale: float = 1.0
    norm: float = 0.0


@dataclass
class Refusals:
    """Guard refusals per worker (clipped pushes and rolled-back applies included), their streaks, and
    the workers expelled for them. ``expel_after`` 0: never expel."""

    expel_after: int = 10
    counts: dict[str, int] = field(default_factory=dict)
    streaks: dict[str, int] = field(default_factory=dict)
    expelled: dict[str, str] = field(default_factory=dict)    # worker -> why
    rolled_back: int = 0

    def refused(self, worker: str, reason: str) -> bool:
        """Counts one refusal of ``worker``'s; True when it is the worker's first (alert once)."""
        first = worker not in self.counts
        self.counts[worker] = self.counts.get(worker, 0) + 1
        streak = self.streaks[worker] = self.streaks.get(worker, 0) + 1
        if self.expel_after and streak >= self.expel_after and worker not in self.expelled:
            self.expelled[worker] = f"{streak} refused updates in a row, the last: {reason}"
        return first

    def taken(self, worker: str) -> None:
        self.streaks.pop(worker, None)


class UpdateGuard:
    """The three checks of one shard, with their settings (see the module docstring)."""

    def __init__(self, configured: Mapping[str, float], lr_factor: float = 10.0, norm_factor: float = 10.0,
                 norm_policy: str = "refuse", norm_warmup: int = 20, expel_after: int = 10):
        self.bounds = HparamBounds(configured, lr_factor)
        self.norms = NormGuard(norm_factor, norm_warmup)
        self.norm_policy = norm_policy
        self.refusals = Refusals(expel_after)

    def judge(self, hparams: Mapping[str, float] | None, norm: float) -> Verdict:
        """The verdict on a push with these hyper-parameters and gradient norm (nothing is counted)."""
        why = self.bounds.why_not(hparams) if hparams else ""
        if why:
            return Verdict(why, norm=norm)
        if not norm < FP32_MAX:
            return Verdict(f"its gradient norm overflows fp32 ({norm:g}); no training gradient is that large",
                           norm=norm)
        bound = self.norms.bound()
        if norm <= bound:
            return Verdict(norm=norm)
        over = (f"its gradient norm {norm:.4g} is beyond {self.norms.factor:g}x the median {self.norms.median():.4g} "
                f"of this shard's last accepted pushes (--grad-norm-factor)")
        if self.norm_policy == "clip":
            return Verdict(scale=bound / norm, norm=norm, refuse="") if norm > 0 else Verdict(norm=norm)
        return Verdict(over, norm=norm)

    def clip_reason(self, v: Verdict) -> str:
        return (f"its gradient norm {v.norm:.4g} was clipped to {v.norm * v.scale:.4g} ({self.norms.factor:g}x the "
                f"median of this shard's accepted pushes; --grad-norm-policy clip)")
