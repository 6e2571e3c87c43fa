"""The shards one ps process holds, as primary or as backup, kept in line with the chief's view.

Roles follow the view (:meth:`ShardHost.set_view`): a backup named primary is
promoted in place (it already holds every acknowledged update); a primary the
view no longer names is fenced and dropped; a primary gets a
:class:`~shoal.ps.replication.Replicator` aimed at whatever backup the view
names. Worker calls reach primaries only (:meth:`ShardHost.get`); a backup's
copy changes only through :meth:`replicate` and :meth:`install`.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.errors import HANDED_OVER, NOT_PRIMARY, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from shoal.observe.loglines import log_burst
from shoal.proto import shoal_pb2 as pb
from shoal.ps.consistency import rule_for
from shoal.ps.replication import FENCED, NEEDS_COPY, Replicator, replica_from_bytes
from shoal.ps.shard import Shard
from shoal.ps.update import Update

log = logging.getLogger(__name__)

PRIMARY, BACKUP = "primary", "backup"


class ShardHost:
    """The shards of one ps process, keyed by shard id, plus their byte counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.leaving = False        # set by a planned stop: dropping its copies is expected
        self.member_id = ""
        self.job: JobConfig | None = None
        self.assigned: set[int] = set()               # shards this process is primary of
        self.shards: dict[int, Shard] = {}            # every copy held, primary or backup
        self.roles: dict[int, str] = {}
        self.replicators: dict[int, Replicator] = {}
        self.primary_of: dict[int, str] = {}          # from the latest view
        self.live_workers: frozenset[str] = frozenset()
        self.verify_key: bytes = b""    # the chief's public key (shoal.security.tokens): checks tokens and credentials
        self.credential = ""          # this ps's member credential from the chief (shoal.security.auth)
        self.completed_epochs = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.promotions = 0
        self._restoring: set[int] = set()             # shards being loaded from a checkpoint
        # A shard the view makes this process primary of after its join (the chief spreads the shards no
        # server took at its join, chief/placement.py) is loaded by ``restorer`` from the checkpoint the
        # join named, when it named one, before an Init may create it
        self.restore_path = ""
        self.restorer: Callable[[int], None] | None = None
        self.on_backup_complete: Callable[[], None] = lambda: None   # a backup's first copy is in place
        self._restored = threading.Condition(self._lock)
        # Live-worker sets reach the shards from their own thread: a primary may hold its shard's
        # lock while it waits for the view to replace a dead backup, and the view must get through.
        self._live_cond = threading.Condition()
        self._live_pending: frozenset[str] | None = None
        self._closed = False
        self._live_thread = threading.Thread(target=self._live_loop, name="live-workers", daemon=True)
        self._live_thread.start()

    def rename(self, member_id: str, credential: str) -> None:
        """This process joined the job again under ``member_id``: routes naming it are this process's."""
        with self._lock:
            if member_id and member_id != self.member_id:
                if self.member_id:
                    log.warning("this parameter server is %s now (was %s): the chief forgot the old id",
                                member_id, self.member_id)
                self.member_id = member_id
            self.credential = credential or self.credential

    # ------------------------------------------------------------ primaries

    def assign(self, shard: int, job: JobConfig, restoring: bool = False) -> None:
        """This process is ``shard``'s primary. ``restoring``: the shard is loaded from a checkpoint next;
        an Init waits for it (see :meth:`install`)."""
        with self._lock:
            self.job = job
            self.assigned.add(shard)
            self.roles[shard] = PRIMARY
            if restoring:
                self._restoring.add(shard)

    def install(self, s: Shard) -> None:
        """Puts a shard restored from a checkpoint in place and wakes the Inits that waited for it."""
        with self._lock:
            self._place(s, PRIMARY)
            self._restoring.discard(s.shard_id)
            self._restored.notify_all()

    def _place(self, s: Shard, role: str) -> None:
        """Installs a copy (lock held); a primary copy gets its replicator."""
        s.set_live_workers(self.live_workers)
        if self.job is not None:
            s.nonfinite = self.job.nonfinite
            s.set_guard(self.job)
        self.shards[s.shard_id] = s
        self.roles[s.shard_id] = role
        if role == PRIMARY:
            s.replicator = self._replicator(s.shard_id)

    def _replicator(self, shard: int) -> Replicator:
        r = self.replicators.get(shard)
        if r is None:
            r = Replicator(shard, lambda: self.member_id, lambda: self._primary_copy(shard),
                           credential=lambda: self.credential, on_in_sync=lambda: self.on_backup_complete())
            self.replicators[shard] = r
        return r

    def _primary_copy(self, shard: int) -> Shard | None:
        s = self.shards.get(shard)
        # a fenced copy never feeds a backup: it may hold an update its own backup did not take (ps/shard.py)
        return s if s is not None and not s.fenced and self.roles.get(shard) == PRIMARY else None

    def backups_complete(self) -> list[tuple[int, str]]:
        """``(shard, backup id)`` for each primary copy here whose backup holds a whole copy and follows it."""
        with self._lock:
            reps = [(k, r) for k, r in self.replicators.items() if self.roles.get(k) == PRIMARY]
        return [(k, r.backup) for k, r in sorted(reps) if r.state == "in_sync" and r.backup]

    def get(self, shard: int) -> Shard:
        """The primary copy of ``shard`` for a worker's call; the errors tell the worker what to do."""
        s = self.shards.get(shard)
        if s is not None and not s.fenced and self.roles.get(shard) == PRIMARY:
            return s                        # the hot path reads without the lock
        with self._lock:                    # anything else is judged on a state no view is half-way through
            s, role, assigned = self.shards.get(shard), self.roles.get(shard), shard in self.assigned
        if role == BACKUP:
            raise FailedPrecondition(f"this ps is {NOT_PRIMARY} of shard {shard} (it holds its backup); "
                                     f"the primary is {self.primary_of.get(shard, '?')}")
        if s is None:
            if assigned:
                raise FailedPrecondition(f"shard {shard} is not initialised yet")
            if self.leaving:            # its calls are answered until the workers follow the view
                raise FailedPrecondition(f"this ps is {NOT_PRIMARY} of shard {shard}: it is leaving the job and "
                                         f"{HANDED_OVER}")
            raise NotFound(f"this parameter server does not hold shard {shard} (holds {sorted(self.assigned)})")
        if s.fenced:
            raise FailedPrecondition(f"shard {shard} here is {NOT_PRIMARY} any more: {s.fenced}")
        return s

    def create(self, shard: int, values: torch.Tensor, optimizer: OptimizerSpec, fingerprint: str,
               restore_wait_s: float = 300.0, flat_start: int = 0) -> tuple[Shard, bool]:
        with self._lock:
            if not self._restored.wait_for(lambda: shard not in self._restoring, timeout=restore_wait_s):
                raise Unavailable(f"shard {shard} is still being restored from a checkpoint")
            existing = self.shards.get(shard)
            if existing is not None and self.roles.get(shard) == PRIMARY:
                if existing.fingerprint != fingerprint:
                    raise FailedPrecondition(
                        f"shard {shard} holds model layout {existing.fingerprint}, not {fingerprint}")
                return existing, False
            if shard not in self.assigned or self.job is None:
                raise Unavailable(f"shard {shard} is not assigned to this parameter server (yet)")
            s = Shard(shard, values, optimizer, rule_for(self.job), fingerprint, flat_start=flat_start)
            self._place(s, PRIMARY)
            log.info("shard %d initialised: %d elements, %s, mode %s", shard, s.numel,
                     optimizer.name, self.job.mode)
            return s, True

    # ------------------------------------------------------------ backups

    def _check_sender(self, shard: int, primary_id: str) -> None:
        known = self.primary_of.get(shard)
        if known is not None and known != primary_id:
            raise FailedPrecondition(f"shard {shard}'s {FENCED} {known}, not {primary_id}")
        if self.roles.get(shard) == PRIMARY and shard in self.shards:
            raise FailedPrecondition(f"shard {shard}'s {FENCED} {self.member_id} (this ps), not {primary_id}")

    def check_sender(self, shard: int, primary_id: str, numel: int | None = None) -> None:
        """Refuses, before anything is allocated for it, a copy or (with ``numel``) an update that the
        view says ``primary_id`` may not send, or whose size is not this copy's."""
        with self._lock:
            self._check_sender(shard, primary_id)
            s = self.shards.get(shard)
        if numel is None:
            return
        if s is None:
            raise FailedPrecondition(f"no copy of shard {shard} here: {NEEDS_COPY}")
        if numel != s.numel:
            raise InvalidArgument(f"an update of {numel} elements for shard {shard}, which has {s.numel}")

    def replicate(self, head: pb.ReplicateHeader, u: Update) -> int:
        with self._lock:
            self._check_sender(head.shard, head.primary_id)
            s = self.shards.get(head.shard)
        if s is None:
            raise FailedPrecondition(f"no copy of shard {head.shard} here: {NEEDS_COPY}")

        def still_backup() -> None:
            # checked again under the shard's lock: a view that promoted this copy meanwhile (a planned
            # move) may have let it take pushes already, and the old primary's update must not follow
            with self._lock:
                self._check_sender(head.shard, head.primary_id)
                if self.shards.get(head.shard) is not s:
                    raise FailedPrecondition(f"no copy of shard {head.shard} here: {NEEDS_COPY}")
        try:
            return s.apply_replica(u, still_backup)
        except FailedPrecondition as exc:
            raise FailedPrecondition(f"{exc} ({NEEDS_COPY})") from None

    def install_copy(self, head: pb.InstallHeader, data: bytes | bytearray) -> int:
        """A primary sends this backup a whole copy of its shard."""
        with self._lock:
            self._check_sender(head.shard, head.primary_id)
            job = self.job
        if job is None:
            raise Unavailable("this ps has not joined the job yet")
        s = Shard.from_replica(replica_from_bytes(data), rule_for(job))
        with self._lock:
            self._check_sender(head.shard, head.primary_id)
            self._place(s, BACKUP)
        log.info("shard %d: holding a backup copy from %s at version %d", s.shard_id, head.primary_id, s.version)
        return s.version

    # ------------------------------------------------------------ the view

    def set_view(self, workers: frozenset[str], completed_epochs: int,
                 routes: list[pb.ShardRoute] | None = None, in_view: bool = True) -> None:
        """``in_view``: the view lists this server alive. One that does not (the chief expired it: it was
        paused, cut off) lost its shards to a failover, never to a planned move."""
        dropped: list[Shard] = []
        with self._lock:
            self.live_workers = workers
            self.completed_epochs = max(self.completed_epochs, completed_epochs)
            known = set(self.assigned) | set(self.roles)    # a backup promoted with no copy is a loss: not here
            targets = self._apply_routes(routes, dropped, in_view) if routes is not None else []
            restore = sorted(k for k in self.assigned - known if k not in self.shards) \
                if self.restore_path and self.restorer is not None else []
            self._restoring.update(restore)
        for k in restore:
            threading.Thread(target=self.restorer, args=(k,), name=f"restore-{k}", daemon=True).start()
        for s in dropped:                   # outside the host's lock: a round may hold the shard's a moment
            s.fence(s.fenced)
        for r, backup_id, backup_address in targets:
            if not self.leaving:    # a server on its way out starts no new replication
                r.set_target(backup_id, backup_address)
        with self._live_cond:
            self._live_pending = workers
            self._live_cond.notify_all()

    def _live_loop(self) -> None:
        """Applies the newest live-worker set to every shard (older sets not yet applied are skipped)."""
        while True:
            with self._live_cond:
                self._live_cond.wait_for(lambda: self._live_pending is not None or self._closed)
                if self._closed:
                    return
                workers, self._live_pending = self._live_pending, None
            with self._lock:
                shards = list(self.shards.values())
            for s in shards:
                s.set_live_workers(workers)

    def _apply_routes(self, routes: list[pb.ShardRoute], dropped: list[Shard],
                      in_view: bool = True) -> list[tuple[Replicator, str, str]]:
        """Roles from the view (lock held); returns the replicators to aim, outside the lock, and adds the
        copies it drops to ``dropped`` (to be fenced outside the lock). Its routine lines, one a shard (a
        planned promotion, a copy dropped on purpose), are logged together, folded when there are many."""
        targets = []
        named = set()
        routine: list[str] = []
        for route in routes:
            k = route.shard
            named.add(k)
            self.primary_of[k] = route.primary_id
            if route.primary_id == self.member_id:
                if self.roles.get(k) == BACKUP and k in self.shards:
                    self.promotions += 1
                    # info: the chief warns when it is a failover; a planned hand-over is routine
                    routine.append(f"shard {k}: promoted to primary at version {self.shards[k].version}")
                self.assigned.add(k)
                self.roles[k] = PRIMARY
                s = self.shards.get(k)
                r = self._replicator(k)
                if s is not None:
                    s.replicator = r
                targets.append((r, route.backup_id, route.backup_address))
            elif route.backup_id == self.member_id:
                if self.roles.get(k) == PRIMARY:
                    r = self.replicators.get(k)
                    planned = r is not None and r.state == "in_sync" and r.backup == route.primary_id
                    dropped += self._drop_copy(k, f"the view names {route.primary_id} primary and this ps its "
                                                  f"backup", routine, planned=planned)
                self.roles[k] = BACKUP
            elif k in self.shards or k in self.roles:
                r = self.replicators.get(k)
                # a backup copy the chief aimed elsewhere, or a primary handed to the backup it kept in
                # step (the chief's rebalancing, chief/placement.py): routine; not so for a server the
                # chief dropped from the view (expired): its backup took over in a failover
                planned = in_view and (self.roles.get(k) == BACKUP or (
                    r is not None and r.state == "in_sync" and r.backup == route.primary_id))
                dropped += self._drop_copy(k, f"the view names {route.primary_id} primary", routine, planned=planned)
        log_burst(log, routine)
        return targets

    def _drop_copy(self, shard: int, why: str, routine: list[str], planned: bool = False) -> list[Shard]:
        """Forgets this process's copy of ``shard`` (lock held); returns it, to be fenced (:meth:`Shard.fence`).
        A copy dropped on purpose (a planned move, this ps leaving) adds its line to ``routine``; any other
        drop is a warning, logged at once.

        The flag goes up first and the replicator closes next, so an update on its way to the backup
        raises instead of being applied here (a closed replicator never reads as "no backup")."""
        s = self.shards.pop(shard, None)
        if s is not None:   # a worker told the copy went to the backup it kept in step follows without alarm
            handed = planned and self.roles.get(shard) == PRIMARY
            s.fenced = s.fenced or (f"{why} ({HANDED_OVER})" if handed else why)
        r = self.replicators.pop(shard, None)
        if r is not None:
            r.close()
        self.roles.pop(shard, None)
        self.assigned.discard(shard)
        if s is None:
            return []
        line = f"shard {shard}: dropping this copy (version {s.version}): {why}" + \
            (" (a planned move)" if planned else "")
        if self.leaving or planned:
            routine.append(line)
        else:
            log.warning("%s", line)
        return [s]

    def close(self) -> None:
        with self._live_cond:
            self._closed = True
            self._live_cond.notify_all()
        with self._lock:
            reps = list(self.replicators.values())
        for r in reps:
            r.close()

    def count(self, inbound: int = 0, outbound: int = 0) -> None:
        with self._lock:
            self.bytes_in += inbound
            self.bytes_out += outbound
