"""The chief on grpc.aio (chief/aio.py): what its one wrapper does for every call, a blocking probe
kept off the event loop, and a stop that does not wait on open watches."""
from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from shoal.security import auth
from shoal.chief.server import ChiefServer
from shoal.settings.config import JobConfig
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LAYOUT = pb.ModelLayout(tensors=[pb.TensorSpec(name="w", shape=[4], dtype="float32")])
TOKEN = b"0123456789abcdef-aio-test-token"


@pytest.fixture
def chief():
    server = ChiefServer(JobConfig(num_shards=1, lease_seconds=30.0), bind="127.0.0.1:0", tick_s=0.05).start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield server, pb_grpc.ChiefStub(channel), channel
    finally:
        channel.close()
        server.stop(grace_s=0.2)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def errors_counted(method: str, code: str) -> float:
    return REGISTRY.get_sample_value("shoal_rpc_errors_total", {"method": method, "code": code}) or 0.0


def counted_by(pred, what: str, deadline_s: float = 5.0) -> None:
    """The call is counted after its status is sent: the caller may see the status first."""
    deadline = time.monotonic() + deadline_s
    while not pred():
        assert time.monotonic() < deadline, f"{what} not counted"
        time.sleep(0.005)


def test_garbage_to_every_method_is_refused_invalid_argument_and_counted(chief):
    server, stub, channel = chief
    for method in ("Join", "Heartbeat", "Leave", "GetView", "GetTasks", "ReportMetrics", "ReportUnreachable"):
        before = errors_counted(method, "INVALID_ARGUMENT")
        call = channel.unary_unary(f"/shoal.Chief/{method}")
        assert code_of(lambda: call(b"\xff\xff\xff\xff", timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT, method
        counted_by(lambda: errors_counted(method, "INVALID_ARGUMENT") == before + 1, method)
    # and the chief still serves
    assert stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5).member_id


def test_a_shoal_error_becomes_its_status_code_and_a_successful_call_is_timed(chief):
    server, stub, channel = chief
    assert code_of(lambda: stub.Join(pb.JoinRequest(role=pb.PS), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    before = REGISTRY.get_sample_value("shoal_rpc_duration_seconds_count", {"method": "GetJobStats", "code": "OK"}) or 0.0
    stub.GetJobStats(pb.Empty(), timeout=5)
    counted_by(lambda: REGISTRY.get_sample_value("shoal_rpc_duration_seconds_count",
                                                 {"method": "GetJobStats", "code": "OK"}) == before + 1, "GetJobStats")


def test_with_a_token_every_chief_call_needs_it_and_health_does_not():
    auth.use_token(TOKEN)
    try:
        server = ChiefServer(JobConfig(num_shards=1), bind="127.0.0.1:0").start()
    finally:
        auth.reset()
    try:
        with grpc.insecure_channel(server.address) as bare:
            stub = pb_grpc.ChiefStub(bare)
            assert code_of(lambda: stub.GetJobStats(pb.Empty(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5)) == \
                grpc.StatusCode.UNAUTHENTICATED
            wrong = pb_grpc.ChiefStub(bare).GetJobStats
            assert code_of(lambda: wrong(pb.Empty(), timeout=5, metadata=[(auth.TOKEN_KEY, "x" * 20)])) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert wrong(pb.Empty(), timeout=5, metadata=[(auth.TOKEN_KEY, TOKEN.decode())]).tasks_total == 0
            health = health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest(service="shoal.Chief"),
                                                            timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(grace_s=0.2)


def test_a_probe_of_an_unreachable_server_does_not_hold_up_the_other_calls(chief):
    """ReportUnreachable probes the server itself (up to a second): on a thread, not on the event loop."""
    server, stub, channel = chief
    silent = socket.socket()            # takes connections (the kernel's backlog) but never speaks: the
    silent.bind(("127.0.0.1", 0))       # probe waits out its timeout, as with a frozen host
    silent.listen(16)
    server.servicer.probe_timeout_s = 1.5
    ps = stub.Join(pb.JoinRequest(role=pb.PS, address=f"127.0.0.1:{silent.getsockname()[1]}"), timeout=5).member_id
    worker = stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5).member_id
    report = stub.ReportUnreachable.future(pb.UnreachableReport(member_id=ps, reporter_id=worker), timeout=10)
    time.sleep(0.1)                       # the probe is under way
    t0 = time.monotonic()
    for _ in range(5):
        assert stub.Heartbeat(pb.HeartbeatRequest(member_id=worker), timeout=5).known
    assert time.monotonic() - t0 < 0.5 and not report.done()
    assert report.result().expired
    silent.close()


def test_stop_does_not_wait_for_open_watches(chief):
    server, stub, channel = chief
    workers = [stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5).member_id for _ in range(50)]
    epoch = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5).epoch
    calls = [stub.GetView.future(pb.ViewRequest(after_epoch=epoch, timeout_seconds=30, member_id=m), timeout=40)
             for m in workers]
    deadline = time.monotonic() + 10
    while sum(len(w) for w in server.servicer.views.watches.values()) < len(calls):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    server.stop(grace_s=0.2)
    assert time.monotonic() - t0 < 3.0
    for c in calls:
        with pytest.raises(grpc.RpcError):
            c.result(timeout=5)


def test_calls_from_many_threads_at_once_are_all_answered(chief):
    """The servicer's lock is taken by the loop and by the ticker's thread: no call is lost or stuck."""
    server, stub, channel = chief
    workers = [stub.Join(pb.JoinRequest(role=pb.WORKER, layout=LAYOUT), timeout=5).member_id for _ in range(20)]
    errors: list[Exception] = []

    def beat(m: str) -> None:
        try:
            for i in range(25):
                assert stub.Heartbeat(pb.HeartbeatRequest(member_id=m, counters=pb.Counters(steps=i)), timeout=5).known
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)
    threads = [threading.Thread(target=beat, args=(m,)) for m in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    stats = stub.GetJobStats(pb.Empty(), timeout=5)
    assert stats.workers_live == 20 and stats.totals.steps == 20 * 24


def test_the_loop_lag_is_measured_and_fades(chief):
    """A loop held up (here by a blocking call on it) shows as lag, which the lease checks allow for."""
    server, stub, channel = chief
    assert server.server.lag_s < 0.2

    async def hold() -> None:
        time.sleep(0.6)
    import asyncio
    asyncio.run_coroutine_threadsafe(hold(), server.server.loop).result(5)
    deadline = time.monotonic() + 2
    while server.server.lag_s < 0.4:
        assert time.monotonic() < deadline, server.server.lag_s
        time.sleep(0.01)
    deadline = time.monotonic() + 5
    while server.server.lag_s > 0.05:              # it fades once the loop keeps up
        assert time.monotonic() < deadline, server.server.lag_s
        time.sleep(0.05)
    # the ticker hands it to the lease checks
    deadline = time.monotonic() + 2
    while server.state.members.backlog_s > 0.05:
        assert time.monotonic() < deadline
        time.sleep(0.05)
