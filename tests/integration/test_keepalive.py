"""Heartbeats on one KeepAlive stream (shoal/net/keepalive.py, chief/aio.py): the chief answers each in
order as Heartbeat would; a member whose beat goes unanswered fails it in time and opens a new
stream; one whose chief ended the stream, or has none, goes on; a stranger gets the same refusals
as on the single call."""
from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import pytest
from prometheus_client import REGISTRY

from shoal.security import auth
from shoal.chief.server import ChiefServer
from shoal.chief_client import ChiefClient
from shoal.settings.config import JobConfig
from shoal.net.keepalive import HeartbeatStream
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from tests.harness import wait_until

LAYOUT = pb.ModelLayout(tensors=[pb.TensorSpec(name="w", shape=[4], dtype="float32")])
TOKEN = b"0123456789abcdef-keepalive-token"


@pytest.fixture
def chief():
    server = ChiefServer(JobConfig(num_shards=1, lease_seconds=30.0), bind="127.0.0.1:0", tick_s=0.05).start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield server, pb_grpc.ChiefStub(channel), channel
    finally:
        channel.close()
        server.stop(grace_s=0.2)


def heartbeats_counted() -> float:
    return REGISTRY.get_sample_value("shoal_rpc_duration_seconds_count", {"method": "Heartbeat", "code": "OK"}) or 0.0


def test_heartbeats_on_one_stream_are_answered_in_order_and_renew_the_lease(chief):
    server, stub, _ = chief
    a = stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5).member_id
    beats = HeartbeatStream(lambda: stub)
    before = heartbeats_counted()
    try:
        for i in range(1, 6):
            reply = beats.beat(pb.HeartbeatRequest(member_id=a, counters=pb.Counters(steps=i)), timeout_s=5)
            assert reply.known and reply.epoch == server.state.epoch
            assert server.state.members.find(a).counters.steps == i       # this beat, not an older one
        assert not beats.unary and beats.opened == 1
        assert not beats.beat(pb.HeartbeatRequest(member_id="worker-99"), timeout_s=5).known   # join again
        wait_until(lambda: heartbeats_counted() == before + 6, timeout_s=5, what="beats counted as Heartbeat")
    finally:
        beats.close()


def test_a_member_keeps_its_lease_on_the_stream_and_close_ends_it_quietly(caplog):
    server = ChiefServer(JobConfig(num_shards=1, lease_seconds=0.6), bind="127.0.0.1:0", tick_s=0.05).start()
    client = ChiefClient(server.address, pb.WORKER, layout=LAYOUT)
    try:
        client.join()
        client.start_background()
        time.sleep(2.0)                                          # more than three leases
        assert client.member_id in {m.member_id for m in server.state.members.alive()}     # alive or idle
        assert client._beats.opened == 1 and not client._beats.unary
        with caplog.at_level(logging.WARNING, logger="shoal"):
            client.close()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "heartbeat-stream" and t.is_alive()],
                   timeout_s=5, what="the stream's reader to end")
    finally:
        client.close()
        server.stop(grace_s=0.1)


class FakeChief:
    """A chief with a hand-made KeepAlive: ``mode`` 'silent' never answers the first stream,
    'end' ends the first stream after one answer, 'none' has no KeepAlive at all."""

    def __init__(self, mode: str):
        self.mode, self.streams, self.unary = mode, 0, 0
        self.release = threading.Event()
        methods = {"Heartbeat": grpc.unary_unary_rpc_method_handler(
            self.heartbeat, pb.HeartbeatRequest.FromString, pb.HeartbeatReply.SerializeToString)}
        if mode != "none":
            methods["KeepAlive"] = grpc.stream_stream_rpc_method_handler(
                self.keepalive, pb.HeartbeatRequest.FromString, pb.HeartbeatReply.SerializeToString)
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("shoal.Chief", methods),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def heartbeat(self, request, context):
        self.unary += 1
        return pb.HeartbeatReply(epoch=7, known=True)

    def keepalive(self, requests, context):
        self.streams += 1
        first = self.streams == 1
        for n, _ in enumerate(requests):
            if first and self.mode == "silent":
                self.release.wait(10)
                return
            yield pb.HeartbeatReply(epoch=self.streams, known=True)
            if first and self.mode == "end":
                return


@pytest.mark.parametrize("mode", ["silent", "end"])
def test_a_stream_that_stops_answering_or_ends_fails_that_beat_and_the_next_opens_another(mode):
    fake = FakeChief(mode)
    channel = grpc.insecure_channel(f"127.0.0.1:{fake.port}")
    beats = HeartbeatStream(lambda: pb_grpc.ChiefStub(channel))
    try:
        if mode == "end":
            assert beats.beat(pb.HeartbeatRequest(member_id="w"), timeout_s=5).epoch == 1
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            beats.beat(pb.HeartbeatRequest(member_id="w"), timeout_s=0.5)
        assert err.value.code() is (grpc.StatusCode.DEADLINE_EXCEEDED if mode == "silent"
                                    else grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - t0 < 3
        assert beats.beat(pb.HeartbeatRequest(member_id="w"), timeout_s=5).epoch == 2    # a second stream
        assert beats.opened == 2 and fake.unary == 0
    finally:
        fake.release.set()
        beats.close()
        channel.close()
        fake.server.stop(0)


def test_a_chief_without_keepalive_gets_single_heartbeat_calls():
    fake = FakeChief("none")
    channel = grpc.insecure_channel(f"127.0.0.1:{fake.port}")
    beats = HeartbeatStream(lambda: pb_grpc.ChiefStub(channel))
    try:
        for _ in range(3):
            assert beats.beat(pb.HeartbeatRequest(member_id="w"), timeout_s=5).epoch == 7
        assert beats.unary and fake.unary == 3 and beats.opened == 1
    finally:
        beats.close()
        channel.close()
        fake.server.stop(0)


def test_strangers_get_the_refusals_of_the_single_call(chief):
    server, stub, channel = chief
    raw = channel.stream_stream("/shoal.Chief/KeepAlive")
    with pytest.raises(grpc.RpcError) as err:
        list(raw(iter([b"\xff\xff\xff\xff"]), timeout=5))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    auth.use_token(TOKEN)
    try:
        guarded = ChiefServer(JobConfig(num_shards=1), bind="127.0.0.1:0").start()
    finally:
        auth.reset()
    try:
        with grpc.insecure_channel(guarded.address) as bare:
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.ChiefStub(bare).KeepAlive(iter([pb.HeartbeatRequest(member_id="w")]), timeout=5))
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        guarded.stop(grace_s=0.1)
    # and the open chief still answers a member on a stream
    a = stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5).member_id
    assert [r.known for r in stub.KeepAlive(iter([pb.HeartbeatRequest(member_id=a)] * 2), timeout=5)] == [True, True]


# ---------------------------------------------------------------- the view on a Watch stream

def test_a_watch_stream_sends_the_view_then_each_change_once(chief):
    server, stub, _ = chief
    ps = stub.Join(pb.JoinRequest(role=pb.PS, address="127.0.0.1:1"), timeout=5).member_id
    call = stub.Watch(pb.ViewRequest(after_epoch=-1, member_id=ps, scope=pb.FULL))
    try:
        first = next(call)
        assert first.epoch == server.state.epoch and any(m.member_id == ps for m in first.members)
        assert server.state.members.watching(ps)
        epochs = [first.epoch]
        for _ in range(3):                                        # three changes, each seen
            stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5)
            view = next(call)
            assert view.epoch > epochs[-1] and view.epoch == server.state.epoch
            epochs.append(view.epoch)
    finally:
        call.cancel()
    # the stream ending is a watch broken off: the member is not watching, and its lease is cut
    wait_until(lambda: not server.state.members.watching(ps), timeout_s=5, what="the watch to close")


@pytest.mark.parametrize("how", ["stream", "long poll"])
def test_full_views_are_paced_and_a_watcher_gets_the_changes_in_between_in_one(chief, monkeypatch, how):
    """While a full view may not be built again (chief/views.py, FULL_PACE; here 0.4 s after each),
    changes pile up; the watcher's next answer holds all of them, and later ones follow."""
    server, stub, _ = chief
    board = server.servicer.views
    pace_s, built = 0.4, board.answer

    def paced_answer(scope, member_id, fresh):
        out = built(scope, member_id, fresh)
        if scope == pb.FULL:
            board._full_next = time.monotonic() + pace_s
        return out
    monkeypatch.setattr(board, "answer", paced_answer)
    ps = stub.Join(pb.JoinRequest(role=pb.PS, address="127.0.0.1:1"), timeout=5).member_id
    if how == "stream":
        call = stub.Watch(pb.ViewRequest(after_epoch=-1, member_id=ps, scope=pb.FULL))
        answers = lambda epoch: call                                                  # noqa: E731
    else:
        call = None
        answers = lambda epoch: iter([stub.GetView(pb.ViewRequest(after_epoch=epoch, member_id=ps, scope=pb.FULL,  # noqa: E731
                                                                  timeout_seconds=10), timeout=15)])
    try:
        first = next(answers(-1))
        t0 = time.monotonic()
        for _ in range(3):
            stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5)
        after = server.state.epoch
        view = next(answers(first.epoch))
        waited = time.monotonic() - t0
        assert view.epoch == after and sum(m.role == pb.WORKER for m in view.members) == 3
        assert pace_s * 0.8 <= waited < pace_s + 5, waited
        stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5)
        assert next(answers(view.epoch)).epoch == server.state.epoch
    finally:
        if call is not None:
            call.cancel()


def test_a_workers_routing_stream_is_not_woken_by_other_workers(chief):
    server, stub, _ = chief
    stub.Join(pb.JoinRequest(role=pb.PS, address="127.0.0.1:1"), timeout=5)
    w = stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT, view_scope=pb.ROUTING), timeout=5)
    call = stub.Watch(pb.ViewRequest(after_epoch=w.view.epoch, member_id=w.member_id, scope=pb.ROUTING))
    got = []

    def read():
        try:
            got.extend(v.epoch for v in call)
        except grpc.RpcError:
            pass                                                  # cancelled at the end
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for _ in range(3):
            stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5)
        time.sleep(0.3)
        assert got == []                                          # workers joining change no route
        stub.Join(pb.JoinRequest(role=pb.PS, address="127.0.0.1:2"), timeout=5)
        wait_until(lambda: len(got) == 1, timeout_s=5, what="the routing change")
    finally:
        call.cancel()
        reader.join(5)


def test_a_member_follows_the_view_on_one_stream_and_falls_back_to_long_polls_without_one():
    server = ChiefServer(JobConfig(num_shards=1, lease_seconds=2.0), bind="127.0.0.1:0", tick_s=0.05).start()
    client = ChiefClient(server.address, pb.PS, address_advertised="127.0.0.1:9")
    other = pb_grpc.ChiefStub(grpc.insecure_channel(server.address))
    try:
        client.join()
        client.start_background()
        for _ in range(3):
            other.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5)
            client.wait_view(lambda v: v.epoch == server.state.epoch, timeout_s=5)
        assert client._watch_stream and client._watch_call is not None
    finally:
        client.close()
        server.stop(grace_s=0.1)
    fake = FakeChief("none")                                      # no Watch, no KeepAlive
    old = ChiefClient(f"127.0.0.1:{fake.port}", pb.PS)
    try:
        old.member_id = "ps-0"
        old._watch_on_stream(-1, 0.1)
        assert not old._watch_stream                              # UNIMPLEMENTED: long polls from now on
    finally:
        old.close()
        fake.server.stop(0)


def test_a_stranger_gets_the_refusals_of_getview_on_the_stream(chief):
    server, stub, channel = chief
    raw = channel.unary_stream("/shoal.Chief/Watch")
    with pytest.raises(grpc.RpcError) as err:
        list(raw(b"\xff\xff\xff\xff", timeout=5))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Watch(pb.ViewRequest(after_epoch=-1, scope=7), timeout=5))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
