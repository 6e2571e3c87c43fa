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
from shoal.settings.config import JobConfig
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


# ------------------------------------------------------------ routing views (chief/views.py)

def routing_watch(stub, member: str, after: int, wait_s: float = 20):
    return stub.GetView.future(pb.ViewRequest(after_epoch=after, timeout_seconds=wait_s, member_id=member,
                                              scope=pb.ROUTING), timeout=wait_s + 10)


def join_ps(stub, port: int) -> str:
    return stub.Join(pb.JoinRequest(role=pb.PS, address=f"127.0.0.1:{port}"), timeout=10).member_id


def test_a_worker_joining_or_leaving_wakes_no_routing_watch_and_a_server_joining_wakes_them_all(chief):
    server, stub = chief
    join_ps(stub, 1)
    workers = join(stub, 8)
    epoch = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5).epoch
    routing = [routing_watch(stub, m, epoch) for m in workers[:6]]
    full = stub.GetView.future(pb.ViewRequest(after_epoch=epoch, timeout_seconds=20), timeout=30)
    wait_for(lambda: len(server.servicer.views.watches[pb.ROUTING]) == 6)
    more = join(stub, 2)                                                # worker churn: a new epoch each
    stub.Leave(pb.LeaveRequest(member_id=workers[7]), timeout=5)
    assert full.result().epoch > epoch                                  # a full watch sees every change
    time.sleep(0.3)
    assert not any(c.done() for c in routing), "worker churn woke a routing watch"

    join_ps(stub, 2)                                                    # a server joins: routing changed
    views = [c.result() for c in routing]
    now = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5)
    assert {v.epoch for v in views} == {now.epoch}
    for v in views:
        assert v.routing_only and not v.unchanged and v.ready
        assert {m.role for m in v.members} == {pb.PS} and len(v.members) == 2
        assert sorted(m.address for m in v.members) == ["127.0.0.1:1", "127.0.0.1:2"]
        assert v.num_workers == 9 and v.job.num_shards == 1
        assert not any(m.HasField("counters") for m in v.members)
    # each watcher's rank among the live workers, by number
    live = sorted((m for m in workers[:7] + more), key=lambda m: int(m.rsplit("-", 1)[1]))
    assert [v.worker_rank for v in views] == [live.index(m) for m in workers[:6]]


def test_a_routing_view_is_built_once_per_change_for_every_watcher(chief, monkeypatch):
    server, stub = chief
    builds = [0]
    routing_view = ChiefState.routing_view

    def counting(self):
        builds[0] += 1
        return routing_view(self)
    join_ps(stub, 1)
    workers = join(stub, 12)
    epoch = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5).epoch
    calls = [routing_watch(stub, m, epoch) for m in workers]
    wait_for(lambda: len(server.servicer.views.watches[pb.ROUTING]) == 12)
    monkeypatch.setattr(ChiefState, "routing_view", counting)
    join_ps(stub, 2)
    views = [c.result() for c in calls]
    assert {v.epoch for v in views} == {views[0].epoch} and len({v.worker_rank for v in views}) == 12
    # one build compares the routes, one builds the answer (and the joining server's own reply none:
    # it asked for a full view)
    assert builds[0] <= 2, builds[0]


def test_a_watch_that_times_out_is_answered_unchanged_with_no_view(chief):
    server, stub = chief
    join_ps(stub, 1)
    (worker,) = join(stub, 1)
    epoch = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5).epoch
    for scope in (pb.FULL, pb.ROUTING):
        v = stub.GetView(pb.ViewRequest(after_epoch=epoch, timeout_seconds=0.2, member_id=worker, scope=scope),
                         timeout=5)
        assert v.unchanged and v.epoch == epoch and not v.members and not v.shards and not v.HasField("job")
    join(stub, 1)                      # a worker: a new epoch, but no routing change
    v = stub.GetView(pb.ViewRequest(after_epoch=epoch, timeout_seconds=0.2, member_id=worker, scope=pb.ROUTING),
                     timeout=5)
    assert v.unchanged
    # a read that asks for no epoch always gets the view, of either scope
    assert len(stub.GetView(pb.ViewRequest(after_epoch=-1, scope=pb.ROUTING), timeout=5).members) == 1
    assert len(stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5).members) == 3


def test_a_worker_joining_for_routing_gets_a_routing_view_with_its_rank(chief):
    server, stub = chief
    join_ps(stub, 1)
    replies = [stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT, view_scope=pb.ROUTING), timeout=10)
               for _ in range(3)]
    for i, r in enumerate(replies):
        assert r.view.routing_only and r.view.num_workers == i + 1 and r.view.worker_rank == i
        assert [m.role for m in r.view.members] == [pb.PS]
    old = stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=10)     # FULL by default
    assert not old.view.routing_only and sum(m.role == pb.WORKER for m in old.view.members) == 4


def test_an_unknown_view_scope_is_refused(chief):
    server, stub = chief
    for call in (lambda: stub.GetView(pb.ViewRequest(after_epoch=-1, scope=7), timeout=5),
                 lambda: stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT, view_scope=7), timeout=5)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "view scope" in err.value.details()


def test_a_routing_change_made_outside_the_servicer_reaches_routing_watches_within_a_poll(chief):
    """The checkpointer changes the state under the lock without the servicer: the watches' poll finds it."""
    server, stub = chief
    join_ps(stub, 1)
    (worker,) = join(stub, 1)
    epoch = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5).epoch
    call = routing_watch(stub, worker, epoch)
    wait_for(lambda: len(server.servicer.views.watches[pb.ROUTING]) == 1)
    with server.servicer.lock:
        server.state.join_ps("127.0.0.1:2")
    t0 = time.monotonic()
    view = call.result()
    assert len(view.members) == 2 and time.monotonic() - t0 < 2.5


def test_a_routing_change_found_by_a_read_wakes_the_other_routing_watches():
    """A change made without the servicer (under its lock) that a read finds first: the read must not
    keep it from the open watches until the ticker's next look (here 5 s away)."""
    server = ChiefServer(JobConfig(num_shards=1, lease_seconds=30.0), bind="127.0.0.1:0", tick_s=5.0).start()
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.ChiefStub(channel)
        join_ps(stub, 1)
        (worker,) = join(stub, 1)
        epoch = stub.GetView(pb.ViewRequest(after_epoch=-1, scope=pb.ROUTING), timeout=5).epoch
        call = routing_watch(stub, worker, epoch)
        wait_for(lambda: len(server.servicer.views.watches[pb.ROUTING]) == 1)
        with server.servicer.lock:      # changed, then answered (a read whose watch began before the change)
            server.state.join_ps("127.0.0.1:2")
            server.servicer.views.answer(pb.ROUTING, "", fresh=True)
        t0 = time.monotonic()
        assert len(call.result(timeout=10).members) == 2 and time.monotonic() - t0 < 2.0
    finally:
        channel.close()
        server.stop(grace_s=0.2)
