"""A job's end: when the chief says the job is done, how long it drains, and when every role exits.

Pure: no sockets, no threads; the chief's ticker calls :meth:`JobLifecycle.step` with what it
knows now and applies what comes back (a line to log, a view change to publish).

Phases (``Phase``), in order, never back::

    RUNNING --(every task of the last epoch done and the final checkpoint committed,
               or the job stopped or failed)--> FINISHED
    FINISHED --(the drain is over: ``drain_s`` after the end, or one lease with no
                live worker)--> CLOSING
    CLOSING: every server sees it in the view and exits with the job's exit code; the
             chief exits once no server is left (or ``close_grace_s`` later)

While FINISHED the servers keep serving (a worker evaluates and pulls the final weights) and
``shoal status`` shows the result; a worker that joins is turned away at once (``JOB_FINISHED``).
The ending is journaled: a chief restarted during the drain keeps the result and drains again.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from enum import Enum
from typing import Callable

from shoal.errors import EXIT_CHECKPOINT_FAILED, EXIT_FAILED, EXIT_ROLLBACK

log = logging.getLogger(__name__)

# How many attempts at the final checkpoint (every task done) may fail before the job ends as failed:
# its weights are then only on the servers, which are about to exit
FINAL_CHECKPOINT_ATTEMPTS = 5


class Phase(str, Enum):
    RUNNING = "running"
    FINISHED = "finished"
    CLOSING = "closing"


@dataclasses.dataclass(frozen=True)
class Ending:
    """How the job ended: ``exit_code`` 0 when it succeeded, else an ``EXIT_*`` code of shoal.errors."""

    result: str
    exit_code: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def to_dict(self) -> dict:
        return {"result": self.result, "exit_code": self.exit_code}

    @classmethod
    def from_dict(cls, d: dict) -> "Ending":
        return cls(str(d["result"]), int(d["exit_code"]))


@dataclasses.dataclass(frozen=True)
class FinalCheckpoint:
    """What the checkpointer says of the final checkpoint (``None`` of it: the job takes none)."""

    committed_step: int = -1      # >= 0: the final model is kept at this step
    failures: int = 0             # attempts at it that failed
    error: str = ""               # the newest failure


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the chief knows at one tick."""

    tasks_done: int
    tasks_total: int
    finished: bool                 # every task of every epoch is done
    stopped: str = ""              # the job stopped (--recovery consistent lost a shard): why
    checkpoint: FinalCheckpoint | None = None
    live_workers: int = 0
    live_servers: int = 0


class JobLifecycle:
    """``drain_s``: how long the chief and its servers stay up after the end (``math.inf``: until a
    signal, as under ``shoal local``, which stops them itself). ``quiet_s``: the drain ends early once
    no worker has been live this long (the workers heard the end, evaluated and left).
    ``close_grace_s``: how long the chief waits in CLOSING for its servers to leave."""

    def __init__(self, clock: Callable[[], float], drain_s: float = 30.0, quiet_s: float = 3.0,
                 close_grace_s: float = 10.0, ending: Ending | None = None):
        if not drain_s >= 0:
            raise ValueError(f"the drain must be >= 0 seconds, got {drain_s!r}")
        self._clock = clock
        self.drain_s = drain_s
        self.quiet_s = quiet_s
        self.close_grace_s = close_grace_s
        self.phase = Phase.RUNNING
        self.ending: Ending | None = None
        self.ended_at = 0.0
        self.closing_at = 0.0
        self._no_workers_since: float | None = None
        if ending is not None:      # a chief recovered from the journal of a job that had ended
            self._end(ending)

    # ------------------------------------------------------------ decisions

    def step(self, seen: Observed) -> list[str]:
        """Moves through the phases; returns the lines to log (empty when nothing changed)."""
        now = self._clock()
        if self.phase is Phase.RUNNING:
            ending = self._ending_of(seen)
            if ending is None:
                return []
            self._end(ending)
            drain = "until stopped" if math.isinf(self.drain_s) else f"for at most {self.drain_s:g}s"
            return [f"job {'finished' if ending.ok else 'FAILED'}: {ending.result}; the servers stay up {drain} "
                    f"(exit code {ending.exit_code})"]
        if self.phase is Phase.FINISHED:
            if seen.live_workers:
                self._no_workers_since = None
            elif self._no_workers_since is None:
                self._no_workers_since = now
            drained = now - self.ended_at >= self.drain_s
            quiet = self._no_workers_since is not None and now - self._no_workers_since >= self.quiet_s
            if drained or (quiet and not math.isinf(self.drain_s)):
                self.phase, self.closing_at = Phase.CLOSING, now
                why = "the drain is over" if drained else f"no worker left for {self.quiet_s:g}s"
                return [f"closing the job ({why}): every server exits now, then the chief"]
        return []

    def _ending_of(self, seen: Observed) -> Ending | None:
        if seen.stopped:
            return Ending(f"stopped: {seen.stopped}", EXIT_ROLLBACK)
        if not seen.finished:
            return None
        done = f"{seen.tasks_done}/{seen.tasks_total} tasks done"
        ck = seen.checkpoint
        if ck is None:
            return Ending(f"{done} (no checkpoints taken)")
        if ck.committed_step >= 0:
            return Ending(f"{done}, final checkpoint step {ck.committed_step}")
        if ck.failures >= FINAL_CHECKPOINT_ATTEMPTS:
            return Ending(f"{done} but the final checkpoint failed {ck.failures} times ({ck.error})",
                          EXIT_CHECKPOINT_FAILED)
        return None                  # waiting for the final checkpoint

    def _end(self, ending: Ending) -> None:
        self.phase, self.ending, self.ended_at = Phase.FINISHED, ending, self._clock()
        self._no_workers_since = None

    def fail(self, why: str, exit_code: int = EXIT_FAILED) -> list[str]:
        """The job ends as failed now (whatever phase it is in), for a reason outside :meth:`step`."""
        if self.phase is not Phase.RUNNING:
            return []
        self._end(Ending(why, exit_code))
        return [f"job FAILED: {why} (exit code {exit_code})"]

    def chief_may_exit(self, live_servers: int) -> bool:
        """In CLOSING: every server has left, or they had ``close_grace_s`` to."""
        return self.phase is Phase.CLOSING and (
            live_servers == 0 or self._clock() - self.closing_at >= self.close_grace_s)

    # ------------------------------------------------------------ reads

    @property
    def finished(self) -> bool:
        return self.phase is not Phase.RUNNING

    def drain_left_s(self) -> float:
        """Seconds until CLOSING at the latest (-1: until a signal; 0 once closing)."""
        if self.phase is Phase.RUNNING:
            return self.drain_s if not math.isinf(self.drain_s) else -1.0
        if self.phase is Phase.CLOSING:
            return 0.0
        if math.isinf(self.drain_s):
            return -1.0
        return max(0.0, self.ended_at + self.drain_s - self._clock())

    def ended_seconds_ago(self) -> float:
        return self._clock() - self.ended_at if self.finished else 0.0
