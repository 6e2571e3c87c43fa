"""A plain PyTorch loop on a cluster: the user's optimizer, scheduler, DataLoader and epoch loop."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from shoal.errors import FailedPrecondition, InvalidArgument
from harness import InProcessCluster, run_threads, wait_until
from shoal.state.checkpoint import export_to_file, load_latest
from shoal.chief.checkpointer import CheckpointConfig, Interval
from shoal.settings.config import JobConfig
from shoal.worker import DistributedOptimizer, DistributedSampler, Trainer


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def dataset(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(torch.arange(n), x, y)


def groups(m):
    return [{"params": [m[0].weight, m[0].bias], "lr": 0.05, "weight_decay": 0.01},
            {"params": [m[2].weight, m[2].bias]}]


SCHEDULES = {
    "steplr": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_users_optimizer_groups_and_scheduler_train_as_in_one_process(cluster_factory, schedule):
    c = cluster_factory(2, mode="sync")
    ds = dataset()
    model = mlp()
    opt = DistributedOptimizer(torch.optim.RMSprop(groups(model), lr=0.02, momentum=0.5), model,
                               chief=c.chief_address)
    sched = SCHEDULES[schedule](opt)
    sampler = DistributedSampler(ds, batch_size=16, epochs=2, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    order = []
    try:
        for epoch in range(2):
            for idx, x, y in loader:
                order.append(idx)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
    finally:
        opt.close()
    # the same batches in the same order, in one process
    ref = mlp()
    ref_opt = torch.optim.RMSprop(groups(ref), lr=0.02, momentum=0.5)
    ref_sched = SCHEDULES[schedule](ref_opt)
    _, x_all, y_all = ds.tensors
    for idx in order:
        ref_opt.zero_grad()
        F.cross_entropy(ref(x_all[idx]), y_all[idx]).backward()
        ref_opt.step()
        ref_sched.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)
    # each epoch a fresh permutation: every sample once, in another order than the epoch before
    seen = torch.cat(order)
    assert sorted(seen[:96].tolist()) == list(range(96)) == sorted(seen[96:].tolist())
    assert not torch.equal(seen[:96], seen[96:])
    # the servers stepped with the scheduler's last learning rates, group by group
    # (the primaries': a backup whose copy was installed after the last update has stepped with nothing yet,
    # and keeps the optimizer's own settings until its next update brings the user's)
    lr_used = {k: v for ps in c.servers for sid, s in ps.host.shards.items()
               if c.chief.state.routing[sid] == ps.chief.member_id for k, v in s.applied_hparams.items()}
    assert lr_used["1.lr"] == pytest.approx(ref_opt.param_groups[1]["lr"] if schedule == "warmup" else 0.02 * 0.5 ** 5)
    assert lr_used["0.lr"] == pytest.approx(0.05 * (1.0 if schedule == "warmup" else 0.5 ** 5))
    # the wrapped optimizer is still the user's class; state_dict round-trips the scheduled lr
    assert isinstance(opt, torch.optim.RMSprop)
    state = opt.state_dict()
    assert state["param_groups"][0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_two_workers_split_each_epoch_with_their_own_epoch_loops(cluster_factory):
    c = cluster_factory(2, mode="async")
    ds = dataset(n=100)                       # 100 = 6 full batches of 16 and one of 4, each epoch
    seen = {0: [], 1: []}
    models = [mlp(0), mlp(1)]

    def worker(i):
        model = models[i]
        trainer = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.01)
        opt = torch.optim.Adam(model.parameters())        # the sampler takes the trainer given
        sampler = DistributedSampler(ds, batch_size=16, epochs=3, seed=1, trainer=trainer)
        loader = DataLoader(ds, batch_size=16, sampler=sampler, num_workers=0)
        del opt
        try:
            for epoch in range(3):
                for idx, x, y in loader:
                    seen[i].append((epoch, idx))
                    trainer.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    trainer.step()
        except SystemExit as exc:      # its last epoch was all trained by the other: it left, exit 0
            assert exc.code == 0 and c.chief.state.tasks.finished
        finally:
            trainer.close()

    run_threads(lambda: worker(0), lambda: worker(1), timeout_s=20)
    for shard in (s for ps in c.servers for s in ps.host.shards.values()):
        for e in range(3):
            starts = shard.ledger.starts(e)
            assert set(starts) == set(range(0, 100, 16)) and set(starts.values()) == {1}
    everything = [idx for i in (0, 1) for _, idx in seen[i]]
    assert sorted(torch.cat(everything).tolist()) == sorted(list(range(100)) * 3)
    assert all(len(idx) in (16, 4) for i in (0, 1) for _, idx in seen[i])


def test_a_loop_past_the_jobs_epochs_leaves_the_job_and_set_epoch_past_the_end_is_an_error(cluster_factory):
    c = cluster_factory(1, mode="async")
    ds = dataset(n=32)
    model = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, chief=c.chief_address)
    sampler = DistributedSampler(ds, batch_size=16, epochs=2)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    try:
        for _ in range(2):
            for x in loader:
                opt.zero_grad()
                F.cross_entropy(model(x[1]), x[2]).backward()
                opt.step()
        with pytest.raises(InvalidArgument, match=r"set_epoch\(5\): the job trains epochs 0..1"):
            sampler.set_epoch(5)
        with pytest.raises(SystemExit) as leaving:        # the job is over: the worker leaves, exit 0
            list(loader)
        assert leaving.value.code == 0
        assert c.chief.state.tasks.finished
    finally:
        opt.close()


@pytest.fixture
def plain_trainer(cluster_factory):
    """An MLP and the lower-layer Trainer on a one-shard async job."""
    c = cluster_factory(1, mode="async")
    model = mlp()
    trainer = Trainer(model, chief=c.chief_address)
    yield model, trainer
    trainer.close()


def test_calling_batches_again_after_the_data_is_done_is_an_error(plain_trainer):
    model, trainer = plain_trainer
    x, y = dataset(n=32).tensors[1:]
    for epoch in range(2):                # the one-epoch trap: batches() inside an epoch loop
        if epoch == 1:
            with pytest.raises(FailedPrecondition, match="one iterator over all epochs"):
                next(iter(trainer.batches((x, y), batch_size=16)))
            break
        for xb, yb in trainer.batches((x, y), batch_size=16):
            trainer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            trainer.step()


def test_a_batch_left_without_step_is_an_error_and_skip_batch_hands_it_back(plain_trainer):
    model, trainer = plain_trainer
    x, y = dataset(n=64).tensors[1:]
    batches = trainer.batches((x, y), batch_size=16)
    next(batches)
    trainer.skip_batch()                       # handed back: the loop may go on
    xb, yb = next(batches)
    F.cross_entropy(model(xb), yb).backward()  # accumulating: a second backward() before one step()
    with pytest.raises(FailedPrecondition, match=r"without step\(\) or skip_batch\(\).*accumulation"):
        next(batches)
    assert trainer.step_count == 0


def bn_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def test_batchnorm_buffers_are_the_jobs_state_on_every_worker_and_in_the_export(cluster_factory, tmp_path):
    c = cluster_factory(2, mode="sync")
    ds = dataset(n=128)
    models = [bn_net(0), bn_net(1)]
    opts = [DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, chief=c.chief_address) for m in models]

    def worker(i):
        # a third epoch stays untrained: the job is still running when the late worker joins (a worker that
        # joins a job that has ended is turned away, chief/lifecycle.py)
        sampler = DistributedSampler(ds, batch_size=16, epochs=3, seed=0, trainer=opts[i].trainer)
        for epoch in range(2):
            for idx, x, y in DataLoader(ds, batch_size=16, sampler=sampler):
                opts[i].zero_grad()
                F.cross_entropy(models[i](x), y).backward()
                opts[i].step()

    try:
        run_threads(lambda: worker(0), lambda: worker(1), timeout_s=60)
        for o in opts:
            o.synchronize()
        s0, s1 = (m.state_dict() for m in models)
        bn = models[0][1]
        assert bn.num_batches_tracked.item() > 0 and not torch.equal(bn.running_var, torch.ones(16))
        for k in s0:
            assert torch.equal(s0[k], s1[k]), f"{k} differs between the workers"
        # a worker that joins starts from the job's buffers, not its fresh ones
        late = bn_net(7)
        late_opt = DistributedOptimizer(torch.optim.SGD(late.parameters(), lr=0.1), late, chief=c.chief_address)
        assert torch.equal(late[1].running_mean, bn.running_mean)
        assert late[1].num_batches_tracked.item() == bn.num_batches_tracked.item()
        late_opt.close()
    finally:
        for o in opts:
            o.close()


def test_the_exported_model_loads_strictly_with_its_batchnorm_statistics_and_scores_the_same(tmp_path):
    cfg = CheckpointConfig(str(tmp_path / "ckpts"), Interval(steps=4), keep=2, poll_s=0.05)
    ds = dataset(n=64)
    with InProcessCluster(1, JobConfig(mode="async", num_shards=1), checkpoint=cfg) as c:
        model = bn_net()
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model, chief=c.chief_address)
        try:
            for idx, x, y in DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, batch_size=16, epochs=1)):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            opt.synchronize()
            final = opt.trainer.flat_weights.clone()
            wait_until(lambda: (ck := load_latest(cfg.directory)) is not None and torch.equal(ck.flat_values(), final),
                       timeout_s=30, what="the checkpoint taken when the data is done")
        finally:
            opt.close()
    exported = bn_net(9)
    exported.load_state_dict(torch.load(export_to_file(cfg.directory, tmp_path / "model.pt")), strict=True)
    model.eval(), exported.eval()
    _, x, _ = ds.tensors
    assert torch.equal(exported[1].running_mean, model[1].running_mean)
    torch.testing.assert_close(exported(x), model(x))


def test_grad_scaler_unscales_before_the_push_and_a_skipped_step_pushes_nothing(cluster_factory):
    c = cluster_factory(1, mode="async")
    ds = dataset(n=64)
    model = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, chief=c.chief_address,
                               overlap=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    sampler = DistributedSampler(ds, batch_size=16, epochs=2, seed=4)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    trained, n = [], 0
    try:
        for epoch in range(2):
            for idx, x, y in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).float(), y)
                if n == 2:
                    loss = loss * float("inf")         # an overflow: the scaler skips this step
                n += 1
                scaler.scale(loss).backward()
                before = opt.trainer.step_count
                scaler.step(opt)
                scaler.update()
                if opt.trainer.step_count > before:
                    trained.append(idx)
            opt.zero_grad()
    finally:
        opt.close()
    shard = c.servers[0].host.shards[0]
    assert shard.version == len(trained) == 8                 # 8 batches in 2 epochs; the skipped one again
    for e in range(2):
        starts = shard.ledger.starts(e)
        assert set(starts) == set(range(0, 64, 16)) and set(starts.values()) == {1}
    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    _, x_all, y_all = ds.tensors
    for idx in trained:                                       # unscaled: as without a scaler
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(ref(x_all[idx]).float(), y_all[idx]).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=1e-4)


def test_gradients_clipped_between_backward_and_step_are_what_is_pushed(cluster_factory):
    c = cluster_factory(2, mode="async")
    ds = dataset(n=32)
    model, ref = mlp(), mlp()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, chief=c.chief_address)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    loader = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, batch_size=16, epochs=1))
    try:
        for idx, x, y in loader:
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.01)
                o.step()
    finally:
        opt.close()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
