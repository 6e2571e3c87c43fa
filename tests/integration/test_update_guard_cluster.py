"""The issue's attacks on an in-process cluster: a worker whose pushes carry a 3e38 gradient and a
learning rate of 1e30 (each from the user's own loop) is refused; its batches go back, are trained
again, and the job ends exactly-once with the model as a clean run leaves it, near enough."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from harness import run_threads
from shoal.worker import DistributedOptimizer, DistributedSampler
from test_user_loop import dataset, mlp

EPOCHS = 3


def train(c, attack: bool):
    ds = dataset(n=96)
    models = [mlp(0), mlp(0)]
    steps = {0: 0, 1: 0}

    def worker(i):
        model = models[i]
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model, chief=c.chief_address)
        loader = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, batch_size=16, epochs=EPOCHS, seed=1,
                                                                         trainer=opt.trainer))
        try:
            for _ in range(EPOCHS):
                for _, x, y in loader:
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    evil = attack and i == 1 and steps[i] in (1, 3)
                    if evil and steps[i] == 1:
                        model[0].weight.grad[0, 0] = 3e38           # finite: NaN checks let it through
                    lr = opt.param_groups[0]["lr"]
                    if evil and steps[i] == 3:
                        opt.param_groups[0]["lr"] = 1e30
                    opt.step()
                    opt.param_groups[0]["lr"] = lr
                    steps[i] += 1
        finally:
            opt.close()

    run_threads(lambda: worker(0), lambda: worker(1), timeout_s=60)
    primaries = [s for ps in c.servers for sid, s in ps.host.shards.items()
                 if c.chief.state.routing[sid] == ps.chief.member_id]
    return primaries, torch.cat([s.values() for s in sorted(primaries, key=lambda s: s.shard_id)])


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_workers_3e38_gradient_and_lr_1e30_leave_the_model_intact_and_the_job_exactly_once(cluster_factory,
                                                                                             mode):
    clean_shards, clean = train(cluster_factory(2, mode=mode), attack=False)
    shards, attacked = train(cluster_factory(2, mode=mode), attack=True)
    for s in shards:                                  # every batch reached every shard exactly once
        for e in range(EPOCHS):
            starts = s.ledger.starts(e)
            assert set(starts) == set(range(0, 96, 16)) and set(starts.values()) == {1}, (s.shard_id, e, starts)
    refused = {}
    for s in shards:
        for w, n in s.guard_counts().items():
            refused[w] = refused.get(w, 0) + n
    assert len(refused) == 1 and sum(refused.values()) >= 2     # the attacker's two pushes, on the shards they hit
    assert all(s.guard.refusals.rolled_back == 0 and not s.guard.refusals.expelled for s in shards)
    assert torch.isfinite(attacked).all()
    # Adam, lr 0.01, 18 batches: the attacked model is as far from its start as the clean one, not 1e30 away
    start = torch.cat([p.detach().reshape(-1) for p in mlp(0).parameters()])
    assert float((attacked - start).abs().max()) < 2 * float((clean - start).abs().max()) + 0.05
