"""Server-side optimizers, registered by name, built over one flat shard.

Every supported optimizer is element-wise, so applying ``torch.optim`` to a
shard's slice gives exactly what it would give on the whole model.
"""
from __future__ import annotations

from typing import Callable

import torch

from shoal.config import OptimizerSpec

Factory = Callable[[torch.nn.Parameter, dict[str, float]], torch.optim.Optimizer]


def _sgd(p: torch.nn.Parameter, h: dict[str, float]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p], lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"],
                           weight_decay=h["weight_decay"], nesterov=bool(h["nesterov"]))


def _adam(p: torch.nn.Parameter, h: dict[str, float]) -> torch.optim.Optimizer:
    return torch.optim.Adam([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"])


def _adamw(p: torch.nn.Parameter, h: dict[str, float]) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                             weight_decay=h["weight_decay"])


OPTIMIZERS: dict[str, Factory] = {"sgd": _sgd, "adam": _adam, "adamw": _adamw}


def build_optimizer(param: torch.nn.Parameter, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """``spec`` is validated on construction, so its name is always registered."""
    return OPTIMIZERS[spec.name](param, dict(spec.hparams))


def warm_up() -> None:
    """Builds and steps a throw-away optimizer of each kind.

    The first ``torch.optim`` construction in a process imports torch's compiler
    stack (about 1.5 s here); paying it at start-up keeps it off the first Init.
    """
    for factory in OPTIMIZERS.values():
        p = torch.nn.Parameter(torch.zeros(1))
        opt = factory(p, {**_DEFAULTS_FOR_WARMUP})
        p.grad = torch.zeros(1)
        opt.step()


_DEFAULTS_FOR_WARMUP = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": 0.0,
                        "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
