"""Every wait on the chief ends, with one line saying what it waited for; a Leave is final."""
from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from harness import wait_until
from shoal.chief.server import ChiefServer
from shoal.chief_client import ChiefClient
from shoal.cli.main import main
from shoal.config import JobConfig
from shoal.convert import layout_to_pb
from shoal.dataset import DatasetSpec
from shoal.errors import EXIT_UNREACHABLE, Unreachable
from shoal.layout import ModelLayout, TensorSpec
from shoal.members import MemberState
from shoal.proto import shoal_pb2 as pb
from shoal.ps.server import PSServer
from shoal.worker.data import TaskFeed

LAYOUT = layout_to_pb(ModelLayout([TensorSpec("w", (2, 2))]))


def dead_address() -> str:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Down(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


class DownStub:
    def GetTasks(self, req, timeout=None):
        raise Down()


@pytest.mark.timeout(30)
def test_the_task_feed_gives_up_on_an_unreachable_chief_with_one_line():
    feed = TaskFeed(DownStub(), lambda: "worker-0", DatasetSpec(size=8, batch_size=2), poll_s=0.01, wait_s=0.3,
                    chief="the chief at 10.0.0.1:7070")
    t0 = time.monotonic()
    with pytest.raises(Unreachable) as err:
        next(iter(feed))
    feed.close()
    assert time.monotonic() - t0 < 10
    assert str(err.value).startswith("gave up after ") and \
        str(err.value).endswith("s waiting for the chief at 10.0.0.1:7070 to hand out data tasks (UNAVAILABLE)")


@pytest.mark.timeout(30)
def test_joining_an_unreachable_chief_gives_up_after_its_deadline():
    address = dead_address()
    client = ChiefClient(address, pb.PS, join_deadline_s=0.5)
    with pytest.raises(Unreachable, match=rf"gave up after \d+s waiting to join the chief at {address} \(UNAVAILABLE\)"):
        client.join()
    client.close()


@pytest.mark.timeout(30)
def test_shoal_ps_exits_unreachable_with_one_line(capsys):
    address = dead_address()
    assert main(["ps", "--chief", address, "--bind", "127.0.0.1:0", "--chief-timeout", "0.5"]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("shoal ps: error: gave up after") and address in err[-1]


@pytest.mark.timeout(60)
def test_a_ps_that_loses_the_chief_gives_up_after_its_timeout():
    chief = ChiefServer(JobConfig(num_shards=1, lease_seconds=1.0), bind="127.0.0.1:0", tick_s=0.05).start()
    ps = PSServer(chief.address, bind="127.0.0.1:0", chief_timeout_s=1.0).start()
    try:
        chief.stop(grace_s=0.1)                              # gone for good
        t0 = time.monotonic()
        wait_until(ps.gave_up.is_set, timeout_s=30, what="the ps to give up on the chief")
        assert time.monotonic() - t0 < 15
        assert ps.gave_up_reason.startswith("gave up after") and chief.address in ps.gave_up_reason
    finally:
        ps.stop(grace_s=0.1)


class HeldHeartbeats:
    """The client's stub, except that a heartbeat is held until ``gate`` opens (a leave happens meanwhile)."""

    def __init__(self, real):
        self.real, self.gate, self.held = real, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.real, name)

    def Heartbeat(self, req, timeout=None):
        self.held.set()
        self.gate.wait(10)
        return self.real.Heartbeat(req, timeout=timeout)


@pytest.mark.timeout(60)
def test_a_heartbeat_racing_a_leave_does_not_join_again():
    chief = ChiefServer(JobConfig(num_shards=1, lease_seconds=0.8), bind="127.0.0.1:0", tick_s=0.05).start()
    client = ChiefClient(chief.address, pb.WORKER, layout=LAYOUT)
    try:
        client.join()
        me = client.member_id
        stub = client.stub = HeldHeartbeats(client.stub)
        client.start_background()
        assert stub.held.wait(10)                             # a heartbeat is on its way ...
        client.leave()                                        # ... the worker leaves ...
        stub.gate.set()                                       # ... and the heartbeat arrives after the Leave
        time.sleep(0.5)                                       # room for a (wrong) join to happen
        client.close()
        members = list(chief.state.members.all())
        assert [(m.member_id, m.state) for m in members] == [(me, MemberState.LEFT)]
    finally:
        client.close()
        chief.stop(grace_s=0.1)


def test_a_join_asking_for_the_id_of_a_member_that_left_gets_a_new_id():
    from shoal.chief.membership import Membership
    from shoal.members import Role

    now = [0.0]
    m = Membership(3.0, lambda: now[0])
    w = m.join(Role.WORKER)
    m.leave(w.member_id)
    again = m.join(Role.WORKER, member_id=w.member_id)
    assert again.member_id != w.member_id and m.get(w.member_id).state is MemberState.LEFT
    lapsed = m.join(Role.WORKER)
    now[0] = 10.0
    m.heartbeat(again.member_id)
    assert [x.member_id for x in m.expire()] == [lapsed.member_id]
    assert m.join(Role.WORKER, member_id=lapsed.member_id).member_id == lapsed.member_id   # expired: it comes back


class DeadChief:
    """A chief client whose chief is gone: its last view still names the failed primary."""

    lease_seconds = 1.0

    def __init__(self):
        self.view = pb.ClusterView(epoch=3, shards=[pb.ShardRoute(shard=0, primary_id="ps-0",
                                                                  primary_address="10.0.0.9:4000")])
        self.stub = self

    def refresh_view(self):
        raise Down()

    def on_view(self, listener):
        pass

    def ReportUnreachable(self, req, timeout=None):
        raise Down()


class Client:
    def __init__(self, shard, address):
        self.address = address

    def close(self):
        pass


@pytest.mark.timeout(30)
def test_a_worker_gives_up_waiting_for_a_new_primary_with_one_line():
    from shoal.worker.routes import ShardRoutes

    chief = DeadChief()
    routes = ShardRoutes(chief, chief.view, Client, lambda: "worker-0")
    routes.failover_timeout_s = 0.3
    with pytest.raises(Unreachable, match=r"gave up after 0s waiting for a primary of shard 0 "
                                          r"\(the last, 10.0.0.9:4000, failed with UNAVAILABLE\)"):
        routes.reroute(0, routes.clients[0], Down())
