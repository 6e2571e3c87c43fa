"""The update guard over the wire (gRPC and the TCP data channel): the issue's attacks refused with their
reason, counted in status, the shard untouched; a push naming no batch refused when the job requires one."""
import grpc
import pytest
import torch

from shoal.net import frames
from shoal.chief.telemetry import RefusedPushes, read_shards
from shoal.cli import records
from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.ps.host import ShardHost
from shoal.ps.servicer import DataServicer, StatusServicer
from shoal.ps.telemetry import collector
from shoal.ps.tcp_server import DataChannelServer
from shoal.net.rpc import create_server, open_channel
from shoal.worker.ps_client import ShardClient

FP = "layout-fp"


@pytest.fixture(params=["grpc", "tcp"])
def ps(request):
    host = ShardHost()
    host.assign(0, JobConfig(mode="async", expel_after=4, require_batch=request.param == "tcp"))
    server, port, _ = create_server("127.0.0.1:0")
    servicer = DataServicer(host)
    server.add_generic_rpc_handlers((servicer.handler(),))
    pb_grpc.add_ParameterServerServicer_to_server(StatusServicer(host), server)
    channel = DataChannelServer(servicer).start() if request.param == "tcp" else None
    server.start()
    yield host, f"127.0.0.1:{port}", request.param
    if channel is not None:
        channel.close()
    server.stop(0)


CLAIM = dict(has_batch=True, task_id=0, data_epoch=0, task_start=0, task_stop=640)


def push(c, grad, key, n=0, **extra):
    claim = {**CLAIM, "batch_start": 16 * n, "batch_stop": 16 * (n + 1)}
    return c.push([(0, grad.numel(), "none", frames.tensor_bytes(grad))], worker="w1", version=0, key=key,
                  view_epoch=0, samples=1, **claim, **extra)[0]


def status(addr):
    ch = open_channel(addr)
    try:
        return pb_grpc.ParameterServerStub(ch).Status(pb.StatusRequest(shard=0, by_shard=True), timeout=5)
    finally:
        ch.close()


def test_the_issues_attacks_are_refused_and_the_model_is_untouched(ps):
    host, addr, _ = ps
    c = ShardClient(0, addr, 100, FP)
    c.init(torch.zeros(100), OptimizerSpec("adam", {"lr": 0.001}))
    assert push(c, torch.ones(100), "ok", 0).accepted
    before = host.get(0).export_state()
    big = torch.zeros(100)
    big[5] = 3e38
    r = push(c, big, "evil-norm", 1)
    assert not r.accepted and not r.duplicate and "overflows fp32" in r.reason
    r = push(c, torch.ones(100), "evil-lr", 2, hparams={"0.lr": 1e30})
    assert not r.accepted and "0.lr = 1e+30 is out of bounds" in r.reason and "--lr-factor" in r.reason
    after = host.get(0).export_state()
    assert torch.equal(after.values, before.values) and after.version == before.version == 1
    assert all(torch.equal(a, b) for a, b in zip(after.opt_state["state"][0].values(),
                                                 before.opt_state["state"][0].values()))
    st = status(addr)
    assert dict(st.guard_refused) == {"w1": 2} and st.rolled_back == 0
    # the chief's watcher alerts once; the run's summary says the model was protected
    versions, refused = read_shards({0: addr})
    (alert,) = RefusedPushes().observe(refused, versions)
    assert alert.member == "w1" and "update guard" in alert.text
    assert records.guard_record([{"guard_refused": dict(st.guard_refused)}])["refused"] == {"w1": 2}
    # and the Prometheus counter a scrape reads
    (fam,) = [f for f in collector(host)() if f.name == "shoal_shard_updates_refused"]
    assert [(x.labels["worker"], x.value) for x in fam.samples if x.name.endswith("_total")] == [("w1", 2)]


def test_a_worker_that_keeps_attacking_is_expelled(ps):
    host, addr, _ = ps
    c = ShardClient(0, addr, 10, FP)
    c.init(torch.zeros(10), OptimizerSpec("sgd", {"lr": 0.1}))
    for k in range(3):
        assert not push(c, torch.ones(10), f"e{k}", k, hparams={"0.lr": 1e30}).accepted
    with pytest.raises(grpc.RpcError) as err:
        push(c, torch.ones(10), "e3", 3, hparams={"0.lr": 1e30})
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "expelled" in err.value.details()
    assert list(status(addr).expelled) == ["w1"]


def test_a_push_naming_no_batch_is_refused_when_the_job_requires_one(ps):
    host, addr, transport = ps
    c = ShardClient(0, addr, 10, FP)
    c.init(torch.zeros(10), OptimizerSpec("sgd", {"lr": 0.1}))
    grad = torch.ones(10)
    if transport == "grpc":          # this fixture's gRPC server runs a job that does not require one
        assert c.push([(0, 10, "none", frames.tensor_bytes(grad))], worker="w1", version=0, key="k",
                      view_epoch=0, samples=1)[0].accepted
        return
    with pytest.raises(grpc.RpcError) as err:
        c.push([(0, 10, "none", frames.tensor_bytes(grad))], worker="w1", version=0, key="k", view_epoch=0,
               samples=1)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "names no batch" in err.value.details()
    assert host.get(0).version == 0
