"""Every wait on the chief ends, with one line saying what it waited for; a Leave is final."""
from __future__ import annotations

import socket
import threading
import time

import grpc
import torch
import pytest

from harness import wait_until
from shoal.chief.server import ChiefServer
from shoal.chief_client import ChiefClient
from shoal.cli.main import main
from shoal.settings.config import JobConfig
from shoal.state.convert import layout_to_pb
from shoal.dataset import DatasetSpec
from shoal.errors import EXIT_UNREACHABLE, Unreachable
from shoal.state.layout import ModelLayout, TensorSpec
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
    # single Heartbeat calls, which the wrapper holds (the race is the client's, whatever carries the beat)
    client = ChiefClient(chief.address, pb.WORKER, layout=LAYOUT, keepalive=False)
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


def hold_while_paused(monkeypatch, name: str, answering: threading.Event, calls: list, probe=lambda req: True):
    """``ChiefServicer.<name>`` blocks while ``answering`` is clear, as a paused chief (SIGSTOP: its socket
    takes the call, nothing answers) does; the arrival time of each call ``probe`` picks goes to ``calls``."""
    from shoal.chief import aio
    from shoal.chief.servicer import ChiefServicer

    original = getattr(ChiefServicer, name)
    # the aio chief runs its handlers on its event loop: a held one runs on a thread, as a slow probe does
    monkeypatch.setattr(aio, "OFF_LOOP", aio.OFF_LOOP | {name})

    def held(self, request, context):
        if probe(request):
            calls.append(time.monotonic())
        answering.wait(30)
        return original(self, request, context)

    monkeypatch.setattr(ChiefServicer, name, held)


@pytest.mark.timeout(90)
def test_a_chief_that_stops_answering_fails_the_workers_calls_within_a_lease_and_they_are_tried_again(monkeypatch):
    """The worker's GetTasks and its report() to a chief that stopped answering give up within about a
    lease and are tried again, as with a dead chief (they waited out a fixed 10 s deadline); once the
    chief answers, the job goes on."""
    from harness import InProcessCluster
    from shoal.worker import Trainer
    from test_cluster import data, mlp

    lease = 1.0
    answering, tasks, reports = threading.Event(), [], []
    answering.set()
    hold_while_paused(monkeypatch, "GetTasks", answering, tasks)
    hold_while_paused(monkeypatch, "ReportMetrics", answering, reports, probe=lambda req: "probe" in req.values)
    c = InProcessCluster(1, JobConfig(mode="async", num_shards=1, lease_seconds=lease))
    trainer = None
    try:
        model = mlp(0)
        trainer = Trainer(model, chief=c.chief_address, optimizer="sgd", lr=0.05)
        x, y = data(64)

        def train() -> None:
            for xb, yb in trainer.batches((x, y), batch_size=16, epochs=1):
                trainer.zero_grad()
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                trainer.step(samples=len(xb))

        answering.clear()                                   # the chief stops answering
        worker = threading.Thread(target=train, daemon=True)
        worker.start()
        wait_until(lambda: len(tasks) >= 2, timeout_s=2.5 * lease + 5, what="GetTasks to be tried again")
        assert tasks[1] - tasks[0] < 2.5 * lease, tasks     # the first call failed within about a lease
        answering.set()
        worker.join(30)
        assert not worker.is_alive() and trainer.step_count == 4

        answering.clear()
        reporter = threading.Thread(target=lambda: trainer.report(probe=1.0), daemon=True)
        reporter.start()
        wait_until(lambda: len(reports) >= 2, timeout_s=2.5 * lease + 5, what="the report to be tried again")
        assert reports[1] - reports[0] < 2.5 * lease, reports
        answering.set()
        reporter.join(30)
        assert not reporter.is_alive()
        wait_until(lambda: c.chief.state.metrics.get("probe") == 1.0, timeout_s=10, what="the report")
    finally:
        answering.set()
        if trainer is not None:
            trainer.close()
        c.stop()
