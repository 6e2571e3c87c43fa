"""The update guard (ps/guard.py) on the pure shard: bounded hyper-parameters, a robust gradient-norm
bound, steps rolled back rather than leaving NaN/Inf state, refusals counted and expulsion."""
import math

import pytest
import torch

from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.errors import InvalidArgument, PermissionDenied
from shoal.ps.consistency import AsyncRule, SyncRule
from shoal.ps.guard import HparamBounds, NormGuard, UpdateGuard
from shoal.ps.ledger import BatchKey
from shoal.ps.shard import Shard
from shoal.ps.sparse import SparseGrad
from shoal.ps.update import Update

ADAM = OptimizerSpec("adam", {"lr": 0.01})
SGD = OptimizerSpec("sgd", {"lr": 0.1})


def shard(spec=ADAM, n=8, rule=None, **job):
    s = Shard(0, torch.linspace(-1, 1, n), spec, rule or AsyncRule(), "fp")
    s.set_guard(JobConfig(**job))
    return s


def state(s: Shard):
    """Everything a step may change, bit for bit: the weights, the optimizer's state, its hyper-parameters."""
    opt = s.export_state().opt_state["state"]
    return (s.values().numpy().tobytes(), {k: v.numpy().tobytes() if isinstance(v, torch.Tensor) else v
                                           for e in opt.values() for k, v in e.items()}, s.applied_hparams)


def warm(s: Shard, pushes=20, scale=1.0, worker="w0"):
    for i in range(pushes):
        g = torch.full((s.numel,), scale * (1 + 0.01 * i))
        assert s.push(worker, s.version, g, key=f"warm{i}").accepted


# ------------------------------------------------------------ hyper-parameters

def test_bounds_let_a_schedule_move_and_refuse_the_rest():
    b = HparamBounds({"0.lr": 0.1, "0.momentum": 0.9, "0.weight_decay": 0.01, "0.eps": 1e-8,
                      "0.betas.0": 0.9, "0.lr_decay": 0.5}, lr_factor=10)
    assert b.why_not({"0.lr": 0.0}) == ""          # warm-up from zero
    assert b.why_not({"0.lr": 1e-5}) == ""         # decay
    assert b.why_not({"0.lr": 1.0}) == ""          # 10x: the bound itself
    assert "at most 10x" in b.why_not({"0.lr": 1e30}) and "1e+30" in b.why_not({"0.lr": 1e30})
    assert "[0, 1)" in b.why_not({"0.momentum": 1.0})
    assert "[0, 1)" in b.why_not({"0.betas.0": 1.5})
    assert "> 0" in b.why_not({"0.eps": 0.0})
    assert b.why_not({"0.weight_decay": 0.1}) == "" and "at most" in b.why_not({"0.weight_decay": 0.2})
    assert "at most" in b.why_not({"0.lr_decay": 6.0})
    assert "finite" in b.why_not({"0.lr": math.inf})


def test_a_one_cycle_schedule_may_reach_its_max_lr_times_the_factor():
    b = HparamBounds({"0.lr": 0.004, "0.max_lr": 0.1}, lr_factor=2)
    assert b.why_not({"0.lr": 0.1}) == "" and b.why_not({"0.lr": 0.3}) != ""


def test_a_push_carrying_lr_1e30_is_refused_and_the_shard_is_untouched():
    s = shard(SGD)
    warm(s, 3)
    before, version = state(s), s.version
    r = s.push("w0", s.version, torch.ones(8), key="evil", hparams={"0.lr": 1e30})
    assert not r.accepted and not r.duplicate and "0.lr = 1e+30" in r.reason
    assert state(s) == before and s.version == version
    assert s.guard_counts() == {"w0": 1}
    # a scheduler's warm-up and decay are taken
    assert s.push("w0", s.version, torch.ones(8), key="decay", hparams={"0.lr": 0.001}).accepted
    assert s.applied_hparams["0.lr"] == 0.001


# ------------------------------------------------------------ the gradient norm

def test_the_median_is_robust_and_warms_up():
    g = NormGuard(factor=10, warmup=3)
    assert g.bound() == math.inf
    for n in (1.0, 2.0, 1e9):
        g.accept(n)
    assert g.median() == 2.0 and g.bound() == 20.0


def test_a_3e38_gradient_with_adam_leaves_the_shard_exactly_as_before():
    s = shard(ADAM)
    warm(s, 2)                                      # still warming up: only the overflow bound holds
    before, version = state(s), s.version
    g = torch.zeros(8)
    g[3] = 3e38
    r = s.push("w1", s.version, g, key="evil")
    assert not r.accepted and "overflows" in r.reason
    assert state(s) == before and s.version == version


def test_a_norm_far_beyond_the_median_is_refused_after_warm_up():
    s = shard(SGD, grad_norm_warmup=5)
    warm(s, 5)
    before = state(s)
    r = s.push("w1", s.version, torch.full((8,), 1e3), key="spike")
    assert not r.accepted and "beyond 100x the median" in r.reason
    assert state(s) == before
    assert s.push("w1", s.version, torch.full((8,), 2.0), key="ok").accepted   # within 10x: taken


def test_clip_policy_scales_the_push_down_to_the_bound():
    s = shard(SGD, grad_norm_warmup=5, grad_norm_policy="clip")
    warm(s, 5)
    bound = s.guard.norms.bound()
    w0 = s.values()
    r = s.push("w1", s.version, torch.full((8,), 1e6), key="spike")
    assert r.accepted
    moved = float(torch.linalg.vector_norm(w0 - s.values()))
    assert moved == pytest.approx(0.1 * bound, rel=1e-4)          # lr x the clipped norm
    assert s.guard_counts() == {"w1": 1}


def test_sync_round_refuses_one_worker_and_applies_the_others():
    s = shard(SGD, rule=SyncRule(), grad_norm_warmup=1)
    s.set_live_workers(["a", "b"])
    for i in range(3):                              # warm-up rounds
        assert s.push("a", s.version, torch.ones(8), key=f"a{i}").accepted
        assert s.push("b", s.version, torch.ones(8), key=f"b{i}").accepted
    v = s.version
    assert not s.push("b", v, torch.full((8,), 1e4), key="spike").accepted
    assert s.version == v
    assert s.push("a", v, torch.ones(8), key="a-next").accepted
    assert s.push("b", v, torch.ones(8), key="b-again").accepted
    assert s.version == v + 1


# ------------------------------------------------------------ rollback

def test_an_update_that_would_leave_state_nonfinite_is_rolled_back_on_a_backup_too():
    s = shard(ADAM)
    warm(s, 3)
    before, version = state(s), s.version
    g = torch.zeros(8)
    g[3] = 3e38                         # a backup takes its primary's update unguarded: the last line holds
    s.apply_replica(Update(version + 1, g, ("k",), ((BatchKey(0, 0), "k"),), ("w1",)))
    assert state(s) == before
    assert s.version == version + 1 and s.ledger.owner(BatchKey(0, 0)) == "k"   # exactly-once still kept
    assert s.guard.refusals.rolled_back == 1 and s.guard_counts()["w1"] == 1
    assert s.delta("none", version) is not None and len(s.delta("none", version)[1]) == 0   # nothing changed


def test_a_rolled_back_first_step_leaves_no_optimizer_state_behind():
    s = shard(ADAM)
    before = state(s)
    g = torch.zeros(8)
    g[0] = 3e38
    s.apply_replica(Update(1, g, hparams=(("0.lr", 0.05),)))
    assert state(s) == before and s.applied_hparams["0.lr"] == 0.01
    assert s.push("w0", s.version, torch.ones(8), key="next").accepted       # and it trains on


def test_a_sparse_step_that_overflows_is_rolled_back():
    s = Shard(0, torch.tensor([3.3e38, 1.0, 2.0, 3.0]), SGD, AsyncRule(), "fp")
    before = state(s)
    s.apply_replica(Update(1, SparseGrad(torch.tensor([0, 2]), torch.tensor([-3e38, 1.0]), 4), sparse=True))
    assert s.stats.sparse_updates == 1          # the sparse path, its touched elements saved and put back
    assert state(s) == before and s.guard.refusals.rolled_back == 1


# ------------------------------------------------------------ counting and expulsion

def test_a_worker_that_keeps_sending_refused_updates_is_expelled():
    s = shard(SGD, expel_after=3)
    warm(s, 2)
    for i in range(2):
        assert not s.push("evil", s.version, torch.ones(8), key=f"e{i}", hparams={"0.lr": 1e30}).accepted
    with pytest.raises(PermissionDenied, match="expelled from shard 0: 3 refused updates in a row"):
        s.push("evil", s.version, torch.ones(8), key="e2", hparams={"0.lr": 1e30})
    with pytest.raises(PermissionDenied, match="expelled"):
        s.push("evil", s.version, torch.ones(8), key="e3")              # even a good one now
    assert s.push("w0", s.version, torch.ones(8), key="good").accepted  # the others train on
    assert s.guard_counts() == {"evil": 3}


def test_an_accepted_push_ends_the_streak():
    s = shard(SGD, expel_after=2)
    assert not s.push("w", 0, torch.ones(8), key="a", hparams={"0.lr": 1e30}).accepted
    assert s.push("w", 0, torch.ones(8), key="b").accepted
    assert not s.push("w", s.version, torch.ones(8), key="c", hparams={"0.lr": 1e30}).accepted
    assert s.guard_counts() == {"w": 2} and not s.guard.refusals.expelled


def test_guard_settings_are_validated_with_the_bad_value():
    with pytest.raises(InvalidArgument, match="--lr-factor must be a finite number >= 1, got 0.5"):
        JobConfig(lr_factor=0.5)
    with pytest.raises(InvalidArgument, match="--grad-norm-policy 'drop'"):
        JobConfig(grad_norm_policy="drop")
    with pytest.raises(InvalidArgument, match="--grad-norm-factor"):
        JobConfig(grad_norm_factor=1.0)
    assert UpdateGuard({}).judge(None, 1.0).refuse == ""


def test_the_guard_settings_travel_in_the_view():
    from shoal.state import convert

    job = JobConfig(lr_factor=30, grad_norm_factor=0, grad_norm_policy="clip", grad_norm_warmup=5,
                    expel_after=0, require_batch=True)
    assert convert.job_from_pb(convert.job_to_pb(job)) == job


def test_status_and_the_run_summary_say_what_the_guard_did():
    from shoal.cli.progress import result_lines
    from shoal.cli.records import guard_record
    from shoal.cli.status import render

    row = {"shard": 0, "primary": "ps-0", "backup": "", "backup_state": "none", "version": 5, "applied": 9,
           "dropped": 2, "ledger": [], "guard_refused": {"worker-1": 2}, "rolled_back": 1, "expelled": ["worker-1"]}
    s = {"mode": "sync", "view_epoch": 3, "ready": True, "epochs": {"completed": 0, "total": 1},
         "tasks": {"done": 1, "total": 4, "queue_depth": 3}, "totals": {"steps": 9}, "members": [], "shards": [row]}
    assert ("updates refused by the update guard (docs/update-safety.md): worker-1 2 EXPELLED (shard 0); "
            "1 step(s) rolled back") in render(s)
    record = guard_record([row, {"shard": 1, "guard_refused": {"worker-1": 1, "worker-0": 1}}])
    assert record == {"refused": {"worker-1": 3, "worker-0": 1}, "rolled_back": 1, "expelled": ["worker-1"]}
    lines = result_lines({"mode": "sync", "update_guard": record}, ok=True)
    assert ("  update guard    protected the model: 4 update(s) refused, clipped or rolled back "
            "(worker-0 1, worker-1 3); expelled worker-1") in lines
    assert guard_record([{"shard": 0, "guard_refused": {}}]) is None
    assert not any("update guard" in ln for ln in result_lines({"mode": "sync"}, ok=True))


# ------------------------------------------------------------ saving only what a step could spoil

def test_a_bounded_step_is_not_saved_and_an_unbounded_one_is():
    from shoal.state.optim import ShardOptimizer, magnitude

    for spec in (ADAM, SGD, OptimizerSpec("adamw", {"lr": 0.01}), OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9})):
        opt = ShardOptimizer(torch.linspace(-1, 1, 8), spec)
        g = torch.full((8,), 0.5)
        assert opt.needs_save(magnitude(g))             # the first step: nothing known of its inputs
        opt.step(g)
        assert opt.finite() and not opt.needs_save(magnitude(g))
        assert opt.needs_save(3e38) and opt.needs_save(1e13)
        opt.set_hparams({"0.lr": 1e30})
        assert opt.needs_save(magnitude(g))             # a growth no bound covers (a backup's update)
    from shoal.settings.config import ParamGroupSpec

    rms = ShardOptimizer(torch.ones(8), OptimizerSpec("RMSprop", groups=(ParamGroupSpec({"lr": 0.01}, ((0, 8),)),)))
    rms.step(torch.ones(8))
    assert rms.finite() and rms.needs_save(1.0)         # no bound known for it: every step saved


def test_a_step_the_bound_lets_go_unsaved_stays_finite():
    """The bound holds at its edges: inputs up to 1e12, learning rates up to 1e7, decay up to 999, eps down
    to 1e-9, every registered optimizer; and it does let most ordinary steps go unsaved."""
    from shoal.state.optim import ShardOptimizer, magnitude

    unsaved = 0
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        name = ("sgd", "adam", "adamw")[seed % 3]
        hp = {"lr": 10.0 ** int(torch.randint(-3, 8, (1,), generator=g)),
              "weight_decay": float(torch.randint(0, 999, (1,), generator=g)) if seed % 2 else 0.0}
        hp.update({"momentum": 0.99, "nesterov": 1.0} if name == "sgd" else
                  {"eps": 10.0 ** -int(torch.randint(1, 10, (1,), generator=g)), "beta1": 0.99})
        opt = ShardOptimizer((torch.randn(64, generator=g) * 1e11).clamp(-1e11, 1e11), OptimizerSpec(name, hp))
        for _ in range(4):
            grad = (torch.randn(64, generator=g) * 10.0 ** int(torch.randint(0, 12, (1,), generator=g)))
            grad = grad.clamp(-1e11, 1e11)
            free = not opt.needs_save(magnitude(grad))
            opt.step(grad)
            ok = opt.finite()
            if free:
                unsaved += 1
                assert ok, (name, hp)
            elif not ok:
                break                                   # saved: the shard would roll it back
    assert unsaved >= 20
