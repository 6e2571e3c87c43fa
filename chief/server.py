"""Runs the chief: gRPC server, lease ticker, graceful stop, recovery from its journal."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

from shoal.chief.aio import SERVICE, AioServer
from shoal.chief import identity
from shoal.chief.ckpt_record import write_pointer
from shoal.chief.autoscale import AutoscalePolicy, Autoscaler
from shoal.chief.checkpointer import CheckpointConfig, Checkpointer, resume
from shoal.chief.journal import Journal, JournalError, JournalUnreadable
from shoal.chief.servicer import ChiefServicer
from shoal.chief.state import ChiefState
from shoal.chief.stragglers import StragglerPolicy
from shoal.chief.telemetry import ChiefWatch
from shoal.settings.config import JobConfig
from shoal.members import Role

log = logging.getLogger(__name__)

SILENT_SERVERS_HOLD_LEASES = 3    # how long the chief waits (in leases) when it hears from no server at all
DRAIN_S = 30.0      # after the job's end, how long at most the chief and its servers stay up (chief/lifecycle.py)


class ChiefServer:
    """``journal``: a path (or an open :class:`Journal`) to keep the state in; a chief started on
    an existing journal carries on from it (``fresh=True`` moves it aside and starts over).
    ``checkpoint``: take checkpoints, and resume a new job from the newest (chief/checkpointer.py)."""

    def __init__(self, job: JobConfig, bind: str = "127.0.0.1:0", tick_s: float = 0.2,
                 journal: "str | os.PathLike | Journal | None" = None, fresh: bool = False,
                 checkpoint: CheckpointConfig | None = None, autoscale: AutoscalePolicy | None = None,
                 drain_s: float = DRAIN_S, stragglers: StragglerPolicy | None = None):
        self.journal = journal if isinstance(journal, Journal) or journal is None else Journal(journal, fresh=fresh)
        saved = self.journal.load() if self.journal is not None else None
        if self.journal is not None and not fresh:
            try:
                identity.check_not_lost(self.journal.path, saved)   # a journal that held a job and vanished
            except JournalError:
                self.journal.close()
                raise
        same_job: dict = {}
        if saved is not None and saved.get("stopped") and checkpoint is not None:
            log.warning("the journaled job stopped (%s); rolling back: starting over from the newest checkpoint "
                        "in %s", saved["stopped"], checkpoint.directory)
            path = self.journal.path
            self.journal.close()
            # the same job, restarted from its checkpoint: its id stays, its next chief is a new generation
            same_job = {"job_id": str(saved.get("job_id", "")), "generation": int(saved.get("generation", 0)) + 1}
            self.journal, saved = Journal(path, fresh=True), None
        self.recovered = saved is not None
        self.state = (self._recover(saved, job) if saved is not None
                      else ChiefState(job, time.monotonic, **same_job))
        self.job = self.state.job
        lc = self.state.lifecycle      # the drain ends early once no worker was live for a lease
        lc.drain_s, lc.quiet_s, lc.close_grace_s = drain_s, self.job.lease_seconds, 2 * self.job.lease_seconds + 5
        if stragglers is not None:      # the job file's straggler_detection (chief/stragglers.py)
            self.state.straggling.policy = stragglers
        self.servicer = ChiefServicer(self.state, self.journal)
        if self.journal is not None and not self.recovered and not fresh and not same_job:
            self.servicer.new_journal = str(self.journal.path)     # members of an older job: it was lost
        if autoscale is not None:
            self.servicer.autoscaler = Autoscaler(autoscale)
        self.checkpointer: Checkpointer | None = None
        if checkpoint is not None:
            resume(self.state, checkpoint, recovered=self.recovered)
            self.checkpointer = Checkpointer(self.state, self.servicer.lock, checkpoint)
            if self.journal is not None:
                self.checkpointer.on_record = self.servicer.save
            self.servicer.final_checkpoint = self.checkpointer.final
        self.failed = threading.Event()     # set when the journal cannot be written: the process should exit
        self.stopped = threading.Event()    # set when the job stopped (--recovery consistent lost a shard)
        self.closed = threading.Event()     # set when the job ended, drained and its servers left: exit now
        self._closed = False
        self.telemetry: ChiefWatch | None = None
        self.metrics_endpoint = None
        self.server = AioServer(self.servicer, bind)
        self.port = self.server.port
        self._tick_s = tick_s
        # a gap in the ticker's progress this much over its period is the chief's own pause (membership.py)
        self.state.members.bridge_pauses_over(tick_s + max(2 * tick_s, self.job.lease_seconds / 4))
        # every server silent at once: more likely the chief cut off than all of them gone (membership.py)
        self.state.members.hold_when_servers_silent(SILENT_SERVERS_HOLD_LEASES * self.job.lease_seconds)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="chief-ticker", daemon=True)
        self.bind = bind
        host = bind.rsplit(":", 1)[0].strip("[]")
        self.address = f"{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{self.port}"

    def _recover(self, saved: dict, job: JobConfig) -> ChiefState:
        assert self.journal is not None
        try:
            state = ChiefState.from_dict(saved, time.monotonic, recover=True)
        except (KeyError, TypeError, ValueError) as exc:
            raise JournalUnreadable(f"chief journal {self.journal.path} holds a state this chief cannot read "
                               f"({type(exc).__name__}: {exc}); pass --fresh to start the job over") from exc
        if state.job != job:
            diff = ", ".join(f"{k} {v!r} (asked {getattr(job, k)!r})" for k, v in dataclasses.asdict(state.job).items()
                             if getattr(job, k) != v)
            log.warning("the journal's job settings win over the command line's: %s", diff)
        live = state.members.alive()
        log.info("recovered from journal %s: %d live member(s) (%s) with fresh leases, tasks %d/%d done, "
                 "%d held, view epoch %d", self.journal.path, len(live), ", ".join(m.member_id for m in live),
                 state.tasks.done_count, state.tasks.total,
                 sum(len(state.tasks.held_by(m.member_id)) for m in live if m.role is Role.WORKER), state.epoch)
        return state

    def start(self) -> "ChiefServer":
        if self.journal is not None:    # the recovered epoch, or the new job's secret, is durable before serving
            self.servicer.save("recovered" if self.recovered else "started")
            identity.write_marker(self.journal.path, self.state.job_id, self.state.generation)
        if self.checkpointer is not None:   # shoal export finds the job's checkpoint record through it
            write_pointer(self.checkpointer.cfg.directory, self.state.job_id,
                          self.journal.path if self.journal is not None else None)
        self.server.start()
        self._ticker.start()
        if self.checkpointer is not None:
            self.checkpointer.start()
        self.server.set_serving(SERVICE, True)
        host = self.bind.rsplit(":", 1)[0].strip("[]")
        bound = f"{host or '0.0.0.0'}:{self.port}"        # what it listens on, not the loopback it is dialled at
        log.info("chief of job %s (generation %d) serving on %s (mode %s, %d shard(s), lease %.1fs)",
                 self.state.job_id, self.state.generation, bound, self.job.mode, self.job.num_shards,
                 self.job.lease_seconds)
        return self

    def watch(self, tensorboard: str = "", metrics_port: int | None = None) -> "ChiefServer":
        """Starts the telemetry watcher (TensorBoard under ``tensorboard``/chief, Prometheus gauges,
        worker-behind alerts) and, with ``metrics_port`` (0: any free port), ``/metrics`` over HTTP."""
        from shoal.observe.metrics import MetricsEndpoint, bind_host, set_info

        def report(member: str, values: dict) -> None:
            with self.servicer.lock:
                self.state.metrics.update(values)

        pauses = (lambda: self.checkpointer.pauses) if self.checkpointer is not None else None
        set_info(mode=self.job.mode)
        if metrics_port is not None:
            self.metrics_endpoint = MetricsEndpoint(metrics_port, bind_host(self.bind), role="chief")
            self.metrics_endpoint.announce("chief", "chief")
        def desired_workers() -> int | None:
            scaler = self.servicer.autoscaler
            return scaler.desired if scaler is not None else None

        self.telemetry = ChiefWatch(self.state, self.servicer.lock, tensorboard=tensorboard, report=report,
                                    pauses=pauses, desired_workers=desired_workers).start()
        return self

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick_s):
            if self.servicer.failed is not None or self.servicer.lost_journal:
                self.server.set_serving(SERVICE, False)
                self.failed.set()
                return
            if self.state.stopped and not self.stopped.is_set():
                log.error("job stopped: %s", self.state.stopped)
                self.stopped.set()
            self.state.members.backlog_s = self.server.lag_s    # its own queue counts against no member
            try:
                self.servicer.tick()
                with self.servicer.lock:
                    if self.state.lifecycle.chief_may_exit(len(self.state.members.alive(Role.PS))):
                        self.closed.set()
            except JournalError:
                pass                # logged by the servicer; the next round stops
            except Exception:  # noqa: BLE001 - keep expiring leases whatever happens
                log.exception("lease tick failed")

    def stop(self, grace_s: float = 2.0) -> None:
        self._stop.set()
        if self.telemetry is not None:
            self.telemetry.stop()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        if self.checkpointer is not None:
            self.checkpointer.stop()
        self.server.set_serving(SERVICE, False)
        self.server.stop(grace_s)
        if self._ticker.is_alive():
            self._ticker.join(timeout=5)
        if self.journal is not None and not self._closed:
            self._closed = True
            if self.servicer.failed is None:
                self.servicer.flush()
            self.journal.close()

    @property
    def exit_code(self) -> int | None:
        """What the process exits with once the job ended (None while it runs)."""
        ending = self.state.lifecycle.ending
        return ending.exit_code if ending is not None else None

    def wait(self) -> None:
        self.server.wait()
