"""Consistency rules on a shard: sync rounds, stale drops, membership changes, idempotency."""
import threading

import pytest
import torch

from shoal.settings.config import OptimizerSpec
from shoal.errors import DeadlineExceeded, InvalidArgument
from shoal.ps.consistency import AsyncRule, SyncRule
from shoal.ps.shard import Shard

SGD = OptimizerSpec("sgd", {"lr": 1.0})


def shard(rule, n=4):
    return Shard(0, torch.zeros(n), SGD, rule, "fp")


def ones(v, n=4):
    return torch.full((n,), float(v))


def test_sync_round_averages_all_live_workers_then_advances():
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})
    assert s.push("a", 0, ones(1)).accepted and s.version == 0
    assert s.push("b", 0, ones(3)).accepted and s.version == 1
    assert torch.equal(s.values(), ones(-2))             # w -= lr * mean(1, 3)


def test_sync_drops_stale_and_repeated_pushes():
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})
    s.push("a", 0, ones(1))
    again = s.push("a", 0, ones(5))
    assert not again.accepted and "already pushed" in again.reason
    s.push("b", 0, ones(1))
    late = s.push("a", 0, ones(9))
    assert not late.accepted and late.reason.startswith("stale")
    assert torch.equal(s.values(), ones(-1))
    with pytest.raises(InvalidArgument, match="version 5"):
        s.push("a", 5, ones(1))


def test_sync_round_closes_when_a_missing_worker_leaves():
    s = shard(SyncRule())
    s.set_live_workers({"a", "b", "c"})
    s.push("a", 0, ones(2))
    s.push("b", 0, ones(4))
    assert s.version == 0
    s.set_live_workers({"a", "b"})                         # c died
    assert s.version == 1 and torch.equal(s.values(), ones(-3))


def test_a_worker_joining_a_running_job_is_waited_for_from_its_first_gradient():
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})                         # present before the first update: waited for
    s.push("a", 0, ones(1))
    assert s.version == 0
    s.push("b", 0, ones(1))
    s.set_live_workers({"a", "b", "c"})                    # c joins a running job, still loading its data
    s.push("a", 1, ones(1))
    s.push("b", 1, ones(1))
    assert s.version == 2                                  # the round did not wait for c's first step
    first = s.push("c", 1, ones(1))                        # computed on version 1: stale, batch re-queued
    assert not first.accepted and first.reason.startswith("stale")
    s.push("a", 2, ones(1))
    s.push("b", 2, ones(1))
    assert s.version == 2                                  # from its first gradient on, c is waited for
    s.push("c", 2, ones(1))
    assert s.version == 3


def test_a_promoted_backup_waits_for_the_same_workers():
    primary = shard(SyncRule())
    primary.set_live_workers({"a"})
    updates = []
    primary.replicator = updates.append
    primary.push("a", 0, ones(1))                          # a alone, in a job where b joined later
    primary.set_live_workers({"a", "b"})
    primary.push("b", 0, ones(1))                          # b's first gradient: stale, but now counted
    backup = Shard.from_replica(primary.export_replica(), SyncRule())
    backup.set_live_workers({"a", "b"})
    backup.push("a", 1, ones(1))
    assert backup.version == 1                             # the copy kept "b has pushed": it waits for b
    backup.push("b", 1, ones(1))
    assert backup.version == 2
    late = shard(SyncRule())                               # a backup fed update by update learns it too
    late.set_live_workers({"x"})
    late.apply_replica(updates[0])
    late.set_live_workers({"a", "b"})
    late.push("a", 1, ones(1))
    assert late.version == 2                               # b never pushed where this copy could see it


def test_backup_workers_close_the_round_without_the_slowest():
    s = shard(SyncRule(backup_workers=1))
    s.set_live_workers({"a", "b", "c"})
    s.push("a", 0, ones(1))
    assert s.version == 0
    s.push("b", 0, ones(3))
    assert s.version == 1
    assert not s.push("c", 0, ones(100)).accepted           # the straggler's gradient is dropped
    assert torch.equal(s.values(), ones(-2))


def test_async_applies_each_push():
    s = shard(AsyncRule())
    s.push("a", 0, ones(1))
    s.push("b", 0, ones(1))                                 # computed on an older version: still applied
    assert s.version == 2 and torch.equal(s.values(), ones(-2))


def test_a_key_is_applied_at_most_once():
    s = shard(AsyncRule())
    assert s.push("a", 0, ones(1), key="k1").accepted
    dup = s.push("a", 0, ones(1), key="k1")
    assert dup.duplicate and s.version == 1 and torch.equal(s.values(), ones(-1))


def test_wrong_gradient_size_changes_nothing():
    s = shard(AsyncRule())
    with pytest.raises(InvalidArgument, match="has 4 elements"):
        s.push("a", 0, torch.ones(5))
    assert s.version == 0 and torch.equal(s.values(), torch.zeros(4))


def test_pull_waits_for_the_round():
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})
    s.push("a", 0, ones(1))
    got = []
    t = threading.Thread(target=lambda: got.append(s.wait_version(1, 5.0)))
    t.start()
    s.push("b", 0, ones(1))
    t.join(5)
    assert got == [1]
    with pytest.raises(DeadlineExceeded):
        s.wait_version(2, 0.05)


def test_snapshot_is_cached_per_version_and_codec():
    s = shard(AsyncRule())
    v, raw = s.snapshot("none")
    assert (v, len(raw)) == (0, 16) and s.snapshot("none")[1] is raw
    s.push("a", 0, ones(1))
    assert s.snapshot("none")[1] is not raw
    assert len(s.snapshot("bf16")[1]) == 8
    with pytest.raises(InvalidArgument, match="unknown pull codec"):
        s.snapshot("int3")


def test_a_batch_is_applied_once_whoever_pushes_it():
    from shoal.ps.ledger import BatchKey
    s = shard(AsyncRule())
    b = BatchKey(0, 32)
    assert s.push("a", 0, ones(1), key="a/t1/32", batch=b).accepted
    retry = s.push("a", 1, ones(1), key="a/t1/32", batch=b)            # same push again (a retry)
    assert retry.accepted and retry.duplicate
    other = s.push("b", 1, ones(1), key="b/t1.2/32", batch=b)          # the batch re-run elsewhere
    assert not other.accepted and other.duplicate and "applied by push a/t1/32" in other.reason
    assert s.version == 1 and s.ledger.starts(0) == {32: 1}


def test_sync_ledger_records_batches_when_the_round_closes():
    from shoal.ps.ledger import BatchKey
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})
    s.push("a", 0, ones(1), key="ka", batch=BatchKey(0, 0))
    assert s.ledger.starts(0) == {}
    assert s.push("b", 0, ones(1), key="kb", batch=BatchKey(0, 0)).duplicate   # pending in the round
    s.push("b", 0, ones(1), key="kb2", batch=BatchKey(0, 16))
    assert s.ledger.starts(0) == {0: 1, 16: 1}


def test_ssp_blocks_a_worker_too_far_ahead_until_the_slowest_catches_up():
    from shoal.errors import ResourceExhausted
    from shoal.ps.consistency import SSPRule
    s = shard(SSPRule(staleness=1))
    s.set_live_workers({"fast", "slow"})
    s.push("fast", 0, ones(1))
    s.push("fast", 1, ones(1))                           # clock 2 vs 0: next one must wait
    with pytest.raises(ResourceExhausted, match="more than 1 ahead"):
        s.push("fast", 2, ones(1), wait_s=0.05)
    done = []
    t = threading.Thread(target=lambda: done.append(s.push("fast", 2, ones(1), wait_s=5)))
    t.start()
    t.join(0.1)
    assert not done                                      # still blocked
    s.push("slow", 2, ones(1))                           # the slowest advances: fast may go
    t.join(5)
    assert done and done[0].accepted and s.version == 4


def test_ssp_stops_waiting_for_a_worker_that_left():
    from shoal.ps.consistency import SSPRule
    s = shard(SSPRule(staleness=0))
    s.set_live_workers({"a", "b"})
    s.push("a", 0, ones(1))
    done = []
    t = threading.Thread(target=lambda: done.append(s.push("a", 1, ones(1), wait_s=5)))
    t.start()
    t.join(0.1)
    assert not done
    s.set_live_workers({"a"})
    t.join(5)
    assert done and done[0].accepted


def test_ssp_newcomer_starts_level_with_the_slowest():
    from shoal.ps.consistency import SSPRule
    s = shard(SSPRule(staleness=0))
    s.set_live_workers({"a"})
    for v in range(3):
        s.push("a", v, ones(1))
    s.set_live_workers({"a", "b"})                       # b joins late: a is not held back by 3 steps
    assert s.push("b", 3, ones(1), wait_s=0.05).accepted
    assert s.push("a", 4, ones(1), wait_s=0.05).accepted


def test_a_sync_round_does_not_wait_for_a_worker_whose_push_is_a_batch_applied_before():
    """Found by the nemesis (seed 119, sync): shard 0's round waited for worker b, whose only work was
    batch X, already applied on shard 0 (so refused there as a duplicate) and handed back again and
    again by shard 1, whose own round waited for a, who waited on shard 0. Training stood still for
    four minutes while b retrained X thousands of times. A duplicate pushed on the round's version
    now shows b present with nothing new: the round closes with a's gradient alone."""
    from shoal.ps.ledger import BatchKey
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})
    x = BatchKey(0, 0)
    s.push("a", 0, ones(1), key="a1", batch=x)
    s.push("b", 0, ones(1), key="b1", batch=BatchKey(0, 8))
    assert s.version == 1 and s.ledger.starts(0) == {0: 1, 8: 1}
    before = s.values().clone()
    assert s.push("a", 1, ones(3), key="a2", batch=BatchKey(0, 16)).accepted
    assert s.version == 1                                    # waits for b
    again = s.push("b", 1, ones(1), key="b2", batch=x)       # b retrained x, which this shard has
    assert again.duplicate and not again.accepted
    assert s.version == 2 and s.ledger.starts(0) == {0: 1, 8: 1, 16: 1}
    assert torch.equal(before - s.values(), ones(3))         # lr 1 x a's 3, alone: not (3 + 0) / 2


def test_a_duplicate_from_an_older_version_does_not_count_as_presence():
    from shoal.ps.ledger import BatchKey
    s = shard(SyncRule())
    s.set_live_workers({"a", "b"})
    s.push("a", 0, ones(1), key="a1", batch=BatchKey(0, 0))
    s.push("b", 0, ones(1), key="b1", batch=BatchKey(0, 8))
    s.push("a", 1, ones(1), key="a2", batch=BatchKey(0, 16))
    assert s.push("b", 0, ones(1), key="b2", batch=BatchKey(0, 0)).duplicate   # computed on version 0
    assert s.version == 1                                    # b has not seen version 1: still waited for
