"""The raw TCP data channel: tickets, refusals that keep the connection, lost peers, fallback to gRPC."""
import socket
import threading

import grpc
import pytest
import torch

from shoal.net import frames
from shoal.net import tcp_channel as tc
from shoal.codecs.sparse import TopKCodec
from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.proto import shoal_pb2 as pb
from shoal.ps.host import ShardHost
from shoal.ps.servicer import DataServicer
from shoal.ps.tcp_server import DataChannelServer
from shoal.net.rpc import create_server
from harness import wait_until
from shoal.worker.ps_client import ShardClient

FP = "layout-fp"
N = 1000


@pytest.fixture
def ps():
    host = ShardHost()
    host.assign(0, JobConfig(mode="async"))
    server, port, _ = create_server("127.0.0.1:0")
    servicer = DataServicer(host)
    server.add_generic_rpc_handlers((servicer.handler(),))
    lost: list[str] = []
    channel = DataChannelServer(servicer, on_lost=lost.append).start()
    server.start()
    c = ShardClient(0, f"127.0.0.1:{port}", N, FP, member_id=lambda: "worker-3")
    c.init(torch.zeros(N), OptimizerSpec("sgd", {"lr": 1.0}))
    yield host, channel, c, lost
    c.close()
    channel.close()
    server.stop(0)


def push(c, grad, key, version=0):
    return c.push([(0, grad.numel(), "none", frames.tensor_bytes(grad))], worker="w", version=version, key=key,
                  view_epoch=0, samples=1)


def test_a_refused_push_leaves_the_connection_usable(ps):
    host, _, c, _ = ps
    assert c.uses_tcp
    with pytest.raises(grpc.RpcError) as err:
        push(c, torch.ones(N - 1), "bad")                  # short: refused, its body still read
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert host.get(0).version == 0
    reply, sent = push(c, torch.ones(N), "good")           # same connection, still in step
    assert reply.accepted and reply.version == 1 and sent > 4 * N
    assert c.tcp.idle_connections == 1
    out = torch.empty(N)
    assert c.pull(out)[0] == 1 and torch.equal(out, -torch.ones(N))


def test_a_pull_that_waits_too_long_is_deadline_exceeded(ps):
    _, _, c, _ = ps
    with pytest.raises(grpc.RpcError) as err:
        c.pull(torch.empty(N), min_version=5, timeout_s=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def raw_connection(channel: DataChannelServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", channel.port), timeout=5)
    return s


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionError:
        return True


def test_a_wrong_ticket_or_a_garbage_prefix_is_cut_off_and_changes_nothing(ps):
    host, channel, c, lost = ps
    s = raw_connection(channel)
    tc.send(s, tc.HELLO, tc.hello(b"x" * tc.TICKET_BYTES, "intruder"))
    assert closed_by_peer(s)
    s = raw_connection(channel)
    s.sendall(tc.PREFIX.pack(tc.HELLO, tc.MAX_HEAD + 1, 0))   # a header no shoal peer sends
    assert closed_by_peer(s)
    s = raw_connection(channel)
    tc.send(s, tc.HELLO, tc.hello(channel.ticket, "worker-9"))
    assert tc.recv_prefix(s)[0] == tc.OK
    tc.send(s, 99, b"?")                                     # unknown request kind: refused, then closed
    kind, text, _ = tc.recv_prefix(s)
    assert tc.status_code(kind) == grpc.StatusCode.INVALID_ARGUMENT and b"unknown" in text
    assert closed_by_peer(s)
    assert host.get(0).version == 0
    assert push(c, torch.ones(N), "k")[0].accepted           # the server serves on


def test_a_named_peer_that_drops_its_connection_is_reported(ps):
    _, channel, c, lost = ps
    c.pull(torch.empty(N))
    c.close()                                                # the worker's sockets close
    wait_until(lambda: lost == ["worker-3"], timeout_s=5, what="the lost connection to be reported")
    channel.close()                                          # the server's own close reports nothing
    assert lost == ["worker-3"]


def test_a_retired_client_closes_each_connection_as_its_call_ends_and_the_server_drains(ps):
    host, channel, c, _ = ps
    c.pull(torch.empty(N))                                   # one idle connection
    assert not channel.drain(0.05)
    got: list[int] = []
    waiting = threading.Thread(target=lambda: got.append(c.pull(torch.empty(N), min_version=1, timeout_s=10)[0]))
    waiting.start()                                          # a second connection, busy until version 1
    wait_until(lambda: c.tcp.idle_connections == 0, timeout_s=5, what="the pull to take the idle connection")
    c.pull(torch.empty(N))                                   # a third, back to idle
    c.retire()                                               # the view moved the shard away
    assert c.tcp.idle_connections == 0 and not c.closed
    assert not channel.drain(0.2), "the busy pull's connection closed before its call ended"
    assert push(c, torch.ones(N), "k")[0].accepted           # a call may still be made (on a new connection)
    waiting.join(timeout=10)
    assert got == [1]
    assert channel.drain(5), "connections were kept open after their calls ended"


def test_a_ps_that_closes_its_channel_fails_calls_as_unavailable(ps):
    _, channel, c, _ = ps
    c.pull(torch.empty(N))
    channel.close()
    with pytest.raises(grpc.RpcError) as err:
        c.pull(torch.empty(N))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_unreachable_channel_falls_back_to_grpc(ps):
    host, channel, c, _ = ps
    addr = c.address
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))                          # a port nobody accepts on
    dead_port = listener.getsockname()[1]
    listener.close()
    channel.servicer.offer = pb.DataChannelOffer(port=dead_port, ticket=channel.ticket)
    other = ShardClient(0, addr, N, FP)
    assert push(other, torch.ones(N), "via-grpc")[0].accepted
    assert not other.uses_tcp
    other.close()


def test_pushes_from_many_threads_each_get_their_own_connection(ps):
    host, _, c, _ = ps
    errors = []

    def run(i):
        try:
            for j in range(5):
                push(c, torch.ones(N), f"t{i}-{j}")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and host.get(0).version == 20
    assert 1 <= c.tcp.idle_connections <= 4


def test_a_replicated_update_that_is_not_the_whole_gradient_is_refused(ps):
    host, channel, c, _ = ps
    s = raw_connection(channel)
    tc.send(s, tc.HELLO, tc.hello(channel.ticket, "ps-1"))
    assert tc.recv_prefix(s)[0] == tc.OK
    head = pb.ReplicateHeader(shard=0, version=1, primary_id="ps-1", offset=0, numel=N, shard_numel=N)
    tc.send(s, tc.REPLICATE, head.SerializeToString(), bytes(4 * N - 4))   # one element short
    kind, text, _ = tc.recv_prefix(s)
    assert tc.status_code(kind) == grpc.StatusCode.INVALID_ARGUMENT and b"it must hold all" in text
    tc.send(s, tc.REPLICATE, head.SerializeToString(), bytes(4 * N))       # in step: the next is read
    kind, text, _ = tc.recv_prefix(s)
    assert tc.status_code(kind) == grpc.StatusCode.FAILED_PRECONDITION     # this ps is shard 0's primary
    assert host.get(0).version == 0


def test_a_pull_since_a_held_version_gets_only_what_top_k_pushes_changed(ps):
    host, _, c, _ = ps
    topk = TopKCodec(ratio=3 / N)

    def push_sparse(idx, key):
        g = torch.zeros(N)
        g[idx] = torch.tensor([1.0, 2.0, 3.0])
        return c.push([(0, N, "topk", topk.encode(g))], worker="w", version=0, key=key, view_epoch=0, samples=1)

    push(c, torch.ones(N), "dense")
    held = torch.empty(N)
    version, got = c.pull(held)
    assert version == 1 and got > 4 * N
    push_sparse([5, 17, 900], "s1")
    push_sparse([17, 18, 19], "s2")
    version, got = c.pull(held, since=1)
    assert version == 3 and got < 200                       # 5 indices and 5 values, not 4 kB
    assert torch.equal(held, host.get(0).values())
    assert c.pull(held, since=3)[1] < 100                   # nothing changed
    push(c, torch.ones(N), "dense again")
    version, got = c.pull(held, since=3)
    assert version == 4 and got > 4 * N                     # a dense update: the whole shard
    assert torch.equal(held, host.get(0).values())
