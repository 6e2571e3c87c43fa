"""Runs one parameter-server process: data plane, registration, live-worker tracking."""
from __future__ import annotations

import logging
import socket

from shoal.ps.checkpoint_servicer import ShardControlServicer, restore_shard
from shoal.ps.optim import warm_up
from shoal.ps.host import ShardHost
from shoal.ps.servicer import DataServicer, StatusServicer
from shoal import convert
from shoal.chief_client import ChiefClient
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.rpc import create_server, set_serving

log = logging.getLogger(__name__)

SERVICE = "shoal.ParameterServer"


class PSServer:
    def __init__(self, chief: str, bind: str = "127.0.0.1:0", advertise: str = ""):
        self.host = ShardHost()
        self.server, self.port, self._health = create_server(bind)
        self.server.add_generic_rpc_handlers((DataServicer(self.host).handler(),))
        pb_grpc.add_ParameterServerServicer_to_server(StatusServicer(self.host), self.server)
        pb_grpc.add_ShardControlServicer_to_server(ShardControlServicer(self.host), self.server)
        bind_host = bind.rsplit(":", 1)[0].strip("[]")
        if not advertise:
            advertise = bind_host if bind_host not in ("", "0.0.0.0", "::") else socket.gethostname()
        self.address = f"{advertise}:{self.port}"
        self.chief = ChiefClient(chief, pb.PS, host=socket.gethostname(), address_advertised=self.address)

    def start(self) -> "PSServer":
        warm_up()
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

    def stop(self, grace_s: float = 2.0) -> None:
        set_serving(self._health, SERVICE, False)
        self.chief.leave()
        self.host.close()
        self.server.stop(grace_s).wait()
        self.chief.close()

    def wait(self) -> None:
        self.server.wait_for_termination()
