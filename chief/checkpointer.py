"""Coordinated checkpoints, the chief's side: when, the consistent cut, the commit, the resume.

The chief never touches tensors. Every ``--checkpoint-interval`` (a number of
model updates, i.e. shard versions, like ``500``; or a time like ``30s``) a
background thread takes a consistent cut, every shard at the same version:

1. read each primary's version (``ParameterServer.Status``); the target is the highest;
2. ``Freeze(target)`` on every primary in parallel: a shard holds back updates
   past ``max(target, its version)`` and replies once it is exactly there. If
   the replies differ (a shard had moved past the target), freeze again at the
   highest reply; every shard is held by then, so this settles in one round;
3. snapshot the data-task queue (``TaskQueue.to_dict``) under the chief's lock.
   With every shard held, a task marked done had all its batches applied at or
   before the cut; tasks in flight are handed out again on resume, from the
   progress the chief knows (batches applied twice are dropped by the restored
   shard ledger);
4. ``WriteShard`` on every primary in parallel: it copies its state, thaws,
   then writes and hashes its file in the checkpoint's temporary directory, so
   updates are held only from the freeze to the copy;
5. commit the manifest (layout, shard table, ``meta`` with the task queue).

One more checkpoint is taken once every data task is done (while the job is still up), tried again
every few seconds until it is committed.

Any failure or timeout aborts: the temporary directory is removed, every shard
is thawed, and the next interval tries again.

On start with an existing checkpoint dir the chief resumes from the newest
complete checkpoint (:func:`resume`): it restores the task queue, checks the
first worker's layout against the checkpoint's, and tells each parameter
server at assignment to load its shard (``JoinReply.restore_checkpoint``),
re-sliced when the job has a different number of shards.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import grpc

from shoal.chief.lifecycle import FinalCheckpoint
from shoal.chief.tasks import TaskQueue
from shoal.errors import FailedPrecondition, InvalidArgument, ShoalError
from shoal.observe import metrics
from shoal.state.layout import ModelLayout, ShardPlan
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.state.checkpoint import Checkpoint, load_latest
from shoal.state.checkpoint_failures import record_failure
from shoal.state.checkpoint_store import CheckpointWriter
from shoal.security import auth
from shoal.net.rpc import open_channel

if TYPE_CHECKING:
    from shoal.chief.state import ChiefState
    from shoal.view import Route

log = logging.getLogger(__name__)

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Interval:
    """Every ``steps`` model updates (shard versions), or every ``seconds``; exactly one is set."""

    steps: int = 0
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "Interval":
        """``500`` (updates) or ``30s`` / ``5m`` / ``1h``; InvalidArgument quoting ``text`` otherwise."""
        raw = str(text).strip().lower()
        try:
            if raw and raw[-1] in _UNITS:
                seconds = float(raw[:-1]) * _UNITS[raw[-1]]
                if math.isfinite(seconds) and seconds > 0:
                    return cls(seconds=seconds)
            elif int(raw) >= 1:
                return cls(steps=int(raw))
        except ValueError:
            pass
        raise InvalidArgument(f"--checkpoint-interval {text!r} is not a number of steps (like 500) or a time "
                              f"(like 30s, 5m, 1h) above zero")

    def __str__(self) -> str:
        return f"{self.steps} steps" if self.steps else f"{self.seconds:g}s"


@dataclass(frozen=True)
class CheckpointConfig:
    directory: str
    interval: Interval = field(default_factory=lambda: Interval(steps=500))
    keep: int = 3
    freeze_timeout_s: float = 10.0   # to bring every shard to the cut
    hold_s: float = 30.0             # a shard thaws by itself after this (the chief may have died)
    write_timeout_s: float = 300.0
    poll_s: float = 0.5              # how often the versions are read

    def __post_init__(self) -> None:
        if not self.directory:
            raise InvalidArgument("--checkpoint-dir must not be empty")
        if self.keep < 1:
            raise InvalidArgument(f"--keep-checkpoints must be >= 1, got {self.keep}")


class CheckpointStatus:
    """What the chief knows of checkpoints: the one it resumed from and the newest it committed.

    Kept as ``ChiefState.checkpoints``: :meth:`check_layout` guards the first worker's
    Join, :meth:`restore_path` goes to every parameter server at assignment.
    """

    def __init__(self, resumed: Checkpoint | None = None, newest: Checkpoint | None = None):
        self.resumed = resumed
        self.restored_from = str(resumed.path) if resumed is not None else ""
        self.restored_step = resumed.step if resumed is not None else 0
        # A chief recovered from its journal finds the job's newest checkpoint (``newest``), which an
        # earlier chief of this job committed (maybe the final one, just before it died): it is the
        # newest checkpoint this job has, and reported so, though this chief wrote none itself.
        self.inherited = newest is not None
        newest = newest or resumed
        self.last_path = str(newest.path) if newest is not None else ""
        self.last_step = newest.step if newest is not None else 0
        self.written = 0
        self.failed = 0                  # attempts that failed since the chief started (a visible error)
        self.failed_step = 0             # the step of the newest failed attempt
        self.last_error = ""

    def failed_attempt(self, step: int, error: str) -> None:
        self.failed, self.failed_step, self.last_error = self.failed + 1, step, error

    def check_layout(self, layout: ModelLayout) -> None:
        """FailedPrecondition naming the differing parameters when the job resumes a different model."""
        if self.resumed is not None:
            self.resumed.check_layout(layout)

    def restore_path(self) -> str:
        """The checkpoint a newly assigned shard loads: the newest known (empty: none, workers Init it)."""
        return self.last_path

    def committed(self, path: Path, step: int) -> None:
        self.last_path, self.last_step = str(path), step
        self.written += 1

    def stats(self) -> dict:
        """The ``JobStats`` fields."""
        return {"restored_from": self.restored_from, "restored_step": self.restored_step,
                "checkpoint_step": self.last_step if self.written or self.inherited else 0,
                "checkpoints_written": self.written,
                "checkpoints_failed": self.failed, "checkpoint_failed_step": self.failed_step,
                "checkpoint_error": self.last_error}


def restore_tasks(saved: dict) -> TaskQueue:
    """The task queue of a checkpoint; tasks that were in flight go back to the front, from their progress."""
    q = TaskQueue.from_dict(saved)
    for member in sorted({m for m, _ in saved.get("doing", [])}):
        q.release(member)
    return q


def resume(state: "ChiefState", cfg: CheckpointConfig, recovered: bool = False) -> CheckpointStatus:
    """Sets ``state.checkpoints`` and, for a new job on an existing checkpoint dir, resumes from it.

    ``recovered``: the chief came back from its journal, which already holds the job's
    progress; the checkpoints are then only the source for re-assigned shards.
    """
    ckpt = load_latest(cfg.directory)
    if ckpt is None:
        log.info("no checkpoint under %s yet: the job starts from scratch", cfg.directory)
        status = CheckpointStatus()
    elif recovered:
        log.info("newest checkpoint under %s is step %d; the journal holds the job's progress",
                 cfg.directory, ckpt.step)
        status = CheckpointStatus(newest=ckpt)
    else:
        saved = ckpt.meta.get("tasks")
        if saved:
            state.tasks = restore_tasks(saved)
        log.info("resuming from checkpoint %s: step %d, %d parameter(s) in %d saved shard(s) (this job has %d), "
                 "tasks %d/%d done", ckpt.path, ckpt.step, len(ckpt.layout), ckpt.num_shards, state.job.num_shards,
                 state.tasks.done_count, state.tasks.total)
        status = CheckpointStatus(resumed=ckpt)
    state.checkpoints = status
    return status


# ---------------------------------------------------------------- talking to the primaries

class ShardControlClient:
    """The chief's handle on one primary: its version (Status) and Freeze / WriteShard / Thaw."""

    def __init__(self, address: str, credential: Callable[[], str] | None = None):
        self.address = address
        self.channel = open_channel(address, credential)
        self._status = pb_grpc.ParameterServerStub(self.channel)
        self._control = pb_grpc.ShardControlStub(self.channel)

    def version(self, shard: int, timeout_s: float = 5.0) -> int | None:
        """The shard's version, or None while it is not initialised."""
        st = self._status.Status(pb.StatusRequest(shard=shard, by_shard=True), timeout=timeout_s)
        return st.version if st.initialized and st.shard == shard else None

    def freeze(self, shard: int, target: int, timeout_s: float, hold_s: float) -> int:
        req = pb.FreezeRequest(shard=shard, target_version=target, timeout_seconds=timeout_s, hold_seconds=hold_s)
        return self._control.Freeze(req, timeout=timeout_s + 5).version

    def write(self, shard: int, directory: Path, version: int, start: int, stop: int, fingerprint: str,
              timeout_s: float) -> dict:
        reply = self._control.WriteShard(pb.WriteShardRequest(
            shard=shard, directory=str(directory), version=version, start=start, stop=stop,
            layout_fingerprint=fingerprint, thaw=True), timeout=timeout_s)
        return {"shard": reply.shard, "start": reply.start, "stop": reply.stop, "file": reply.file,
                "sha256": reply.sha256, "bytes": reply.bytes, "version": reply.version,
                "frozen_seconds": reply.frozen_seconds}

    def thaw(self, shard: int, timeout_s: float = 5.0) -> float:
        return self._control.Thaw(pb.ThawRequest(shard=shard), timeout=timeout_s).frozen_seconds

    def close(self) -> None:
        self.channel.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the coordinator

class Checkpointer:
    """The background thread of :mod:`chief.checkpointer`; ``lock`` is the chief servicer's."""

    RETRY_FINAL_S = 2.0     # after a failed attempt, the final checkpoint (every task done) is tried again

    def __init__(self, state: "ChiefState", lock: threading.Condition, cfg: CheckpointConfig,
                 connect: Callable[[str], ShardControlClient] = ShardControlClient,
                 clock: Callable[[], float] = time.monotonic):
        self.state = state
        self.lock = lock
        self.cfg = cfg
        self.status: CheckpointStatus = state.checkpoints or CheckpointStatus()
        self.writer = CheckpointWriter(cfg.directory, cfg.keep)
        self._connect = connect if connect is not ShardControlClient else \
            (lambda address: ShardControlClient(address, self._operator_credential))
        self._clock = clock
        self._clients: dict[str, ShardControlClient] = {}
        self._base_step = self.status.last_step      # the next checkpoint is due an interval after this
        self._base_time = clock()
        self._committed_step = self.status.last_step  # the newest valid checkpoint's step
        self._retry_at = 0.0                          # a failed final checkpoint is tried again from then
        self._final = FinalCheckpoint()               # the final checkpoint (every task done), for the job's end
        self.pauses: list[float] = []                # seconds updates were held, per committed checkpoint
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="checkpoint")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chief-checkpointer", daemon=True)
        # journals the state now (the servicer's save): a checkpoint's failure or commit is in the job's
        # record (chief/ckpt_record.py) before the next attempt, wherever the checkpoint disk stands
        self.on_record: Callable[[str], None] | None = None

    def start(self) -> "Checkpointer":
        log.info("checkpoints every %s into %s (keeping %d)", self.cfg.interval, self.cfg.directory, self.cfg.keep)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.cfg.freeze_timeout_s + 10)
        self._pool.shutdown(wait=False)
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            try:
                self.maybe_checkpoint()
            except Exception:  # noqa: BLE001 - the thread must outlive any one attempt
                log.exception("checkpoint attempt failed")

    # ------------------------------------------------------------ one attempt

    def maybe_checkpoint(self) -> Path | None:
        """Takes a checkpoint if one is due; the committed directory, else None."""
        with self.lock:
            layout, num_shards = self.state.layout, self.state.job.num_shards
            routes = list(self.state.view().routes)
            finished = self.state.tasks.finished
        if layout is None or len(routes) != num_shards:
            return None
        try:
            versions = self._call_all(routes, lambda c, r: c.version(r.shard), 10.0)
        except (grpc.RpcError, ShoalError):
            return None                              # a primary is starting or gone: not now
        if any(v is None for v in versions.values()):
            return None
        top = max(versions.values())
        if finished and top <= self._committed_step:     # the final model is kept
            self._final = dataclasses.replace(self._final, committed_step=self._committed_step)
        if not self._due(top, finished):
            return None
        with self._moves_held():
            with self.lock:     # a primary moved before the hold (chief/placement.py): try again at the next poll
                if [(r.shard, r.member_id) for r in routes] != [(r.shard, r.member_id) for r in self.state.view().routes]:
                    return None
            path = self.checkpoint(routes, layout, top, settled=versions if finished else None)
        if finished:
            self._final = (dataclasses.replace(self._final, committed_step=self._committed_step) if path is not None
                           else dataclasses.replace(self._final, failures=self._final.failures + 1,
                                                    error=self.status.last_error))
        return path

    def final(self) -> FinalCheckpoint:
        """The final checkpoint's state (chief/lifecycle.py ends the job once it is committed)."""
        return self._final

    @contextlib.contextmanager
    def _moves_held(self):
        """No planned move of a primary while a cut is taken (chief/placement.py): a shard moved between
        its freeze and its write would be cut at a copy that no longer takes its pushes."""
        with self.lock:
            self.state.moves_held += 1
        try:
            yield
        finally:
            with self.lock:
                self.state.moves_held -= 1
                self.state.rebalance_soon()

    def _due(self, top: int, finished: bool = False) -> bool:
        if finished:                                 # every task is done: keep the final model, until it is kept
            return top > self._committed_step and self._clock() >= self._retry_at
        if top <= self._base_step:
            return False                             # nothing new since the last checkpoint
        if self.cfg.interval.steps:
            return top - self._base_step >= self.cfg.interval.steps
        return self._clock() - self._base_time >= self.cfg.interval.seconds

    def checkpoint(self, routes: list["Route"], layout: ModelLayout, top: int,
                   settled: dict[int, int] | None = None) -> Path | None:
        """One consistent cut at ``top`` or later; None (after cleaning up) if it could not be taken.

        ``settled`` (shard -> version): every task is done and no update is coming, so each shard is
        cut where it stands. Their versions may differ (a push that reached one shard and was dropped
        by another); waiting for the lower ones to reach ``top`` would wait for ever.
        """
        t0 = self._clock()
        pending, thawed = None, False
        try:
            if settled is not None:          # each held where it stands (one that moved: where it got to)
                cut = self._call_all(routes, lambda c, r: c.freeze(
                    r.shard, settled[r.shard], self.cfg.freeze_timeout_s, self.cfg.hold_s), self.cfg.freeze_timeout_s + 10)
            else:
                at = self._freeze_all(routes, top)
                cut = {r.shard: at for r in routes}
            target = max(cut.values())
            meta = self._meta(target)
            # Whatever lies at this step (a corrupt checkpoint the job resumed past, one of another
            # history) is moved aside at the commit: the state at this cut is the one to keep.
            pending = self.writer.begin(target, replace=True)
            plan = ShardPlan(layout.numel, len(routes))
            entries = self._call_all(routes, lambda c, r: c.write(
                r.shard, pending.tmp, cut[r.shard], *plan.ranges[r.shard], layout.fingerprint,
                self.cfg.write_timeout_s),
                self.cfg.write_timeout_s)
            thawed = True
            held = max(e.pop("frozen_seconds") for e in entries.values())
            for e in entries.values():
                pending.add_entry(e)
            with self.lock:
                now = {k: mid for k, mid in self.state.routing.items()}
            if any(now.get(r.shard) != r.member_id for r in routes):
                raise FailedPrecondition(f"a shard changed primary during the cut: {dict(sorted(now.items()))}")
            path = pending.commit(layout, len(routes), {**meta, "held_ms": round(held * 1e3, 3)}, replace=True)
        except Exception as exc:  # noqa: BLE001 - any failure aborts this attempt, not the job
            if pending is not None:
                pending.abort()
            with self.lock:
                self.status.failed_attempt(top, _describe(exc))
                self.state.ckpt_record.failed_attempt(top, _describe(exc))
                failed, newest = self.status.failed, self.status.last_step
            log.error("checkpoint at step %d aborted (%s); trying again at the next interval (%d attempt(s) "
                      "FAILED so far; the newest checkpoint is step %d)", top, _describe(exc), failed, newest,
                      exc_info=not isinstance(exc, (grpc.RpcError, ShoalError, OSError)))
            record_failure(self.writer.root, top, _describe(exc))
            self._journal(f"checkpoint step {top} failed")
            self._retry_at = self._clock() + self.RETRY_FINAL_S
            return None
        finally:
            if not thawed:
                self._thaw_all(routes)
            self._base_step, self._base_time = max(self._base_step, top), self._clock()
        self._base_step = self._committed_step = target
        self.pauses.append(held)
        with self.lock:
            self.status.committed(path, target)
            self.state.ckpt_record.committed_at(target)
        self._journal(f"checkpoint step {target} committed")
        metrics.CHECKPOINT_SECONDS.observe(self._clock() - t0)
        log.info("checkpoint step %d committed to %s: updates held %.1f ms (freeze to thaw), %.1f ms in all",
                 target, path, held * 1e3, (self._clock() - t0) * 1e3)
        return path

    def _journal(self, event: str) -> None:
        if self.on_record is None:
            return
        try:
            self.on_record(event)
        except ShoalError as exc:      # the chief's journal failed too: the servicer stops the chief
            log.error("cannot journal the checkpoint record (%s)", exc)

    def _freeze_all(self, routes: list["Route"], top: int) -> int:
        target = top
        for _ in range(3):
            held = self._call_all(routes, lambda c, r: c.freeze(r.shard, target, self.cfg.freeze_timeout_s,
                                                                 self.cfg.hold_s), self.cfg.freeze_timeout_s + 10)
            high = max(held.values())
            if min(held.values()) == high:
                return high
            target = high
        raise FailedPrecondition(f"shards did not settle on one version: {dict(sorted(held.items()))}")

    def _meta(self, version: int) -> dict:
        """The data-task progress at the cut (every shard is held while this runs)."""
        with self.lock:
            s = self.state
            totals = s.totals()
            return {"version": version, "mode": s.job.mode, "num_shards": s.job.num_shards,
                    "tasks": s.tasks.to_dict(), "tasks_done": s.tasks.done_count, "tasks_total": s.tasks.total,
                    "completed_epochs": s.tasks.completed_epochs, "worker_steps": totals.steps,
                    "samples": totals.samples}

    def _thaw_all(self, routes: list["Route"]) -> None:
        for r in routes:
            try:
                self._client(r.address).thaw(r.shard)
            except grpc.RpcError as exc:
                log.warning("could not thaw shard %d at %s (%s); it thaws by itself within %.0fs",
                            r.shard, r.address, _describe(exc), self.cfg.hold_s)

    # ------------------------------------------------------------ plumbing

    def _operator_credential(self) -> str:
        """Freeze, WriteShard and Thaw are the operator's: the chief signs its own credential."""
        return auth.issue(self.state.secret, auth.OPERATOR_ID, auth.OPERATOR)

    def _client(self, address: str) -> ShardControlClient:
        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = self._connect(address)
        return c

    def _call_all(self, routes: list["Route"], fn: Callable, timeout_s: float) -> dict:
        """``fn(client, route)`` for every route in parallel; waits for all, then raises the first error."""
        futures = {r.shard: self._pool.submit(fn, self._client(r.address), r) for r in routes}
        concurrent.futures.wait(futures.values(), timeout=timeout_s + 5)
        out = {}
        for shard, f in futures.items():
            if not f.done():
                raise FailedPrecondition(f"shard {shard} did not answer within {timeout_s:.0f}s")
            out[shard] = f.result()
        return out
