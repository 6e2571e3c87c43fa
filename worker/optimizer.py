"""The user's own ``torch.optim`` optimizer, run on the parameter servers.

    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)

returns an object of the user's optimizer class (so ``isinstance`` checks and
``torch.optim.lr_scheduler`` keep working) whose ``step()`` pushes the gradients
and pulls the new weights. The optimizer's class, param groups and
hyper-parameters become the shards' :class:`shoal.settings.config.OptimizerSpec`: a single
group of ``SGD``/``Adam``/``AdamW`` with plain flags maps to the registered name
(so momentum correction with top-k keeps working), anything else is sent as the
class name with each group's hyper-parameters and the flat ranges its
parameters cover. Each push carries the groups' current float
hyper-parameters (``lr``, ``momentum``, ``betas``, ...), so a scheduler stepping
this optimizer changes the servers' learning rate from the next step on.

Gradient accumulation over micro-batches works as in plain PyTorch: several ``loss.backward()``
then one ``step()`` push the summed gradient once, and the push names every batch of the
:class:`~shoal.worker.DistributedSampler` those passes trained (one ``backward()`` per batch), so
the parameter servers' ledger counts each of them once. ``backward_passes_per_step=k`` (Horovod's
name) suits a loop that calls ``zero_grad()``/``backward()``/``step()`` on every batch: ``step()``
pushes only after the k-th backward pass, and ``zero_grad()`` keeps the gradients in between.
The push is the gradient as the loop left it, like DDP's and Horovod's: divide the loss by k for
the mean over the micro-batches; a sync round averages the workers' pushes, one each
(:mod:`shoal.worker.accumulate`).

``state_dict()`` / ``load_state_dict()`` are torch's: the param groups (the
hyper-parameters a scheduler set) round-trip; the optimizer's moments live on
the parameter servers and are saved by the job's checkpoints (``--checkpoint-dir``).
"""
from __future__ import annotations

import atexit
import logging
from typing import Any

import torch

from shoal.settings.config import UNSUPPORTED_TORCH_OPTIMIZERS, OptimizerSpec, ParamGroupSpec
from shoal.errors import InvalidArgument
from shoal.state.layout import ModelLayout
from shoal.state.optim import OPTIMIZERS, numeric_hparams
from shoal.worker.accumulate import Accumulation
from shoal.worker.embedding import find_tables, swap_meta_embeddings
from shoal.worker.tables import row_defaults
from shoal.worker.trainer import Trainer, stop_requested

log = logging.getLogger(__name__)

# flags that change how fast torch runs, not what it computes
_SPEED_FLAGS = {"params", "initial_lr", "foreach", "fused", "capturable", "differentiable"}
_REGISTERED = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}

_active: list["Trainer"] = []      # the trainer of this process's DistributedOptimizer (for samplers)


def active_trainer() -> Trainer | None:
    """The :class:`Trainer` a :func:`DistributedOptimizer` of this process started, if any."""
    return _active[-1] if _active else None


def spec_from_torch(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> OptimizerSpec:
    """The :class:`OptimizerSpec` that runs ``optimizer`` (class, groups, hyper-parameters) on the shards."""
    cls = type(optimizer)
    if cls.__name__ in UNSUPPORTED_TORCH_OPTIMIZERS:
        raise InvalidArgument(f"optimizer torch.optim.{cls.__name__} cannot run on the parameter servers: "
                              f"{UNSUPPORTED_TORCH_OPTIMIZERS[cls.__name__]}")
    layout = ModelLayout.from_module(model)
    where = {id(p): (off, p.numel()) for (_, p), off in zip(model.named_parameters(), layout.offsets)}
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        ranges = []
        for p in group["params"]:
            if id(p) not in where:
                raise InvalidArgument(f"param group {gi} of torch.optim.{type(optimizer).__name__} holds a "
                                      f"tensor {list(p.shape)} that is not a parameter of the model")
            off, n = where[id(p)]
            if n:
                ranges.append((off, off + n))
        hparams = {k: v for k, v in group.items() if k not in ("params", "initial_lr")}
        groups.append((hparams, sorted(ranges), {names[id(p)] for p in group["params"]}))
    legacy = _registered(cls, groups, len(names))
    if legacy is not None:
        return legacy
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or getattr(torch.optim, cls.__name__, None) is not cls:
        raise InvalidArgument(f"optimizer {cls.__module__}.{cls.__name__} cannot run on the parameter servers: "
                              f"they build torch.optim classes by name")
    return OptimizerSpec(cls.__name__, {}, tuple(ParamGroupSpec(h, tuple(r)) for h, r, _ in groups))


def _registered(cls: type, groups: list, num_params: int) -> OptimizerSpec | None:
    """The registered name for one group of SGD/Adam/AdamW over the whole model with plain flags."""
    name = _REGISTERED.get(cls)
    if name is None or len(groups) != 1 or len(groups[0][2]) != num_params:
        return None
    h = groups[0][0]
    try:
        if name == "sgd":
            spec = OptimizerSpec(name, {"lr": h["lr"], "momentum": h["momentum"], "dampening": h["dampening"],
                                        "weight_decay": h["weight_decay"], "nesterov": float(h["nesterov"])})
        else:
            b1, b2 = h["betas"]
            spec = OptimizerSpec(name, {"lr": h["lr"], "beta1": b1, "beta2": b2, "eps": h["eps"],
                                        "weight_decay": h["weight_decay"]})
    except (KeyError, TypeError, ValueError, InvalidArgument):
        return None
    probe_cls, kwargs = OPTIMIZERS[name](dict(spec.hparams))
    probe = probe_cls([torch.zeros(1, requires_grad=True)], **kwargs).param_groups[0]
    same = all(probe.get(k) == v or (isinstance(v, (tuple, list)) and tuple(v) == tuple(probe.get(k, ())))
               for k, v in h.items() if k not in _SPEED_FLAGS)
    return spec if same else None


def _serve_meta_tables(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> tuple[str, dict[str, float]]:
    """The model's ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)`` on the ``meta`` device become tables served
    by the parameter servers (shoal/worker/embedding.py); their weights leave the optimizer's param groups, and
    the row optimizer is the one the user's optimizer (or the group that held the weight) stands for.
    Returns the default row optimizer for tables that name none."""
    swapped = swap_meta_embeddings(model)
    held = {id(w): m for _, w, m in swapped}
    stray = [p for g in optimizer.param_groups for p in g["params"] if p.device.type == "meta" and id(p) not in held]
    if stray:
        raise InvalidArgument(f"torch.optim.{type(optimizer).__name__} holds a meta tensor {list(stray[0].shape)} that "
                              f"is no longer the model's: the table it belonged to was served already. Wrap the "
                              f"optimizer of the tables (e.g. SparseAdam) in DistributedOptimizer before the dense one")
    if any(m._router is not None for _, m in find_tables(model)) and swapped:
        raise InvalidArgument("the model's tables are served already: wrap every optimizer in DistributedOptimizer "
                              "before the first forward")
    for group in optimizer.param_groups:
        for p in group["params"]:
            m = held.get(id(p))
            if m is not None and m.row_optimizer is None:
                m.row_optimizer, hyper = row_defaults(optimizer, group)
                m.hyper = {**hyper, **m.hyper}
        group["params"] = [p for p in group["params"] if id(p) not in held]
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]] or optimizer.param_groups[:1]
    for path, _, _ in swapped:
        log.info("%s (on the meta device) is served by the parameter servers", path)
    return row_defaults(optimizer) if find_tables(model) else ("sgd", {})


class _Distributed:
    """Mixed in before the user's optimizer class: ``step`` and ``zero_grad`` go through the trainer."""

    _shoal: Trainer

    def step(self, closure: Any = None) -> Any:
        """Pushes the gradients of the backward passes since the last push (with the groups' current
        hyper-parameters) and pulls the weights; with ``backward_passes_per_step=k``, only once the
        k-th pass is done (before, it returns at once and the gradients keep accumulating)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._shoal_acc.due():
            return loss
        passes = self._shoal_acc.reset()
        if not passes and all(p.grad is None for g in self.param_groups for p in g["params"]):
            return loss             # nothing to push: torch's step() leaves parameters without a gradient
        self._shoal.step(batches=max(1, passes))
        if stop_requested():            # SIGTERM: hand back at this batch boundary, leave, exit 0
            self._shoal.hand_back()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients (with ``backward_passes_per_step=k``: only once k passes were pushed).
        Gradients left from backward() passes that no step() pushed mean the step was skipped (a
        GradScaler found inf/nan): nothing was pushed, and their batches go back to the chief to be
        trained again."""
        acc = self._shoal_acc
        if acc.accumulating():
            return
        if acc.passes:                  # passes no push took
            self._shoal.skip_batch(batches=acc.reset())
        self._shoal.zero_grad()

    @property
    def trainer(self) -> Trainer:
        """The :class:`Trainer` underneath (``pull()``, ``report()``, ``close()``, ``member_id``)."""
        return self._shoal

    def report(self, **values: float) -> None:
        """Publishes job-level metrics (e.g. ``test_accuracy``) to the chief."""
        self._shoal.report(**values)

    def synchronize(self) -> None:
        """Pushes a last, short group of micro-batches still accumulating (``backward_passes_per_step``
        with fewer than k passes since the last push), then pulls the newest weights (and buffers)
        from the job, e.g. before a final evaluation."""
        acc = self._shoal_acc
        if acc.every is not None and acc.passes:
            self._shoal.step(batches=acc.reset())
        self._shoal.pull()

    def close(self) -> None:
        """Leaves the job (also done at exit)."""
        trainer = self._shoal
        if trainer in _active:
            _active.remove(trainer)
            trainer.close()


class _TablesOnly:
    """Mixed in before a user's optimizer that held only tables now served by the parameter servers (say
    ``SparseAdam`` over the embeddings, next to ``Adam`` over the rest): it settled their row optimizer; the
    DistributedOptimizer of the dense part pushes their rows with its own, so ``step``/``zero_grad`` do nothing
    here, and the rest goes to that one's :class:`Trainer`."""

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    @property
    def trainer(self) -> Trainer:
        trainer = active_trainer()
        if trainer is None:
            raise InvalidArgument("no DistributedOptimizer of the model's dense part serves these tables yet")
        return trainer

    def report(self, **values: float) -> None:
        self.trainer.report(**values)

    def synchronize(self) -> None:
        self.trainer.pull()

    def close(self) -> None:
        return None


def _tables_only(optimizer: torch.optim.Optimizer):
    base = type(optimizer)
    cls = type(base.__name__, (_TablesOnly, base), {"__module__": __name__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    return wrapped


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, *,
                         backward_passes_per_step: int | None = None, **trainer_options: Any):
    """Wraps the user's optimizer: same class, param groups and hyper-parameters, run on the shards.

    ``backward_passes_per_step``: ``None`` (default) pushes at each ``step()`` what the backward
    passes before it summed (several passes: gradient accumulation, the push names all their
    batches); ``k`` pushes at the ``step()`` that follows the k-th pass only, earlier ``step()`` and
    ``zero_grad()`` calls leave the gradients accumulating, and more than k passes before a step
    is an error. ``trainer_options`` go to :class:`Trainer` (``chief``, ``compression``, ``transport``, ...);
    ``overlap`` is off unless asked for, so gradients are pushed as the loop leaves them at ``step()``.
    The object returned shares the user's ``param_groups`` and ``state``: a scheduler made on either
    steers the servers.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgument(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _Distributed):
        raise InvalidArgument("this optimizer is already a DistributedOptimizer")
    Accumulation((), backward_passes_per_step, trainer_options.get("overlap", False))  # checked before joining
    held_tables = any(p.device.type == "meta" for g in optimizer.param_groups for p in g["params"])
    defaults = _serve_meta_tables(optimizer, model)
    if held_tables and not any(g["params"] for g in optimizer.param_groups):
        return _tables_only(optimizer)      # e.g. SparseAdam over the tables: the dense optimizer's step pushes them
    trainer_options.setdefault("table_defaults", defaults)
    spec = spec_from_torch(optimizer, model)
    # pushes start at step(), after whatever the loop does to the gradients (clipping, a GradScaler's
    # unscale_); overlap=True starts each shard's push during backward() instead, for speed
    trainer_options.setdefault("overlap", False)
    base = type(optimizer)
    cls = type(base.__name__, (_Distributed, base), {"__module__": __name__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)        # the same param_groups, state and defaults objects
    trainer = Trainer(model, optimizer=spec, hparams_source=lambda: numeric_hparams(
        enumerate(wrapped.param_groups)), **trainer_options)
    wrapped._shoal = trainer
    # backward passes since the last push; the trainer's sampler keeps the batches they trained
    wrapped._shoal_acc = trainer.accumulation = Accumulation(
        [p for g in wrapped.param_groups for p in g["params"]], backward_passes_per_step,
        trainer._readiness is not None)
    _active.append(trainer)
    atexit.register(wrapped.close)
    log.debug("optimizer %s runs on the parameter servers as %s", base.__name__, spec.name)
    return wrapped
