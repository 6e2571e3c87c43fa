"""Trainers against an in-process chief and parameter servers on ephemeral ports."""
import time

import grpc
import pytest
import torch
import torch.nn.functional as F

from shoal.errors import InvalidArgument, Refused, Unreachable
from shoal.proto import shoal_pb2 as pb
from harness import run_threads, wait_until
from shoal.worker import Trainer


def mlp(seed=0, hidden=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))


def data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x, y


def train(trainer, model, x, y, epochs=3):
    for xb, yb in trainer.batches((x, y), batch_size=16, epochs=epochs):
        trainer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        trainer.step(samples=len(xb))


def assert_exactly_once(cluster, size, batch_size, epochs):
    want = set(range(0, size, batch_size))
    for ps in cluster.servers:
        if getattr(ps, "killed", False):              # a dead process's memory is gone with it
            continue
        for shard in ps.host.shards.values():
            for e in range(epochs):
                starts = shard.ledger.starts(e)
                assert set(starts) == want, f"shard {shard.shard_id} epoch {e}: missing {sorted(want - set(starts))}"
                assert set(starts.values()) == {1}, f"shard {shard.shard_id} epoch {e}: a batch applied twice"


@pytest.mark.parametrize("mode,extra", [("sync", {}), ("async", {}), ("ssp", {"staleness": 1})])
def test_two_workers_train_and_agree(cluster_factory, mode, extra):
    c = cluster_factory(2, mode=mode, **extra)
    x, y = data()
    models = [mlp(0), mlp(1)]                       # different random inits: the first Init wins
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02) for m in models]
    before = F.cross_entropy(models[0](x), y).item()
    run_threads(*[lambda t=t, m=m: train(t, m, x, y) for t, m in zip(trainers, models)])
    for t in trainers:
        t.pull()
    w0 = torch.cat([p.detach().flatten() for p in models[0].parameters()])
    w1 = torch.cat([p.detach().flatten() for p in models[1].parameters()])
    assert torch.equal(w0, w1)
    assert F.cross_entropy(models[0](x), y).item() < before * 0.7
    steps = sum(t.step_count for t in trainers)
    versions = [s.host.get(k).version for k, s in enumerate(c.servers)]
    assert_exactly_once(c, 256, 16, 3)
    if mode == "sync":
        assert steps >= 3 * 256 // 16                # dropped (stale) batches are trained again
        assert all(3 * 256 // 32 <= v <= steps for v in versions)
    else:
        assert steps == 3 * 256 // 16 and versions == [steps, steps]
    for t in trainers:
        t.close()


def two_in_a_round(cluster_factory, lease_seconds):
    """A one-shard sync job with two workers that both hold tasks, so both are in every round."""
    c = cluster_factory(1, mode="sync", lease_seconds=lease_seconds)
    x, y = data(64)
    a, b = mlp(0), mlp(0)
    ta = Trainer(a, chief=c.chief_address, lr=0.1)
    tb = Trainer(b, chief=c.chief_address, lr=0.1)
    feeds = iter(ta.batches((x, y), batch_size=8, epochs=5)), iter(tb.batches((x, y), batch_size=8, epochs=5))
    for feed in feeds:
        next(feed)
    wait_until(lambda: c.servers[0].host.live_workers == {ta.member_id, tb.member_id}, what="both live")
    return c, x, a, ta, tb


def step_alone(model, trainer, x):
    trainer.zero_grad()
    model(x[:8]).sum().backward()
    trainer.step()


def test_sync_round_stops_waiting_for_a_dead_worker(cluster_factory):
    c, x, a, ta, tb = two_in_a_round(cluster_factory, lease_seconds=0.6)
    tb.chief._stop.set()                             # b stops heartbeating (a crash, as seen by the chief)
    step_alone(a, ta, x)                             # blocks until b's lease expires, then the round closes
    assert c.servers[0].host.get(0).version == 1
    assert tb.member_id not in c.servers[0].host.live_workers
    ta.close()


def test_sync_round_goes_on_at_once_when_a_worker_process_dies(cluster_factory):
    """A dead process drops its view watch and its data connections together: the chief ends it then,
    long before its lease (6 s) or the third of a lease a broken watch alone leaves it (2 s)."""
    c, x, a, ta, tb = two_in_a_round(cluster_factory, lease_seconds=6.0)
    assert all(client.uses_tcp for client in tb._clients.values())
    wait_until(lambda: c.chief.state.members.watching(tb.member_id), what="b to watch the view")
    t0 = time.monotonic()
    tb.chief.close()                                 # as a SIGKILL would: the watch and heartbeats stop...
    for client in tb._clients.values():
        client.close()                               # ...and the data connections close, with no Leave
    step_alone(a, ta, x)                             # the round closes once b is gone
    assert time.monotonic() - t0 < 1.5
    assert not c.chief.state.members.get(tb.member_id).live
    assert c.servers[0].host.get(0).version == 1
    tb._pool.shutdown(wait=False)
    ta.close()


def test_layout_mismatch_is_refused_naming_the_first_differing_parameter_both_ways(cluster_factory):
    # issue 36: the worker (already authenticated) hears what to fix; the rest are in the chief's log
    c = cluster_factory(1)
    t = Trainer(mlp(hidden=16), chief=c.chief_address)
    with pytest.raises(Refused) as e:
        Trainer(mlp(hidden=17), chief=c.chief_address)
    assert "0.weight: expected [16, 8] float32, got [17, 8] float32" in str(e.value)
    assert "2 more difference(s)" in str(e.value)
    t.close()


def test_counters_reach_the_chief(cluster_factory):
    c = cluster_factory(2, mode="async")
    m = mlp()
    t = Trainer(m, chief=c.chief_address)
    x, y = data(64)
    train(t, m, x, y, epochs=1)
    t.report(test_accuracy=0.5)
    t.close()
    totals = c.chief.state.totals()
    assert totals.steps == 4 and totals.samples == 64
    payload = 4 * 4 * sum(p.numel() for p in m.parameters())     # 4 steps of fp32 gradients, and of weights
    assert totals.bytes_pushed >= payload and totals.bytes_pulled >= payload
    assert c.chief.state.metrics == {"test_accuracy": 0.5}


def test_missing_chief_address_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("SHOAL_CHIEF", raising=False)
    with pytest.raises(InvalidArgument, match="SHOAL_CHIEF"):
        Trainer(mlp())


def test_role_retries_an_unreachable_chief_and_says_so(caplog):
    from shoal.chief_client import ChiefClient
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                        # nothing listens there now
    client = ChiefClient(f"127.0.0.1:{port}", pb.WORKER, join_deadline_s=1.0)
    with caplog.at_level("WARNING"), pytest.raises(Unreachable, match=f"gave up after .* to join the chief at 127.0.0.1:{port} \\(UNAVAILABLE\\)"):
        client.join()
    assert any("join chief" in r.message and "retrying" in r.message for r in caplog.records)
    client.close()


def test_backup_worker_rounds_drop_the_straggler_and_requeue_its_batches(cluster_factory):
    # Two shards close their rounds independently; workers late on one shard and on time on the
    # other must not deadlock (each waiting on a round the others are late for).
    import random
    import time
    c = cluster_factory(2, mode="sync", backup_workers=1)
    x, y = data(192)
    models = [mlp(0) for _ in range(4)]
    trainers = [Trainer(m, chief=c.chief_address, lr=0.05) for m in models]

    def run(t, m, delay, seed):
        jitter = random.Random(seed)
        for xb, yb in t.batches((x, y), batch_size=16, epochs=2, batches_per_task=1):
            time.sleep(delay + jitter.random() * 0.01)
            t.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            t.step()

    run_threads(*[lambda t=t, m=m, d=d, i=i: run(t, m, d, i)
                  for i, (t, m, d) in enumerate(zip(trainers, models, (0, 0, 0, 0.04)))], timeout_s=120)
    shard = c.servers[0].host.get(0)
    assert shard.stats.pushes_dropped > 0               # the slow worker's late gradients were dropped ...
    assert_exactly_once(c, 192, 16, 2)                   # ... and their batches trained again by someone
    assert c.chief.state.tasks.finished and c.chief.state.tasks.total > 2 * 12
    for t in trainers:
        t.close()


def test_a_push_for_a_task_the_worker_does_not_hold_is_refused(cluster_factory):
    from shoal.net import frames
    from shoal.state.layout import ModelLayout
    from shoal.worker.ps_client import ShardClient

    c = cluster_factory(1, mode="async")
    x, y = data(64)
    m = mlp()
    t = Trainer(m, chief=c.chief_address)
    feed = iter(t.batches((x, y), batch_size=16, epochs=1, batches_per_task=4))
    next(feed)                                            # this worker now holds task 0 (attempt 1)
    layout = ModelLayout.from_module(m)
    client = ShardClient(0, c.servers[0].address, layout.numel, layout.fingerprint)
    grad = torch.ones(layout.numel)
    claim = dict(has_batch=True, task_id=0, data_epoch=0, task_start=0, task_stop=64, batch_start=0, batch_stop=16)
    for who, attempt in (("worker-9", 1), (t.member_id, 2)):   # another member; a later hand-out
        with pytest.raises(grpc.RpcError) as e:
            client.push([(0, layout.numel, "none", frames.tensor_bytes(grad))], worker=who, version=0,
                        key=f"forged-{who}", view_epoch=0, samples=16, attempt=attempt, token=b"x" * 16, **claim)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "does not hold task 0" in e.value.details()
    assert c.servers[0].host.get(0).version == 0          # nothing changed
    m(x[:16]).sum().backward()
    t.step()                                              # the holder's own push goes through
    assert c.servers[0].host.get(0).version == 1
    client.close()
    t.close()


def test_status_shows_members_shards_and_ledger(cluster_factory, capsys):
    from shoal.cli import main
    c = cluster_factory(2, mode="async")
    x, y = data(64)
    m = mlp()
    t = Trainer(m, chief=c.chief_address)
    train(t, m, x, y, epochs=1)
    assert main(["status", "--chief", c.chief_address]) == 0
    text = capsys.readouterr().out
    assert "mode async" in text and "epochs 1/1" in text and "tasks 1/1 done" in text
    assert t.member_id in text and "ps-0" in text
    assert main(["status", "--chief", c.chief_address, "--json"]) == 0
    import json
    snap = json.loads(capsys.readouterr().out)
    assert [s["ledger"] for s in snap["shards"]] == [[{"epoch": 0, "batches": 4, "max_count": 1}]] * 2
    assert snap["shards"][0]["version"] == 4
    t.close()


class _HalfUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)      # gets a gradient in the first step only

    def forward(self, x, both=False):
        return self.used(x) + (self.unused(x) if both else 0)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_parameter_without_a_gradient_this_step_pushes_zeros(cluster_factory, overlap):
    """zero_grad clears gradients to None: a parameter backward() skips must push zeros, not last
    step's gradient, whether its shard leaves from a hook or from step()."""
    c = cluster_factory(1, mode="async")
    model = _HalfUsed()
    t = Trainer(model, chief=c.chief_address, optimizer="sgd", lr=0.1, overlap=overlap)
    try:
        x = torch.randn(8, 4)
        t.zero_grad()
        model(x, both=True).pow(2).mean().backward()
        t.step()
        after_first = model.unused.weight.detach().clone()
        for _ in range(2):
            t.zero_grad()
            model(x).pow(2).mean().backward()
            t.step()
        assert torch.equal(model.unused.weight.detach(), after_first)
    finally:
        t.close()
