"""``shoal local --autoscale``: starts and stops local workers to follow the chief's desired count.

The chief computes the count from the job file's ``autoscaling`` policy (``chief/autoscale.py``) and
publishes it in its job stats; this reads it about once a second. Scaling out starts a worker; scaling
in sends SIGTERM to the newest, which hands back its task, leaves and exits 0 (graceful preemption),
and is not restarted.
"""
from __future__ import annotations

import logging
from typing import Callable

import grpc

from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import open_channel

log = logging.getLogger(__name__)

DESIRED_WORKERS = "autoscale_desired_workers"


class WorkerScaler:
    """``poll(now)`` once in a while: reads the desired count and starts or stops workers to match."""

    def __init__(self, chief_address: str, workers: Callable[[], list], start: Callable[[str], object],
                 first_index: int, period_s: float = 1.0):
        self._channel = open_channel(chief_address)
        self._stub = pb_grpc.ChiefStub(self._channel)
        self._workers = workers
        self._start = start
        self._next_index = first_index
        self._period_s = period_s
        self._next_poll = 0.0
        self.scaled_in: set[str] = set()        # asked to leave: their exit is not a crash
        self.history: list[tuple[int, int]] = []    # (running before, desired) at each change

    def poll(self, now: float) -> None:
        if now < self._next_poll:
            return
        self._next_poll = now + self._period_s
        try:
            stats = self._stub.GetJobStats(pb.Empty(), timeout=2)
        except grpc.RpcError as exc:
            log.debug("autoscaling: cannot read the chief's stats: %s", exc.code().name)
            return
        desired = stats.metrics.get(DESIRED_WORKERS)
        if desired is None:
            return
        desired = int(desired)
        running = [w for w in self._workers() if w.proc.poll() is None and w.name not in self.scaled_in]
        finished = stats.tasks_total > 0 and stats.tasks_done >= stats.tasks_total
        if desired > len(running) and not finished:
            log.info("autoscaling: %d -> %d worker(s)", len(running), desired)
            self.history.append((len(running), desired))
            for _ in range(desired - len(running)):
                self._start(f"worker{self._next_index}")
                self._next_index += 1
        elif desired < len(running):
            log.info("autoscaling: %d -> %d worker(s)", len(running), desired)
            self.history.append((len(running), desired))
            for w in running[desired:]:          # the newest leave; the first ones hold the most state
                self.scaled_in.add(w.name)
                w.terminate()

    def close(self) -> None:
        self._channel.close()
