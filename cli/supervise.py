"""When ``shoal local`` restarts a role that exited, and when it gives up on the run.

A crash (a traceback's exit 1, an unreachable peer's 69) or a signal (SIGKILL by
the OOM killer, a preempted process) is worth a restart with backoff. Some exits
are not, because the role would fail the same way again: ``EXIT_REFUSED`` (78: a
refused model, credentials the job does not take, a journal it cannot read),
``EXIT_USAGE`` (2: bad settings), and the same non-zero exit twice in a row each
within ``crash_loop_s`` of the role's start (a crash loop). A worker (the user's
script) that fails the same way twice in a row is not restarted again, however
long each run lasted: the same exception type raised at the same line of its
traceback, or, without a traceback, the same exit code (a bug at step 10 fails
at step 10 every time; restarting it only spreads the crash over minutes); so
is a worker whose traceback is one another worker of the job failed with. For
those the run fails at once with the role's last lines, instead of restarting
it for minutes.

The decisions are a function of (exit, start time, now), driven by tests
without processes; :class:`shoal.cli.local.LocalCluster` applies them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from shoal.errors import EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE

FINAL_EXITS = {EXIT_REFUSED: "refused for good", EXIT_USAGE: "bad settings"}


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float = 0.0
    why: str = ""            # for a role that is not restarted: why not
    fatal: bool = False      # the role would fail the same way again: the run fails now


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)?)(:|$)")


def failure_signature(code: int, lines: Iterable[str]) -> str:
    """How a process failed, to tell the same failure twice: the exception type and the innermost
    ``File "...", line N`` of the last traceback in its output; without one, its exit code."""
    lines = [line.rstrip() for line in lines]
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                default=-1)
    if start >= 0:
        frames = [m for m in (_FRAME.match(line) for line in lines[start:]) if m]
        after = [line for line in lines[start + 1:] if line and not line.startswith(" ")]
        kind = next((m.group("type") for m in (_EXCEPTION.match(line) for line in reversed(after)) if m), "")
        if frames and kind:
            where = frames[-1]
            return f"{kind} at {where.group('file')}:{where.group('line')}"
    return f"exit {code}"


def traceback_tail(lines: Iterable[str], n: int = 4) -> str:
    """The last ``n`` lines of the last traceback in ``lines`` (where and what), else the last line."""
    lines = [line.rstrip() for line in lines if line.strip()]
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                default=-1)
    tail = lines[start + 1:][-n:] if start >= 0 else lines[-1:]
    return "\n".join(tail)


class RestartPolicy:
    """Per role: restart with backoff (``backoff_s`` doubling, at most ``max_backoff_s``), or give up."""

    def __init__(self, enabled: bool = True, max_restarts: int = 10, backoff_s: float = 1.0,
                 max_backoff_s: float = 15.0, crash_loop_s: float = 30.0):
        self.enabled = enabled
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.crash_loop_s = crash_loop_s
        self.restarts: dict[str, int] = {}
        self._quick: dict[str, int] = {}      # role -> its last exit code, if that came soon after its start
        self._failed: dict[str, str] = {}     # worker -> how its last run failed (failure_signature)
        self._tracebacks: dict[str, str] = {}  # a traceback's signature -> the worker that failed with it first

    def on_exit(self, name: str, code: int, started: float, now: float, signature: str = "") -> Decision:
        """``code``: the exit status (negative: killed by that signal); ``started``: when this run of the role
        began; ``signature``: how it failed (:func:`failure_signature`; a worker's only)."""
        quick = now - started < self.crash_loop_s
        previous = self._quick.pop(name, None)
        if quick and code > 0:
            self._quick[name] = code
        same = self._failed.pop(name, None)
        if signature and code > 0 and code != EXIT_UNREACHABLE:    # an unreachable peer may come back
            self._failed[name] = signature
        if code in FINAL_EXITS:
            return Decision(False, why=f"exit {code}: {FINAL_EXITS[code]}", fatal=True)
        if code > 0 and quick and previous == code:
            return Decision(False, why=f"exit {code} twice in a row, each within {self.crash_loop_s:g}s of "
                                       f"starting: a crash loop", fatal=True)
        if signature and code > 0 and same == signature:
            return Decision(False, why=f"failed the same way twice in a row ({signature}): a bug, not a "
                                       f"transient failure", fatal=True)
        first = self._tracebacks.setdefault(signature, name) if not signature.startswith("exit ") else name
        if signature and code > 0 and first != name:     # two workers of one script, one traceback: a bug
            return Decision(False, why=f"failed the same way as {first} ({signature}): a bug, not a transient "
                                       f"failure", fatal=True)
        if not self.enabled:
            return Decision(False, why="--no-restart")
        n = self.restarts.get(name, 0)
        if n >= self.max_restarts:
            return Decision(False, why=f"restarted {n} times already")
        return Decision(True, min(self.max_backoff_s, self.backoff_s * (2 ** n)))

    def restarted(self, name: str) -> int:
        self.restarts[name] = self.restarts.get(name, 0) + 1
        return self.restarts[name]


def job_data_done(chief_address: str) -> bool:
    """Whether the chief counts every data task of the job done (False when it cannot be asked): a worker
    that fails then has trained its share, and the job's end does not wait on it."""
    import grpc

    from shoal.proto import shoal_pb2 as pb
    from shoal.proto import shoal_pb2_grpc as pb_grpc
    from shoal.net.rpc import open_channel

    try:
        channel = open_channel(chief_address)
        try:
            stats = pb_grpc.ChiefStub(channel).GetJobStats(pb.Empty(), timeout=5)
        finally:
            channel.close()
    except grpc.RpcError:
        return False
    return stats.tasks_total > 0 and stats.tasks_done >= stats.tasks_total


def stopped_in_journal(path: Path) -> bool:
    """Whether a dead chief's journal says it had stopped the job (a shard lost every copy). Killed after
    it stopped the job and before it exited to say so (EXIT_ROLLBACK), it left every other role on the
    state the job lost: restarting the chief alone would carry on with them (bench/nemesis.py --netns,
    seed 703), so the supervisor rolls back instead."""
    from shoal.chief.journal import Journal, JournalError

    if not path.exists():
        return False
    try:
        journal = Journal(path)
    except JournalError:
        return False                      # the restarted chief says why
    try:
        return bool((journal.load() or {}).get("stopped"))
    except JournalError:
        return False
    finally:
        journal.close()
