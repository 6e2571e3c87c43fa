"""A worker blocked on a server that stopped answering (paused: SIGSTOP, a long GC, a VM migration)
follows the view: when the chief moves the shard, the call in flight fails at once (CANCELLED, a
failover) instead of waiting out its 60 s timeout, and the start-up path follows the view too."""
import socket
import threading
import time

import grpc
import pytest
import torch

from shoal.net import tcp_channel as tc
from shoal.proto import shoal_pb2 as pb
from shoal.net.tcp_client import TcpDataChannel
from shoal.worker.ps_client import ShardClient
from shoal.worker.routes import ShardRoutes, is_failover


class FakeChief:
    """What ShardRoutes reads of a ChiefClient: the view, its listeners, the lease."""

    lease_seconds = 1.0

    def __init__(self, view: pb.ClusterView):
        self.view = view
        self.listeners = []

    def on_view(self, listener):
        self.listeners.append(listener)
        listener(self.view)

    def refresh_view(self):
        return self.view

    def publish(self, view: pb.ClusterView):
        self.view = view
        for listener in self.listeners:
            listener(view)


def view(epoch, address):
    return pb.ClusterView(epoch=epoch, shards=[pb.ShardRoute(shard=0, primary_id="ps", primary_address=address)])


@pytest.fixture
def silent_server():
    """A port that accepts connections and never answers: a paused process."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


def timed(fn):
    out = {}

    def run():
        t0 = time.monotonic()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - looked at below
            out["error"] = exc
        out["took"] = time.monotonic() - t0
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_pull_blocked_on_a_silent_primary_fails_at_once_when_the_view_moves_the_shard(silent_server):
    chief = FakeChief(view(1, silent_server))
    routes = ShardRoutes(chief, chief.view, lambda k, a: ShardClient(k, a, 4, "fp", transport="grpc"), lambda: "w")
    old = routes.clients[0]
    t, out = timed(lambda: old.pull(torch.empty(4), timeout_s=30))
    time.sleep(0.3)
    assert t.is_alive()                                  # blocked on the silent server
    chief.publish(view(2, "127.0.0.1:9"))                # the chief promoted the backup elsewhere
    t.join(5)
    assert not t.is_alive() and out["took"] < 3.0, out
    assert isinstance(out["error"], grpc.RpcError) and is_failover(out["error"]), out
    with pytest.raises(grpc.RpcError) as later:           # a call started after the close: a failover too
        old.push([(0, 4, "none", b"\0" * 16)], worker="w", version=0, key="k", view_epoch=2, samples=1)
    assert later.value.code() == grpc.StatusCode.CANCELLED
    routes.reroute(0, old, later.value)                   # follows the view to the new primary
    assert routes.clients[0].address == "127.0.0.1:9" and routes.clients[0] is not old
    routes.close()


def test_a_view_naming_the_same_primary_leaves_its_client_alone(silent_server):
    chief = FakeChief(view(1, silent_server))
    routes = ShardRoutes(chief, chief.view, lambda k, a: ShardClient(k, a, 4, "fp", transport="grpc"), lambda: "w")
    chief.publish(view(2, silent_server))
    assert not routes.clients[0].closed
    routes.close()


def test_closing_a_tcp_data_channel_cuts_a_call_blocked_on_it_short():
    a, b = socket.socketpair()
    ch = TcpDataChannel("127.0.0.1", pb.DataChannelOffer(port=1))
    ch.release(a)                                         # an idle connection to a peer that never answers
    t, out = timed(lambda: ch.call(tc.recv_prefix, timeout_s=30))
    time.sleep(0.2)
    assert t.is_alive()
    ch.close()
    t.join(5)
    assert not t.is_alive() and out["took"] < 3.0
    assert out["error"].code() == grpc.StatusCode.CANCELLED     # a failover, not "unreachable"
    b.close()


@pytest.mark.timeout(90)
def test_a_worker_starting_up_while_a_primary_is_killed_follows_the_view_to_its_backup():
    """Issue 20: a worker that started while a primary was being killed retried the dead address for 60 s
    and exited 1. Its start-up (pull, Init, status) follows the view like its training calls do."""
    from harness import InProcessCluster, wait_until
    from shoal.settings.config import JobConfig
    from shoal.worker import Trainer
    from test_cluster import mlp

    lease = 1.0
    with InProcessCluster(2, JobConfig(mode="async", num_shards=2, lease_seconds=lease)) as c:
        first = Trainer(mlp(0), chief=c.chief_address, optimizer="sgd", lr=0.05)     # initialises the shards
        second = None
        try:
            wait_until(lambda: set(c.chief.state.complete) == {0, 1}, timeout_s=20, what="whole backups")
            victim = c.chief.state.routing[0]
            dead = next(s for s in c.servers if s.chief.member_id == victim)
            c.kill_ps(c.servers.index(dead))
            t0 = time.monotonic()
            second = Trainer(mlp(1), chief=c.chief_address, optimizer="sgd", lr=0.05)
            took = time.monotonic() - t0
            assert took < 4 * lease, took
            assert all(cl.address != dead.address for cl in second.routes.clients.values())
        finally:
            if second is not None:
                second.close()
            first.close()
