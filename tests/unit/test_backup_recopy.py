"""A backup counted whole that lost its copy (nemesis --netns seed 519): no acknowledgement without it.

Pure state, no sockets: a primary's shard and :class:`Replicator` talk to a real backup
:class:`ShardHost` through a stand-in for the gRPC stubs. The chief's half (a backup its primary no
longer reports whole is not promoted) is in test_membership.py.
"""
import threading

import grpc
import torch

from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.errors import ShoalError
from shoal.proto import shoal_pb2 as pb
from shoal.ps.consistency import AsyncRule
from shoal.ps.host import ShardHost
from shoal.ps.replication import Replicator, install_from_frames
from shoal.ps.update_wire import update_from_frames
from shoal.ps.shard import Shard

SGD = OptimizerSpec("sgd", {"lr": 1.0})


class Refusal(grpc.RpcError):
    def __init__(self, exc: ShoalError):
        self._code, self._details = exc.code, str(exc)

    def code(self):
        return self._code

    def details(self):
        return self._details


class BackupStubs:
    """The backup's data service, in process. A copy sent from a thread other than the test's waits
    for ``background_copies`` (set at the end): what the primary acknowledged before it is on record."""

    def __init__(self, host: ShardHost):
        self.host = host
        self.background_copies = threading.Event()
        self.main = threading.current_thread()

    def install(self, frame_iter, timeout=None):
        if threading.current_thread() is not self.main:
            self.background_copies.wait(10)
        try:
            head, data = install_from_frames(frame_iter)
            return pb.ReplicateReply(version=self.host.install_copy(head, data)).SerializeToString()
        except ShoalError as exc:
            raise Refusal(exc) from None

    def replicate_one(self, frame, timeout=None):
        try:
            head, u = update_from_frames(iter([frame]))
            return pb.ReplicateReply(version=self.host.replicate(head, u)).SerializeToString()
        except ShoalError as exc:
            raise Refusal(exc) from None


def test_a_backup_in_step_that_lost_its_copy_holds_every_update_the_primary_acknowledges():
    primary = Shard(0, torch.zeros(4), SGD, AsyncRule(), "fp")
    backup = ShardHost()
    backup.member_id, backup.job, backup.primary_of = "ps-1", JobConfig(mode="async"), {0: "ps-0"}
    stubs = BackupStubs(backup)
    r = Replicator(0, lambda: "ps-0", lambda: primary, retry_s=0.01)
    try:
        # the backup as the chief counts it whole: copied, in step (what set_target and _install reach)
        r._target, r._stubs, r._negotiated, r._state = ("ps-1", "backup:1"), stubs, True, "in_sync"
        stubs.install(iter(_copy_frames(primary)))
        primary.replicator = r
        assert primary.push("a", 0, torch.ones(4), key="k1").accepted
        assert backup.shards[0].version == 1
        with backup._lock:                       # it restarted / re-joined under the same id: no copy now
            backup.shards.pop(0)
            backup.roles.pop(0, None)
        assert primary.push("a", 1, torch.ones(4), key="k2").accepted    # acknowledged: version 2
        assert primary.version == 2
        assert 0 in backup.shards, "the primary acknowledged version 2 while its backup held no copy"
        assert backup.shards[0].digest() == primary.digest()             # the backup holds it: promotable
        assert r.state == "in_sync"
        assert primary.push("a", 2, torch.ones(4), key="k3").accepted    # and follows in step after it
        assert backup.shards[0].digest() == primary.digest() and primary.version == 3
    finally:
        stubs.background_copies.set()
        r.close()
        backup.close()


def _copy_frames(shard: Shard):
    from shoal.ps.replication import install_frames, replica_bytes

    return install_frames(0, "ps-0", shard.version, shard.fingerprint, replica_bytes(shard.export_replica()), 1 << 20)
