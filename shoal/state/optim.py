"""Server-side optimizers over one flat shard: a registered name, or any element-wise ``torch.optim`` class.

Every supported optimizer is element-wise, so applying ``torch.optim`` to a
shard's slice gives exactly what it would give on the whole model. A
:class:`ShardOptimizer` runs one torch optimizer whose param groups are the
user's: each group holds views of the parts of the shard's flat slice that the
group covers (a slice may span several groups, or cover elements no group
owns, e.g. frozen parameters, which are never stepped). Its ``state_dict`` is in
the one-flat-parameter form checkpoints store (``shoal.state.checkpoint_store``),
whatever the groups.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np
import torch

from shoal.settings.config import OptimizerSpec, ParamGroupSpec
from shoal.errors import InvalidArgument

Factory = Callable[[dict[str, float]], tuple[type, dict[str, Any]]]

# A dense step is not saved before it is taken (ShardOptimizer.needs_save) when its inputs are at most this
# large and its growth factor at most SAFE_GROWTH: its results then stay below 1e32
SAFE_MAGNITUDE = 1e12
SAFE_GROWTH = 1e20
MAX_BOUNDED_DECAY = 1e3      # (1 + weight decay) squared keeps Adam's second moment of such inputs below 1e30


def _sgd(h: dict[str, float]) -> tuple[type, dict[str, Any]]:
    return torch.optim.SGD, dict(lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"],
                                 weight_decay=h["weight_decay"], nesterov=bool(h["nesterov"]))


def _adam(h: dict[str, float]) -> tuple[type, dict[str, Any]]:
    return torch.optim.Adam, dict(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                  weight_decay=h["weight_decay"])


def _adamw(h: dict[str, float]) -> tuple[type, dict[str, Any]]:
    return torch.optim.AdamW, dict(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                   weight_decay=h["weight_decay"])


OPTIMIZERS: dict[str, Factory] = {"sgd": _sgd, "adam": _adam, "adamw": _adamw}


def torch_groups(spec: OptimizerSpec, start: int, numel: int) -> tuple[type, list[tuple[int, dict, list]]]:
    """``(class, [(user group index, hyper-parameters, [(a, b) local ranges])])`` for the shard
    covering ``[start, start + numel)`` of the flat model; groups with nothing here are left out."""
    if not spec.torch_class:
        cls, kwargs = OPTIMIZERS[spec.name](dict(spec.hparams))
        stepped = _minus([(0, numel)] if numel else [], local_ranges(spec.buffers, start, numel))
        return cls, [(0, kwargs, stepped)] if stepped else []
    cls = getattr(torch.optim, spec.name)
    out = []
    for gi, group in enumerate(spec.groups):
        local = local_ranges(group.ranges, start, numel)
        if local:
            out.append((gi, dict(group.hparams), local))
    return cls, out


def local_ranges(ranges, start: int, numel: int) -> list[tuple[int, int]]:
    """The parts of global flat ``ranges`` inside ``[start, start + numel)``, shard-local, merged."""
    return _merge(sorted((max(a, start) - start, min(b, start + numel) - start) for a, b in ranges
                         if a < start + numel and b > start))


def _minus(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for a, b in ranges:
        pos = a
        for h0, h1 in holes:
            if h1 <= pos or h0 >= b:
                continue
            if h0 > pos:
                out.append((pos, h0))
            pos = max(pos, h1)
        if pos < b:
            out.append((pos, b))
    return out


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class ShardOptimizer:
    """The user's optimizer over one shard's flat slice ``param`` (which starts at ``start`` in the model)."""

    def __init__(self, param: torch.Tensor, spec: OptimizerSpec, start: int = 0):
        self.spec = spec
        self._flat = param
        cls, groups = torch_groups(spec, start, param.numel())
        self._buffers = local_ranges(spec.buffers, start, param.numel())   # added to, never stepped
        self._segments: list[tuple[int, int, torch.Tensor]] = []
        torch_param_groups, self._index = [], {}
        for gi, hparams, ranges in groups:
            views = []
            for a, b in ranges:
                view = param.detach()[a:b]
                self._segments.append((a, b, view))
                views.append(view)
            self._index[gi] = len(torch_param_groups)
            torch_param_groups.append({**hparams, "params": views})
        self._segments.sort(key=lambda s: s[0])
        self._saved: Saved | None = None
        self._largest: float | None = None      # the largest magnitude after the last checked step (None: unknown)
        try:
            self._opt = cls(torch_param_groups) if torch_param_groups else None
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"optimizer torch.optim.{cls.__name__}: {exc}") from None

    # ------------------------------------------------------------ steps

    def step(self, grad: torch.Tensor | None = None) -> None:
        """One step with ``grad`` (the shard's flat gradient; default: the flat parameter's ``.grad``)."""
        if grad is None:
            grad = self._flat.grad
        if grad is None:
            return
        for a, b in self._buffers:             # a buffer moves by the change the workers saw
            self._flat.detach()[a:b].add_(grad[a:b])
        if self._opt is None:
            return
        for a, b, view in self._segments:
            view.grad = grad[a:b]
        self._opt.step()
        for _, _, view in self._segments:
            view.grad = None

    def sparse_exact(self) -> bool:
        """Whether a step leaves every element whose gradient is zero exactly as it was, as its current
        hyper-parameters stand: plain SGD (no momentum, no weight decay) or nothing but buffers."""
        if self.spec.torch_class:
            return False
        if self._opt is None:
            return True
        if not isinstance(self._opt, torch.optim.SGD) or len(self._opt.param_groups) != 1:
            return False
        g = self._opt.param_groups[0]
        return (g["momentum"] == 0 and g["weight_decay"] == 0 and not g.get("maximize") and not g.get("fused")
                and not isinstance(g["lr"], torch.Tensor))

    def step_sparse(self, indices: torch.Tensor, values: torch.Tensor) -> bool:
        """One step with a gradient that is ``values`` at ``indices`` (int64, strictly increasing) and zero
        elsewhere, on those elements only; False (nothing done) where that is not exactly :meth:`step`
        (:meth:`sparse_exact`). The touched elements go through the kernels :meth:`step` runs
        (``add_``, with ``alpha=-lr`` where stepped), so they round the same, bit for bit."""
        if not self.sparse_exact():
            return False
        flat = self._flat.detach()
        if not len(indices):
            return True
        stepped = None
        if self._buffers:
            bounds = np.array([x for ab in self._buffers for x in ab], dtype=np.int64)
            in_buffer = torch.from_numpy(np.searchsorted(bounds, indices.numpy(), side="right") % 2 == 1)
            sel = flat.index_select(0, indices[in_buffer])
            flat.index_copy_(0, indices[in_buffer], sel.add_(values[in_buffer]))
            stepped = ~in_buffer
        if self._opt is None:
            return True
        idx, vals = (indices, values) if stepped is None else (indices[stepped], values[stepped])
        sel = flat.index_select(0, idx)
        sel.add_(vals, alpha=-self._opt.param_groups[0]["lr"])
        flat.index_copy_(0, idx, sel)
        return True

    def save(self, indices: torch.Tensor | None = None) -> "Saved":
        """What a step may change, copied, for :meth:`restore` (``indices``: those elements only, for a
        sparse step, which touches nothing else). A dense save reuses the buffers of the last one."""
        flat = self._flat.detach()
        if indices is not None:
            saved = Saved(indices)
            saved.tensors["param"] = flat.index_select(0, indices)
            return saved
        saved = self._saved = self._saved or Saved()
        saved.begin()
        saved.take("param", flat)
        if self._opt is not None:
            for i, (_, _, view) in enumerate(self._segments):
                for key, val in self._opt.state.get(view, {}).items():
                    if isinstance(val, torch.Tensor):
                        saved.take(f"{i}/{key}", val)
        return saved

    def restore(self, saved: "Saved") -> None:
        """Puts back what :meth:`save` copied: the weights and the optimizer's state (the hyper-parameters
        are the caller's to put back)."""
        flat = self._flat.detach()
        if saved.indices is not None:
            flat.index_copy_(0, saved.indices, saved.tensors["param"])
            return
        flat.copy_(saved.tensors["param"])
        if self._opt is None:
            return
        for i, (_, _, view) in enumerate(self._segments):
            st = self._opt.state.get(view)
            if not st:
                continue
            for key in list(st):
                if not isinstance(st[key], torch.Tensor):
                    continue
                kept = saved.tensors.get(f"{i}/{key}")
                if kept is None:          # created by this step (the first): the state did not exist
                    del st[key]
                else:
                    st[key].copy_(kept)
            if not st:
                del self._opt.state[view]
        self._largest = None

    def finite(self, indices: torch.Tensor | None = None) -> bool:
        """Whether every weight (``indices``: those) and every element of the optimizer's state is finite.
        A whole check also keeps the largest magnitude it saw, for :meth:`needs_save`."""
        flat = self._flat.detach()
        if indices is not None:
            self._largest = None
            return _finite(flat.index_select(0, indices))
        tensors = [flat] + ([val for _, _, view in self._segments for val in self._opt.state.get(view, {}).values()
                             if isinstance(val, torch.Tensor)] if self._opt is not None else [])
        sizes = [magnitude(t) for t in tensors]
        ok = all(math.isfinite(x) for x in sizes)         # (max() of a list holding NaN depends on its order)
        self._largest = max(sizes) if ok else None
        return ok

    def needs_save(self, grad_largest: float) -> bool:
        """Whether a dense step with a gradient whose largest magnitude is ``grad_largest`` must be saved
        first. Not when the step is bounded and the bound proves it finite: SGD, Adam or AdamW (by name or
        class) move no value by more than :meth:`_growth` times the largest input (weights, optimizer state,
        gradient), and with those inputs at most :data:`SAFE_MAGNITUDE` and the growth at most
        :data:`SAFE_GROWTH` every result stays below 1e32, far from fp32's 3.4e38 (Adam's second moment,
        the square of a gradient, below 1e30). Anything else (an unknown class, an unknown largest value: the
        first step, after a rollback or a load) is saved."""
        growth = self._growth()
        if growth is None or self._largest is None:
            return True
        return not (max(grad_largest, self._largest) <= SAFE_MAGNITUDE and growth <= SAFE_GROWTH)

    def _growth(self) -> float | None:
        """How many times the largest input one step's results may be, as the hyper-parameters stand
        (None: no bound is known for this optimizer)."""
        if self._opt is None:
            return 2.0                                   # buffers only: p + g
        adam = type(self._opt) in (torch.optim.Adam, torch.optim.AdamW)
        if not adam and type(self._opt) is not torch.optim.SGD:
            return None
        growth = 2.0
        for g in self._opt.param_groups:
            lr, wd = float(g["lr"]), float(g.get("weight_decay", 0.0))
            if not (0 <= lr and 0 <= wd <= MAX_BOUNDED_DECAY):
                return None
            k = 4.0 * (1 + lr) * (1 + wd)                # SGD: p - lr (g + wd p + momentum buf)
            if adam:
                eps, beta1 = float(g["eps"]), float(g["betas"][0])
                if not (eps > 0 and 0 <= beta1 < 1):
                    return None
                k *= 1 + 1 / ((1 - beta1) * eps)        # |m / (sqrt(v) + eps)| <= |m| / eps; bias correction
            growth = max(growth, k)
        return growth

    def check_hparams(self, values: Mapping[str, float]) -> None:
        """InvalidArgument unless :meth:`set_hparams` would take every one of ``values``."""
        for key, value in values.items():
            self._resolve(key, value)

    def set_hparams(self, values: Mapping[str, float]) -> None:
        """Takes the user's current hyper-parameters (``"<group>.<name>"``, ``"<group>.<name>.<i>"``)."""
        for key, value in values.items():
            target = self._resolve(key, value)
            if target is None:
                continue
            g, name, element = target
            if element is None:
                g[name] = float(value)
            else:
                old = list(g[name])
                old[element] = float(value)
                g[name] = tuple(old)

    def _resolve(self, key: str, value: float) -> tuple[dict, str, int | None] | None:
        """The param group, name and tuple element ``key`` sets; None for a group with nothing here."""
        group, name, element = _parse_key(key)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"hyper-parameter {key} = {value!r} is not a finite number >= 0")
        if not 0 <= group < self._num_user_groups():
            raise InvalidArgument(f"hyper-parameter {key}: the optimizer has no param group {group}")
        i = self._index.get(group)
        if i is None or self._opt is None:
            return None
        g = self._opt.param_groups[i]
        current = g.get(name)
        if name == "params" or current is None or isinstance(current, (bool, str)):
            raise InvalidArgument(f"hyper-parameter {key}: torch.optim.{type(self._opt).__name__} has no "
                                  f"numeric {name!r}")
        if element is None:
            if isinstance(current, (tuple, list)):
                raise InvalidArgument(f"hyper-parameter {key}: {name!r} is a tuple; name an element")
        elif not isinstance(current, (tuple, list)) or not 0 <= element < len(current):
            raise InvalidArgument(f"hyper-parameter {key}: {name!r} has no element {element}")
        return g, name, element

    def hparams(self) -> dict[str, float]:
        """The numeric hyper-parameters of every group, keyed as :meth:`set_hparams` takes them."""
        if self._opt is None:
            return {}
        inverse = {i: gi for gi, i in self._index.items()}
        return numeric_hparams((inverse[i], g) for i, g in enumerate(self._opt.param_groups))

    def _num_user_groups(self) -> int:
        return len(self.spec.groups) if self.spec.torch_class else 1

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """One flat parameter's state: element-wise tensors over the whole slice (zeros where no group
        keeps that entry), scalars (``step``) from the first segment that has them."""
        if self._opt is None:
            return {"state": {}, "param_groups": [{"params": [0]}]}
        entry: dict[str, Any] = {}
        numel = self._flat.numel()
        for a, b, view in self._segments:
            for key, val in self._opt.state.get(view, {}).items():
                if isinstance(val, torch.Tensor) and val.dim() > 0:
                    if key not in entry:
                        entry[key] = torch.zeros(numel, dtype=torch.float32)
                    entry[key][a:b] = val.detach().reshape(-1)
                elif val is not None and key not in entry:
                    entry[key] = val.clone() if isinstance(val, torch.Tensor) else val
        return {"state": {0: entry} if entry else {}, "param_groups": [{"params": [0]}]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Takes a one-flat-parameter state (as :meth:`state_dict` gives, or a checkpoint holds); the
        hyper-parameters stay this optimizer's own (the next push brings the user's current ones)."""
        entries = list(dict(state_dict.get("state", {})).values())
        if len(entries) > 1:
            raise InvalidArgument("optimizer state must cover exactly one (flat) parameter")
        self._largest = None
        if self._opt is None:
            return
        groups = list(state_dict.get("param_groups", ()))
        if not self.spec.torch_class and len(groups) == 1:   # a registered name: its one group's flags (amsgrad)
            for g in self._opt.param_groups:
                g.update({k: v for k, v in groups[0].items() if k != "params" and k in g})
        if not entries:
            return
        entry = entries[0]
        numel = self._flat.numel()
        for a, b, view in self._segments:
            st: dict[str, Any] = {}
            for key, val in entry.items():
                if isinstance(val, torch.Tensor) and val.dim() > 0:
                    if val.numel() != numel:
                        raise InvalidArgument(f"optimizer state {key!r} has {val.numel()} elements, shard {numel}")
                    st[key] = val.detach().reshape(-1)[a:b].to(torch.float32).clone()
                elif isinstance(val, torch.Tensor):
                    st[key] = val.detach().clone()
                else:
                    st[key] = torch.tensor(float(val), dtype=torch.float32)
            if st:
                self._opt.state[view] = st


class Saved:
    """Copies of a step's inputs (:meth:`ShardOptimizer.save`), in buffers kept for the next save."""

    def __init__(self, indices: torch.Tensor | None = None):
        self.indices = indices
        self.tensors: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        """A new save: the buffers of the last one are reused for the entries taken again."""
        self._spare, self.tensors = self.tensors, {}

    def take(self, key: str, t: torch.Tensor) -> None:
        buf = self._spare.pop(key, None)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = t.detach().clone()
        else:
            buf.copy_(t.detach())
        self.tensors[key] = buf


def _finite(t: torch.Tensor) -> bool:
    return math.isfinite(magnitude(t))


def magnitude(t: torch.Tensor) -> float:
    """The largest |element| of ``t`` (NaN if it holds one; 0 when empty or not floating point): two
    reductions, no temporary (``vector_norm(inf)`` is 80x slower here, ``abs().max()`` allocates)."""
    if t.numel() == 0 or not t.is_floating_point():
        return 0.0
    top, bottom = float(t.amax()), float(t.amin())
    return math.nan if math.isnan(top) or math.isnan(bottom) else max(top, -bottom)


def numeric_hparams(groups) -> dict[str, float]:
    """``{"<group>.<name>": value, "<group>.<name>.<i>": value}`` for the float hyper-parameters of
    ``(group index, param group dict)`` pairs (what a scheduler changes); flags and ints are left out."""
    out: dict[str, float] = {}
    for gi, g in groups:
        for name, value in g.items():
            if name in ("params", "initial_lr") or isinstance(value, bool):
                continue
            if isinstance(value, float):
                out[f"{gi}.{name}"] = value
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                out[f"{gi}.{name}"] = float(value)
            elif isinstance(value, (tuple, list)) and all(isinstance(v, float) for v in value):
                for i, v in enumerate(value):
                    out[f"{gi}.{name}.{i}"] = v
    return out


def _parse_key(key: str) -> tuple[int, str, int | None]:
    parts = key.split(".")
    try:
        if len(parts) == 2:
            return int(parts[0]), parts[1], None
        if len(parts) == 3:
            return int(parts[0]), parts[1], int(parts[2])
    except ValueError:
        pass
    raise InvalidArgument(f"hyper-parameter key {key!r} is not <group>.<name> or <group>.<name>.<index>")


def build_optimizer(param: torch.Tensor, spec: OptimizerSpec, start: int = 0) -> ShardOptimizer:
    """``spec`` is validated on construction, so its name is registered or a runnable torch class."""
    return ShardOptimizer(param, spec, start)


def group_spec(hparams: Mapping[str, Any], ranges) -> ParamGroupSpec:
    return ParamGroupSpec(dict(hparams), tuple(ranges))


def warm_up() -> None:
    """Builds and steps a throw-away optimizer of each kind.

    The first ``torch.optim`` construction in a process imports torch's compiler
    stack (about 1.5 s here); paying it at start-up keeps it off the first Init.
    """
    for name in OPTIMIZERS:
        p = torch.zeros(1)
        opt = ShardOptimizer(p, OptimizerSpec(name, {}))
        opt.step(torch.zeros(1))
