"""Momentum correction (Lin et al., "Deep Gradient Compression", ICLR 2018).

With a sparsifying codec (top-k) and error feedback, a server-side momentum
sees each element's gradient late and in lumps: whatever a worker held back
arrives in one push, and the server's velocity then carries that lump on for
many steps. Momentum correction moves the velocity to the workers: each
keeps ``u = m * u + g`` per shard and compresses ``u`` (error feedback adds what
was held back); the server runs plain SGD. What the server applies then adds up
to what momentum SGD would have applied, only later, and with SGD on the server
a top-k update changes only the elements it names, so delta pulls stay small.

The shard's optimizer says who holds the momentum: ``worker_momentum`` in its
hyper-parameters (with ``momentum`` 0). The worker that creates a shard decides,
as for every hyper-parameter; every worker reads the shard's setting and
follows it, so the momentum is never applied twice (nor not at all). A worker
that joins starts with a zero velocity, as does one after its shard restarted.
"""
from __future__ import annotations

import torch

from shoal.config import OptimizerSpec


def server_optimizer(spec: OptimizerSpec, sparse_codec: bool) -> OptimizerSpec:
    """The optimizer a new shard gets: SGD's momentum moved to the workers when the codec sparsifies
    (plain momentum only: with Nesterov, dampening or weight decay the server keeps it).

    Only for top-k: quantizers (int8, sign) send every element every step, so nothing arrives in
    lumps, and sign compressing a velocity instead of a gradient measured worse (bench/RESULTS.md)."""
    h = dict(spec.hparams)
    if (spec.name != "sgd" or not sparse_codec or not h["momentum"] or h["nesterov"] or h["dampening"]
            or h["weight_decay"] or h["worker_momentum"]):
        return spec
    return OptimizerSpec("sgd", {**h, "momentum": 0.0, "worker_momentum": h["momentum"]})


class LocalMomentum:
    """Per-shard velocities of the momentum the shards' optimizers leave to the workers."""

    def __init__(self) -> None:
        self.factors: dict[int, float] = {}
        self._velocity: dict[int, torch.Tensor] = {}

    def follow(self, shard: int, hparams: dict[str, float]) -> None:
        """Takes the shard's setting (its optimizer's hyper-parameters); a change restarts the velocity."""
        factor = float(hparams.get("worker_momentum", 0.0))
        if self.factors.get(shard) != factor:
            self._velocity.pop(shard, None)
        self.factors[shard] = factor

    def active(self, shard: int) -> bool:
        return self.factors.get(shard, 0.0) > 0.0

    def apply(self, shard: int, grad: torch.Tensor) -> torch.Tensor:
        """``u = m * u + grad`` for the shard, in the velocity's own storage; returns ``u``."""
        m = self.factors.get(shard, 0.0)
        if m <= 0.0:
            return grad
        u = self._velocity.get(shard)
        if u is None or u.shape != grad.shape or u.device != grad.device:
            u = self._velocity[shard] = torch.zeros_like(grad)
        return u.mul_(m).add_(grad)

    def reset(self, shard: int) -> None:
        self._velocity.pop(shard, None)
