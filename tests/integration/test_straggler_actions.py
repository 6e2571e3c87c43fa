"""What straggler_detection's actions do across the wire: a server leaves an excluded straggler out of
its sync rounds (backup), the chief asks an evicted one to leave through its heartbeat (evict)."""
from harness import wait_until
from shoal.proto import shoal_pb2 as pb
from shoal.ps.server import PSServer
from shoal.worker import Trainer

from test_cluster import mlp


def test_a_server_leaves_an_excluded_straggler_out_of_the_workers_its_rounds_wait_for():
    ps = PSServer("127.0.0.1:1", bind="127.0.0.1:0", data_port=None, chief_timeout_s=1)
    try:
        ps._on_view(pb.ClusterView(members=[
            pb.MemberInfo(member_id="worker-0", role=pb.WORKER, state="alive"),
            pb.MemberInfo(member_id="worker-1", role=pb.WORKER, state="alive", straggler=True, excluded=True),
            pb.MemberInfo(member_id="worker-2", role=pb.WORKER, state="alive", straggler=True)]))
        assert ps.host.live_workers == {"worker-0", "worker-2"}      # flagged only: still waited for
    finally:
        ps.host.close()
        ps.server.stop(0)
        ps.chief.close()


def test_the_chief_asks_an_evicted_straggler_to_leave_through_its_heartbeat(cluster_factory):
    c = cluster_factory(num_ps=1, mode="async", lease_seconds=1.0)
    t = Trainer(mlp(0), chief=c.chief_address, lr=0.05)
    asked = []
    t.chief.on_leave_asked = asked.append          # the Trainer's own hands back its task and exits
    try:
        with c.chief.servicer.lock:
            c.chief.state.straggling.evicting[t.member_id] = "2.5x the others' median"
        wait_until(lambda: asked, timeout_s=10, what="the heartbeat reply asking the worker to leave")
        assert asked == ["evicted as a straggler: 2.5x the others' median"]
    finally:
        t.close()
