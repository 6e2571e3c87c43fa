"""The user's torch.optim class and param groups, run over shards cut anywhere across the groups."""
import pytest
import torch

from shoal.settings.config import OptimizerSpec
from shoal.errors import InvalidArgument
from shoal.state.layout import ModelLayout, ShardPlan
from shoal.state.optim import numeric_hparams
from shoal.ps.consistency import AsyncRule
from shoal.ps.shard import Shard
from shoal.worker.optimizer import spec_from_torch


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))


def groups_of(m, **second):
    return [{"params": [m[0].weight, m[2].bias]}, {"params": [m[0].bias, m[2].weight], **second}]


CASES = [
    (lambda m: torch.optim.RMSprop(groups_of(m, lr=0.02, weight_decay=0.1), lr=0.01, momentum=0.5), 3),
    (lambda m: torch.optim.Adam(groups_of(m, lr=0.003, betas=(0.8, 0.9)), lr=0.01, amsgrad=True), 2),
    (lambda m: torch.optim.SGD(groups_of(m, lr=0.05, momentum=0.9, nesterov=True), lr=0.1), 4),
    (lambda m: torch.optim.Adagrad([m[0].weight, m[0].bias], lr=0.1), 3),      # layer 2 frozen: never stepped
    (lambda m: torch.optim.NAdam(m.parameters(), lr=0.01), 1),
]


@pytest.mark.parametrize("make, num_shards", CASES)
def test_shards_step_as_the_users_optimizer_with_changing_hyperparameters(make, num_shards):
    ref, dist = model(), model()
    opt_ref, opt_user = make(ref), make(dist)
    spec = spec_from_torch(opt_user, dist)
    assert spec.name == type(opt_ref).__name__ and len(spec.groups) == len(opt_ref.param_groups)
    layout = ModelLayout.from_module(dist)
    plan = ShardPlan(layout.numel, num_shards)
    flat = layout.flatten([p.detach() for p in dist.parameters()])
    shards = [Shard(k, flat[a:b].clone(), spec, AsyncRule(), layout.fingerprint, flat_start=a)
              for k, (a, b) in enumerate(plan.ranges)]
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        for g in opt_ref.param_groups:           # a scheduler's doing: lr halves every step
            g["lr"] *= 0.5
        hp = numeric_hparams(enumerate(opt_ref.param_groups))
        grads = [torch.randn(p.shape, generator=gen) for p in ref.parameters()]
        for p, gr in zip(ref.parameters(), grads):
            p.grad = gr.clone() if any(p is q for g in opt_ref.param_groups for q in g["params"]) else None
        opt_ref.step()
        fg = layout.flatten(grads)
        for k, (a, b) in enumerate(plan.ranges):
            shards[k].push("w", shards[k].version, fg[a:b].clone(), hparams=hp)
    got = torch.cat([s.values() for s in shards])
    torch.testing.assert_close(got, layout.flatten([p.detach() for p in ref.parameters()]), rtol=1e-5, atol=1e-6)
    assert shards[0].applied_hparams["0.lr"] == opt_ref.param_groups[0]["lr"]


def test_a_shard_spanning_groups_checkpoints_and_restores_its_state():
    m = model()
    spec = spec_from_torch(torch.optim.RMSprop(groups_of(m, lr=0.02), lr=0.01, momentum=0.5), m)
    layout = ModelLayout.from_module(m)
    flat = layout.flatten([p.detach() for p in m.parameters()])
    a, b = 20, layout.numel - 7
    s = Shard(0, flat[a:b].clone(), spec, AsyncRule(), layout.fingerprint, flat_start=a)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        s.push("w", s.version, torch.randn(b - a, generator=gen))
    state = s.export_state()
    assert state.start == a and OptimizerSpec.from_saved(state.optimizer, state.hparams) == spec
    copy = Shard.from_state(state, AsyncRule(), layout.fingerprint)
    g = torch.randn(b - a, generator=gen)
    s.push("w", s.version, g.clone())
    copy.push("w", copy.version, g.clone())
    assert torch.equal(s.values(), copy.values()) and s.digest() == copy.digest()


def test_plain_sgd_adam_adamw_keep_the_registered_names():
    m = model()
    assert spec_from_torch(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m) == \
        OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9})
    assert spec_from_torch(torch.optim.AdamW(m.parameters(), lr=0.01), m) == OptimizerSpec("adamw", {"lr": 0.01})
    assert spec_from_torch(torch.optim.Adam(m.parameters(), amsgrad=True), m).name == "Adam"


@pytest.mark.parametrize("make, message", [
    (lambda m: torch.optim.LBFGS(m.parameters()), "torch.optim.LBFGS cannot run on the parameter servers: it re-eval"),
    (lambda m: torch.optim.Adafactor(m.parameters()), "torch.optim.Adafactor cannot run"),
    (lambda m: torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1), "not a parameter of the model"),
])
def test_an_optimizer_the_servers_cannot_run_is_a_clear_error(make, message):
    m = model()
    with pytest.raises(InvalidArgument, match=message):
        spec_from_torch(make(m), m)


def test_bad_pushed_hyperparameters_are_refused_and_change_nothing():
    m = model()
    spec = spec_from_torch(torch.optim.RMSprop(groups_of(m, lr=0.02), lr=0.01), m)
    layout = ModelLayout.from_module(m)
    s = Shard(0, layout.flatten([p.detach() for p in m.parameters()]), spec, AsyncRule(), layout.fingerprint)
    for bad, message in [({"5.lr": 0.1}, "no param group 5"), ({"0.lr": float("nan")}, "not a finite"),
                         ({"0.betas.0": 0.1}, "has no numeric 'betas'"), ({"lr": 0.1}, "is not <group>.<name>")]:
        with pytest.raises(InvalidArgument, match=message):
            s.push("w", 0, torch.zeros(layout.numel), hparams=bad)
    assert s.version == 0
