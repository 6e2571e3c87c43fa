"""Row optimizers: the update a table applies to the rows a batch touched.

Each one is a small registered object (name, defaults, per-row state names and
initial values, the step) working on the touched rows only, vectorised in numpy
float32, with PyTorch's semantics where PyTorch has the optimizer:

- ``sgd``: ``torch.optim.SGD`` (no momentum, no weight decay) on a sparse
  gradient: ``row -= lr * g``. Hyper: ``lr`` (default 0.01).
- ``adagrad``: ``torch.optim.Adagrad`` with a sparse gradient: ``sum += g*g``;
  ``row -= clr * g / (sqrt(sum) + eps)`` with ``clr = lr / (1 + (t - 1) * lr_decay)``.
  Hyper: ``lr`` 0.01, ``lr_decay`` 0, ``eps`` 1e-10, ``initial_accumulator_value`` 0.
- ``adam``: ``torch.optim.SparseAdam``: the moments of the touched rows only
  (lazy), bias correction from the table partition's global step count ``t``.
  Hyper: ``lr`` 0.001, ``beta1`` 0.9, ``beta2`` 0.999, ``eps`` 1e-8.
- ``ftrl``: FTRL-proximal, per coordinate (McMahan et al. 2013, Algorithm 1):
  ``sigma = (sqrt(n + g*g) - sqrt(n)) / alpha; z += g - sigma * w; n += g*g;
  w = 0 if |z| <= l1 else -(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + l2)``.
  Hyper: ``alpha`` 0.05, ``beta`` 1, ``l1`` 0, ``l2`` 0, ``initial_accumulator_value`` 0.
  As in the paper (and TensorFlow's Ftrl), ``w`` is the row's current value, so a
  row's initial value enters its first update and is then replaced by the
  closed form; use ``init_std=0`` for the paper's ``w = 0`` start.

``t`` is the number of updates the table partition has applied, this one
included (one per :meth:`RowTable.apply`, an empty one too): with one apply per
training step it is PyTorch's per-parameter ``step``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from shoal.errors import InvalidArgument

StepFn = Callable[[np.ndarray, dict, np.ndarray, Mapping[str, float], int], None]


@dataclass(frozen=True)
class RowOptimizer:
    """One row optimizer. ``step(rows, state, grads, hyper, t)`` updates gathered copies in place."""

    name: str
    defaults: Mapping[str, float]
    state: tuple[str, ...]                        # per-row arrays of shape (dim,), fp32, kept in the row's slot
    bounds: Mapping[str, tuple[float, float, bool]]  # key -> (low, high, low_inclusive); high exclusive if < inf
    initial: Callable[[str, Mapping[str, float]], float]
    step: StepFn

    def check_hyper(self, hyper: dict, table: str = "?") -> dict[str, float]:
        unknown = sorted(set(hyper) - set(self.defaults))
        if unknown:
            raise InvalidArgument(f"table {table!r}: unknown {self.name} hyper-parameter(s) {unknown}; "
                                  f"known: {sorted(self.defaults)}")
        out: dict[str, float] = {}
        for k, v in hyper.items():
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise InvalidArgument(f"table {table!r}: {self.name} {k} must be a number, got {v!r}")
            v = float(v)
            lo, hi, lo_incl = self.bounds[k]
            ok = math.isfinite(v) and (v >= lo if lo_incl else v > lo) and (v < hi or hi == math.inf)
            if not ok:
                rng = f"{'[' if lo_incl else '('}{lo}, {hi})"
                raise InvalidArgument(f"table {table!r}: {self.name} {k} must be finite in {rng}, got {v!r}")
            out[k] = v
        return out


_F = np.float32
_NONNEG = (0.0, math.inf, True)
_POS = (0.0, math.inf, False)
_UNIT = (0.0, 1.0, True)


def _sgd(rows, state, g, h, t):
    rows += _F(-h["lr"]) * g


def _adagrad(rows, state, g, h, t):
    clr = h["lr"] / (1 + (t - 1) * h["lr_decay"])
    acc = state["sum"]
    acc += g * g
    std = np.sqrt(acc)
    std += _F(h["eps"])
    rows += _F(-clr) * (g / std)


def _adam(rows, state, g, h, t):
    b1, b2 = h["beta1"], h["beta2"]
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m_upd = (g - m) * _F(1 - b1)
    v_upd = (g * g - v) * _F(1 - b2)
    m += m_upd                      # torch: exp_avg.add_(update); numer = update + old == new exp_avg
    v += v_upd
    denom = np.sqrt(v)
    denom += _F(h["eps"])
    step_size = h["lr"] * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    rows += _F(-step_size) * (m / denom)


def _ftrl(rows, state, g, h, t):
    alpha, beta, l1, l2 = _F(h["alpha"]), _F(h["beta"]), _F(h["l1"]), _F(h["l2"])
    z, n = state["z"], state["n"]
    n_new = n + g * g
    sqrt_new = np.sqrt(n_new)
    sigma = (sqrt_new - np.sqrt(n)) / alpha
    z += g - sigma * rows
    n[...] = n_new
    shrunk = z - np.sign(z) * l1
    w = -shrunk / ((beta + sqrt_new) / alpha + l2)
    rows[...] = np.where(np.abs(z) <= l1, _F(0.0), w)


ROW_OPTIMIZERS: dict[str, RowOptimizer] = {}


def register_row_optimizer(opt: RowOptimizer) -> RowOptimizer:
    """Add a row optimizer to the registry (a name taken twice is an error)."""
    if opt.name in ROW_OPTIMIZERS:
        raise InvalidArgument(f"row optimizer {opt.name!r} is already registered")
    ROW_OPTIMIZERS[opt.name] = opt
    return opt


def row_optimizer(name: str) -> RowOptimizer:
    """The registered row optimizer ``name``; an unknown name lists the known ones."""
    try:
        return ROW_OPTIMIZERS[name]
    except (KeyError, TypeError):
        raise InvalidArgument(f"unknown row optimizer {name!r}; known: {sorted(ROW_OPTIMIZERS)}") from None


register_row_optimizer(RowOptimizer(
    "sgd", {"lr": 0.01}, (), {"lr": _NONNEG}, lambda s, h: 0.0, _sgd))
register_row_optimizer(RowOptimizer(
    "adagrad", {"lr": 0.01, "lr_decay": 0.0, "eps": 1e-10, "initial_accumulator_value": 0.0}, ("sum",),
    {"lr": _NONNEG, "lr_decay": _NONNEG, "eps": _NONNEG, "initial_accumulator_value": _NONNEG},
    lambda s, h: h["initial_accumulator_value"], _adagrad))
register_row_optimizer(RowOptimizer(
    "adam", {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}, ("exp_avg", "exp_avg_sq"),
    {"lr": _NONNEG, "beta1": _UNIT, "beta2": _UNIT, "eps": _POS}, lambda s, h: 0.0, _adam))
register_row_optimizer(RowOptimizer(
    "ftrl", {"alpha": 0.05, "beta": 1.0, "l1": 0.0, "l2": 0.0, "initial_accumulator_value": 0.0}, ("z", "n"),
    {"alpha": _POS, "beta": _NONNEG, "l1": _NONNEG, "l2": _NONNEG, "initial_accumulator_value": _NONNEG},
    lambda s, h: h["initial_accumulator_value"] if s == "n" else 0.0, _ftrl))
