"""The chief's start-up line names the address it listens on (a chief bound to every interface said
127.0.0.1, the loopback its own clients dial)."""
import logging

from shoal.chief.server import ChiefServer
from shoal.settings.config import JobConfig


def test_a_chief_bound_to_every_interface_says_so(caplog):
    caplog.set_level(logging.INFO, logger="shoal.chief.server")
    chief = ChiefServer(JobConfig(), bind="0.0.0.0:0").start()
    try:
        line = next(r.getMessage() for r in caplog.records if " serving on " in r.getMessage())
        assert f" serving on 0.0.0.0:{chief.port} " in line and line.startswith("chief of job ")
        assert chief.address == f"127.0.0.1:{chief.port}"      # where local clients dial it, unchanged
    finally:
        chief.stop(grace_s=0.1)


def test_an_address_that_cannot_be_bound_is_one_refusal_naming_it():
    import socket

    import pytest

    from shoal.errors import InvalidArgument
    from shoal.net.rpc import create_server

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    try:
        for bad in (address, "notahost:99999"):
            with pytest.raises(InvalidArgument, match=f"cannot listen on {bad}: the port is in use"):
                create_server(bad)
            with pytest.raises(InvalidArgument, match=f"cannot listen on {bad}"):
                ChiefServer(JobConfig(), bind=bad)
    finally:
        taken.close()


def test_the_chief_reads_no_message_larger_than_its_cap_from_a_stranger():
    """Control messages only: a 20 MB request is refused at the transport (SHOAL_CHIEF_MAX_MESSAGE_MB, 16),
    before any token check or decoding, instead of being read into the chief's memory."""
    import grpc

    from shoal.chief.aio import CHIEF_MAX_MESSAGE_MB
    from shoal.proto import shoal_pb2 as pb
    from shoal.proto import shoal_pb2_grpc as pb_grpc

    chief = ChiefServer(JobConfig(), bind="127.0.0.1:0").start()
    try:
        with grpc.insecure_channel(chief.address, options=[("grpc.max_send_message_length", -1)]) as ch:
            big = pb.JoinRequest(role=pb.WORKER, host="x" * ((CHIEF_MAX_MESSAGE_MB + 4) << 20))
            try:
                pb_grpc.ChiefStub(ch).Join(big, timeout=10)
                code = None
            except grpc.RpcError as exc:
                code = exc.code()
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            small = pb_grpc.ChiefStub(ch).GetView(pb.ViewRequest(after_epoch=-1), timeout=5)
            assert small.epoch >= 0
    finally:
        chief.stop(grace_s=0.1)
