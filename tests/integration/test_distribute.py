"""Adopt in one line: ``model, opt, loader = shoal.worker.distribute(model, opt, loader)``."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler, default_collate

import shoal.worker
from shoal.errors import InvalidArgument
from shoal.worker import DistributedSampler


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def dataset(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(torch.arange(n), x, y)


collated = []


def counting_collate(items):
    collated.append(len(items))
    return default_collate(items)


def test_one_call_keeps_the_loaders_settings_and_takes_the_epochs_from_the_loop(cluster_factory, monkeypatch):
    c = cluster_factory(1, mode="async")
    monkeypatch.setenv("SHOAL_CHIEF", c.chief_address)
    monkeypatch.delenv("SHOAL_EPOCHS", raising=False)
    ds, epochs = dataset(), 2
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(ds, batch_size=16, shuffle=True, collate_fn=counting_collate)
    model2, opt, loader = shoal.worker.distribute(model, opt, loader)        # the one changed line
    try:
        assert model2 is model and isinstance(opt, torch.optim.Adam)
        assert isinstance(loader.sampler, DistributedSampler)
        assert (loader.sampler.batch_size, loader.sampler.epochs, loader.sampler.shuffle) == (16, 2, True)
        assert loader.collate_fn is counting_collate
        seen = []
        for epoch in range(epochs):
            for idx, x, y in loader:
                seen.append(idx)
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            print(epoch, loss.item())
    finally:
        opt.close()
    assert sorted(torch.cat(seen).tolist()) == sorted(list(range(64)) * 2)
    assert collated and set(collated) == {16}
    assert c.chief.state.tasks.finished


def test_outside_a_job_the_three_come_back_unchanged(monkeypatch):
    monkeypatch.delenv("SHOAL_CHIEF", raising=False)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(dataset(), batch_size=16, shuffle=True)
    assert shoal.worker.distribute(model, opt, loader) == (model, opt, loader)


def test_the_epochs_come_from_the_launcher_and_a_job_without_them_is_one_line(monkeypatch):
    from shoal.worker.distribute import _epochs

    monkeypatch.setenv("SHOAL_EPOCHS", "7")
    assert _epochs(None, None) == 7
    assert _epochs(3, None) == 3
    monkeypatch.delenv("SHOAL_EPOCHS")
    monkeypatch.delenv("SHOAL_JOB_FILE", raising=False)
    with pytest.raises(InvalidArgument, match="cannot tell how many epochs the job trains: pass epochs=N"):
        _epochs(None, None)


def test_a_loader_whose_sampler_cannot_be_kept_is_refused_before_joining(monkeypatch):
    monkeypatch.setenv("SHOAL_CHIEF", "127.0.0.1:1")            # nothing listens: refused before joining
    ds = dataset()
    model = mlp()
    weighted = DataLoader(ds, batch_size=16, sampler=WeightedRandomSampler(torch.ones(64), 64))
    with pytest.raises(InvalidArgument, match="its WeightedRandomSampler cannot be kept"):
        shoal.worker.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), weighted, epochs=1)
