"""A primary killed around its new backup's first copy (issue 20), shared by bench/pauses.py and the nemesis.

SIGKILL one ps; its supervisor (``shoal local``) restarts it, and the restart joins as the backup of every
shard, all of which the other ps now holds as primary. Then SIGKILL that other ps, the primary of them all:

- ``before``: as soon as the restart is in pids.json (it has not joined yet, so no copy has started);
- ``during``: once its primary logs ``sending it a copy`` (after the first kill);
- ``after``: once the chief has logged ``holds a whole copy`` for every shard (after the first kill), and
  has not since logged ``no longer holds a whole copy`` for it.
"""
from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

POINTS = ("before", "during", "after")


_WHOLE = re.compile(r"shard (\d+): backup \S+ (no longer )?holds a whole copy")


def whole_shards(text: str) -> int:
    """How many shards the chief's log last called whole (a later ``no longer holds`` line undoes one)."""
    latest = {m[1]: not m[2] for m in _WHOLE.finditer(text)}
    return sum(latest.values())


class NotReached(RuntimeError):
    """The job ended, or the wait ran out, before the kill point."""


def wait_for(what: str, cond: Callable[[], bool], running: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if not running():
            raise NotReached(f"the job ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise NotReached(f"no {what} within {timeout_s:.0f}s")
        time.sleep(0.01)


def _kill(pid: int | None) -> bool:
    """SIGKILLs ``pid``; false when there is none or it is already gone."""
    if not pid:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def kill_around_install(point: str, pids: Callable[[], dict], log: Path, running: Callable[[], bool],
                        first: str = "ps0", shards: int = 2, timeout_s: float = 120.0,
                        note: Callable[[str], None] = lambda _: None) -> None:
    """Kills ``first``, waits for its restart, then kills the other ps at ``point`` (one of POINTS).

    ``pids()`` reads the run's pids.json (role -> pid; a missing role is None), ``log`` is ``shoal local``'s
    output, ``running()`` is false once the job ended. Raises NotReached when the point is never reached
    (then the second kill is not made)."""
    if point not in POINTS:
        raise ValueError(f"point {point!r}: one of {POINTS}")
    second = "ps1" if first == "ps0" else "ps0"
    since = _Tail(log)                                  # the log after the first kill
    victim = pids().get(first)
    note(f"install_kill: SIGKILL {first} ({victim})" + ("" if _kill(victim) else ": already gone"))
    wait_for(f"{first}'s restart", lambda: pids().get(first) not in (None, victim), running, timeout_s)
    if point == "during":
        wait_for("a copy to start", lambda: "sending it a copy" in since(), running, timeout_s)
    elif point == "after":
        wait_for("every copy to be reported whole", lambda: whole_shards(since()) >= shards,
                 running, timeout_s)
    primary = pids().get(second)
    killed = _kill(primary)
    # the copy of a small model takes milliseconds: "during" may land after it on a loaded host; say which
    whole = whole_shards(since())
    note(f"install_kill: SIGKILL {second} ({primary}) {point} {first}'s copy (restarted as {pids().get(first)}; "
         f"{whole} of {shards} copies reported whole by then)" + ("" if killed else ": already gone"))


class _Tail:
    """What a growing log file holds past its size at creation (read incrementally)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.text = path, (path.stat().st_size if path.exists() else 0), ""

    def __call__(self) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.text
        self.offset += len(data)
        self.text += data.decode(errors="replace")
        return self.text
