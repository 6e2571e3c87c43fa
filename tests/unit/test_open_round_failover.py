"""A sync push a round took, that its worker did not wait for, survives the primary that held it.

nemesis --netns seed 519: worker-0 trained batch 0/160 again (task 34: shard 1 had dropped it the
first time, worker-1's push); shard 0 had it already, shard 1's primary (ps1) put it in its open
round, so the worker moved on without waiting for that round. ps1 was cut off and lost its lease,
the round never closed, and the promoted backup closed its next round with the worker's next batch
instead: shard 1 ended one batch short, at the same version as shard 0.

Pure state: the shards are real :class:`Shard` objects behind stand-in clients; the worker's half
is :class:`ShardExchange` on a minimal host object.
"""
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import torch

from shoal.settings.config import OptimizerSpec
from shoal.dataset import Task
from shoal.proto import shoal_pb2 as pb
from shoal.ps.consistency import SyncRule
from shoal.ps.ledger import BatchKey
from shoal.ps.shard import Shard
from shoal.worker.exchange import BatchContext, SentPush, ShardExchange

SGD = OptimizerSpec("sgd", {"lr": 1.0})


class Client:
    """One primary's client: pushes and pulls go straight to its shard."""

    chunk_bytes = 1 << 20

    def __init__(self, shard: Shard):
        self.shard = shard

    def push(self, chunks, worker, version, key, view_epoch=0, samples=0, **extra):
        r = self.shard.push(worker, version, chunks, key=key,
                            batch=BatchKey(extra["data_epoch"], extra["batch_start"]), wait_s=0.2)
        return pb.PushReply(accepted=r.accepted, version=r.version, duplicate=r.duplicate, reason=r.reason), 0

    def pull(self, buf, min_version, codec, since=None):
        return self.shard.wait_version(min_version, 5.0), 0


class HadIt(Client):
    """Shard 0's primary, which applied the batch the first time round."""

    def __init__(self):
        pass

    def push(self, chunks, worker, version, key, **kw):
        return pb.PushReply(accepted=False, version=0, duplicate=True, reason="applied before"), 0

    def pull(self, buf, min_version, codec, since=None):
        return 0, 0


class Worker(ShardExchange):
    mode, member_id, delta_pulls, pull_codec, _started = "sync", "w1", False, "none", True

    def __init__(self, clients):
        self._clients, self._sent, self._open_pushes, self._held, self.versions = clients, {}, {}, {}, {}
        self._sent_to = {}                  # shard -> the client that answered its latest push
        self.dropped = []
        self._feed = SimpleNamespace(drop=lambda *a: self.dropped.append(a))
        self.chief, self.clock = SimpleNamespace(view=None), SimpleNamespace(pushed_at=0.0)
        self._pool = ThreadPoolExecutor(2)
        self.staging = SimpleNamespace(weights_target=lambda k: None, land=lambda k: None,
                                       host_grads=lambda k, ready: torch.ones(4))
        self.plan = SimpleNamespace(ranges={1: (0, 4)})
        self.encoder = SimpleNamespace(tag="none", encode=lambda k, grad, chunk: grad)
        self.momentum = SimpleNamespace(active=lambda k: False)
        self._init_pipeline(0)

    def _count(self, **kw):
        pass


def batch(start):
    return (BatchContext(Task(35, 0, start, start + 32), b"", start, start + 32),)


def done(reply):
    f = Future()
    f.set_result(reply)
    return f


def sync_shard(shard=None):
    s = shard or Shard(1, torch.zeros(4), SGD, SyncRule(), "fp")
    s.set_live_workers({"w0", "w1"})
    return s


def test_a_push_left_in_an_open_round_is_sent_again_when_the_shard_moves():
    old = sync_shard()
    w = Worker({0: HadIt(), 1: Client(old)})
    # the step: shard 0 had the batch already, shard 1's round took it; the worker does not wait
    w._sent[1] = SentPush(torch.ones(4), 0, "w1/35.0/160/1", 32, {"data_epoch": 0, "batch_start": 160},
                          batch(160))
    w._push_then_pull({0: done(HadIt().push(None, "w1", 0, "")[0]), 1: done(w._send(1, w._sent[1]))},
                      {0: 0, 1: 0})
    assert old.version == 0 and old.round_pending == 1       # still open: w0 has not pushed to it
    # the primary is cut off and its backup (which never saw the open round) is promoted
    new = sync_shard(Shard.from_replica(old.export_replica(), SyncRule()))
    old.fence("the view names another primary")
    w._clients[1] = Client(new)
    assert new.push("w0", 0, torch.ones(4), key="w0/9.0/0/1", batch=BatchKey(0, 0)).accepted
    # the worker's next step pushes its next batch to the new primary
    w._push(1, 0, "w1/35.0/192", 32, batch(192))
    assert new.version == 1
    assert new.ledger.owner(BatchKey(0, 160)) is not None, "batch 0/160 was taken by a round that never " \
        "closed and never sent again: lost"
    assert new.ledger.owner(BatchKey(0, 192)) is None        # the round closed before it: it goes back
    w._pool.shutdown()
