"""Runs one parameter-server process: data plane, registration, live-worker tracking."""
from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from shoal.ps.checkpoint_servicer import ShardControlServicer, restore_shard
from shoal.state.optim import warm_up
from shoal.ps.host import ShardHost
from shoal.ps.servicer import DataServicer, StatusServicer
from shoal.ps.tcp_server import DataChannelServer
from shoal.state import convert
from shoal.chief_client import ChiefClient
from shoal.errors import EXIT_REFUSED, EXIT_UNREACHABLE
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import create_server, set_serving

log = logging.getLogger(__name__)

SERVICE = "shoal.ParameterServer"
# how long a server leaving on purpose waits for its peers to close their data connections: the view reaches
# the workers in milliseconds and they close a client it moved away from after worker.routes.RETIRE_GRACE_S
DRAIN_S = 1.0


class PSServer:
    """``data_port``: where the raw TCP data channel listens (0: any free port; None: no channel,
    workers push and pull over gRPC)."""

    def __init__(self, chief: str, bind: str = "127.0.0.1:0", advertise: str = "", data_port: int | None = 0,
                 chief_timeout_s: float | None = 300.0):
        self.host = ShardHost()
        self.server, self.port, self._health = create_server(bind)
        self.data = DataServicer(self.host)
        self.server.add_generic_rpc_handlers((self.data.handler(),))
        pb_grpc.add_ParameterServerServicer_to_server(StatusServicer(self.host), self.server)
        pb_grpc.add_ShardControlServicer_to_server(ShardControlServicer(self.host), self.server)
        bind_host = bind.rsplit(":", 1)[0].strip("[]")
        self.bind_host = bind_host
        self.metrics_endpoint = None      # with serve_metrics(port)
        self.channel = None if data_port is None else DataChannelServer(
            self.data, bind_host or "0.0.0.0", data_port, on_lost=self._worker_dropped)
        self._reports = ThreadPoolExecutor(max_workers=1, thread_name_prefix="report")
        if not advertise:
            advertise = bind_host if bind_host not in ("", "0.0.0.0", "::") else socket.gethostname()
        self.address = f"{advertise}:{self.port}"
        # Without the chief for ``chief_timeout_s`` (None: wait for ever), the server gives up: ``gave_up``
        # is set with the reason and the process exits EXIT_UNREACHABLE.
        # A chief of another job (the journal of this one was lost): ``gave_up`` too, exit EXIT_REFUSED.
        self.gave_up = threading.Event()
        self.gave_up_reason = ""
        self.gave_up_code = EXIT_UNREACHABLE
        # The job ended and its drain is over (the view's job_phase "closing", chief/lifecycle.py): ``done``
        # is set, and the process exits with the job's exit code. ``done`` is also set when it gave up.
        self.done = threading.Event()
        self.job_result = ""
        self.job_exit_code: int | None = None
        self.chief = ChiefClient(chief, pb.PS, host=socket.gethostname(), address_advertised=self.address,
                                 join_deadline_s=chief_timeout_s, lost_after_s=chief_timeout_s,
                                 on_lost=self._lost_chief, heartbeat_extra=self._fill_heartbeat,
                                 on_refused=self._refused_chief)
        self.host.on_backup_complete = self.chief.heartbeat_now     # the chief learns it within a round trip

    def start(self) -> "PSServer":
        warm_up()
        if self.channel is not None:
            self.channel.start()
        self.server.start()
        try:
            reply = self.chief.join()
        except Exception:               # e.g. Unreachable: nothing was served yet; close what was opened
            self.stop(grace_s=0.2)
            raise
        job = convert.job_from_pb(reply.view.job)
        self.host.verify_key = reply.verify_key
        self.host.credential = reply.credential
        self.host.member_id = self.chief.member_id
        self.host.job = job
        if reply.shard < 0:
            log.info("chief has no free shard for %s; it holds backups until it is promoted", self.address)
        else:
            self.host.assign(reply.shard, job, restoring=bool(reply.restore_checkpoint))
        self.host.restore_path = reply.restore_checkpoint
        self.host.restorer = self._restore
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

    def _restore(self, shard: int) -> None:
        """Loads a shard the view assigned after the join from the checkpoint the job resumed from."""
        try:
            restore_shard(self.host, shard, self.host.restore_path, self.host.job)
        except Exception:   # noqa: BLE001 - its Inits keep waiting (and fail): never a silent fresh start
            log.exception("cannot restore shard %d from %s", shard, self.host.restore_path)

    def serve_metrics(self, port: int | None) -> "PSServer":
        """Gauges of the shards this server holds in the registry; with ``port`` (0: any free one) ``/metrics``."""
        from shoal.observe import metrics
        from shoal.ps.telemetry import collector

        metrics.register_state(f"ps/{id(self)}", collector(self.host))
        if self.host.job is not None:
            metrics.set_info(mode=self.host.job.mode)
        if port is not None:
            self.metrics_endpoint = metrics.MetricsEndpoint(port, self.bind_host, role="ps")
            self.metrics_endpoint.announce("ps", self.chief.member_id)
        return self

    def _fill_heartbeat(self, req: pb.HeartbeatRequest) -> None:
        """Tells the chief which backups of this server's primaries hold a whole copy (only those it promotes)."""
        req.backups_complete.extend(pb.ShardCopy(shard=k, backup_id=b) for k, b in self.host.backups_complete())
        # which workers this server's primaries' sync rounds waited for (ps/round_timing.py, chief/stragglers.py)
        for k, shard in list(self.host.shards.items()):
            if self.host.roles.get(k) == "primary":
                req.round_blame.extend(pb.RoundBlame(shard=k, worker=b.worker, rounds=b.rounds, last=b.last,
                                                     ratio=b.ratio, waited_seconds=b.waited_s)
                                       for b in shard.rounds.blame())

    def _lost_chief(self, why: str) -> None:
        self.gave_up_reason = why
        self.gave_up.set()
        self.done.set()

    def _refused_chief(self, why: str) -> None:
        self.gave_up_code = EXIT_REFUSED
        self._lost_chief(why)

    def _on_view(self, view: pb.ClusterView) -> None:
        # A server the chief forgot (its lease lapsed, or a Leave named it) joins again under a new id, and
        # the join's view is the first to name it: the host answers to that id (and signs replication with
        # its credential) before it reads the view's routes, or it would drop as another member's the very
        # copies the view makes it primary of, and the job would wait on a shard nobody holds.
        self.host.rename(self.chief.member_id, self.chief.credential)
        # a worker the chief leaves out (straggler_detection action backup) is not waited for by sync rounds
        workers = frozenset(m.member_id for m in view.members
                            if m.role == pb.WORKER and m.state == "alive" and not m.excluded)
        servers = {m.member_id for m in view.members if m.role == pb.PS}     # a view lists the living only
        self.host.set_view(workers, view.completed_epochs, list(view.shards),
                           in_view=self.chief.member_id in servers)
        if view.job_phase == "closing" and not self.done.is_set():
            self.job_result, self.job_exit_code = view.job_result, view.job_exit_code
            log.info("the job ended (%s) and its drain is over: this server exits", view.job_result)
            self.done.set()

    def _worker_dropped(self, member_id: str) -> None:
        """A worker's data connection closed under it: tell the chief, which ends the worker at once if
        its view watch broke too (a dead process), long before its lease would run out."""
        if member_id in self.host.live_workers and not self.host.leaving:   # leaving: they follow the view
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
        if getattr(self, "_stopped", False):       # once: `shoal ps` stops it at the job's end, a harness again
            return
        self._stopped = True
        set_serving(self._health, SERVICE, False)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        from shoal.observe import metrics
        metrics.unregister_state(f"ps/{id(self)}")
        self.host.leaving = True
        self.chief.leave()          # the chief promotes this server's complete backups: a planned hand-over
        if self.channel is not None:    # calls go on being answered (handed over) until the workers move
            self.channel.drain(min(grace_s, DRAIN_S))
        self.host.close()
        if self.channel is not None:
            self.channel.close()
        self._reports.shutdown(wait=False)
        self.server.stop(grace_s).wait()
        self.chief.close()

    def wait(self) -> None:
        self.server.wait_for_termination()
