"""Gradient accumulation over micro-batches in the user's own loop: one push per k batches, each batch
in every shard's ledger once, the same weights as accumulating in one process."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from harness import run_threads, wait_until
from shoal.errors import FailedPrecondition, InvalidArgument
from shoal.worker import DistributedOptimizer, DistributedSampler

K = 4
BS = 8
N = 144                  # 18 batches an epoch: groups of 4 reach across the epoch boundary
PER_TASK = 3             # 3 batches a task: groups of 4 reach across tasks


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def dataset(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(torch.arange(n), x, y)


def accumulate(opt, model, loader, epochs, style):
    """Trains with groups of K micro-batches; returns the sample indices of each push, in order.

    ``plain``: K backward() then one step() (the user's own counter, across epochs), and a step()
    after the loop for a last short group. ``per_batch``: zero_grad/backward/step on every batch,
    with backward_passes_per_step=K."""
    groups, group = [], []
    for _ in range(epochs):
        for idx, x, y in loader:
            if style == "per_batch":
                opt.zero_grad()
            (F.cross_entropy(model(x), y) / K).backward()
            group.append(idx)
            before = opt.trainer.step_count
            if style == "per_batch" or len(group) == K:
                opt.step()
            if opt.trainer.step_count > before:
                groups.append(group)
                group = []
                if style == "plain":
                    opt.zero_grad()
    before = opt.trainer.step_count
    opt.step()                                         # a last short group, if any (none: a no-op)
    if group:
        groups.append(group)
    assert opt.trainer.step_count == before + bool(group)
    return groups


def one_process(groups, ds, momentum=0.9):
    ref = mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    _, x_all, y_all = ds.tensors
    for group in groups:
        opt.zero_grad()
        for idx in group:
            (F.cross_entropy(ref(x_all[idx]), y_all[idx]) / K).backward()
        opt.step()
    return ref


def copies(c):
    """Every copy of every shard: primaries and their backups."""
    return [s for ps in c.servers for s in ps.host.shards.values()]


def assert_every_batch_once(c, epochs, n=N):
    for shard in copies(c):
        for e in range(epochs):
            starts = shard.ledger.starts(e)
            assert set(starts) == set(range(0, n, BS)) and set(starts.values()) == {1}, (shard.shard_id, e)


@pytest.mark.parametrize("style", ["plain", "per_batch"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_accumulating_k_micro_batches_trains_as_in_one_process_with_one_push_per_k(cluster_factory, mode, style):
    c = cluster_factory(2, mode=mode)
    ds = dataset()
    model = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                               chief=c.chief_address, backward_passes_per_step=K if style == "per_batch" else None)
    loader = DataLoader(ds, batch_size=BS, sampler=DistributedSampler(ds, batch_size=BS, epochs=2, shuffle=False,
                                                                      batches_per_task=PER_TASK))
    try:
        groups = accumulate(opt, model, loader, 2, style)
        pushes = opt.trainer.step_count
    finally:
        opt.close()
    assert [len(g) for g in groups] == [K] * 9 and pushes == 9          # 36 batches, one push per 4
    assert any(len({int(i) // (BS * PER_TASK) for i in torch.cat(g)}) > 1 for g in groups)   # spanning tasks
    ref = one_process(groups, ds)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)
    assert_every_batch_once(c, 2)
    applied = sorted(s.stats.pushes_applied for s in copies(c) if s.stats.pushes_applied)
    assert applied == [9, 9] and all(s.version == 9 for s in copies(c))      # primaries and backups
    wait_until(lambda: c.chief.state.tasks.finished, what="every task of the job done")


def test_synchronize_pushes_a_last_short_group_of_backward_passes_per_step(cluster_factory):
    """36 batches in groups of 5: seven pushes during the loop, and synchronize() pushes the last
    batch rather than leaving it to go back to the chief when the worker leaves."""
    c = cluster_factory(2, mode="async")
    ds = dataset()
    model = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, chief=c.chief_address,
                               backward_passes_per_step=5)
    loader = DataLoader(ds, batch_size=BS, sampler=DistributedSampler(ds, batch_size=BS, epochs=2, shuffle=False,
                                                                      batches_per_task=PER_TASK))
    try:
        for _ in range(2):
            for _, x, y in loader:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        assert opt.trainer.step_count == 7
        opt.synchronize()
        assert opt.trainer.step_count == 8
        opt.synchronize()                          # nothing left: only a pull
        assert opt.trainer.step_count == 8
    finally:
        opt.close()
    assert_every_batch_once(c, 2)
    wait_until(lambda: c.chief.state.tasks.finished, what="every task of the job done")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_workers_accumulating_put_every_batch_in_every_ledger_once(cluster_factory, mode):
    c = cluster_factory(2, mode=mode)
    ds = dataset()
    models = [mlp(0), mlp(1)]
    opts = [DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), m, chief=c.chief_address)
            for m in models]
    groups = {}

    def worker(i):
        sampler = DistributedSampler(ds, batch_size=BS, epochs=2, seed=5, batches_per_task=PER_TASK,
                                     trainer=opts[i].trainer)
        groups[i] = accumulate(opts[i], models[i], DataLoader(ds, batch_size=BS, sampler=sampler), 2, "plain")

    try:
        run_threads(lambda: worker(0), lambda: worker(1), timeout_s=60)
        steps = [o.trainer.step_count for o in opts]
    finally:
        for o in opts:
            o.close()
    trained = [len(g) for i in (0, 1) for g in groups[i]]
    assert sum(steps) == len(trained) == sum(math.ceil(sum(len(g) for g in groups[i]) / K) for i in (0, 1))
    assert sum(trained) >= 36 and max(trained) == K
    assert_every_batch_once(c, 2)
    primaries = [s for s in copies(c) if s.stats.pushes_applied]
    assert len(primaries) == 2
    for s in primaries:          # each push reached each shard once: applied, or dropped (its batches retrained)
        assert s.stats.pushes_applied + s.stats.pushes_dropped == sum(steps)
    wait_until(lambda: c.chief.state.tasks.finished, what="every task of the job done")


def test_an_accumulated_step_the_grad_scaler_skips_pushes_nothing_and_hands_back_all_its_batches(cluster_factory):
    c = cluster_factory(1, mode="async")
    ds = dataset(n=128)                            # 16 batches, 4 groups
    model = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                               chief=c.chief_address)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    loader = DataLoader(ds, batch_size=BS, sampler=DistributedSampler(ds, batch_size=BS, epochs=1, seed=2,
                                                                      batches_per_task=PER_TASK))
    trained, group, n = [], [], 0
    try:
        opt.zero_grad()
        for idx, x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y) / K
            if n == 5:
                loss = loss * float("inf")           # an overflow in the second group: the scaler skips it
            n += 1
            scaler.scale(loss).backward()
            group.append(idx)
            if len(group) == K:
                before = opt.trainer.step_count
                scaler.step(opt)
                scaler.update()
                if opt.trainer.step_count > before:
                    trained.append(group)
                group = []
                opt.zero_grad()                      # after a skipped step: its 4 batches go back to the chief
    finally:
        opt.close()
    shard = c.servers[0].host.shards[0]
    assert n == 20 and len(trained) == 4 and shard.version == 4 == shard.stats.pushes_applied
    starts = shard.ledger.starts(0)
    assert set(starts) == set(range(0, 128, BS)) and set(starts.values()) == {1}
    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _, x_all, y_all = ds.tensors
    for g in trained:                                # unscaled: as without a scaler
        ref_opt.zero_grad()
        for idx in g:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                (F.cross_entropy(ref(x_all[idx]).float(), y_all[idx]) / K).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=1e-4)


def test_misused_accumulation_is_a_clear_error(cluster_factory):
    c = cluster_factory(1, mode="async")
    model = mlp()
    with pytest.raises(InvalidArgument, match="backward_passes_per_step must be a whole number >= 1.*got 0"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, chief=c.chief_address,
                             backward_passes_per_step=0)
    with pytest.raises(InvalidArgument, match="backward_passes_per_step=2 needs overlap=False"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, chief=c.chief_address,
                             backward_passes_per_step=2, overlap=True)
    ds = dataset(n=64)
    x, y = ds.tensors[1:]
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, chief=c.chief_address,
                               backward_passes_per_step=2)
    try:
        opt.zero_grad()
        for i in range(3):
            F.cross_entropy(model(x[:8]), y[:8]).backward()
        with pytest.raises(FailedPrecondition, match="step\\(\\) after 3 backward passes with "
                                                     "backward_passes_per_step=2"):
            opt.step()
        assert opt.trainer.step_count == 0
    finally:
        opt.close()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, chief=c.chief_address,
                               overlap=True)
    try:
        opt.zero_grad()
        F.cross_entropy(model(x[:8]), y[:8]).backward()
        with pytest.raises(FailedPrecondition, match="second backward\\(\\) before step\\(\\).*overlap=False"):
            F.cross_entropy(model(x[8:16]), y[8:16]).backward()
    finally:
        opt.close()
