"""NaN/Inf over the wire: a ps never applies it, whichever transport, and never checkpoints it."""
import math

import grpc
import pytest
import torch

from shoal.net import frames
from shoal.state.checkpoint_store import CheckpointWriter
from shoal.chief.telemetry import RefusedPushes, read_shards
from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.ps.checkpoint_servicer import ShardControlServicer
from shoal.ps.host import ShardHost
from shoal.ps.servicer import DataServicer, StatusServicer
from shoal.ps.shard import NONFINITE_STREAK
from shoal.ps.tcp_server import DataChannelServer
from shoal.net.rpc import create_server, open_channel
from shoal.worker.ps_client import ShardClient

FP = "layout-fp"


@pytest.fixture(params=["grpc", "tcp"])
def ps(request):
    host = ShardHost()
    host.assign(0, JobConfig(mode="async", nonfinite="refuse"))
    server, port, _ = create_server("127.0.0.1:0")
    servicer = DataServicer(host)
    server.add_generic_rpc_handlers((servicer.handler(),))
    pb_grpc.add_ParameterServerServicer_to_server(StatusServicer(host), server)
    pb_grpc.add_ShardControlServicer_to_server(ShardControlServicer(host), server)
    channel = DataChannelServer(servicer).start() if request.param == "tcp" else None
    server.start()
    yield host, f"127.0.0.1:{port}"
    if channel is not None:
        channel.close()
    server.stop(0)


def push(c, grad, key):
    return c.push([(0, grad.numel(), "none", frames.tensor_bytes(grad))], worker="w1", version=0, key=key,
                  view_epoch=0, samples=1)[0]


def test_a_nan_push_is_refused_counted_in_status_and_then_fails_the_worker(ps):
    host, addr = ps
    n = 1000
    c = ShardClient(0, addr, n, FP)
    c.init(torch.zeros(n), OptimizerSpec("sgd", {"lr": 1.0}))
    grad = torch.ones(n)
    grad[7] = math.nan
    for k in range(NONFINITE_STREAK):
        reply = push(c, grad, f"k{k}")
        assert not reply.accepted and "1 non-finite value" in reply.reason
    with pytest.raises(grpc.RpcError) as err:
        push(c, grad, "last")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "in a row" in err.value.details()
    assert host.get(0).version == 0 and torch.equal(host.get(0).values(), torch.zeros(n))
    ch = open_channel(addr)
    st = pb_grpc.ParameterServerStub(ch).Status(pb.StatusRequest(shard=0, by_shard=True), timeout=5)
    ch.close()
    assert dict(st.nonfinite_refused) == {"w1": NONFINITE_STREAK + 1}
    # what the chief's watcher reads every few seconds, and the one alert it raises
    versions, refused = read_shards({0: addr})
    assert versions == {0: 0} and refused == {0: {"w1": NONFINITE_STREAK + 1}}
    (alert,) = RefusedPushes().observe(refused, versions)
    assert alert.kind == "pushes_refused" and alert.member == "w1"


def test_an_init_with_nonfinite_weights_is_refused(ps):
    host, addr = ps
    w = torch.zeros(10)
    w[3] = math.inf
    with pytest.raises(grpc.RpcError) as err:
        ShardClient(0, addr, 10, FP).init(w, OptimizerSpec())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "non-finite" in err.value.details()
    assert 0 not in host.shards


def test_a_gradient_that_would_overflow_the_weights_never_reaches_a_checkpoint(ps, tmp_path):
    """The update guard (ps/guard.py) refuses it; were the weights non-finite anyway, WriteShard would
    refuse to write them (ps/checkpoint_servicer.py)."""
    host, addr = ps
    c = ShardClient(0, addr, 4, FP)
    c.init(torch.full((4,), 3e38), OptimizerSpec("sgd", {"lr": 1.0}))
    r = push(c, torch.full((4,), -3e38), "k")       # finite gradient: the weights would overflow to inf
    assert not r.accepted and "overflows fp32" in r.reason
    pending = CheckpointWriter(tmp_path).begin(1)
    ch = open_channel(addr)
    reply = pb_grpc.ShardControlStub(ch).WriteShard(pb.WriteShardRequest(
        shard=0, directory=str(pending.tmp), version=0, start=0, stop=4, layout_fingerprint=FP, thaw=True), timeout=5)
    ch.close()
    assert reply.version == 0 and list(pending.tmp.iterdir())
    assert torch.equal(host.shards[0].values(), torch.full((4,), 3e38))
