"""An in-process cluster on ephemeral ports, for tests and benchmarks.

    with InProcessCluster(num_ps=2, job=JobConfig(mode="sync", num_shards=2)) as c:
        trainer = Trainer(model, chief=c.chief_address)
"""
from __future__ import annotations

import grpc

import threading
import time
from typing import Callable

from shoal.chief.server import ChiefServer
from shoal.settings.config import JobConfig
from shoal.ps.server import PSServer


class InProcessCluster:
    """``journal``: a SQLite path for the chief's state, so :meth:`restart_chief` can bring it back.
    ``checkpoint``: a ``chief.checkpointer.CheckpointConfig`` for the chief."""

    def __init__(self, num_ps: int = 2, job: JobConfig | None = None, journal: str | None = None,
                 checkpoint=None):
        self.job = job or JobConfig(num_shards=num_ps)
        if self.job.num_shards < num_ps:
            raise ValueError(f"job has {self.job.num_shards} shards but {num_ps} parameter servers were asked for")
        self.journal = journal
        self.checkpoint = checkpoint
        self.chief = ChiefServer(self.job, bind="127.0.0.1:0", tick_s=0.05, journal=journal,
                                 checkpoint=checkpoint).start()
        self.chief_address = self.chief.address
        self.servers = [PSServer(self.chief_address, bind="127.0.0.1:0").start() for _ in range(num_ps)]

    def kill_ps(self, i: int) -> None:
        """Parameter server ``i`` dies as a process would on SIGKILL: no goodbye, its lease runs out."""
        ps = self.servers[i]
        if ps.channel is not None:
            ps.channel.close()
        ps.server.stop(0).wait()
        ps.chief.close()          # heartbeats stop; no Leave
        ps.host.close()
        ps.killed = True

    def stop_chief(self) -> None:
        self.chief.stop(grace_s=0.2)

    def start_chief(self) -> ChiefServer:
        """A new chief on the old address, recovering from the journal."""
        self.chief = ChiefServer(self.job, bind=self.chief_address, tick_s=0.05, journal=self.journal,
                                 checkpoint=self.checkpoint).start()
        return self.chief

    def stop(self) -> None:
        for s in self.servers:
            if not getattr(s, "killed", False):
                s.stop(grace_s=0.5)
        self.chief.stop(grace_s=0.5)

    def __enter__(self) -> "InProcessCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.02,
               what: str = "condition") -> None:
    """Polls ``predicate`` until true; raises AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.1f}s waiting for {what}")


def run_threads(*targets: Callable[[], None], timeout_s: float = 60.0) -> None:
    """Runs callables in threads and re-raises the first exception."""
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def inner() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        return inner

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"threads still running after {timeout_s:.0f}s")


class FakeRpcError(grpc.RpcError):
    """A gRPC failure with a code and details, as a stub raises it (for tests that fake a peer)."""

    def __init__(self, code: grpc.StatusCode, details: str = ""):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
