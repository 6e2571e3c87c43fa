"""Momentum correction: the momentum (or Adam's moments) moves to the workers only for top-k, and
adds up to the same steps."""
import pytest
import torch

from shoal.settings.config import OptimizerSpec
from shoal.ps.consistency import AsyncRule
from shoal.ps.shard import Shard
from shoal.worker.momentum import LocalMomentum, server_optimizer

SGD_M = OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9})


def test_sparse_codecs_move_plain_sgd_momentum_to_the_workers():
    moved = server_optimizer(SGD_M, sparse_codec=True)
    assert moved.hparams["momentum"] == 0.0 and moved.hparams["worker_momentum"] == 0.9
    assert server_optimizer(SGD_M, sparse_codec=False) == SGD_M
    for other in (OptimizerSpec("sgd", {"lr": 0.1}), OptimizerSpec("adam", {"lr": 1e-3, "weight_decay": 1e-4}),
                  OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": 1}),
                  OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4})):
        assert server_optimizer(other, sparse_codec=True) == other


def both_ways(spec: OptimizerSpec, steps: int) -> tuple[torch.Tensor, torch.Tensor, LocalMomentum]:
    """The same gradients through ``spec`` on a shard, and through the workers' share of it into the
    shard's share: ``(server-side weights, split weights, the worker's state)``."""
    grads = [torch.randn(257, generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    start = torch.randn(257, generator=torch.Generator().manual_seed(99))
    server = Shard(0, start, spec, AsyncRule(), "fp")
    moved = server_optimizer(spec, sparse_codec=True)
    split = Shard(0, start, moved, AsyncRule(), "fp")
    local = LocalMomentum()
    local.follow(0, dict(moved.hparams))
    for i, g in enumerate(grads):
        server.push("w", i, g.clone(), key=f"a{i}")
        split.push("w", i, local.apply(0, g.clone()).clone(), key=f"b{i}")
    assert not torch.equal(server.values(), start)
    return server.values(), split.values(), local


def test_worker_momentum_into_server_sgd_takes_the_same_steps_as_server_momentum():
    server, split, _ = both_ways(SGD_M, 20)
    assert torch.equal(server, split)


def test_a_changed_setting_restarts_the_velocity_and_zero_leaves_the_gradient_alone():
    local = LocalMomentum()
    g = torch.ones(4)
    assert local.apply(0, g) is g                          # no setting: nothing applied
    local.follow(0, {"worker_momentum": 0.5})
    local.apply(0, g)
    assert torch.equal(local.apply(0, g), torch.full((4,), 1.5))
    local.follow(0, {"worker_momentum": 0.25})
    assert torch.equal(local.apply(0, g), torch.ones(4))   # a fresh velocity
    local.follow(0, {"momentum": 0.9})
    assert not local.active(0) and local.apply(0, g) is g


def test_worker_momentum_is_a_hyper_parameter_of_sgd_only():
    assert OptimizerSpec("sgd", {"worker_momentum": 0.5}).hparams["worker_momentum"] == 0.5
    with pytest.raises(ValueError, match="has no hyper-parameter worker_momentum"):
        OptimizerSpec("adam", {"worker_momentum": 0.5})


ADAM = OptimizerSpec("adam", {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6})
ADAMW = OptimizerSpec("adamw", {"lr": 0.01, "weight_decay": 0.1})


def test_sparse_codecs_move_adams_moments_to_the_workers():
    moved = server_optimizer(ADAM, sparse_codec=True)
    assert moved.name == "sgd" and moved.hparams["momentum"] == 0.0 and moved.hparams["weight_decay"] == 0.0
    assert (moved.hparams["lr"], moved.hparams["worker_momentum"], moved.hparams["worker_beta2"],
            moved.hparams["worker_eps"]) == (0.01, 0.8, 0.99, 1e-6)
    assert server_optimizer(ADAM, sparse_codec=False) == ADAM
    w = server_optimizer(ADAMW, sparse_codec=True)     # decoupled weight decay stays with the server, as SGD's
    assert w.name == "sgd" and w.hparams["weight_decay"] == 0.1 and w.hparams["worker_beta2"] == 0.999


@pytest.mark.parametrize("spec", [ADAM, ADAMW], ids=["adam", "adamw"])
def test_worker_adam_into_server_sgd_takes_adams_steps(spec):
    """Adam's direction from the worker, scaled by the server's SGD, gives torch's Adam (AdamW)."""
    server, split, local = both_ways(spec, 30)
    assert local.adam(0) and "Adam" in local.describe(0)
    torch.testing.assert_close(split, server, rtol=1e-5, atol=1e-6)


def test_a_restart_of_adams_moments_starts_bias_correction_over():
    local = LocalMomentum()
    local.follow(0, dict(server_optimizer(ADAM, sparse_codec=True).hparams))
    g = torch.full((3,), 2.0)
    first = local.apply(0, g).clone()
    torch.testing.assert_close(first, torch.ones(3), rtol=1e-5, atol=0)    # m_hat / sqrt(v_hat) = g / |g|
    local.apply(0, -g)
    local.reset(0)
    torch.testing.assert_close(local.apply(0, g), first)


def test_adam_without_a_first_moment_still_normalises_on_the_workers():
    """beta1 0 (RMSprop-like): no velocity, but the direction is still Adam's, never the raw gradient."""
    local = LocalMomentum()
    local.follow(0, dict(server_optimizer(OptimizerSpec("adam", {"beta1": 0.0}), sparse_codec=True).hparams))
    assert local.active(0) and local.adam(0)
    torch.testing.assert_close(local.apply(0, torch.full((3,), -4.0)), -torch.ones(3), rtol=1e-5, atol=0)
