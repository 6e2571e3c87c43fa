"""The parameter server's data plane on ephemeral ports: every test runs over gRPC and over the TCP channel."""
import grpc
import pytest
import torch

from shoal.net import frames
from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.proto import shoal_pb2 as pb
from shoal.ps.host import ShardHost
from shoal.ps.servicer import DataServicer
from shoal.ps.tcp_server import DataChannelServer
from shoal.net.rpc import create_server, open_channel
from shoal.worker.ps_client import ShardClient

FP = "layout-fp"


@pytest.fixture(params=["grpc", "tcp"])
def ps(request):
    """A ps serving shard 0; with ``tcp`` it also offers the TCP data channel, which clients then use."""
    host = ShardHost()
    host.assign(0, JobConfig(mode="async"))
    server, port, _ = create_server("127.0.0.1:0")
    servicer = DataServicer(host, pull_chunk_bytes=1 << 20)
    server.add_generic_rpc_handlers((servicer.handler(),))
    channel = DataChannelServer(servicer).start() if request.param == "tcp" else None
    server.start()
    yield host, f"127.0.0.1:{port}"
    if channel is not None:
        channel.close()
    server.stop(0)


def client(addr, numel, chunk_bytes=1 << 20):
    return ShardClient(0, addr, numel, FP, chunk_bytes=chunk_bytes)


def test_clients_take_the_tcp_channel_when_offered(ps, request):
    host, addr = ps
    c = client(addr, 10)
    c.init(torch.zeros(10), OptimizerSpec())
    c.pull(torch.empty(10))
    assert c.uses_tcp == request.node.callspec.params["ps"].endswith("tcp")
    assert not ShardClient(0, addr, 10, FP, transport="grpc").uses_tcp


def raw_chunks(grad, per):
    return [(o, min(per, grad.numel() - o), "none", frames.tensor_bytes(grad[o:o + per]))
            for o in range(0, grad.numel(), per)]


def test_large_init_push_pull_beyond_grpc_default_limits(ps):
    host, addr = ps
    n = 20 * (1 << 20)                                   # 80 MB of fp32: > 4 MB and > 64 MB
    c = client(addr, n, chunk_bytes=16 << 20)
    init = torch.arange(n, dtype=torch.float32)
    assert c.init(init, OptimizerSpec("sgd", {"lr": 1.0})).created
    grad = torch.ones(n)
    reply, sent = c.push(raw_chunks(grad, 4 << 20), worker="w", version=0, key="k", view_epoch=0, samples=1)
    assert reply.accepted and reply.version == 1 and sent > n * 4
    out = torch.empty(n)
    version, got = c.pull(out)
    assert version == 1 and got > n * 4
    assert torch.equal(out, init - 1)
    # one single 80 MB frame also goes through
    single = client(addr, n, chunk_bytes=1 << 30)
    reply, _ = single.push([(0, n, "none", frames.tensor_bytes(grad))], worker="w", version=1, key="k2",
                           view_epoch=0, samples=1)
    assert reply.version == 2


def bad_push(c, chunks, **kw):
    args = dict(worker="w", version=0, key="bad", view_epoch=0, samples=1)
    args.update(kw)
    with pytest.raises(grpc.RpcError) as err:
        c.push(chunks, **args)
    return err.value


@pytest.mark.parametrize("case", ["short", "overlap", "beyond", "size_mismatch", "codec", "fingerprint"])
def test_bad_pushes_are_invalid_and_change_nothing(ps, case):
    host, addr = ps
    n = 1000
    c = client(addr, n)
    c.init(torch.zeros(n), OptimizerSpec("sgd", {"lr": 1.0}))
    g = torch.ones(n)
    chunks = {
        "short": [(0, 999, "none", frames.tensor_bytes(g[:999]))],
        "overlap": [(0, 600, "none", frames.tensor_bytes(g[:600])), (500, 500, "none", frames.tensor_bytes(g[500:]))],
        "beyond": [(0, 1001, "none", frames.tensor_bytes(torch.ones(1001)))],
        "size_mismatch": [(0, 1000, "none", frames.tensor_bytes(g[:900]))],
        "codec": [(0, 1000, "gzip9", frames.tensor_bytes(g))],
        "fingerprint": [(0, 1000, "none", frames.tensor_bytes(g))],
    }[case]
    if case == "fingerprint":
        c.fingerprint = "other"
    err = bad_push(c, chunks)
    want = grpc.StatusCode.FAILED_PRECONDITION if case == "fingerprint" else grpc.StatusCode.INVALID_ARGUMENT
    assert err.code() == want, err.details()
    shard = host.get(0)
    assert shard.version == 0 and torch.equal(shard.values(), torch.zeros(n))


def test_push_to_unknown_or_uninitialised_shard(ps):
    host, addr = ps
    c = client(addr, 10)
    err = bad_push(c, [(0, 10, "none", frames.tensor_bytes(torch.ones(10)))])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not initialised" in err.details()
    other = ShardClient(5, addr, 10, FP)
    with pytest.raises(grpc.RpcError) as e:
        other.pull(torch.empty(10))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_second_init_with_other_layout_is_refused(ps):
    host, addr = ps
    c = client(addr, 10)
    assert c.init(torch.zeros(10), OptimizerSpec()).created
    assert not c.init(torch.ones(10), OptimizerSpec()).created       # first one wins
    c.fingerprint = "another-model"
    with pytest.raises(grpc.RpcError) as e:
        c.init(torch.zeros(10), OptimizerSpec())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "layout" in e.value.details()


@pytest.mark.parametrize("codec,tol", [("none", 0), ("fp16", 1e-3), ("bf16", 1e-2)])
def test_pull_codecs(ps, codec, tol):
    host, addr = ps
    n = 3001
    c = client(addr, n, chunk_bytes=4096)
    w = torch.randn(n, generator=torch.Generator().manual_seed(1))
    c.init(w, OptimizerSpec())
    out = torch.empty(n)
    _, got = c.pull(out, codec=codec)
    torch.testing.assert_close(out, w, rtol=tol, atol=tol)
    assert got < n * (4 if codec == "none" else 2) + 2000


def test_malformed_frames_are_invalid_argument(ps):
    host, addr = ps
    channel = open_channel(addr)
    push = channel.stream_unary("/shoal.ParameterServerData/Push")
    with pytest.raises(grpc.RpcError) as e:
        push(iter([b"\xff\xff\xff\x7fgarbage"]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        push(iter([]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
    assert pb.PushReply  # the reply type stays importable for clients


def test_an_install_that_sends_nothing_is_answered_unavailable_without_a_warning(cluster_factory, caplog):
    """A server leaving the job may close a copy's stream before its first part: nothing arrived and
    nothing changes, so it is no refusal to warn about (a WARNING on a healthy planned leave)."""
    import logging
    from shoal.net.wire import DATA_SERVICE
    c = cluster_factory(1, num_shards=1)
    with grpc.insecure_channel(c.servers[0].address) as ch, caplog.at_level(logging.WARNING):
        with pytest.raises(grpc.RpcError) as err:
            ch.stream_unary(f"/{DATA_SERVICE}/Install")(iter([]), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "before its first part" in err.value.details()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
