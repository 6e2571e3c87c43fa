"""The chief's view watch at scale (issue 17; bench/chief_grpc.py measures it with 1000 fake workers).

- One view change answers every watcher with one view, built and serialized once, not once per
  watcher (O(members) each: O(members^2) per change).
- More watches open than the old 64 server threads must not starve heartbeats (leases lapsed).
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from shoal.chief.server import ChiefServer
from shoal.chief.state import ChiefState
from shoal.config import JobConfig
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc

LAYOUT = pb.ModelLayout(tensors=[pb.TensorSpec(name="w", shape=[4], dtype="float32")])


@pytest.fixture
def chief():
    server = ChiefServer(JobConfig(num_shards=1, lease_seconds=30.0), bind="127.0.0.1:0", tick_s=0.05).start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield server, pb_grpc.ChiefStub(channel)
    finally:
        channel.close()
        server.stop(grace_s=0.2)


@pytest.fixture
def counted(monkeypatch):
    """Counts the chief's view builds and opened watches (``ChiefState.view``, ``watch_opened``)."""
    counts = {"views": 0, "watches": 0}
    view, opened = ChiefState.view, ChiefState.watch_opened

    def counting_view(self):
        counts["views"] += 1
        return view(self)

    def counting_opened(self, member_id):
        counts["watches"] += 1
        return opened(self, member_id)

    monkeypatch.setattr(ChiefState, "view", counting_view)
    monkeypatch.setattr(ChiefState, "watch_opened", counting_opened)
    return counts


def wait_for(pred, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def join(stub, n: int) -> list[str]:
    return [stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=10).member_id for _ in range(n)]


def watch_all(stub, members: list[str], after: int) -> list:
    return [stub.GetView.future(pb.ViewRequest(after_epoch=after, timeout_seconds=20, member_id=m), timeout=30)
            for m in members]


def test_one_view_change_builds_the_view_once_for_every_watcher(chief, counted):
    server, stub = chief
    members = join(stub, 16)
    epoch = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5).epoch
    counted["watches"] = 0
    calls = watch_all(stub, members[1:], epoch)
    wait_for(lambda: counted["watches"] == len(calls))
    before = counted["views"]
    stub.Leave(pb.LeaveRequest(member_id=members[0]), timeout=5)        # the change: no view in its reply
    views = [c.result() for c in calls]
    assert counted["views"] - before == 1
    assert {v.epoch for v in views} == {epoch + 1}
    assert len({v.SerializeToString() for v in views}) == 1
    assert members[0] not in {m.member_id for m in views[0].members} and len(views[0].members) == 15

    # a read that asks for no epoch (shoal status) is built anew: step times change without an epoch
    stub.Heartbeat(pb.HeartbeatRequest(member_id=members[1], step_seconds=0.25), timeout=5)
    fresh = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5)
    assert counted["views"] - before == 2 and fresh.epoch == epoch + 1
    assert {m.member_id: m.step_seconds for m in fresh.members}[members[1]] == 0.25
    # ...and watchers answered at that epoch get that newer one, still without a build each
    again = [c.result() for c in watch_all(stub, members[1:4], epoch)]
    assert counted["views"] - before == 2 and all(v == fresh for v in again)


def test_heartbeats_are_answered_while_more_watches_are_open_than_the_old_64_threads(chief, counted):
    server, stub = chief
    members = join(stub, 100)
    epoch = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5).epoch
    counted["watches"] = 0
    calls = watch_all(stub, members, epoch)
    wait_for(lambda: counted["watches"] == len(calls))
    t0 = time.monotonic()
    reply = stub.Heartbeat(pb.HeartbeatRequest(member_id=members[0]), timeout=5)   # 64 threads: ~20 s queued
    assert reply.known and time.monotonic() - t0 < 2.0
    stub.Leave(pb.LeaveRequest(member_id=members[0]), timeout=5)
    assert {c.result().epoch for c in calls} == {epoch + 1}


def test_idle_watches_take_no_lock_and_still_answer_a_change_at_once(chief, counted, monkeypatch):
    """A thousand open watches must not wake (and queue on the chief's lock) every second while nothing
    changes: the old watch re-took the lock once a second each, 1000 lock round trips a second."""
    server, stub = chief
    members = join(stub, 120)
    epoch = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5).epoch
    counted["watches"] = 0
    calls = watch_all(stub, members[1:], epoch)
    wait_for(lambda: counted["watches"] == len(calls))
    taken = [0]                           # the lock taken, or taken back after a wait on it
    enter, wait = threading.Condition.__enter__, threading.Condition.wait

    def counting_enter(self):
        if self is server.servicer.lock:
            taken[0] += 1
        return enter(self)

    def counting_wait(self, timeout=None):
        try:
            return wait(self, timeout)
        finally:
            if self is server.servicer.lock:
                taken[0] += 1
    monkeypatch.setattr(threading.Condition, "__enter__", counting_enter)
    monkeypatch.setattr(threading.Condition, "wait", counting_wait)
    time.sleep(2.5)                       # every old watch re-took the lock twice in this window
    idle = taken[0]
    started = time.monotonic()
    stub.Leave(pb.LeaveRequest(member_id=members[0]), timeout=5)
    views = [c.result() for c in calls]
    took = time.monotonic() - started
    assert {v.epoch for v in views} == {epoch + 1}
    assert took < 1.0, f"the change reached the last of {len(calls)} watchers after {took:.2f}s"
    # the chief's ticker takes it 20 times a second (tick_s 0.05); 119 watches polling once a second add 238
    assert idle < 2.5 * 20 + len(calls), f"{idle} lock acquisitions in 2.5 s with {len(calls)} idle watches"
