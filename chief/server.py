"""Runs the chief: gRPC server, lease ticker, graceful stop."""
from __future__ import annotations

import logging
import threading
import time

from shoal.chief.servicer import ChiefServicer
from shoal.chief.state import ChiefState
from shoal.config import JobConfig
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.rpc import create_server, set_serving

log = logging.getLogger(__name__)

SERVICE = "shoal.Chief"


class ChiefServer:
    def __init__(self, job: JobConfig, bind: str = "127.0.0.1:0", tick_s: float = 0.2):
        self.job = job
        self.state = ChiefState(job, time.monotonic)
        self.servicer = ChiefServicer(self.state)
        self.server, self.port, self._health = create_server(bind)
        pb_grpc.add_ChiefServicer_to_server(self.servicer, self.server)
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="chief-ticker", daemon=True)
        host = bind.rsplit(":", 1)[0].strip("[]")
        self.address = f"{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{self.port}"

    def start(self) -> "ChiefServer":
        self.server.start()
        self._ticker.start()
        set_serving(self._health, SERVICE, True)
        log.info("chief serving on %s (mode %s, %d shard(s), lease %.1fs)", self.address,
                 self.job.mode, self.job.num_shards, self.job.lease_seconds)
        return self

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            try:
                self.servicer.tick()
            except Exception:  # noqa: BLE001 - keep expiring leases whatever happens
                log.exception("lease tick failed")

    def stop(self, grace_s: float = 2.0) -> None:
        self._stop.set()
        set_serving(self._health, SERVICE, False)
        self.server.stop(grace_s).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()
