"""A loop written for DDP runs unchanged: no empty epoch while the job has data, a joining worker's loop
follows the job's epoch, SIGTERM hands back on the optimizer path, a DataLoader batch size that differs
from the sampler's is an error at the first batch."""
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from harness import run_threads, wait_until
from shoal.errors import InvalidArgument
from shoal.worker import DistributedOptimizer, DistributedSampler
from shoal.worker import trainer as trainer_module


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def dataset(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(torch.arange(n), x, y)


def every_batch_once(c, epochs, n, batch):
    for shard in (s for ps in c.servers for s in ps.host.shards.values()):
        for e in range(epochs):
            starts = shard.ledger.starts(e)
            assert set(starts) == set(range(0, n, batch)) and set(starts.values()) == {1}, (e, starts)


def test_a_late_worker_never_iterates_an_empty_epoch_and_a_joiner_follows_the_jobs_epoch(cluster_factory):
    c = cluster_factory(1, mode="async")
    ds, epochs = dataset(), 3
    iterations = {0: [], 1: []}          # per worker: (sampler.epoch, batches) of each finished iteration
    ended = {}
    joined = threading.Event()

    def worker(i):
        model = mlp(i)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, chief=c.chief_address)
        sampler = DistributedSampler(ds, batch_size=16, epochs=epochs, batches_per_task=1, seed=1,
                                     trainer=opt.trainer)
        loader = DataLoader(ds, batch_size=16, sampler=sampler)
        try:
            for epoch in range(epochs):        # the plain loop: loss.item() after the inner loop
                for _, x, y in loader:
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                iterations[i].append((sampler.epoch, loss.item()))
                if i == 0 and epoch == 0:
                    joined.wait(30)        # the second worker joins after epoch 0 is handed out
            ended[i] = "loop"
        except SystemExit as exc:
            ended[i] = f"exit {exc.code}"
        finally:
            opt.close()

    def late():
        wait_until(lambda: iterations[0], timeout_s=30, what="the first worker to finish epoch 0")
        joined.set()
        worker(1)

    run_threads(lambda: worker(0), late, timeout_s=60)
    # the joiner's first iteration was the job's current epoch, not epoch 0, and no iteration was empty
    # (an empty one raises UnboundLocalError at loss.item())
    assert iterations[1] and iterations[1][0][0] >= 1, iterations
    assert [e for e, _ in iterations[0]][0] == 0
    # a worker whose loop asked for more than the job had left (the joiner's last iteration; one whose
    # last epoch the other took whole) left it with exit 0; any other finished its loop
    assert set(ended.values()) <= {"loop", "exit 0"} and len(ended) == 2, ended
    assert c.chief.state.tasks.finished
    every_batch_once(c, epochs, 64, 16)


def test_a_dataloader_batch_size_other_than_the_samplers_is_an_error_at_the_first_batch(cluster_factory):
    c = cluster_factory(1, mode="async")
    ds = dataset()
    model = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, chief=c.chief_address)
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, batch_size=16, epochs=1))
    try:
        with pytest.raises(InvalidArgument, match="the DataLoader's batch_size is 8 but the sampler's is 16"):
            next(iter(loader))
        assert opt.trainer.step_count == 0
    finally:
        opt.close()


@pytest.fixture
def clear_stop():
    yield
    trainer_module._STOP_REQUESTED.clear()


def test_sigterm_on_the_optimizer_path_hands_back_at_the_next_step_and_another_worker_finishes(
        cluster_factory, clear_stop):
    c = cluster_factory(1, mode="async")
    ds, epochs = dataset(), 2
    model = mlp()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, chief=c.chief_address)
    loader = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, batch_size=16, epochs=epochs,
                                                                      batches_per_task=2))
    steps = 0
    with pytest.raises(SystemExit) as leaving:
        for _ in range(epochs):
            for _, x, y in loader:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                if steps == 1:
                    assert trainer_module.request_stop()     # what shoal worker's SIGTERM handler calls
                opt.step()
                steps += 1
    assert leaving.value.code == 0 and opt.trainer.step_count == 2    # the step under way was pushed, then it left
    assert opt.trainer._closed
    trainer_module._STOP_REQUESTED.clear()
    # another worker trains the rest: every batch once, the first worker's included
    other = mlp(1)
    opt2 = DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.05), other, chief=c.chief_address)
    loader2 = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, batch_size=16, epochs=epochs,
                                                                       batches_per_task=2))
    try:
        for _ in range(epochs):
            for _, x, y in loader2:
                opt2.zero_grad()
                F.cross_entropy(other(x), y).backward()
                opt2.step()
    finally:
        opt2.close()
    assert c.chief.state.tasks.finished
    every_batch_once(c, epochs, 64, 16)
