"""gRPC servicer of the chief: one lock, one state call per RPC, proto in and out.

With a journal, every RPC that changed durable state journals what it changed
(``ChiefState.take_changes``, appended; chief/journal.py) before it replies,
still inside the lock (heartbeat-only changes are batched: at most
one write per ``heartbeat_flush_s``). A write that fails leaves the chief
``failed``: it answers Unavailable from then on and its server stops, so it
restarts from the journal instead of running on with state it cannot keep.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import Callable, Iterator

from shoal.chief.autoscale import DESIRED_WORKERS, Autoscaler
from shoal.chief import identity
from shoal.chief.ckpt_record import record_stats
from shoal.chief.journal import Journal, JournalError
from shoal.chief.lifecycle import FinalCheckpoint
from shoal.chief.state import ChiefState
from shoal.chief.stragglers import RoundBlame
from shoal.chief.views import ViewBoard, check_scope
from shoal.security import auth, tokens
from shoal.state import convert
from shoal.errors import InvalidArgument, Unavailable
from shoal.members import Role
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import check_address, grpc_errors, probe

log = logging.getLogger(__name__)

MAX_VIEW_WAIT_S = 30.0


class ChiefServicer(pb_grpc.ChiefServicer):
    def __init__(self, state: ChiefState, journal: Journal | None = None, heartbeat_flush_s: float = 0.2):
        self.probe_timeout_s = 1.0           # ReportUnreachable: how long the chief's own probe waits
        self.state = state
        self.journal = journal
        self.heartbeat_flush_s = heartbeat_flush_s
        self.failed: JournalError | None = None
        self._dirty = False
        self._last_write = float("-inf")
        self._cond = threading.Condition()
        self.guard = auth.Guard(self._credential_key)
        self.autoscaler: Autoscaler | None = None      # the desired worker count, published in GetJobStats
        self.views = ViewBoard(state)        # the open watches and what they are answered with
        # a chief that started a new job on an empty or missing journal (not --fresh): if a member of another
        # job reaches it, that journal was lost, and ``lost_journal`` says so (the chief exits EXIT_REFUSED)
        self.new_journal: str | None = None
        self.lost_journal = ""
        # what the checkpointer says of the final checkpoint (None: the job takes no checkpoints)
        self.final_checkpoint: Callable[[], FinalCheckpoint | None] = lambda: None

    def _credential_key(self) -> bytes:
        return tokens.public_key(self.state.secret)

    @property
    def lock(self) -> threading.Condition:
        """The lock every RPC holds; in-process helpers (chief/checkpointer.py) take it to read the state."""
        return self._cond

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._cond:
            if self.failed is not None:
                raise Unavailable(f"the chief cannot write its journal and is stopping: {self.failed}")
            yield

    def _save(self, event: str) -> None:
        """Journals the state (lock held), before the reply that reveals the change."""
        if self.journal is None:
            return
        try:
            self.journal.append(self.state.take_changes(), event, self.state.journal_snapshot)
        except JournalError as exc:
            self.failed = exc
            log.critical("%s; the chief stops", exc)
            raise
        self._dirty = False
        self._last_write = time.monotonic()

    def _touch(self) -> None:
        """A heartbeat changed counters or task progress: journal it, at most every heartbeat_flush_s."""
        self._dirty = True
        if time.monotonic() - self._last_write >= self.heartbeat_flush_s:
            self._save("heartbeats")

    def save(self, event: str) -> None:
        """Journals the state now (e.g. right after a start or a recovery)."""
        with self._locked():
            self._save(event)

    def flush(self) -> None:
        """Journals batched heartbeat changes now (on stop)."""
        with self._locked():
            if self._dirty:
                self._save("heartbeats")

    def tick(self) -> None:
        """Called periodically: expires leases, wakes view watchers on change, journals batched heartbeats."""
        with self._locked():
            before = self.state.epoch
            gone = self.state.tick()
            for line in self.state.step_lifecycle(self.final_checkpoint()):
                (log.info if self.state.lifecycle.ending.ok else log.error)(line)
            for level, line in self.state.watch_stragglers():
                log.log(level, line)
            if self.autoscaler is not None:
                self._autoscale()
            if self.state.epoch != before:
                self._save("expired " + ", ".join(m.member_id for m in gone) if gone else "tick")
                self._wake_watchers()
            elif self.views.stale():        # a change made outside the servicer (the checkpointer)
                self._wake_watchers()
            elif self._dirty and time.monotonic() - self._last_write >= self.heartbeat_flush_s:
                self._save("heartbeats")

    def _autoscale(self) -> None:
        """The desired worker count follows the load (chief/autoscale.py); each decision is one line."""
        s, scaler = self.state, self.autoscaler
        made = scaler.made
        scaler.observe(time.monotonic(), s.tasks.total - s.tasks.done_count, len(s.members.alive(Role.WORKER)),
                       s.totals().steps, s.tasks.total, s.tasks.finished)
        for d in list(scaler.decisions)[made - scaler.made:] if scaler.made > made else []:
            log.info("autoscaling: %s", d.line())

    @grpc_errors
    def ReportUnreachable(self, request, context):
        """A member could not reach another. A ps: probe it ourselves; if it does not answer, end its
        lease now. A worker (a ps saw its data connection drop): end it if its view watch broke too."""
        self.guard.require(context, auth.PS, auth.WORKER, member=request.reporter_id)
        with self._locked():
            m = self.state.members.find(request.member_id)
            if m is not None and m.live and m.role is Role.WORKER:
                expired = self.state.connection_lost(request.member_id, request.reporter_id)
                if expired:
                    self._changed_now(f"expired {request.member_id}: connection lost")
                return pb.UnreachableReply(expired=expired)
            address = m.address if m is not None and m.live and m.role is Role.PS else ""
        if not address or probe(address, self.probe_timeout_s):
            return pb.UnreachableReply(expired=False)
        with self._locked():
            expired = self.state.expire(request.member_id, f"unreachable for {request.reporter_id} and the chief")
            if expired:
                self._changed_now(f"expired {request.member_id}: unreachable")
        return pb.UnreachableReply(expired=expired)

    def _wake_watchers(self) -> None:
        """The epoch changed (lock held): the watches it concerns wake and answer (chief/views.py)."""
        self.views.changed()

    def _changed_now(self, event: str) -> None:
        """Journals a change and wakes the view watchers (lock held)."""
        self._save(event)
        self._wake_watchers()

    @grpc_errors
    def Join(self, request, context):
        if request.role == pb.PS:
            check_address(request.address)
        member_id = request.member_id
        scope = check_scope(request.view_scope)
        if member_id and not self.guard.speaks_for(context, member_id):
            member_id = ""      # only the member itself re-attaches under its id; anyone else joins anew
        with self._locked():
            self._check_job(request)
            if request.role == pb.WORKER:
                m = self.state.join_worker(convert.layout_from_pb(request.layout), request.host, member_id)
                shard = -1
            elif request.role == pb.PS:
                if not request.address:
                    raise InvalidArgument("a parameter server must give the address it serves on")
                m, shard = self.state.join_ps(request.address, request.host, member_id)
            else:
                raise InvalidArgument(f"unknown role {request.role}")
            self._save(f"join {m.member_id}" + (f" (shard {shard})" if request.role == pb.PS else ""))
            self._wake_watchers()
            ckpts = self.state.checkpoints
            return pb.JoinReply(member_id=m.member_id, lease_seconds=self.state.job.lease_seconds,
                                view=self.views.joined(scope, m.member_id), shard=shard,
                                verify_key=tokens.public_key(self.state.secret) if request.role == pb.PS else b"",
                                restore_checkpoint=ckpts.restore_path() if ckpts and request.role == pb.PS else "",
                                credential=auth.issue(self.state.secret, m.member_id,
                                                      auth.PS if request.role == pb.PS else auth.WORKER))

    def _check_job(self, request) -> None:
        """Refuses a member of another job (lock held). On a chief that began a new job on a journal that
        held nothing, it is the sign that the journal was lost: ``lost_journal`` is set (chief/identity.py)."""
        if not request.job_id or request.job_id == self.state.job_id:
            return
        new = self.new_journal is not None
        exc = identity.foreign(request.job_id, request.generation, self.state.job_id, self.state.generation,
                               self.new_journal or (str(self.journal.path) if self.journal else ""), new)
        if new and not self.lost_journal:
            self.lost_journal = (f"chief journal {self.new_journal} is missing or empty but members of job "
                                 f"{request.job_id} (generation {request.generation}) reach this chief: the job's "
                                 f"state is lost; restore the journal, or pass --fresh to start a new job")
            log.error("%s", self.lost_journal)
        log.warning("refused a %s join: %s", "ps" if request.role == pb.PS else "worker", exc)
        raise exc

    @grpc_errors
    def Heartbeat(self, request, context):
        self.guard.require(context, auth.PS, auth.WORKER, member=request.member_id)
        with self._locked():
            mid = request.member_id
            m = self.state.members.find(mid)
            before = (m.counters, self.state.step_seconds.get(mid)) if m is not None else None
            epoch = self.state.epoch
            known = self.state.heartbeat(mid, convert.counters_from_pb(request.counters),
                                         {p.task_id: p.next_start for p in request.progress},
                                         request.step_seconds,
                                         {c.shard: c.backup_id for c in request.backups_complete})
            if request.own_step_seconds and known:
                self.state.straggling.own_time(mid, request.own_step_seconds)
            if request.round_blame and known:
                self.state.round_blame(mid, [RoundBlame(b.shard, b.worker, b.rounds, b.last, b.ratio,
                                                        b.waited_seconds) for b in request.round_blame])
            if self.state.epoch != epoch:           # a backup's copy is complete: journaled, then published
                self._changed_now(f"backups complete from {mid}")
            elif known and (request.progress or before != (m.counters, self.state.step_seconds.get(mid))):
                self._touch()
            return pb.HeartbeatReply(epoch=self.state.epoch, known=known,
                                     leave=self.state.straggling.leave_reason(mid))

    @grpc_errors
    def Leave(self, request, context):
        self.guard.require(context, auth.PS, auth.WORKER, member=request.member_id)
        with self._locked():
            self.state.leave(request.member_id, convert.counters_from_pb(request.counters))
            self._save(f"leave {request.member_id}")
            self._wake_watchers()
            return pb.Empty()

    # GetView, the view watch (a long poll), is a coroutine on the chief's aio server (chief/aio.py),
    # made of these steps. What wakes a watch of each scope and what it gets: chief/views.py.

    def watch_begin(self, request, woke) -> tuple[int, float]:
        """Opens a view watch: its scope and the monotonic time it is answered by at the latest.
        ``woke.set()`` is called (under the lock) when the view of that scope changes."""
        scope = check_scope(request.scope)
        deadline = time.monotonic() + (min(max(request.timeout_seconds, 0.0), MAX_VIEW_WAIT_S)
                                       if math.isfinite(request.timeout_seconds) else 0.0)
        with self._locked():
            if request.member_id:
                self.state.watch_opened(request.member_id)
            if self.views.stale():
                self.views.changed()
            self.views.watches[scope].add(woke)
        return scope, deadline

    def after_epoch(self, request) -> int:
        """The epoch a watch waits past: none (-1) when the watcher's epoch is of another generation (a
        recovered chief's epoch may be lower than the one the member saw, if the journal lost its last
        writes: its view is newer all the same)."""
        if request.generation and request.generation != self.state.generation:
            return -1
        return request.after_epoch

    def watch_done(self, scope: int, after_epoch: int) -> bool:
        return self.views.waits_past(scope) > after_epoch or self.failed is not None

    def watch_answer(self, request, scope: int) -> bytes:
        with self._locked():
            if self.failed is not None:     # a view the journal does not hold must not be seen
                raise Unavailable(f"the chief cannot write its journal and is stopping: {self.failed}")
            if 0 <= request.after_epoch and self.views.waits_past(scope) <= request.after_epoch:
                return self.views.unchanged(request.after_epoch)
            return self.views.answer(scope, request.member_id, fresh=request.after_epoch < 0)

    def watch_end(self, request, scope: int, woke, answered: bool) -> None:
        """Closes a watch and reports its end for the watcher's lease (:meth:`_watch_closed`)."""
        with self._cond:
            self.views.watches[scope].discard(woke)
        if request.member_id:
            self._watch_closed(request.member_id, answered)

    def _watch_closed(self, member_id: str, answered: bool) -> None:
        """A watch ended, answered or not. One that breaks off before its answer means the process (or its
        socket) is gone: its lease is cut to a third, which a live member's next heartbeat (every quarter
        lease) renews. Must not raise."""
        with self._cond:
            if self.failed is not None:
                return
            if self.state.watch_closed(member_id, answered):
                try:
                    self._changed_now(f"expired {member_id}: connection lost")
                except JournalError:
                    pass          # logged, and the chief is failed: it stops

    @grpc_errors
    def GetTasks(self, request, context):
        self.guard.require(context, auth.WORKER, member=request.member_id)
        spec = convert.dataset_from_pb(request.dataset) if request.HasField("dataset") else None
        dropped = tuple((b.epoch, b.start, b.stop) for b in request.dropped)
        with self._locked():
            before, configured = self.state.epoch, self.state.tasks.spec is not None
            known = frozenset(request.held_task_ids) | frozenset(request.done_task_ids) \
                if request.reports_held else None
            tasks, finished = self.state.take_tasks(request.member_id, spec, request.max_tasks,
                                                    tuple(request.done_task_ids), dropped, known)
            if (tasks or request.done_task_ids or dropped or self.state.epoch != before
                    or configured != (self.state.tasks.spec is not None)):
                self._save(f"tasks {request.member_id}: got {[t.task_id for t in tasks]}, "
                           f"done {list(request.done_task_ids)}, dropped {len(dropped)}")
            if self.state.epoch != before:
                self._wake_watchers()
            return pb.TaskReply(tasks=[convert.task_to_pb(t, self.state.sign(request.member_id, t)) for t in tasks],
                                finished=finished, epoch=self.state.epoch,
                                data_epochs_open=self.state.tasks.epochs_open)

    @grpc_errors
    def ReportMetrics(self, request, context):
        self.guard.require(context, auth.PS, auth.WORKER, member=request.member_id)
        with self._locked():
            self.state.report(request.member_id, dict(request.values))
            self._save(f"metrics from {request.member_id}: {', '.join(sorted(request.values))}")
            return pb.Empty()

    @grpc_errors
    def GetJobStats(self, request, context):
        with self._cond:
            s = self.state
            workers = list(s.members.all(Role.WORKER))
            metrics = dict(s.metrics)
            if self.autoscaler is not None and self.autoscaler.desired is not None:
                metrics[DESIRED_WORKERS] = float(self.autoscaler.desired)
            return pb.JobStats(totals=convert.counters_to_pb(s.totals()), metrics=metrics,
                               job_id=s.job_id, generation=s.generation,
                               workers_seen=len(workers), workers_live=len(s.members.alive(Role.WORKER)),
                               tasks_done=s.tasks.done_count, tasks_total=s.tasks.total,
                               job=convert.job_to_pb(s.job), queue_depth=s.tasks.depth,
                               completed_epochs=s.tasks.completed_epochs,
                               epochs=s.tasks.spec.epochs if s.tasks.spec else 0,
                               batches_per_epoch=s.tasks.spec.batches_per_epoch if s.tasks.spec else 0,
                               lost_shards=s.lost, stopped=s.stopped, metric_sources=dict(s.metric_sources),
                               **{**(s.checkpoints.stats() if s.checkpoints is not None else {}),
                                  **record_stats(s.ckpt_record)},     # the journaled record wins
                               **self._ending_stats())

    def _ending_stats(self) -> dict:
        lc = self.state.lifecycle
        out = {"job_phase": lc.phase.value, "job_drain_left_seconds": lc.drain_left_s()}
        if self.autoscaler is not None:
            now = time.monotonic()
            out["autoscale_decisions"] = [f"{now - d.at:.0f}s ago: {d.line()}" for d in self.autoscaler.decisions]
        if lc.ending is not None:
            out.update(job_result=lc.ending.result, job_exit_code=lc.ending.exit_code,
                       job_ended_seconds_ago=lc.ended_seconds_ago())
        return out
