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

Adam gets the same treatment, for the same reason and one more: a server-side
Adam divides each element's update by its gradient's running magnitude, so a
lump that stands for a hundred steps of gradient moves the weight about as far
as one step would. With top-k and Adam (or AdamW), each worker keeps Adam's two
moments per shard and compresses Adam's direction ``m_hat / (sqrt(v_hat) + eps)``;
the server runs SGD at Adam's learning rate (with AdamW's decoupled weight
decay as SGD's, which is exactly AdamW's). The shard records ``worker_beta2``
(> 0), with ``worker_momentum`` as beta1 and ``worker_eps``. Adam's coupled
(L2) weight decay needs the weights in the gradient, so with it the server
keeps Adam. The cost is worker memory: three buffers the size of the model
(the two moments and the direction), where momentum needs one.
"""
from __future__ import annotations

import torch

from shoal.settings.config import OptimizerSpec


def server_optimizer(spec: OptimizerSpec, sparse_codec: bool) -> OptimizerSpec:
    """The optimizer a new shard gets: SGD's momentum, or Adam's moments, moved to the workers when
    the codec sparsifies (plain momentum only: with Nesterov, dampening or weight decay the server
    keeps it; Adam without its coupled weight decay, AdamW with its decoupled one).

    Only for top-k: quantizers (int8, sign) send every element every step, so nothing arrives in
    lumps, and sign compressing a velocity instead of a gradient measured worse (bench/RESULTS.md)."""
    h = dict(spec.hparams)
    if not sparse_codec:
        return spec
    if spec.name in ("adam", "adamw") and not (spec.name == "adam" and h["weight_decay"]):
        return OptimizerSpec("sgd", {"lr": h["lr"], "weight_decay": h["weight_decay"],
                                     "worker_momentum": h["beta1"], "worker_beta2": h["beta2"],
                                     "worker_eps": h["eps"]})
    if (spec.name != "sgd" or not h["momentum"] or h["nesterov"] or h["dampening"]
            or h["weight_decay"] or h["worker_momentum"]):
        return spec
    return OptimizerSpec("sgd", {**h, "momentum": 0.0, "worker_momentum": h["momentum"]})


class LocalMomentum:
    """Per-shard state of what the shards' optimizers leave to the workers: a velocity, or Adam's moments."""

    def __init__(self) -> None:
        self.settings: dict[int, tuple[float, float, float]] = {}    # shard -> (momentum or beta1, beta2, eps)
        self._velocity: dict[int, torch.Tensor] = {}
        self._adam: dict[int, _AdamState] = {}

    def follow(self, shard: int, hparams: dict[str, float]) -> None:
        """Takes the shard's setting (its optimizer's hyper-parameters); a change restarts the state."""
        setting = (float(hparams.get("worker_momentum", 0.0)), float(hparams.get("worker_beta2", 0.0)),
                   float(hparams.get("worker_eps", 1e-8)))
        if self.settings.get(shard) != setting:
            self.reset(shard)
        self.settings[shard] = setting

    def active(self, shard: int) -> bool:
        momentum, beta2, _ = self.settings.get(shard, (0.0, 0.0, 0.0))
        return momentum > 0.0 or beta2 > 0.0

    def adam(self, shard: int) -> bool:
        return self.settings.get(shard, (0.0, 0.0, 0.0))[1] > 0.0

    def describe(self, shard: int) -> str:
        m, b2, eps = self.settings[shard]
        return f"Adam's direction (betas {m:g}, {b2:g}; eps {eps:g})" if b2 > 0 else f"momentum {m:g}"

    def apply(self, shard: int, grad: torch.Tensor) -> torch.Tensor:
        """What the worker compresses for this shard's gradient: itself (no setting), the velocity
        ``u = m * u + grad`` (in the velocity's own storage), or Adam's direction."""
        if not self.active(shard):
            return grad
        m, beta2, eps = self.settings[shard]
        if beta2 > 0.0:
            st = self._adam.get(shard)
            if st is None or st.m.shape != grad.shape or st.m.device != grad.device:
                st = self._adam[shard] = _AdamState(grad)
            return st.step(grad, m, beta2, eps)
        u = self._velocity.get(shard)
        if u is None or u.shape != grad.shape or u.device != grad.device:
            u = self._velocity[shard] = torch.zeros_like(grad)
        return u.mul_(m).add_(grad)

    def reset(self, shard: int) -> None:
        self._velocity.pop(shard, None)
        self._adam.pop(shard, None)


class _AdamState:
    """Adam's moments of one shard's gradients, and a buffer its direction is written into."""

    def __init__(self, like: torch.Tensor):
        self.m = torch.zeros_like(like)
        self.v = torch.zeros_like(like)
        self.out = torch.empty_like(like)
        self.t = 0

    def step(self, grad: torch.Tensor, beta1: float, beta2: float, eps: float) -> torch.Tensor:
        """``m_hat / (sqrt(v_hat) + eps)`` after this gradient, as torch.optim.Adam computes it."""
        self.t += 1
        self.m.lerp_(grad, 1 - beta1)
        self.v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = 1 - beta1 ** self.t, 1 - beta2 ** self.t
        torch.sqrt(self.v, out=self.out).div_(bias2 ** 0.5).add_(eps)
        return torch.div(self.m, self.out, out=self.out).div_(bias1)
