"""A batch that one shard took and another refused goes back to the chief and is trained again.

In the wild this happens when a backup-worker round closes without a worker on one shard but not
on the other, which a timing test only sometimes produces. Here one shard refuses one push on
purpose, so the worker's choice (hand the batch back when *any* shard refused it) is tested every run.
"""
import threading

import torch.nn.functional as F

from shoal.ps.update import PushResult
from shoal.worker import Trainer

from test_cluster import assert_exactly_once, data, mlp

SIZE, BATCH = 64, 8


def refuse_first_batch(shard):
    """Makes ``shard`` refuse the first push that names a batch (as a closed round would)."""
    push, refused, lock = shard.push, [], threading.Lock()

    def once(worker, version, grad, key="", batch=None, *args, **kw):
        named = batch or next(iter(kw.get("batches", ())), None)
        with lock:
            first = named is not None and not refused
            if first:
                refused.append(named)
        if first:
            return PushResult(False, shard.version, "stale: refused by the test")
        return push(worker, version, grad, key, batch, *args, **kw)

    shard.push = once
    return refused


def test_a_batch_refused_by_one_shard_only_is_handed_back_and_applied_once_everywhere(cluster_factory):
    c = cluster_factory(2, mode="async")
    model = mlp(0)
    t = Trainer(model, chief=c.chief_address, lr=0.1)
    try:
        shards = {k: s for ps in c.servers for k, s in ps.host.shards.items()}
        refused = refuse_first_batch(shards[1])         # shard 0 takes every push, shard 1 refuses one
        x, y = data(SIZE)
        seen = []
        for xb, yb in t.batches((x, y), batch_size=BATCH, epochs=1):
            seen.append(t._batch.start)
            t.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            t.step(samples=len(xb))
        assert len(refused) == 1
        again = refused[0].start
        assert sorted(seen) == sorted([*range(0, SIZE, BATCH), again])     # the refused batch came back once
        assert shards[0].ledger.starts(0)[again] == 1   # shard 0 already had it: the second push is a duplicate
        assert_exactly_once(c, SIZE, BATCH, 1)           # ... and shard 1 got it the second time
        stats = c.chief.state.tasks
        assert stats.finished and stats.total == SIZE // (BATCH * 4) + 1      # one extra one-batch task
    finally:
        t.close()
