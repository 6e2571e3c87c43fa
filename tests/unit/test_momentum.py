"""Momentum correction: the momentum moves to the workers only for biased codecs, and adds up the same."""
import pytest
import torch

from shoal.config import OptimizerSpec
from shoal.ps.consistency import AsyncRule
from shoal.ps.shard import Shard
from shoal.worker.momentum import LocalMomentum, server_optimizer

SGD_M = OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9})


def test_sparse_codecs_move_plain_sgd_momentum_to_the_workers():
    moved = server_optimizer(SGD_M, sparse_codec=True)
    assert moved.hparams["momentum"] == 0.0 and moved.hparams["worker_momentum"] == 0.9
    assert server_optimizer(SGD_M, sparse_codec=False) == SGD_M
    for other in (OptimizerSpec("sgd", {"lr": 0.1}), OptimizerSpec("adam", {"lr": 1e-3}),
                  OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": 1}),
                  OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4})):
        assert server_optimizer(other, sparse_codec=True) == other


def test_worker_momentum_into_server_sgd_takes_the_same_steps_as_server_momentum():
    grads = [torch.randn(257, generator=torch.Generator().manual_seed(i)) for i in range(20)]
    start = torch.randn(257, generator=torch.Generator().manual_seed(99))
    server = Shard(0, start, SGD_M, AsyncRule(), "fp")
    moved = server_optimizer(SGD_M, sparse_codec=True)
    split = Shard(0, start, moved, AsyncRule(), "fp")
    local = LocalMomentum()
    local.follow(0, dict(moved.hparams))
    for i, g in enumerate(grads):
        server.push("w", i, g.clone(), key=f"a{i}")
        split.push("w", i, local.apply(0, g.clone()).clone(), key=f"b{i}")
    assert torch.equal(server.values(), split.values())


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
