"""The shard's server-side optimizers give what torch.optim gives on the whole model."""
import re

import pytest
import torch

from shoal.settings.config import OptimizerSpec
from shoal.state.layout import ModelLayout, ShardPlan
from shoal.ps.consistency import AsyncRule
from shoal.ps.shard import Shard


@pytest.mark.parametrize("name,hparams,torch_opt", [
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("sgd", {"lr": 0.05, "momentum": 0.8, "nesterov": 1},
     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True)),
    ("adam", {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "weight_decay": 0.001},
     lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), weight_decay=0.001)),
    ("adamw", {"lr": 0.01}, lambda ps: torch.optim.AdamW(ps, lr=0.01)),
])
def test_sharded_optimizer_matches_torch_optim(name, hparams, torch_opt):
    g = torch.Generator().manual_seed(3)
    ref = torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))
    layout = ModelLayout.from_module(ref)
    plan = ShardPlan(layout.numel, 3)
    flat = layout.flatten([p.detach() for p in ref.parameters()])
    spec = OptimizerSpec(name, hparams)
    shards = [Shard(k, flat[a:b].clone(), spec, AsyncRule(), layout.fingerprint)
              for k, (a, b) in enumerate(plan.ranges)]
    opt = torch_opt(list(ref.parameters()))
    for step in range(6):
        grads = [torch.randn(p.shape, generator=g) for p in ref.parameters()]
        for p, gr in zip(ref.parameters(), grads):
            p.grad = gr.clone()
        opt.step()
        flat_g = layout.flatten(grads)
        for k, (a, b) in enumerate(plan.ranges):
            shards[k].push("w", shards[k].version, flat_g[a:b].clone())
    got = torch.cat([s.values() for s in shards])
    want = layout.flatten([p.detach() for p in ref.parameters()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(s.version == 6 for s in shards)


def test_bad_optimizer_settings_are_clear_errors():
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'; known: adam, adamw, sgd"):
        OptimizerSpec("lamb")
    with pytest.raises(ValueError, match="no hyper-parameter betas"):
        OptimizerSpec("adam", {"betas": 0.9})
    with pytest.raises(ValueError, match="learning rate must be > 0, got -1.0"):
        OptimizerSpec("sgd", {"lr": -1})


@pytest.mark.parametrize("name, hparams, message", [
    ("adam", {"beta1": 1.5}, "beta1 must be in [0, 1), got 1.5"),
    ("adamw", {"beta2": -0.1}, "beta2 must be in [0, 1), got -0.1"),
    ("adam", {"eps": float("nan")}, "eps must be in [0, inf), got nan"),
    ("sgd", {"momentum": -0.9}, "momentum must be in [0, inf), got -0.9"),
    ("sgd", {"worker_beta2": 1.0}, "worker_beta2 must be in [0, 1), got 1"),
    ("sgd", {"lr": "fast"}, "hyper-parameters must be numbers"),
])
def test_out_of_range_hyper_parameters_are_refused_where_they_are_given(name, hparams, message):
    """On the worker, before anything is sent: the server would fail its Init, or (for the workers'
    share of an optimizer) nobody would, and training would diverge."""
    with pytest.raises(ValueError, match=re.escape(message)):
        OptimizerSpec(name, hparams)
