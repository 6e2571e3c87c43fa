"""What a worker tells the people watching it: TensorBoard scalars, Prometheus metrics, alerts, its loss.

The trainer hands one :class:`StepRecord` per step to :meth:`WorkerTelemetry.record`,
which only puts it on a queue; a background thread turns records into TensorBoard
scalars (``torch.utils.tensorboard``, its own writer thread and file), Prometheus
counters, alert checks and, every couple of seconds, the worker's recent mean loss
for the chief (``train_loss`` in the job metrics: the progress bar and the run
summary show it). A loss tensor is read (``.item()``) on that thread, not the
training loop's. If the queue backs up (a stalled disk), records are dropped and
counted rather than slowing training.

Settings come from ``$SHOAL_TENSORBOARD`` (a parent directory: this worker writes
the run ``<dir>/<member id>``), ``$SHOAL_METRICS_PORT`` and ``$SHOAL_ALERT_*``, set by
``shoal worker`` and ``shoal local`` from their flags.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from shoal.observe import metrics
from shoal.observe.alerts import AlertConfig, TrainingAlerts, count_key, metric_key
from shoal.settings.config import from_sources

log = logging.getLogger(__name__)

REPORT_EVERY_S = 2.0
QUEUE_LIMIT = 10_000


@dataclass
class StepRecord:
    step: int
    wall: float                          # time.time() at the end of the step
    samples: int
    loss: Any = None                     # a float, a 0-d tensor (read on the telemetry thread) or None
    grad_norm: Any = None                # a 0-d tensor or None
    phases: dict[str, float] = field(default_factory=dict)   # compute / push / pull / wait, seconds
    bytes_pushed: int = 0                # this step
    bytes_pulled: int = 0
    raw_bytes: int = 0                   # the fp32 gradient this step pushed, before compression
    staleness: int = 0
    job_step: int = 0                    # the job's applied updates after this step (the shards' newest version):
                                         # every worker's and the chief's TensorBoard x-axis, so runs overlay


def _value(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return float(x.detach().float().item())
    return float(x)


class WorkerTelemetry:
    def __init__(self, member_id: Callable[[], str], *, tensorboard: str = "", metrics_port: int | None = None,
                 report: Callable[[dict[str, float]], None] | None = None, alerts: AlertConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._member = member_id
        self._tb_parent = tensorboard
        self._writer = None
        self._report = report
        self._clock = clock
        self.alerts = TrainingAlerts(alerts)
        self.norms = NormSampler()
        self.raised: list = []           # every Alert this worker raised
        self.dropped = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._losses: list[float] = []
        self._samples = 0
        self._last_report = clock()
        self._endpoint = None
        self._announced = False
        if metrics_port is not None:
            self._endpoint = metrics.MetricsEndpoint(metrics_port, role="worker")     # announced once the member has a name
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, member_id: Callable[[], str], report: Callable[[dict[str, float]], None] | None = None
                 ) -> "WorkerTelemetry":
        return cls(member_id, tensorboard=os.environ.get("SHOAL_TENSORBOARD", ""),
                   metrics_port=metrics.from_env_or(None), report=report,
                   alerts=from_sources(AlertConfig, env_prefix="SHOAL_ALERT_"))

    @property
    def metrics_url(self) -> str:
        return self._endpoint.url if self._endpoint else ""

    # ------------------------------------------------------------ the training loop's side

    def record(self, rec: StepRecord) -> None:
        """Queues one step's figures; never blocks."""
        if self._pending >= QUEUE_LIMIT:
            self.dropped += 1
            return
        self._pending += 1
        self._queue.put(rec)

    def reported(self, values: dict[str, float], step: int) -> None:
        """What the script passed to ``trainer.report`` (e.g. ``test_accuracy``), as scalars at ``step``."""
        self._queue.put(("report", values, step, time.time()))

    # ------------------------------------------------------------ the telemetry thread

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=REPORT_EVERY_S / 2)
            except queue.Empty:
                item = None
            if item == "stop":
                self._report_loss(force=True)
                return
            if self._endpoint is not None and not self._announced and self._member():
                self._announced = True
                self._endpoint.announce("worker", self._member())
            try:
                if isinstance(item, StepRecord):
                    self._pending -= 1
                    self._step(item)
                elif isinstance(item, tuple):
                    _, values, step, wall = item
                    w = self._tb()
                    for k, v in values.items():
                        if w is not None:
                            w.add_scalar(f"eval/{k}", float(v), step, walltime=wall)
                        if k == "loss":
                            self._losses.append(float(v))
                self._report_loss()
            except Exception:  # noqa: BLE001 - telemetry never stops training
                log.exception("telemetry failed; training goes on")

    def _tb(self):
        if self._writer is None and self._tb_parent:
            from torch.utils.tensorboard import SummaryWriter

            member = self._member() or "worker"
            try:
                self._writer = SummaryWriter(log_dir=str(Path(self._tb_parent) / member), flush_secs=5)
            except OSError as exc:      # once, not once a step: training goes on without TensorBoard
                log.warning("cannot write TensorBoard events under %s (%s); going on without them",
                            self._tb_parent, exc.strerror or exc)
                self._tb_parent = ""
        return self._writer

    def _step(self, r: StepRecord) -> None:
        loss, norm = _value(r.loss), _value(r.grad_norm)
        member = self._member()
        metrics.STEPS.inc()
        metrics.SAMPLES.inc(r.samples)
        self._samples += r.samples
        metrics.PUSH_BYTES.inc(r.bytes_pushed)
        metrics.PULL_BYTES.inc(r.bytes_pulled)
        for phase, seconds in r.phases.items():
            metrics.STEP_SECONDS.labels(phase).observe(seconds)
        metrics.STALENESS.set(r.staleness)
        ratio = r.raw_bytes / r.bytes_pushed if r.bytes_pushed else None
        if ratio is not None:
            metrics.COMPRESSION_RATIO.set(ratio)
        if loss is not None:
            metrics.LOSS.set(loss)
            if math.isfinite(loss):
                self._losses.append(loss)
        if norm is not None:
            metrics.GRAD_NORM.set(norm)
        step_s = sum(r.phases.values())
        w = self._tb()
        if w is not None:
            t, s = r.wall, r.job_step or r.step
            if loss is not None:
                w.add_scalar("train/loss", loss, s, walltime=t)
            if norm is not None:
                w.add_scalar("train/grad_norm", norm, s, walltime=t)
            if step_s > 0:
                w.add_scalar("throughput/samples_per_s", r.samples / step_s, s, walltime=t)
                w.add_scalar("throughput/steps_per_s", 1.0 / step_s, s, walltime=t)
            for phase, seconds in r.phases.items():
                w.add_scalar(f"step_time/{phase}_ms", seconds * 1e3, s, walltime=t)
            w.add_scalar("bytes/pushed", r.bytes_pushed, s, walltime=t)
            w.add_scalar("bytes/pulled", r.bytes_pulled, s, walltime=t)
            w.add_scalar("train/staleness", r.staleness, s, walltime=t)
            w.add_scalar("train/samples", self._samples, s, walltime=t)
            if ratio is not None:
                w.add_scalar("bytes/compression_ratio", ratio, s, walltime=t)
        for alert in self.alerts.observe(member, r.step, loss, norm):
            self._alert(alert, w, r.wall)

    def _alert(self, alert, writer, wall: float) -> None:
        self.raised.append(alert)
        metrics.ALERTS.labels(alert.kind).inc()
        log.warning("alert: %s", alert.message())
        if writer is not None:
            writer.add_scalar(f"alerts/{alert.kind}", alert.value if math.isfinite(alert.value) else 0.0,
                              alert.step, walltime=wall)
            writer.add_text("alerts", alert.message(), alert.step, walltime=wall)
        # the number of lines, so the run's ending counts what was printed (shoal.observe.alerts.count_key)
        raised = sum(1 for a in self.raised if a.kind == alert.kind)
        self._send({metric_key(alert): float(alert.step), count_key(alert): float(raised)})

    def _report_loss(self, force: bool = False) -> None:
        now = self._clock()
        if not force and now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        if self._losses:
            mean = sum(self._losses) / len(self._losses)
            self._losses.clear()
            self._send({"train_loss": mean})

    def _send(self, values: dict[str, float]) -> None:
        if self._report is None:
            return
        try:
            self._report(values)
        except Exception as exc:  # noqa: BLE001 - a chief that is away misses one figure, no more
            log.debug("could not send %s to the chief: %s", ", ".join(values), exc)

    def close(self) -> None:
        """Writes what is queued, closes the event file and the metrics endpoint."""
        self._queue.put("stop")
        self._thread.join(timeout=10)
        if self._writer is not None:
            self._writer.close()
        if self._endpoint is not None:
            self._endpoint.close()


class StepClock:
    """Splits the training loop's time into phases: ``wait`` (for the next batch from the data feed),
    ``compute`` (the rest between steps: forward, backward), ``push`` and ``pull`` (inside ``step``;
    ``pull`` includes waiting for a sync round to close or for ssp's slowest worker)."""

    def __init__(self, budget_s: float | None = None) -> None:
        self.last_end = 0.0
        self.waited = 0.0
        self.pushed_at = 0.0
        if budget_s is None:
            raw = os.environ.get("SHOAL_TIME_BUDGET", "")
            budget_s = float(raw) if raw else 0.0
        self.budget_s = budget_s           # > 0: stop taking tasks this long after the first (shoal compare --budget)
        self.started = 0.0

    def timed(self, feed):
        """Iterates ``feed``, adding the time spent waiting on it to ``wait``; ends once the budget is spent."""
        it = iter(feed)
        self.started = self.started or time.monotonic()
        while True:
            if self.budget_s and time.monotonic() - self.started > self.budget_s:
                log.info("time budget of %.0fs spent: taking no more tasks", self.budget_s)
                return
            t = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.waited += time.perf_counter() - t
            yield item

    def phases(self, step_start: float, step_end: float) -> dict[str, float]:
        pushed = self.pushed_at if step_start <= self.pushed_at <= step_end else step_end
        out = {"push": pushed - step_start, "pull": step_end - pushed}
        if self.last_end:
            between = max(0.0, step_start - self.last_end)
            wait = min(self.waited, between)
            out.update(compute=between - wait, wait=wait)
        self.waited = 0.0
        self.last_end = step_end
        return out


class NormSampler:
    """Decides on which steps to compute the gradient norm, so that it costs about ``budget`` of the step time.

    The norm reads the whole gradient on the training thread (about 20 ms for 16M fp32 values on one
    CPU core): a small model gets it every step, a large one every few steps.
    """

    def __init__(self, budget: float = 0.01):
        self.budget = budget
        self.every = 1
        self._countdown = 0

    def due(self) -> bool:
        self._countdown -= 1
        return self._countdown <= 0

    def measured(self, norm_s: float, step_s: float) -> None:
        if step_s > 0:
            self.every = max(1, min(1000, math.ceil(norm_s / (self.budget * step_s))))
        self._countdown = self.every


def after_step(trainer, started: float, samples: int, loss: Any, versions: dict[int, int],
               replies: dict[int, Any], last: list[int]) -> None:
    """Builds the step's :class:`StepRecord` from the trainer (called at the end of ``Trainer.step``).

    ``last`` holds the byte counters at the previous step (updated here).
    """
    now = time.perf_counter()
    c = trainer.counters
    pushed, pulled = c.bytes_pushed - last[0], c.bytes_pulled - last[1]
    last[0], last[1] = c.bytes_pushed, c.bytes_pulled
    stale = [r.version - versions[k] - 1 for k, r in replies.items()
             if r.accepted and not r.duplicate and k in versions]
    loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
    phases = trainer.clock.phases(started, now)
    norm, sampler = None, trainer.telemetry.norms
    if sampler.due():
        t = time.perf_counter()
        norm = torch.linalg.vector_norm(trainer.flat_grads)
        sampler.measured(time.perf_counter() - t, sum(phases.values()))
    trainer.telemetry.record(StepRecord(
        step=trainer.step_count, wall=time.time(), samples=samples, loss=loss,
        grad_norm=norm, phases=phases,
        bytes_pushed=pushed, bytes_pulled=pulled, raw_bytes=4 * trainer.layout.numel if pushed else 0,
        staleness=max(0, max(stale, default=0)),
        job_step=max((r.version for r in replies.values() if getattr(r, "version", 0)), default=0)))
