"""The replication promises, each named: replicate before apply, no acknowledgement without the
backup, and a fenced primary that takes no more pushes or pulls.

Pure state: a shard (and the host that serves it) with a replicator stand-in, no sockets. The
replicator over gRPC is tested in tests/integration/test_replication.py.
"""
import threading

import pytest
import torch

from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.errors import NOT_PRIMARY, FailedPrecondition, NotFound, Unavailable
from shoal.proto import shoal_pb2 as pb
from shoal.ps.consistency import AsyncRule, SyncRule
from shoal.ps.host import ShardHost
from shoal.ps.ledger import BatchKey
from shoal.ps.replication import FENCED, replica_bytes
from shoal.ps.update_wire import update_message
from shoal.ps.shard import Shard


def update_header(shard, primary_id, u):
    return pb.ReplicateHeader.FromString(update_message(shard, primary_id, u)[0])

SGD = OptimizerSpec("sgd", {"lr": 1.0})


def ones(v, n=4):
    return torch.full((n,), float(v))


def test_replicate_before_apply_the_backup_gets_the_update_while_the_primary_still_shows_the_old_version():
    s = Shard(0, torch.zeros(4), SGD, SyncRule(), "fp")
    s.set_live_workers({"a", "b"})
    seen = []

    def replicator(u):
        seen.append((u.version, s.version, s.values(), u.keys, u.batches, u.workers))

    s.replicator = replicator
    s.push("a", 0, ones(1), key="ka", batch=BatchKey(0, 0))
    assert seen == []                                        # the round is not complete: nothing to send
    s.push("b", 0, ones(3), key="kb", batch=BatchKey(0, 8))
    [(version, primary_at, values, keys, batches, workers)] = seen
    assert (version, primary_at) == (1, 0)                   # sent before the primary took the step
    assert torch.equal(values, torch.zeros(4))
    assert keys == ("ka", "kb") and workers == ("a", "b")
    assert dict(batches) == {BatchKey(0, 0): "ka", BatchKey(0, 8): "kb"}
    assert s.version == 1 and torch.equal(s.values(), ones(-2))


def test_no_ack_without_backup_a_push_returns_only_once_the_backup_holds_the_update():
    s = Shard(0, torch.zeros(4), SGD, AsyncRule(), "fp")
    entered, release = threading.Event(), threading.Event()

    def replicator(u):
        entered.set()
        assert release.wait(10)

    s.replicator = replicator
    acked = []
    t = threading.Thread(target=lambda: acked.append(s.push("a", 0, ones(1), key="k1")), daemon=True)
    t.start()
    assert entered.wait(10)
    pulled = []
    reader = threading.Thread(target=lambda: pulled.append(s.snapshot()), daemon=True)
    reader.start()
    t.join(0.3)
    reader.join(0.1)
    assert acked == [] and pulled == []                      # neither acknowledged nor visible yet
    release.set()
    t.join(10)
    reader.join(10)
    assert acked[0].accepted and acked[0].version == 1
    assert pulled[0][0] == 1                                 # the pull saw the replicated version


def fencing_host():
    host = ShardHost()
    host.member_id = "ps-a"
    host.assign(0, JobConfig(mode="async"))
    shard, created = host.create(0, torch.zeros(4), SGD, "fp")
    assert created
    return host, shard


def test_a_fenced_primary_refuses_pushes_and_pulls_and_applied_nothing():
    host, s = fencing_host()
    try:
        s.push("w", 0, ones(1), key="k0", batch=BatchKey(0, 0))          # no backup yet: applied alone
        assert s.version == 1

        def refused(u):                  # what the replicator raises when the backup answers FENCED
            raise Unavailable(f"backup refused update {u.version}: shard 0's {FENCED} ps-b, not ps-a")

        s.replicator = refused
        with pytest.raises(Unavailable, match="refused update 2"):
            s.push("w", 1, ones(5), key="k1", batch=BatchKey(0, 8))
        assert s.fenced and FENCED in s.fenced
        assert s.version == 1 and torch.equal(s.values(), ones(-1))       # the refused update was not applied
        assert s.ledger.starts(0) == {0: 1}                                # nor its batch counted
        with pytest.raises(FailedPrecondition, match=NOT_PRIMARY):
            s.push("w", 1, ones(5), key="k1", batch=BatchKey(0, 8))       # its retry is refused, not a duplicate
        with pytest.raises(FailedPrecondition, match=NOT_PRIMARY):
            s.push("w2", 1, ones(1), key="k2")
        with pytest.raises(FailedPrecondition, match=f"{NOT_PRIMARY} any more"):
            host.get(0)                                                    # what Push and Pull call first
        s.set_live_workers({"w", "w2"})                                    # nothing closes a round either
        assert s.version == 1
    finally:
        host.close()


def test_a_primary_the_view_replaces_is_fenced_and_a_push_already_inside_is_refused():
    host, s = fencing_host()
    try:
        host.set_view(frozenset({"w"}), 0, [pb.ShardRoute(shard=0, primary_id="ps-b", primary_address="h:2")])
        assert s.fenced and "ps-b" in s.fenced
        with pytest.raises(FailedPrecondition, match=NOT_PRIMARY):
            s.push("w", 0, ones(1))                       # a worker that still holds the old route
        with pytest.raises((NotFound, FailedPrecondition)):
            host.get(0)
        assert s.version == 0
    finally:
        host.close()


def test_a_promoted_backup_refuses_updates_from_the_old_primary_naming_the_new_one():
    primary_host, primary = fencing_host()
    backup = ShardHost()
    backup.member_id = "ps-b"
    backup.job = JobConfig(mode="async")
    try:
        primary.push("w", 0, ones(1))
        data = replica_bytes(primary.export_replica())
        backup.install_copy(pb.InstallHeader(shard=0, version=1, primary_id="ps-a", total_bytes=len(data)), data)
        updates = []
        primary.replicator = updates.append
        primary.push("w", 1, ones(1))
        assert backup.replicate(update_header(0, "ps-a", updates[0]), updates[0]) == 2
        backup.set_view(frozenset({"w"}), 0, [pb.ShardRoute(shard=0, primary_id="ps-b")])   # promoted
        assert backup.get(0).version == 2                                 # it kept every acknowledged update
        primary.push("w", 2, ones(1))
        with pytest.raises(FailedPrecondition, match=f"{FENCED} ps-b"):
            backup.replicate(update_header(0, "ps-a", updates[1]), updates[1])
        assert backup.get(0).version == 2
    finally:
        primary_host.close()
        backup.close()


def test_a_planned_move_that_reaches_the_backup_while_an_old_update_is_on_its_way_refuses_that_update():
    """The view promoting this backup (a planned move: the old primary lives on) lands between the
    sender check and the apply of the old primary's update; the new primary may already take pushes
    then, so the update must be refused (the old primary fences) rather than applied on top."""
    primary_host, primary = fencing_host()
    backup = ShardHost()
    backup.member_id = "ps-b"
    backup.job = JobConfig(mode="async")
    try:
        primary.push("w", 0, ones(1))
        data = replica_bytes(primary.export_replica())
        backup.install_copy(pb.InstallHeader(shard=0, version=1, primary_id="ps-a", total_bytes=len(data)), data)
        updates = []
        primary.replicator = updates.append
        primary.push("w", 1, ones(1))
        copy = backup.shards[0]
        real_apply = copy.apply_replica

        def view_arrives_first(u, *args):
            backup.set_view(frozenset({"w"}), 0, [pb.ShardRoute(shard=0, primary_id="ps-b")])
            return real_apply(u, *args)

        copy.apply_replica = view_arrives_first
        with pytest.raises(FailedPrecondition, match=f"{FENCED} ps-b"):
            backup.replicate(update_header(0, "ps-a", updates[0]), updates[0])
        assert backup.get(0).version == 1
    finally:
        primary_host.close()
        backup.close()


def test_a_shard_the_view_assigns_after_the_join_is_restored_before_an_init_can_create_it():
    """The chief spreads the shards no server took at its join: a server named primary of one it has
    never held loads it from the checkpoint its join named; a backup promoted without a copy is a loss
    (--recovery decides), not restored here; with no checkpoint, workers Init as before."""
    host = ShardHost()
    host.member_id = "ps-a"
    host.job = JobConfig(mode="async", num_shards=4)
    restored = []
    done = threading.Event()
    host.restore_path, host.restorer = "/ckpt/7", lambda k: (restored.append(k), done.set())
    try:
        host.set_view(frozenset(), 0, [pb.ShardRoute(shard=1, primary_id="ps-b", backup_id="ps-a")])
        host.set_view(frozenset(), 0, [pb.ShardRoute(shard=3, primary_id="ps-a"),
                                       pb.ShardRoute(shard=1, primary_id="ps-a")])
        assert done.wait(5) and restored == [3]
        with pytest.raises(Unavailable, match="still being restored"):
            host.create(3, torch.zeros(4), SGD, "fp", restore_wait_s=0.1)
        host.restore_path = ""
        host.set_view(frozenset(), 0, [pb.ShardRoute(shard=2, primary_id="ps-a")])
        s, created = host.create(2, torch.zeros(4), SGD, "fp")
        assert created and restored == [3]
    finally:
        host.close()


def test_a_fenced_copy_never_feeds_a_backup():
    """A copy fenced because its backup did not take an update may hold that update (it applies while the
    update travels): no copy for a new backup, and no fresh copy for an old one, is ever made from it."""
    host, s = fencing_host()
    try:
        r = host._replicator(0)
        assert r._find_shard() is s
        s.fence("the backup answered that another ps is the primary")
        assert r._find_shard() is None
        with pytest.raises(Unavailable, match="no longer the primary"):
            r._recopy(None, 2)
    finally:
        host.close()
