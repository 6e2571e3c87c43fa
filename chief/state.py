"""The chief's whole state behind one entry point per event.

Pure: no sockets, no threads, an injected clock. The servicer holds the lock
and calls exactly one method per RPC; every method that changes what the
cluster view shows bumps ``epoch``.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Callable, Mapping

from shoal.security import tokens
from shoal.chief import placement
from shoal.chief.ckpt_record import CheckpointRecord
from shoal.chief.identity import new_job_id
from shoal.chief.lifecycle import Ending, FinalCheckpoint, JobLifecycle, Observed, Phase
from shoal.chief.membership import Membership
from shoal.chief.stragglers import MIN_STEPS, RoundBlame, StragglerDetector, StragglerPolicy
from shoal.chief.tasks import DatasetSpec, Task, TaskQueue
from shoal.settings.config import JobConfig
from shoal.errors import JOB_FINISHED, FailedPrecondition, InvalidArgument, NotFound
from shoal.state.layout import ModelLayout, TensorSpec
from shoal.observe.loglines import log_burst
from shoal.members import Counters, Member, MemberState, Role
from shoal.view import Route, View

log = logging.getLogger(__name__)

STATE_FORMAT = 3   # of ChiefState.to_dict; bump on incompatible changes
# 2: the journal appends changes after the snapshot (chief/journal.py). The snapshot itself is the
# same, so format 1 still loads; a chief that reads only 1 refuses a journal of 2 instead of reading
# its snapshot alone and losing the changes.
# 3: the task queue's done ids are a bitmap and its untouched tasks a count (chief/tasks.py,
# chief/idset.py). Formats 1 and 2 still load; an older chief refuses 3 by its number.
READABLE_FORMATS = (1, 2, 3)


class ChiefState:
    def __init__(self, job: JobConfig, clock: Callable[[], float], secret: bytes | None = None,
                 straggler_factor: float = 2.0, job_id: str = "", generation: int = 1):
        self.job = job
        # who the job is (chief/identity.py): made once, journaled, in every view; a chief recovered
        # from the journal is the next generation of the same job
        self.job_id = job_id or new_job_id()
        self.generation = generation
        self.secret = secret or tokens.new_secret()
        self.straggler_factor = straggler_factor
        self.step_seconds: dict[str, float] = {}
        self._steps_changed: dict[str, None] = {}     # since the journal's last write (take_changes)
        self._clock = clock
        self.epoch = 0
        self.members = Membership(job.lease_seconds, clock)
        self.tasks = TaskQueue()
        self.layout: ModelLayout | None = None
        self.routing: dict[int, str] = {}      # shard -> primary ps
        self.backups: dict[int, str] = {}      # shard -> backup ps (with replicas = 2)
        self.complete: dict[int, str] = {}     # shard -> the backup its primary reported holding a whole copy
        self.lost: list[int] = []              # shards that lost every copy (see recovery)
        # each primary's latest heartbeat: (shard, backup) pairs whose replication is in sync now; a planned
        # move needs it on top of ``complete`` (not journaled: a restarted chief waits for a heartbeat)
        self.in_sync: dict[str, frozenset[tuple[int, str]]] = {}
        self.placed: set[int] = set()          # shards that ever had a primary (only others are placed fresh)
        self.moves_held = 0                    # > 0 while a checkpoint is cut: no primary moves (checkpointer.py)
        self._unsettled = True                 # the ticker re-runs placement until a run finds nothing to wait for
        self.stopped = ""                      # why the job stopped: a consistent job lost a shard
        self.metrics: dict[str, float] = {}
        self.metric_sources: dict[str, str] = {}     # metric -> the member that reported it last
        self.checkpoints = None   # chief.checkpointer.CheckpointStatus with --checkpoint-dir (not journaled)
        self.ckpt_record = CheckpointRecord()  # the job's failed and committed checkpoint steps (journaled)
        self.lifecycle = JobLifecycle(clock)   # the job's end (chief/lifecycle.py); its ending is journaled
        # stragglers from what the job waits on, and what to do with them (chief/stragglers.py; not journaled)
        self.straggling = StragglerDetector(StragglerPolicy(max(straggler_factor, 1.01)), sync=job.mode == "sync")

    def _changed(self, why: str) -> None:
        self.epoch += 1
        log.debug("view epoch %d: %s", self.epoch, why)

    # ------------------------------------------------------------ membership

    def join_worker(self, layout: ModelLayout, host: str = "", member_id: str = "") -> Member:
        if self.stopped:
            raise FailedPrecondition(f"the job is stopped: {self.stopped}")
        if self.lifecycle.finished:
            raise FailedPrecondition(f"{JOB_FINISHED} ({self.lifecycle.ending.result}): nothing left to train")
        if self.layout is None:
            if self.checkpoints is not None:
                self.checkpoints.check_layout(layout)   # resuming: the model must match the checkpoint
            self.layout = layout
        elif layout != self.layout:
            log.warning("refused a worker join from %s: model layout differs from the job's: %s", host or "?",
                        "; ".join(self.layout.diff(layout)))
            raise FailedPrecondition(self.layout.refusal(layout))
        m = self.members.join(Role.WORKER, host=host, member_id=member_id)
        self._changed(f"worker {m.member_id} joined")
        return m

    def join_ps(self, address: str, host: str = "", member_id: str = "") -> tuple[Member, int]:
        """A ps joins: it takes a shard without a primary, else it backs up shards that need one."""
        m = self.members.join(Role.PS, address=address, host=host, member_id=member_id)
        shard = next((k for k, mid in sorted(self.routing.items()) if mid == m.member_id), -1)
        # a stopped job (--recovery consistent lost a shard) hands the lost shard to no one: a server
        # restored from a checkpoint now would take pushes that the rollback then throws away
        if shard < 0 and not self.stopped:
            free = [k for k in range(self.job.num_shards) if k not in self.routing]
            if free:
                shard = free[0]
                self.routing[shard] = m.member_id
                self.placed.add(shard)
                self.backups.pop(shard, None)
                self.complete.pop(shard, None)
                log.info("shard %d -> %s at %s", shard, m.member_id, address)
        self._assign_backups()
        self._changed(f"ps {m.member_id} joined (shard {shard})")
        self.rebalance()
        return m, shard

    def _assign_backups(self) -> None:
        """Gives every shard without a backup one on another live ps, the least loaded first."""
        if self.job.replicas < 2:
            return
        live = [m.member_id for m in self.members.alive(Role.PS)]
        log_burst(log, placement.assign_backups(self.routing, self.backups, self.complete, live))

    def rebalance(self) -> bool:
        """Places free shards, refills backups and moves primaries off overloaded servers
        (chief/placement.py); True if the view changed (the epoch is bumped)."""
        self._unsettled = False
        if self.stopped:
            return False
        live = self.members.alive(Role.PS)
        placeable: list[int] = []
        # shards no server took at its join go to the live servers once no server has joined for a lease
        # (those started together have joined by then, and no worker inits a shard before all are
        # routed); a shard that had a primary once (it lost every whole copy, or its last copy left)
        # is never placed fresh: --recovery's way, or the next server to join, takes it
        if live and self._clock() - max(m.joined_at for m in live) >= self.job.lease_seconds:
            placeable = [k for k in range(self.job.num_shards) if k not in self.placed]
        lines = placement.rebalance(self.job.num_shards, self.routing, self.backups, self.complete, self.in_sync,
                                    [m.member_id for m in live], self.job.replicas, placeable,
                                    # no moves once every task is done: the servers are about to leave
                                    moves=self.moves_held == 0 and not self.tasks.finished)
        self.placed.update(self.routing)
        # the ticker comes back while shards wait for their placement or a checkpoint holds the moves
        self._unsettled = bool(lines) or self.moves_held > 0 or len(self.placed) < self.job.num_shards
        log_burst(log, lines)
        if lines:
            self._changed("placement: " + "; ".join(lines))
        return bool(lines)

    def rebalance_soon(self) -> None:
        """The ticker runs placement again (a checkpoint let go of the moves it held)."""
        self._unsettled = True

    def heartbeat(self, member_id: str, counters: Counters | None = None,
                  progress: Mapping[int, int] | None = None, step_seconds: float = 0.0,
                  backups_complete: Mapping[int, str] | None = None) -> bool:
        """Renews the lease; records task progress (for resuming), the step time (for stragglers) and, from
        a primary, which of its shards' backups hold a whole copy (only those are promoted). A primary
        reports them all each time: a backup it no longer names is no longer counted whole (its copy
        is being sent again), so a failover then goes by --recovery instead of promoting it."""
        if not self.members.heartbeat(member_id, counters):
            return False
        if backups_complete is not None:
            for k in [k for k, b in self.complete.items()
                      if self.routing.get(k) == member_id and backups_complete.get(k) != b]:
                log.warning("shard %d: backup %s no longer holds a whole copy (its primary %s says so)", k,
                            self.complete.pop(k), member_id)
                self._changed(f"shard {k}'s backup is not complete")
        for k, backup in (backups_complete or {}).items():
            if self.routing.get(k) == member_id and self.backups.get(k) == backup and self.complete.get(k) != backup:
                self.complete[k] = backup
                log.info("shard %d: backup %s holds a whole copy (its primary %s says so)", k, backup, member_id)
                self._changed(f"shard {k}'s backup {backup} is complete")
        m = self.members.find(member_id)
        if m is not None and m.role is Role.PS:
            pairs = frozenset((backups_complete or {}).items())
            if self.in_sync.get(member_id) != pairs:
                self.in_sync[member_id] = pairs
                self.rebalance()          # a backup in sync now may take over a shard
        for task_id, next_start in (progress or {}).items():
            self.tasks.progress(member_id, task_id, next_start)
        if step_seconds > 0 and self.step_seconds.get(member_id) != step_seconds:
            self.step_seconds[member_id] = step_seconds
            self._steps_changed[member_id] = None
        return True

    def stragglers(self) -> set[str]:
        """Workers found slow by what the job waits on (chief/stragglers.py)."""
        return self.straggling.stragglers()

    def _busy_workers(self) -> set[str]:
        return {m.member_id for m in self.members.alive(Role.WORKER) if m.state is MemberState.ALIVE}

    def round_blame(self, member_id: str, blame: list[RoundBlame]) -> None:
        """A server's heartbeat: which workers its primaries' sync rounds waited for."""
        self.straggling.rounds(b for b in blame if self.routing.get(b.shard) == member_id)

    def watch_stragglers(self) -> list[tuple[int, str]]:
        """One straggler observation (the ticker); the lines to log with their levels. A change in who the sync rounds
        close without bumps the epoch: the servers follow it in the view."""
        busy = self._busy_workers()
        before = (self.straggling.stragglers(), self.straggling.excluded(busy))
        judged = {w for w in busy if (m := self.members.find(w)) is not None and m.counters.steps >= MIN_STEPS}
        lines = self.straggling.observe(judged, self.step_seconds)
        if (self.straggling.stragglers(), self.straggling.excluded(busy)) != before:
            self._changed("stragglers: " + (", ".join(sorted(self.straggling.stragglers())) or "none"))
        return lines

    def sign(self, member_id: str, t: Task) -> bytes:
        return tokens.sign(self.secret, member_id, t.task_id, t.attempt, t.epoch, t.start, t.stop)

    def leave(self, member_id: str, counters: Counters | None = None) -> None:
        m = self.members.leave(member_id, counters)
        self._drop(m, graceful=True)
        self._changed(f"{member_id} left")

    def tick(self) -> list[Member]:
        """Expires lapsed leases: re-queues their tasks and frees their shards."""
        gone = self.members.expire()
        for m in gone:
            self._drop(m)
        if gone:
            self._changed("expired " + ", ".join(m.member_id for m in gone))
        if self._unsettled:
            self.rebalance()
        return gone

    def expire(self, member_id: str, why: str) -> bool:
        """Drops a member before its lease ends (the chief found it unreachable); True if it was live."""
        m = self.members.expire_now(member_id, why)
        if m is None:
            return False
        self._drop(m)
        self._changed(f"expired {member_id} ({why})")
        return True

    def watch_opened(self, member_id: str) -> None:
        self.members.watch_opened(member_id)

    def watch_closed(self, member_id: str, answered: bool) -> bool:
        """A member's view watch ended; True if it broke off and that ended the member (see Membership)."""
        if self.members.watch_closed(member_id, answered):
            return self.expire(member_id, "its view watch broke and a parameter server saw its data "
                                          "connection drop: the process is gone")
        return False

    def connection_lost(self, member_id: str, reporter: str) -> bool:
        """A ps saw a worker drop its data connection; True if that ended the worker (see Membership)."""
        if self.members.connection_lost(member_id):
            return self.expire(member_id, f"{reporter} saw its data connection drop and its view watch "
                                          f"broke: the process is gone")
        return False

    def _drop(self, m: Member, graceful: bool = False) -> None:
        if m.role is Role.WORKER:
            self.tasks.release(m.member_id)
            self.straggling.forget(m.member_id)
            return
        # graceful: the ps left on purpose (SIGTERM, the end of the job): its backups hold every update it
        # acknowledged, so promoting them is a planned hand-over, not a failover. Its routine lines (one a
        # shard) are logged together at the end, hand-overs first, folded when there are many
        handed, gone, let_go = [], [], []
        for k in [k for k, mid in self.backups.items() if mid == m.member_id]:
            del self.backups[k]
            self.complete.pop(k, None)
            if graceful:
                let_go.append(f"shard {k} let go of its backup {m.member_id}")
            else:
                log.warning("shard %d lost its backup %s", k, m.member_id)
        for k in [k for k, mid in self.routing.items() if mid == m.member_id]:
            backup = self.backups.pop(k, None)
            whole = backup is not None and self.complete.pop(k, None) == backup
            if whole or (backup is not None and self.job.recovery == "fast" and not graceful):
                self.routing[k] = backup
                if graceful:
                    handed.append(f"shard {k}: its primary {m.member_id} left; handed over to (promoted its "
                                  f"backup) {backup}")
                else:
                    log.warning("shard %d lost its primary %s; promoted its backup %s", k, m.member_id, backup)
                if not whole:
                    self.lost.append(k)
                    log.error("shard %d: its backup %s had not finished receiving its copy; --recovery fast "
                              "goes on with it, and the updates its primary acknowledged alone are lost "
                              "(exactly_once: false)", k, backup)
            else:
                del self.routing[k]
                if graceful:       # a ps stopped on purpose (the job is being shut down)
                    gone.append(f"shard {k}: its last copy left with {m.member_id}")
                else:
                    self.lost.append(k)
                    why = (f"its backup {backup} had not finished receiving its copy" if backup is not None
                           else "it had no backup")
                    log.error("shard %d lost its primary %s and %s: no whole copy is left", k, m.member_id, why)
                    if self.job.recovery == "consistent" and not self.stopped:
                        self.stopped = (f"shard {k} lost every copy that holds all its updates (its primary "
                                        f"{m.member_id} died and {why}); --recovery consistent stops the job rather "
                                        f"than go on without acknowledged updates: resume it from the newest "
                                        f"checkpoint")
                    elif self.job.recovery == "fast":
                        log.warning("shard %d: --recovery fast goes on; the next ps to take it starts from the "
                                    "newest checkpoint or a worker's weights, and the updates it held since "
                                    "are lost", k)
        log_burst(log, handed + gone + let_go)
        self.in_sync.pop(m.member_id, None)
        self._assign_backups()
        self.rebalance()

    # ------------------------------------------------------------ data tasks

    def take_tasks(self, member_id: str, spec: DatasetSpec | None, max_tasks: int,
                   done: tuple[int, ...] = (), dropped: tuple[tuple[int, int, int], ...] = (),
                   known: frozenset[int] | None = None) -> tuple[list[Task], bool]:
        """Records finished tasks and dropped batches ``(epoch, start, stop)``, hands out new tasks.

        ``known``: the tasks the worker knows it holds. Any other task it holds here was in a reply
        it never got, and is handed out again first (same attempt, so pushes already made count)."""
        m = self.members.get(member_id)
        if not m.live:
            raise NotFound(f"member {member_id} is {m.state.value}; join again")
        if self.stopped:
            raise FailedPrecondition(f"the job is stopped: {self.stopped}")
        if spec is not None:
            self.tasks.configure(spec)
        for epoch, start, stop in dropped:
            self.tasks.requeue_batch(member_id, epoch, start, stop)
        completed_before = self.tasks.completed_epochs
        for tid in done:
            self.tasks.complete(member_id, tid)
        if self.tasks.completed_epochs != completed_before:
            self._changed(f"epoch {self.tasks.completed_epochs - 1} complete")
        lost = [t for t in self.tasks.held_by(member_id) if t.task_id not in known][:max_tasks] \
            if known is not None and max_tasks > 0 else []
        if lost:
            log.info("handing %s again the task(s) %s it never received", member_id, [t.task_id for t in lost])
        got = lost + (self.tasks.take(member_id, max_tasks - len(lost)) if max_tasks > len(lost) else [])
        if max_tasks > 0 and self.members.set_busy(member_id, bool(got) or bool(self.tasks.held_by(member_id))):
            self._changed(f"worker {member_id} is {m.state.value}")
        return got, self.tasks.finished

    def report(self, member_id: str, values: Mapping[str, float]) -> None:
        self.members.get(member_id)
        self.metrics.update({k: float(v) for k, v in values.items()})
        self.metric_sources.update({k: member_id for k in values})

    def step_lifecycle(self, checkpoint: FinalCheckpoint | None) -> list[str]:
        """Moves the job towards its end (chief/lifecycle.py); the lines to log. A new phase bumps the epoch:
        the servers learn it from the view."""
        before = self.lifecycle.phase
        lines = self.lifecycle.step(Observed(self.tasks.done_count, self.tasks.total, self.tasks.finished,
                                             self.stopped, checkpoint, len(self.members.alive(Role.WORKER)),
                                             len(self.members.alive(Role.PS))))
        if self.lifecycle.phase is not before:
            self._changed(f"job {self.lifecycle.phase.value}")
        return lines

    # ------------------------------------------------------------ reads

    def view(self) -> View:
        return self._view(tuple(self.members.alive()))

    def routing_view(self) -> View:
        """What a worker follows (a ROUTING view, chief/views.py): the live servers and the shard routes,
        without the workers, their step times and straggler flags."""
        return self._view(tuple(self.members.alive(Role.PS)), workers=False)

    def _view(self, alive: tuple, workers: bool = True) -> View:
        by_id = {m.member_id: m for m in alive}
        routes = []
        for k, mid in sorted(self.routing.items()):
            if mid not in by_id:
                continue
            b = by_id.get(self.backups.get(k, ""))
            routes.append(Route(k, mid, by_id[mid].address, b.member_id if b else "", b.address if b else "",
                                b is not None and self.complete.get(k) == b.member_id))
        routes = tuple(routes)
        return View(self.epoch, alive, routes, len(routes) == self.job.num_shards, self.job,
                    self.layout.fingerprint if self.layout else "", self.tasks.completed_epochs,
                    *((frozenset(self.stragglers()), dict(self.step_seconds)) if workers else ()),
                    job_id=self.job_id, generation=self.generation,
                    excluded=frozenset(self.straggling.excluded(self._busy_workers())), **self._ending_fields())

    def _ending_fields(self) -> dict:
        lc = self.lifecycle
        if lc.phase is Phase.RUNNING:
            return {}
        return {"job_phase": lc.phase.value, "job_result": lc.ending.result, "job_exit_code": lc.ending.exit_code}

    def totals(self) -> Counters:
        out = Counters()
        for m in self.members.all(Role.WORKER):
            out.steps += m.counters.steps
            out.samples += m.counters.samples
            out.bytes_pushed += m.counters.bytes_pushed
            out.bytes_pulled += m.counters.bytes_pulled
        return out

    # ------------------------------------------------------------ persistence (chief/journal.py)

    def to_dict(self) -> dict:
        """The whole state as JSON-able values; :meth:`from_dict` rebuilds it."""
        return {
            **self._small_dict(),
            "step_seconds": dict(self.step_seconds),
            "members": self.members.to_dict(),
            "tasks": self.tasks.to_dict(),
        }

    def _small_dict(self) -> dict:
        """The parts of :meth:`to_dict` whose size does not grow with the members or the tasks."""
        return {
            "format": STATE_FORMAT,
            "job": dataclasses.asdict(self.job),
            "epoch": self.epoch,
            "job_id": self.job_id,
            "generation": self.generation,
            "secret": self.secret.hex(),
            "straggler_factor": self.straggler_factor,
            "layout": None if self.layout is None else [[t.name, list(t.shape), t.dtype] for t in self.layout.specs],
            "routing": [[k, mid] for k, mid in sorted(self.routing.items())],
            "backups": [[k, mid] for k, mid in sorted(self.backups.items())],
            "complete": [[k, mid] for k, mid in sorted(self.complete.items())],
            "lost": list(self.lost),
            "placed": sorted(self.placed),
            "stopped": self.stopped,
            "metrics": dict(self.metrics),
            "metric_sources": dict(self.metric_sources),
            "checkpoint_record": self.ckpt_record.to_dict(),
            "ending": self.lifecycle.ending.to_dict() if self.lifecycle.ending is not None else None,
        }

    def journal_snapshot(self) -> dict:
        """:meth:`to_dict` and the clock's time: the base that the journal's later changes apply to."""
        return {**self.to_dict(), "clock": self._clock()}

    def take_changes(self) -> dict:
        """What changed since the last call, for the journal (chief/journal.py): the small parts whole,
        the members and step times that changed, the task queue's calls in order (the first call starts
        recording them). It costs what changed, not what the state holds. ``whole``: the task queue
        was not recording (the first call, or a queue put in place since, as a checkpoint's on resume):
        only a whole snapshot holds it."""
        changes = {"whole": self.tasks.ops is None, "clock": self._clock(), "small": self._small_dict(), "members_meta": self.members.meta(),
                   "members": self.members.take_changed(),
                   "steps": [[k, self.step_seconds[k]] for k in self._steps_changed],
                   "tasks": self.tasks.take_ops()}
        self._steps_changed = {}
        return changes

    @classmethod
    def from_dict(cls, d: dict, clock: Callable[[], float], recover: bool = False) -> "ChiefState":
        """Inverse of :meth:`to_dict`.

        ``recover`` is for a restarted chief: every live member gets a full lease
        from now (it could not heartbeat while the chief was down) and the view
        epoch moves past every epoch a client may have seen, so all refresh.
        """
        if d.get("format") not in READABLE_FORMATS:
            raise InvalidArgument(f"chief state has format {d.get('format')!r}, this chief reads "
                                  f"{', '.join(map(str, READABLE_FORMATS))}")
        # a journal from before job ids: the job gets one now, and keeps it from the next write on
        generation = int(d.get("generation", 0))
        s = cls(JobConfig(**d["job"]), clock, secret=bytes.fromhex(d["secret"]),
                straggler_factor=float(d["straggler_factor"]), job_id=str(d.get("job_id", "")),
                generation=generation + 1 if recover else max(generation, 1))
        s.epoch = int(d["epoch"])
        s.step_seconds = {k: float(v) for k, v in d["step_seconds"].items()}
        if d["layout"] is not None:
            s.layout = ModelLayout(TensorSpec(name, tuple(shape), dtype) for name, shape, dtype in d["layout"])
        s.routing = {int(k): mid for k, mid in d["routing"]}
        s.backups = {int(k): mid for k, mid in d.get("backups", [])}
        s.complete = {int(k): mid for k, mid in d.get("complete", [])}
        s.lost = [int(k) for k in d.get("lost", [])]
        # a journal from before placement: every shard with a primary, or lost, had one
        s.placed = {int(k) for k in d.get("placed", [*s.routing, *s.lost])}
        s.stopped = str(d.get("stopped", ""))
        s.metrics = {k: float(v) for k, v in d["metrics"].items()}
        s.metric_sources = {k: str(v) for k, v in d.get("metric_sources", {}).items()}
        s.ckpt_record = CheckpointRecord.from_dict(d.get("checkpoint_record"))
        if d.get("ending"):
            s.lifecycle = JobLifecycle(clock, ending=Ending.from_dict(d["ending"]))
        s.members = Membership.from_dict(d["members"], clock, fresh_leases=recover)
        s.tasks = TaskQueue.from_dict(d["tasks"])
        if recover:
            s._changed("recovered from the journal")
        return s
