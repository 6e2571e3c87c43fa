"""Every wait on the chief ends, with one line saying what it waited for; a Leave is final."""
from __future__ import annotations

import socket
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
