"""Runs one parameter-server process: data plane, registration, live-worker tracking."""
from __future__ import annotations

import logging
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc

from shoal.ps.checkpoint_servicer import ShardControlServicer, restore_shard
from shoal.optim import warm_up
from shoal.ps.host import ShardHost
from shoal.ps.servicer import DataServicer, StatusServicer
from shoal.ps.tcp_server import DataChannelServer
from shoal import convert
from shoal.chief_client import ChiefClient
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.rpc import create_server, set_serving

log = logging.getLogger(__name__)

SERVICE = "shoal.ParameterServer"


class PSServer:
    """``data_port``: where the raw TCP data channel listens (0: any free port; None: no channel,
    workers push and pull over gRPC)."""

    def __init__(self, chief: str, bind: str = "127.0.0.1:0", advertise: str = "", data_port: int | None = 0):
        self.host = ShardHost()
        self.server, self.port, self._health = create_server(bind)
        self.data = DataServicer(self.host)
        self.server.add_generic_rpc_handlers((self.data.handler(),))
        pb_grpc.add_ParameterServerServicer_to_server(StatusServicer(self.host), self.server)
        pb_grpc.add_ShardControlServicer_to_server(ShardControlServicer(self.host), self.server)
        bind_host = bind.rsplit(":", 1)[0].strip("[]")
        self.channel = None if data_port is None else DataChannelServer(
            self.data, bind_host or "0.0.0.0", data_port, on_lost=self._worker_dropped)
        self._reports = ThreadPoolExecutor(max_workers=1, thread_name_prefix="report")
        if not advertise:
            advertise = bind_host if bind_host not in ("", "0.0.0.0", "::") else socket.gethostname()
        self.address = f"{advertise}:{self.port}"
        self.chief = ChiefClient(chief, pb.PS, host=socket.gethostname(), address_advertised=self.address)

    def start(self) -> "PSServer":
        warm_up()
        if self.channel is not None:
            self.channel.start()
        self.server.start()
        reply = self.chief.join()
        job = convert.job_from_pb(reply.view.job)
        self.host.secret = reply.job_secret
        self.host.member_id = self.chief.member_id
        self.host.job = job
        if reply.shard < 0:
            log.info("chief has no free shard for %s; it holds backups until it is promoted", self.address)
        else:
            self.host.assign(reply.shard, job, restoring=bool(reply.restore_checkpoint))
        self.chief.on_view(self._on_view)
        self.chief.start_background()
        if reply.shard >= 0 and reply.restore_checkpoint:   # heartbeats run meanwhile; Inits wait for it
            try:
                restore_shard(self.host, reply.shard, reply.restore_checkpoint, job)
            except Exception:
                log.error("cannot restore shard %d from %s; stopping", reply.shard, reply.restore_checkpoint)
                self.stop(grace_s=0.5)
                raise
        set_serving(self._health, SERVICE, True)
        log.info("ps %s serving shard %d on %s", self.chief.member_id, reply.shard, self.address)
        return self

    def _on_view(self, view: pb.ClusterView) -> None:
        workers = frozenset(m.member_id for m in view.members if m.role == pb.WORKER and m.state == "alive")
        self.host.set_view(workers, view.completed_epochs, list(view.shards))

    def _worker_dropped(self, member_id: str) -> None:
        """A worker's data connection closed under it: tell the chief, which ends the worker at once if
        its view watch broke too (a dead process), long before its lease would run out."""
        if member_id in self.host.live_workers:
            self._reports.submit(self._report_dropped, member_id)

    def _report_dropped(self, member_id: str) -> None:
        try:
            reply = self.chief.stub.ReportUnreachable(
                pb.UnreachableReport(reporter_id=self.chief.member_id, member_id=member_id), timeout=5)
            if reply.expired:
                log.warning("worker %s dropped its connection and the chief confirmed it is gone", member_id)
        except grpc.RpcError as exc:
            log.info("could not report worker %s's dropped connection: %s", member_id, exc.code().name)

    def stop(self, grace_s: float = 2.0) -> None:
        set_serving(self._health, SERVICE, False)
        self.host.leaving = True
        self.chief.leave()          # the chief promotes this server's backups: a planned hand-over
        self.host.close()
        if self.channel is not None:
            self.channel.close()
        self._reports.shutdown(wait=False)
        self.server.stop(grace_s).wait()
        self.chief.close()

    def wait(self) -> None:
        self.server.wait_for_termination()
