"""A server the chief is told has left (its own planned stop, or anyone's ``Leave`` naming it on a job
without a token) heartbeats on, hears the chief no longer knows it and joins again under a new id: it
must answer to that id at once, so that a shard the next view makes it primary of (a hand-back to the
copy it kept in step) is kept, not dropped as someone else's, and the job trains to its end."""
import threading

import pytest

from harness import run_threads, wait_until
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import open_channel
from shoal.worker import Trainer

from test_cluster import assert_exactly_once, data, mlp
from test_replication import in_sync, train_all


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_server_told_to_leave_rejoins_under_a_new_id_and_the_job_ends(cluster_factory, mode):
    c = cluster_factory(2, mode=mode, lease_seconds=1.0)
    size, batch, epochs = 512, 16, 3
    x, y = data(size)
    models = [mlp(0), mlp(1)]
    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02) for m in models]
    steps = [0]
    lock = threading.Lock()

    def tick():
        with lock:
            steps[0] += 1
    victim = c.servers[1]
    old_id = victim.host.member_id
    try:
        wait_until(lambda: in_sync(c), timeout_s=20, what="backups to be filled")

        def leave_it():
            wait_until(lambda: steps[0] >= 20, timeout_s=60, what="training to be under way")
            ch = open_channel(c.chief_address)
            pb_grpc.ChiefStub(ch).Leave(pb.LeaveRequest(member_id=old_id), timeout=5)
            ch.close()
            wait_until(lambda: victim.chief.member_id != old_id, timeout_s=20, what="the server to join again")
            wait_until(lambda: victim.host.member_id == victim.chief.member_id, timeout_s=10,
                       what="the server to answer to its new id")

        run_threads(lambda: train_all(trainers, models, x, y, epochs, batch, on_step=tick), leave_it, timeout_s=150)
        routing = dict(c.chief.state.routing)
        live = {ps.host.member_id for ps in c.servers}
        assert set(routing.values()) <= live, f"a shard routed to a member no server answers to: {routing}"
        for k, member in routing.items():       # every routed primary holds its copy
            (holder,) = [ps for ps in c.servers if ps.host.member_id == member]
            assert holder.host.roles.get(k) == "primary" and k in holder.host.shards
        assert_exactly_once(c, size, batch, epochs)
    finally:
        for t in trainers:
            t.close()
