"""Pipelined push and pull (worker/pipeline.py) against an in-process cluster: more shards (blocks) than
servers, a push window, pulls that start when their shard's push is answered."""
import random
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from harness import run_threads, wait_until
from shoal.proto import shoal_pb2 as pb
from shoal.worker import Trainer

from test_cluster import assert_exactly_once, data, mlp
from test_replication import in_sync


class Events:
    """Per worker: when each push was answered and each pull began, in one sequence."""

    def __init__(self, trainer, delay_shard=None, seed=0):
        self.log: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.t = trainer
        self.step = 0
        jitter = random.Random(seed)
        push, pull = trainer._push, trainer._pull_shard

        def pushed(shard, *a, **kw):
            with self.lock:
                self.log.append(("started", shard, trainer.step_count))
            if shard == delay_shard and jitter.random() < 0.5:
                time.sleep(0.02)        # this block's answer comes after later blocks' answers
            reply = push(shard, *a, **kw)
            with self.lock:
                self.log.append(("answered", shard, trainer.step_count))
            return reply

        def pulled(shard, *a, **kw):
            with self.lock:
                self.log.append(("pull", shard, trainer.step_count))
            return pull(shard, *a, **kw)
        trainer._push, trainer._pull_shard = pushed, pulled

    def early_pulls(self) -> int:
        """Pulls that began while a push of the same step was still unanswered."""
        n = 0
        per_step: dict[int, list] = {}
        for e in self.log:
            per_step.setdefault(e[2], []).append(e)
        for events in per_step.values():
            last_answer = max((i for i, e in enumerate(events) if e[0] == "answered"), default=-1)
            events = [e if e[0] != "started" else ("", -1, -1) for e in events]
            n += sum(1 for i, e in enumerate(events) if e[0] == "pull" and i < last_answer)
        return n

    def out_of_order(self) -> int:
        """Steps whose pushes were answered in an order other than the one they were started in."""
        seen: dict[tuple[str, int], list[int]] = {}
        for kind, shard, step in self.log:
            seen.setdefault((kind, step), []).append(shard)
        return sum(1 for (kind, step), got in seen.items()
                   if kind == "answered" and got != seen[("started", step)][:len(got)])


def train(trainer, model, x, y, epochs, batch=16, on_step=None):
    for xb, yb in trainer.batches((x, y), batch_size=batch, epochs=epochs, batches_per_task=2):
        trainer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        trainer.step()
        if on_step is not None:
            on_step()


def servers_of(c, shards):
    return {k: c.chief.state.routing[k] for k in shards}


@pytest.mark.parametrize("mode,window,overlap", [("async", 1, True), ("async", 2, False), ("sync", 1, True),
                                                  ("sync", 2, False), ("async", 0, True)])
def test_blocks_pipelined_apply_every_batch_once(cluster_factory, mode, window, overlap):
    c = cluster_factory(2, mode=mode, num_shards=6, lease_seconds=1.0)
    size, epochs = 320, 2
    x, y = data(size)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02, push_window=window, overlap=overlap)
                for m in models]
    # the first shard's answer comes late half the time: later blocks' answers overtake it
    events = [Events(t, delay_shard=0, seed=i) for i, t in enumerate(trainers)]
    try:
        assert sorted(set(servers_of(c, range(6)).values())) == sorted(s.chief.member_id for s in c.servers)
        before = F.cross_entropy(models[0](x), y).item()
        run_threads(*[lambda t=t, m=m: train(t, m, x, y, epochs) for t, m in zip(trainers, models)])
        assert_exactly_once(c, size, 16, epochs)
        for t in trainers:
            t.pull()
            assert t.push_window == window
        w0 = torch.cat([p.detach().flatten() for p in models[0].parameters()])
        w1 = torch.cat([p.detach().flatten() for p in models[1].parameters()])
        assert torch.equal(w0, w1)
        assert F.cross_entropy(models[0](x), y).item() < before
        if window:
            assert sum(e.early_pulls() for e in events) > 0, "no pull began before its step's pushes ended"
        if window == 1:
            assert sum(e.out_of_order() for e in events) == 0   # one at a time: answered as started
        elif window == 0 or not overlap:
            assert sum(e.out_of_order() for e in events) > 0    # the delayed block was overtaken
    finally:
        for t in trainers:
            t.close()


def test_workers_push_to_different_servers_first(cluster_factory):
    c = cluster_factory(2, mode="async", num_shards=4, lease_seconds=1.0)
    x, y = data(256)        # 8 tasks: a worker that starts first cannot take them all before the other's first
    models = [mlp(0), mlp(0)]
    trainers = [Trainer(m, chief=c.chief_address, push_window=1, overlap=False) for m in models]
    try:
        # ranks come from the routing view each got when it joined (the second one's counts both)
        assert all(t.chief.view.routing_only for t in trainers)
        assert sorted(t.chief.view.worker_rank for t in trainers) == [0, 1]
        run_threads(*[lambda t=t, m=m: train(t, m, x, y, 1) for t, m in zip(trainers, models)])
        where = servers_of(c, range(4))
        orders = {tuple(t.push_orders[0]) for t in trainers}
        assert len(orders) == 2
        for i in range(4):
            assert len({where[o[i]] for o in orders}) == 2, f"both workers push to one server at position {i}"
    finally:
        for t in trainers:
            t.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_failover_between_two_blocks_of_one_step_loses_nothing(cluster_factory, mode):
    c = cluster_factory(2, mode=mode, num_shards=4, lease_seconds=1.0)
    assert c.job.replicas == 2
    size, epochs = 512, 2
    x, y = data(size)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02, push_window=1, overlap=False)
                for m in models]
    events = Events(trainers[0])
    marks: dict[str, object] = {}
    push = trainers[0]._push

    def push_then_maybe_kill(shard, *a, **kw):
        t = trainers[0]
        order = t._push_order()
        if t.step_count == 12 and "killed" not in marks and shard == order[1]:
            # the step's first block was pushed and answered (window 1); this one's primary dies now
            wait_until(lambda: in_sync(c), timeout_s=20, what="backups to be in sync")
            victim = c.chief.state.routing[shard]
            i = next(i for i, s in enumerate(c.servers) if s.chief.member_id == victim)
            marks["killed"], marks["first"] = victim, order[0]
            marks["answered_before"] = [e for e in events.log if e[0] == "answered" and e[2] == 12]
            c.kill_ps(i)
        return push(shard, *a, **kw)
    trainers[0]._push = push_then_maybe_kill
    try:
        wait_until(lambda: in_sync(c), timeout_s=20, what="backups to be filled")
        run_threads(*[lambda t=t, m=m: train(t, m, x, y, epochs) for t, m in zip(trainers, models)], timeout_s=120)
        assert "killed" in marks
        assert [s for _, s, _ in marks["answered_before"]] == [marks["first"]]
        assert sum(t.failovers for t in trainers) >= 1
        survivor = next(s for s in c.servers if not getattr(s, "killed", False))
        assert sorted(survivor.host.shards) == [0, 1, 2, 3]
        assert_exactly_once(c, size, 16, epochs)     # nothing acknowledged lost, nothing applied twice
        for t in trainers:
            t.pull()
        assert F.cross_entropy(models[0](x), y).item() < 0.9
    finally:
        for t in trainers:
            t.close()


def test_sync_blocks_with_backup_workers_requeue_late_batches_and_never_deadlock(cluster_factory):
    # a worker in some blocks' rounds and late for others: its early pulls give up their rounds
    c = cluster_factory(2, mode="sync", num_shards=4, backup_workers=1, lease_seconds=1.0)
    x, y = data(192)
    models = [mlp(0) for _ in range(4)]
    trainers = [Trainer(m, chief=c.chief_address, lr=0.05, push_window=1) for m in models]

    def run(t, m, delay, seed):
        jitter = random.Random(seed)
        for xb, yb in t.batches((x, y), batch_size=16, epochs=2, batches_per_task=1):
            time.sleep(delay + jitter.random() * 0.01)
            t.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            t.step()
    try:
        run_threads(*[lambda t=t, m=m, d=d, i=i: run(t, m, d, i)
                      for i, (t, m, d) in enumerate(zip(trainers, models, (0, 0, 0, 0.04)))], timeout_s=120)
        dropped = sum(s.stats.pushes_dropped for ps in c.servers for s in ps.host.shards.values())
        assert dropped > 0
        assert_exactly_once(c, 192, 16, 2)
        assert c.chief.state.tasks.finished
    finally:
        for t in trainers:
            t.close()
