"""The servicer boundary (``shoal.net.rpc.grpc_errors``): which failures become which status, and which are quiet."""
import logging

import grpc
import pytest

from shoal.errors import InvalidArgument
from shoal.net.rpc import grpc_errors


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self, active=True):
        self.active = active
        self.aborted = None

    def is_active(self):
        return self.active

    def abort(self, code, details):
        self.aborted = (code, details)
        raise Aborted(details)        # grpc's abort raises too: the handler never returns normally


class Servicer:
    def __init__(self, exc):
        self.exc = exc

    @grpc_errors
    def Install(self, request, context):
        raise self.exc


def test_shoal_errors_abort_with_their_code():
    ctx = FakeContext()
    with pytest.raises(Aborted):
        Servicer(InvalidArgument("bad size")).Install(None, ctx)
    assert ctx.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "bad size")


@pytest.mark.parametrize("exc", [RuntimeError("bug"), grpc.RpcError()])
def test_other_failures_are_logged_and_internal(exc, caplog):
    ctx = FakeContext(active=True)
    with pytest.raises(Aborted):
        Servicer(exc).Install(None, ctx)
    assert ctx.aborted[0] == grpc.StatusCode.INTERNAL
    assert any(r.levelno == logging.ERROR and "Install failed" in r.getMessage() for r in caplog.records)


def test_a_request_stream_whose_caller_left_ends_quietly(caplog):
    """Reading the next message of a cancelled stream raises RpcError: no one is left to answer,
    and a server being stopped mid-copy must not log tracebacks."""
    caplog.set_level(logging.INFO)
    ctx = FakeContext(active=False)
    assert Servicer(grpc.RpcError()).Install(None, ctx) is None
    assert ctx.aborted is None
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)
    assert "went away" in caplog.text
