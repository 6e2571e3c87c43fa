"""What the chief tells the people watching the job: TensorBoard scalars, Prometheus gauges, alerts.

A watcher thread reads the state (under the servicer's lock, a few dict reads) once
a second, never from an RPC: live workers and servers, queue depth, task and epoch
progress, the view epoch; it reads each primary's shard version over gRPC every few
seconds. :class:`JobEvents` (pure) turns consecutive snapshots into the events
worth marking: view changes, failovers (a shard's primary moved), lease
expirations, checkpoints, workers falling behind; :class:`RefusedPushes` marks a shard that
starts refusing a worker's NaN/Inf pushes. Prometheus gauges are read from
the latest snapshot when scraped.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from shoal.observe import metrics
from shoal.observe.alerts import BehindDetector, count_key, metric_key
from shoal.members import MemberState, Role
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import open_channel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    wall: float
    view_epoch: int
    live_workers: int
    live_ps: int
    queue_depth: int
    tasks_done: int
    tasks_total: int
    completed_epochs: int
    epochs: int
    samples: int
    primaries: dict[int, str]                  # shard -> primary member id
    addresses: dict[int, str]                  # shard -> primary address
    expired: frozenset[tuple[str, str]]        # (member, role) of every member dropped without leaving
    checkpoints: int
    checkpoint_step: int
    stragglers: dict[str, tuple[bool, int, float]] = field(default_factory=dict)
    checkpoints_failed: int = 0                # attempts that failed since the chief started
    job_phase: str = "running"                 # chief/lifecycle.py
    job_exit_code: int = 0
    loss: tuple[str, float] | None = None       # the latest worker's report of its mean loss: (member, value)


def snapshot(state, wall: float) -> Snapshot:
    """Reads what the watcher needs from a ChiefState (the caller holds the servicer's lock)."""
    members = state.members
    by_id = {m.member_id: m for m in members.alive()}
    workers = members.alive(Role.WORKER)
    slow = state.stragglers()
    ckpt = state.checkpoints
    tasks = state.tasks
    return Snapshot(
        wall=wall, view_epoch=state.epoch, live_workers=len(workers), live_ps=len(members.alive(Role.PS)),
        queue_depth=tasks.depth, tasks_done=tasks.done_count, tasks_total=tasks.total,
        completed_epochs=tasks.completed_epochs, epochs=tasks.spec.epochs if tasks.spec is not None else 0,
        samples=state.totals().samples,
        primaries=dict(state.routing),
        addresses={k: by_id[mid].address for k, mid in state.routing.items() if mid in by_id},
        expired=frozenset((m.member_id, m.role.value) for m in members.all() if m.state is MemberState.EXPIRED),
        checkpoints=ckpt.written if ckpt is not None else 0,
        checkpoint_step=ckpt.last_step if ckpt is not None else 0,
        stragglers={m.member_id: (m.member_id in slow, m.counters.steps, state.step_seconds.get(m.member_id, 0.0))
                    for m in workers},
        checkpoints_failed=ckpt.failed if ckpt is not None else 0, job_phase=state.lifecycle.phase.value,
        job_exit_code=state.lifecycle.ending.exit_code if state.lifecycle.ending is not None else 0,
        loss=(state.metric_sources.get("train_loss", ""), state.metrics["train_loss"])
        if "train_loss" in state.metrics else None)


@dataclass(frozen=True)
class Event:
    kind: str          # view_change, failover, lease_expired, checkpoint, worker_behind, pushes_refused
    text: str
    value: float = 0.0
    member: str = ""


class JobEvents:
    """Pure: what changed between two snapshots, as events."""

    def __init__(self) -> None:
        self.prev: Snapshot | None = None
        self.behind = BehindDetector()

    def observe(self, s: Snapshot) -> list[Event]:
        out: list[Event] = []
        p = self.prev
        self.prev = s
        for alert in self.behind.observe(s.stragglers):
            out.append(Event("worker_behind", alert.message(), alert.step, alert.member))
        if p is None:
            return out
        if s.view_epoch != p.view_epoch:
            out.append(Event("view_change", f"view epoch {p.view_epoch} -> {s.view_epoch}", s.view_epoch))
        for k, mid in sorted(s.primaries.items()):
            old = p.primaries.get(k)
            if old and old != mid:
                out.append(Event("failover", f"shard {k}: primary {old} -> {mid}", k, mid))
        for member, role in sorted(s.expired - p.expired):
            out.append(Event("lease_expired", f"{role} {member} dropped without leaving", 1, member))
        if s.checkpoints > p.checkpoints:
            out.append(Event("checkpoint", f"checkpoint at step {s.checkpoint_step}", s.checkpoint_step))
        return out


class RefusedPushes:
    """Pure: an alert when a shard starts refusing a worker's pushes (NaN/Inf, ``--nonfinite``).

    Fed each primary's per-worker refusal counts every few seconds; one event when a count
    rises after a reading where it did not (re-armed by a quiet reading), so a worker whose
    every push is refused is one alert, not one per push."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, str], int] = {}
        self._rising: set[tuple[int, str]] = set()

    def observe(self, refused: dict[int, dict[str, int]], versions: dict[int, int]) -> list[Event]:
        out: list[Event] = []
        for shard, by_worker in sorted(refused.items()):
            for worker, count in sorted(by_worker.items()):
                key = (shard, worker)
                before = self._last.get(key, 0)
                self._last[key] = count          # lower: a promoted backup counts from 0 again
                if count <= before:
                    self._rising.discard(key)
                    continue
                if key not in self._rising:
                    self._rising.add(key)
                    out.append(Event("pushes_refused",
                                     f"shard {shard} refuses pushes from {worker} (NaN/Inf or out of the "
                                     f"update guard's bounds) "
                                     f"({count} so far, at version {versions.get(shard, 0)})",
                                     versions.get(shard, 0), worker))
        return out


class ChiefWatch:
    """The watcher thread: snapshots -> TensorBoard, Prometheus, alerts in the job metrics."""

    def __init__(self, state, lock, *, tensorboard: str = "", interval_s: float = 1.0,
                 versions_every_s: float = 3.0, report: Callable[[str, dict], None] | None = None,
                 pauses: Callable[[], list[float]] | None = None,
                 desired_workers: Callable[[], int | None] | None = None):
        self.state = state
        self.lock = lock
        self.tensorboard = tensorboard
        self.interval_s = interval_s
        self.versions_every_s = versions_every_s
        self.events = JobEvents()
        self.latest: Snapshot | None = None
        self.versions: dict[int, int] = {}
        self.refused = RefusedPushes()
        self._raised: dict[tuple[str, str], int] = {}     # alert lines printed, per kind and member
        self._losses: dict[str, float] = {}     # each live worker's latest mean loss: the job's is their mean
        self._report = report
        self._pauses = pauses
        self._desired_workers = desired_workers      # the autoscaler's count (None: no autoscaling)
        self._writer = None
        self._polls = 0
        self._step = 0
        self._versions_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chief-telemetry", daemon=True)
        metrics.register_state("chief", self._collect)

    def start(self) -> "ChiefWatch":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - watching never takes the chief down
                log.exception("chief telemetry failed; the chief goes on")

    def poll(self) -> list[Event]:
        with self.lock:
            s = snapshot(self.state, time.time())
        self.latest = s
        now = time.monotonic()
        if now - self._versions_at >= self.versions_every_s:
            self._versions_at = now
            self.versions, refused = read_shards(s.addresses)
        else:
            refused = {}
        events = self.events.observe(s) + self.refused.observe(refused, self.versions)
        for e in events:
            self._count(e)
        self._write(s, events)
        return events

    def _count(self, e: Event) -> None:
        if e.kind == "failover":
            metrics.FAILOVERS.inc()
        elif e.kind == "view_change":
            metrics.VIEW_CHANGES.inc()
        elif e.kind == "lease_expired":
            role = e.text.split(" ", 1)[0]
            metrics.LEASE_EXPIRATIONS.labels(role).inc()
            if role == "worker":            # a worker gone without leaving (killed, lost): one alert
                self._alert(Event("worker_lost", f"{e.text} (its lease ran out or its process is gone); its "
                                                 f"tasks went back to the queue", 1, e.member))
                return
        elif e.kind in ("worker_behind", "pushes_refused"):
            self._alert(e)
        if e.kind in ("failover", "lease_expired"):
            log.info("%s", e.text)

    def _alert(self, e: Event) -> None:
        """One line per incident, counted, and carried to ``shoal status`` and the run summary."""
        metrics.ALERTS.labels(e.kind).inc()
        log.warning("alert: %s", e.text)
        self._raised[(e.kind, e.member)] = self._raised.get((e.kind, e.member), 0) + 1
        if self._report is not None:
            from shoal.observe.alerts import Alert

            alert = Alert(e.kind, e.member, int(e.value), 0.0)
            self._report(e.member, {metric_key(alert): e.value, count_key(alert): self._raised[(e.kind, e.member)]})

    def _tb(self):
        if self._writer is None and self.tensorboard:
            from shoal.chief.tb_writer import EventWriter   # the tensorboard package, not torch's writer

            try:
                self._writer = EventWriter(str(Path(self.tensorboard) / "chief"), flush_secs=5)
            except OSError as exc:      # once: the chief goes on without TensorBoard
                log.warning("cannot write TensorBoard events under %s (%s); going on without them",
                            self.tensorboard, exc.strerror or exc)
                self.tensorboard = ""
        return self._writer

    def _write(self, s: Snapshot, events: list[Event]) -> None:
        w = self._tb()
        if w is None:
            return
        self._polls += 1
        # the job's applied updates (the shards' newest version), the workers' x-axis too, so runs overlay;
        # the poll count until a shard has been read
        self._step = max(self._step, max(self.versions.values(), default=0), self._polls if not self.versions else 0)
        step, t = self._step, s.wall
        w.add_scalar("cluster/live_workers", s.live_workers, step, walltime=t)
        w.add_scalar("cluster/live_ps", s.live_ps, step, walltime=t)
        w.add_scalar("cluster/view_epoch", s.view_epoch, step, walltime=t)
        w.add_scalar("tasks/queue_depth", s.queue_depth, step, walltime=t)
        w.add_scalar("tasks/done", s.tasks_done, step, walltime=t)
        if s.tasks_total:
            w.add_scalar("progress/epochs", s.epochs * s.tasks_done / s.tasks_total if s.epochs else 0.0,
                         step, walltime=t)
        w.add_scalar("progress/samples", s.samples, step, walltime=t)
        for k, v in self.versions.items():
            w.add_scalar(f"shards/version_{k}", v, step, walltime=t)
        if s.loss is not None and s.loss[0] in s.stragglers:       # stragglers: every live worker, by id
            self._losses[s.loss[0]] = s.loss[1]
        self._losses = {m: v for m, v in self._losses.items() if m in s.stragglers}
        if self._losses:
            w.add_scalar("train/loss", sum(self._losses.values()) / len(self._losses), step, walltime=t)
        for e in events:
            if e.kind == "checkpoint":
                w.add_scalar("events/checkpoint_step", e.value, step, walltime=t)
                if self._pauses is not None and self._pauses():
                    w.add_scalar("events/checkpoint_held_ms", self._pauses()[-1] * 1e3, step, walltime=t)
            elif e.kind in ("failover", "lease_expired", "worker_behind", "pushes_refused"):
                w.add_scalar(f"events/{e.kind}", 1.0, step, walltime=t)
            if e.kind != "view_change":
                w.add_text("events", e.text, step, walltime=t)

    def _collect(self):
        s = self.latest
        if s is None:
            return
        yield metrics.gauge("shoal_live_workers", "Workers holding a lease", values=s.live_workers)
        yield metrics.gauge("shoal_live_parameter_servers", "Parameter servers holding a lease", values=s.live_ps)
        yield metrics.gauge("shoal_queue_depth", "Data tasks waiting to be handed out", values=s.queue_depth)
        yield metrics.gauge("shoal_tasks_done", "Data tasks finished", values=s.tasks_done)
        yield metrics.gauge("shoal_tasks", "Data tasks in the whole job", values=s.tasks_total)
        yield metrics.gauge("shoal_epochs_completed", "Epochs every task of which is done", values=s.completed_epochs)
        yield metrics.gauge("shoal_view_epoch", "Epoch of the cluster view", values=s.view_epoch)
        yield metrics.gauge("shoal_checkpoint_step", "Step of the newest committed checkpoint",
                            values=s.checkpoint_step)
        yield metrics.gauge("shoal_shard_version", "Version (updates applied) of each shard's primary",
                            ["shard"], [([str(k)], v) for k, v in sorted(self.versions.items())])
        yield metrics.gauge("shoal_checkpoints_failed", "Checkpoint attempts that failed since the chief started",
                            values=s.checkpoints_failed)
        yield metrics.gauge("shoal_stragglers", "Workers flagged as stragglers now (chief/stragglers.py)",
                            values=sum(1 for flagged, _, _ in s.stragglers.values() if flagged))
        yield metrics.gauge("shoal_job_phase", "The job's phase (1 for the current one: running, finished, "
                            "closing)", ["phase"], [([p], float(p == s.job_phase))
                                                    for p in ("running", "finished", "closing")])
        yield metrics.gauge("shoal_job_exit_code", "What the chief and its servers exit with once the job "
                            "ended (0: succeeded)", values=s.job_exit_code)
        desired = self._desired_workers() if self._desired_workers is not None else None
        if desired is not None:      # what shoal local --autoscale, or whatever sets the worker Job's parallelism, follows
            yield metrics.gauge("shoal_autoscale_desired_workers",
                                "Workers the job file's autoscaling policy asks for now", values=desired)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        metrics.unregister_state("chief")
        if self._writer is not None:
            self._writer.close()


def read_shards(addresses: dict[int, str], timeout_s: float = 1.0) -> tuple[dict[int, int], dict[int, dict[str, int]]]:
    """Each shard's version and its pushes refused for NaN/Inf per worker, asked of its primary;
    shards that do not answer are left out."""
    versions: dict[int, int] = {}
    refused: dict[int, dict[str, int]] = {}
    for k, address in addresses.items():
        ch = open_channel(address)
        try:
            st = pb_grpc.ParameterServerStub(ch).Status(pb.StatusRequest(shard=k, by_shard=True), timeout=timeout_s)
            versions[k] = st.version
            guarded = dict(st.guard_refused)        # the update guard's refusals (ps/guard.py) count too
            refused[k] = {w: st.nonfinite_refused.get(w, 0) + guarded.get(w, 0)
                          for w in {*st.nonfinite_refused, *guarded}}
        except grpc.RpcError:
            pass
        finally:
            ch.close()
    return versions, refused
