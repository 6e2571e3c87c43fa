"""Checkpoint storage: atomic commits, validation and fallback, re-sliced restore, export."""
import json
import logging

import pytest
import torch

from shoal.settings.config import OptimizerSpec
from shoal.errors import FailedPrecondition, InvalidArgument
from shoal.state.layout import ModelLayout, ShardPlan
from shoal.state.checkpoint import (CheckpointWriter, ShardState, export_to_file, list_checkpoints, load_latest,
                                 open_checkpoint, opt_state_from_flat, opt_state_to_flat)
from shoal.state.optim import build_optimizer


def make_model(hidden: int = 7) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


class Trained:
    """A model trained as ``num_shards`` element-wise shards plus a whole-model reference."""

    def __init__(self, spec: OptimizerSpec, num_shards: int, steps: int = 4):
        self.model = make_model()
        self.layout = ModelLayout.from_module(self.model)
        self.plan = ShardPlan(self.layout.numel, num_shards)
        self.spec = spec
        flat = self.layout.flatten([p.detach() for p in self.model.parameters()])
        self.ref = torch.nn.Parameter(flat.clone(), requires_grad=False)
        self.ref_opt = build_optimizer(self.ref, spec)
        self.params = [torch.nn.Parameter(flat[a:b].clone(), requires_grad=False) for a, b in self.plan.ranges]
        self.opts = [build_optimizer(p, spec) for p in self.params]
        self.gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            self.step()

    def step(self) -> torch.Tensor:
        grad = torch.randn(self.layout.numel, generator=self.gen)
        step_flat(self.ref, self.ref_opt, grad)
        for (a, b), p, o in zip(self.plan.ranges, self.params, self.opts):
            step_flat(p, o, grad[a:b])
        return grad

    def states(self) -> list[ShardState]:
        return [ShardState(k, a, b, p.detach().clone(), self.spec.name, dict(self.spec.hparams),
                           o.state_dict(), version=10 + k, extra={"applied": {"0": 3 + k}})
                for k, ((a, b), p, o) in enumerate(zip(self.plan.ranges, self.params, self.opts))]


def step_flat(param: torch.nn.Parameter, opt: torch.optim.Optimizer, grad: torch.Tensor) -> None:
    param.grad = grad.clone()
    opt.step()
    param.grad = None


def save(root, trained: Trained, step: int, keep: int = 3, meta=None):
    pending = CheckpointWriter(root, keep=keep).begin(step)
    for state in trained.states():
        pending.write_shard(state)
    return pending.commit(trained.layout, trained.plan.num_shards, meta or {"epoch": 1, "step": step})


SGD = OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9})
ADAM = OptimizerSpec("adam", {"lr": 0.01, "beta2": 0.99, "weight_decay": 0.001})


def test_round_trip_two_shards(tmp_path):
    t = Trained(ADAM, 2)
    path = save(tmp_path, t, 7, meta={"epoch": 2, "tasks_done": [1, 2]})
    assert path == tmp_path / "ckpt-000000000007"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "shard-00000.pt", "shard-00001.pt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["step"] == 7 and manifest["num_shards"] == 2
    assert manifest["layout"][0] == ["0.weight", [7, 5], "float32"]
    assert manifest["layout_fingerprint"] == t.layout.fingerprint
    assert [(s["start"], s["stop"], s["version"]) for s in manifest["shards"]] == [(0, 33, 10), (33, 66, 11)]
    assert manifest["shards"][1]["bytes"] == (path / "shard-00001.pt").stat().st_size

    ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 7 and ckpt.path == path
    assert ckpt.layout == t.layout and ckpt.num_shards == 2 and ckpt.versions == {0: 10, 1: 11}
    assert ckpt.meta == {"epoch": 2, "tasks_done": [1, 2]}
    assert torch.equal(ckpt.flat_values(), t.ref.detach())
    state = ckpt.shard_state(t.plan, 1)
    assert (state.start, state.stop, state.version, state.extra) == (33, 66, 11, {"applied": {"0": 4}})
    assert torch.equal(state.values, t.params[1].detach())
    name, hparams, tensors, scalars = ckpt.flat_optimizer()
    assert (name, hparams) == ("adam", dict(ADAM.hparams))
    ref_state = t.ref_opt.state_dict()["state"][0]
    assert torch.equal(tensors["exp_avg_sq"], ref_state["exp_avg_sq"]) and scalars == {"step": 4.0}


@pytest.mark.parametrize("spec", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize("new_shards", [3, 1])
def test_restore_resliced_continues_like_the_whole_model(tmp_path, spec, new_shards):
    t = Trained(spec, 2)
    save(tmp_path, t, 4)
    ckpt = load_latest(tmp_path)
    plan = ShardPlan(t.layout.numel, new_shards)
    restored = [ckpt.shard_state(plan, k) for k in range(new_shards)]
    assert [(s.start, s.stop) for s in restored] == list(plan.ranges)
    assert torch.equal(torch.cat([s.values for s in restored]), ckpt.flat_values())
    _, _, flat_tensors, _ = ckpt.flat_optimizer()
    key = "momentum_buffer" if spec.name == "sgd" else "exp_avg"
    resliced = torch.cat([opt_state_to_flat(s.opt_state)[0][key] for s in restored])
    assert torch.equal(resliced, flat_tensors[key])
    assert torch.equal(flat_tensors[key], t.ref_opt.state_dict()["state"][0][key])
    params = [torch.nn.Parameter(s.values.clone(), requires_grad=False) for s in restored]
    opts = [build_optimizer(p, spec) for p in params]
    for o, s in zip(opts, restored):
        o.load_state_dict(s.opt_state)
    for _ in range(2):
        grad = t.step()
        for (a, b), p, o in zip(plan.ranges, params, opts):
            step_flat(p, o, grad[a:b])
    assert torch.equal(torch.cat([p.detach() for p in params]), t.ref.detach())
    assert restored[0].extra["resliced_from"][0]["extra"] == {"applied": {"0": 3}}


def test_keep_k_prunes_oldest(tmp_path):
    t = Trained(SGD, 2, steps=1)
    for step in (1, 2, 3, 4):
        save(tmp_path, t, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000004", "ckpt-000000000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000003", "ckpt-000000000004"]


def test_just_written_checkpoint_is_never_pruned(tmp_path):
    t = Trained(SGD, 1, steps=1)
    for step in (5, 6):
        save(tmp_path, t, step, keep=1)
    save(tmp_path, t, 3, keep=1)   # older than the newest: kept anyway
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000006", "ckpt-000000000003"]


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[-10] ^= 0x55
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("damage,why", [(_flip, "sha256"), (_truncate, "truncated"),
                                        (lambda p: p.unlink(), "missing")])
def test_damaged_checkpoint_falls_back_to_previous(tmp_path, caplog, damage, why):
    t = Trained(SGD, 2, steps=2)
    save(tmp_path, t, 1)
    first = t.ref.detach().clone()
    t.step()
    bad = save(tmp_path, t, 2)
    damage(bad / "shard-00001.pt")
    with caplog.at_level(logging.WARNING, logger="shoal.state.checkpoint"):
        ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 1
    assert torch.equal(ckpt.flat_values(), first)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ckpt-000000000002" in warnings[0] and why in warnings[0]
    with pytest.raises(FailedPrecondition, match="shard-00001.pt"):
        open_checkpoint(bad)


def test_bad_manifest_is_skipped_and_nothing_valid_gives_none(tmp_path, caplog):
    t = Trained(SGD, 1, steps=1)
    path = save(tmp_path, t, 1)
    (path / "manifest.json").write_text('{"format": 1, "step": ')
    with caplog.at_level(logging.WARNING):
        assert load_latest(tmp_path) is None
    assert "manifest.json" in caplog.text and "ckpt-000000000001" in caplog.text
    assert load_latest(tmp_path / "nowhere") is None


def test_crash_leftover_temp_dir_is_ignored_then_cleaned(tmp_path):
    t = Trained(SGD, 2, steps=1)
    save(tmp_path, t, 5)
    crashed = CheckpointWriter(tmp_path).begin(6)
    crashed.write_shard(t.states()[0])          # the process dies here
    future = tmp_path / ".tmp-ckpt-99-zzzz"      # a step beyond the newest: possibly still being written
    future.mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000005"]
    assert load_latest(tmp_path).step == 5
    save(tmp_path, t, 7)
    assert not crashed.tmp.exists() and future.exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000007", "ckpt-000000000005"]


def test_commit_requires_every_shard_and_exact_tiling(tmp_path):
    t = Trained(SGD, 3, steps=1)
    states = t.states()
    pending = CheckpointWriter(tmp_path).begin(1)
    pending.write_shard(states[0])
    pending.write_shard(states[2])
    with pytest.raises(InvalidArgument, match=r"missing \[1\]"):
        pending.commit(t.layout, 3, {})
    with pytest.raises(InvalidArgument, match="already written"):
        pending.write_shard(states[0])
    assert list_checkpoints(tmp_path) == []
    pending.write_shard(states[1])
    assert pending.commit(t.layout, 3, {}).name == "ckpt-000000000001"

    gap = CheckpointWriter(tmp_path).begin(2)
    s1 = states[1]
    gap.write_shard(states[0])
    gap.write_shard(ShardState(1, s1.start + 1, s1.stop, s1.values[1:].clone(), "sgd", s1.hparams, {}))
    gap.write_shard(states[2])
    with pytest.raises(InvalidArgument, match="must start at"):
        gap.commit(t.layout, 3, {})
    gap.abort()
    assert not gap.tmp.exists() and [p.name for p in tmp_path.iterdir()] == ["ckpt-000000000001"]


def test_write_shard_rejects_bad_values_and_meta(tmp_path):
    t = Trained(SGD, 1, steps=1)
    state = t.states()[0]
    pending = CheckpointWriter(tmp_path).begin(1)
    with pytest.raises(InvalidArgument, match="1-D float32"):
        pending.write_shard(ShardState(0, 0, 66, state.values.double(), "sgd", state.hparams, {}))
    pending.write_shard(state)
    with pytest.raises(InvalidArgument, match="JSON"):
        pending.commit(t.layout, 1, {"bad": object()})


def test_check_layout_names_differing_parameters(tmp_path):
    t = Trained(SGD, 2, steps=1)
    save(tmp_path, t, 1)
    ckpt = load_latest(tmp_path)
    ckpt.check_layout(ModelLayout.from_module(make_model()))
    with pytest.raises(FailedPrecondition, match=r"0\.weight: expected \[7, 5\] float32, got \[8, 5\]") as info:
        ckpt.check_layout(ModelLayout.from_module(make_model(hidden=8)))
    assert "0.bias" in str(info.value) and "2.weight" in str(info.value) and "2.bias" not in str(info.value)


def test_export_to_file_loads_strictly_into_the_module(tmp_path):
    t = Trained(ADAM, 2, steps=3)
    root = tmp_path / "ckpts"
    path = save(root, t, 3)
    for src in (root, path):
        out = export_to_file(src, tmp_path / "model.pt")
        fresh = make_model()
        before = t.layout.flatten([p.detach() for p in fresh.parameters()])
        fresh.load_state_dict(torch.load(out), strict=True)
        after = t.layout.flatten([p.detach() for p in fresh.parameters()])
        assert not torch.equal(before, after)
        assert torch.equal(after, load_latest(root).flat_values())
        assert torch.equal(after, t.ref.detach())


def _flat_param(n: int = 11) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.linspace(-1, 1, n), requires_grad=False)


@pytest.mark.parametrize("name,hparams,amsgrad", [
    ("sgd", {"lr": 0.1, "momentum": 0.9}, False),
    ("sgd", {"lr": 0.05, "momentum": 0.8, "nesterov": 1}, False),
    ("adam", {"lr": 0.01, "beta1": 0.8}, False),
    ("adam", {"lr": 0.01}, True),
    ("adamw", {"lr": 0.01}, False),
])
def test_optimizer_state_flat_round_trip(name, hparams, amsgrad):
    spec = OptimizerSpec(name, hparams)
    a = _flat_param()
    if amsgrad:
        opt_a = torch.optim.Adam([a], lr=0.01, amsgrad=True)
    else:
        opt_a = build_optimizer(a, spec)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        step_flat(a, opt_a, torch.randn(11, generator=gen))
    tensors, scalars = opt_state_to_flat(opt_a.state_dict())
    assert set(tensors) == ({"momentum_buffer"} if name == "sgd" else
                            {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set()))
    assert scalars == ({} if name == "sgd" else {"step": 3.0})
    b = torch.nn.Parameter(a.detach().clone(), requires_grad=False)
    opt_b = build_optimizer(b, spec)
    opt_b.load_state_dict(opt_state_from_flat(name, tensors, scalars, spec.hparams))
    for _ in range(2):
        grad = torch.randn(11, generator=gen)
        step_flat(a, opt_a, grad)
        step_flat(b, opt_b, grad)
    assert torch.equal(a.detach(), b.detach())
    assert not torch.equal(a.detach(), torch.linspace(-1, 1, 11))


def test_fresh_optimizer_state_round_trips_empty():
    spec = OptimizerSpec("adam", {"lr": 0.01})
    tensors, scalars = opt_state_to_flat(build_optimizer(_flat_param(), spec).state_dict())
    assert (tensors, scalars) == ({}, {})
    assert opt_state_from_flat("adam", tensors, scalars, spec.hparams)["state"] == {}


def test_uneven_scalar_across_shards_warns_and_takes_majority(tmp_path, caplog):
    t = Trained(ADAM, 3, steps=2)
    step_flat(t.params[2], t.opts[2], torch.ones(t.plan.shard_numel(2)))   # shard 2 one step ahead
    save(tmp_path, t, 1)
    with caplog.at_level(logging.WARNING):
        _, _, _, scalars = load_latest(tmp_path).flat_optimizer()
    assert scalars == {"step": 2.0} and "'step' differs" in caplog.text


@pytest.mark.parametrize("field,value", [("created", "yesterday"), ("step", "two")])
def test_a_manifest_field_that_is_not_a_number_is_skipped_not_fatal(tmp_path, caplog, field, value):
    t = Trained(SGD, 1, steps=2)
    save(tmp_path, t, 1)
    t.step()
    bad = save(tmp_path, t, 2)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest[field] = value
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="shoal.state.checkpoint"):
        ckpt = load_latest(tmp_path)
    assert ckpt is not None and ckpt.step == 1
    assert "ckpt-000000000002" in caplog.text
    with pytest.raises(FailedPrecondition, match="manifest.json"):
        open_checkpoint(bad)
