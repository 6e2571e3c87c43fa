"""The chief's journal: its whole state in SQLite, so a chief that dies comes back where it was.

One row holds a :meth:`ChiefState.to_dict` snapshot as JSON; a write appends
only what changed since the last one (:meth:`ChiefState.take_changes`: the
members whose rows changed, the task queue's calls, the small parts when they
differ) to a ``changes`` table, and :meth:`Journal.load` replays them on the
snapshot. So a write costs what changed, not the size of the cluster. A write
is a whole snapshot instead (and the changes are deleted) on a process's first
write (rows hold times of the chief's own clock, which a restart does not keep)
and when the changes since the snapshot outgrow it (at least ``compact_bytes``):
compaction now and then, amortized to a constant per change. Every write also
appends a line to a bounded event log (the last ``keep_events`` events with
timestamps, for debugging), all in one transaction.
The database runs in WAL mode with ``synchronous=NORMAL``: a write is in the
WAL before the chief replies, so a reply a member has seen survives a crash of
the chief process (a host power loss may lose the last writes; pass
``synchronous="FULL"`` to pay an fsync per write for that). NORMAL was chosen
because fsyncs under the chief's lock held up heartbeats on a loaded host
long enough for leases to lapse.

A journal that cannot be read is an error naming the file, never an empty
start: losing the job's state silently is worse than refusing to start
(``fresh=True``, ``shoal chief --fresh``, moves it aside and starts over).
"""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable

import grpc

from shoal.chief.membership import Membership
from shoal.chief.tasks import TaskQueue
from shoal.errors import EXIT_REFUSED, ShoalError

log = logging.getLogger(__name__)

SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshot (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    written_at REAL NOT NULL,
    writes INTEGER NOT NULL,
    state TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    event TEXT NOT NULL
);
"""



def _owner_only(path: Path) -> None:
    """Creates the journal (or takes the one there) readable and writable by its owner only (0600), its
    -wal and -shm too (SQLite gives those the database file's mode when it creates them)."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for suffix in ("", "-wal", "-shm"):
        p = Path(f"{path}{suffix}")
        if p.exists():
            os.chmod(p, 0o600)

class JournalError(ShoalError):
    """The journal cannot be read or written (retryable for clients: the chief restarts from it)."""

    code = grpc.StatusCode.UNAVAILABLE


class JournalUnreadable(JournalError):
    """The journal exists but cannot be read: a restarted chief would fail the same way every time,
    so the process exits ``EXIT_REFUSED`` and a supervisor does not restart it."""

    exit_code = EXIT_REFUSED


class Journal:
    # how large the last snapshot and the changes appended since are (compaction's measure): set by every
    # snapshot, and a process's first write is always one (``_need_snapshot`` starts true)
    _snapshot_bytes: int
    _change_bytes: int

    def __init__(self, path: str | os.PathLike, *, fresh: bool = False, synchronous: str = "NORMAL",
                 keep_events: int = 1000, compact_bytes: int = 1 << 20):
        if synchronous.upper() not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {', '.join(SYNCHRONOUS)}, got {synchronous!r}")
        self.path = Path(path)
        self.keep_events = keep_events
        self.compact_bytes = compact_bytes
        self.snapshots = 0              # writes that were whole snapshots (the rest appended changes)
        self._need_snapshot = True      # this process's first write is whole: see the module's docstring
        self._last_small = ""
        self.writes = 0
        self._lock = threading.Lock()
        if fresh:
            self._move_aside()
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _owner_only(self.path)       # it holds the job's signing secret: no other user reads it
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
        except (sqlite3.Error, OSError) as exc:
            raise self._unreadable(exc) from exc
        try:
            (mode,) = self._db.execute("PRAGMA journal_mode=WAL").fetchone()
            if mode.lower() != "wal":
                raise sqlite3.DatabaseError(f"journal_mode is {mode}, not wal")
            self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
            (check,) = self._db.execute("PRAGMA quick_check").fetchone()
            if check != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check}")
            self._db.executescript(_SCHEMA)
            (self._total_writes,) = self._db.execute("SELECT writes FROM snapshot WHERE id = 1").fetchone() or (0,)
        except sqlite3.Error as exc:
            self._db.close()
            raise self._unreadable(exc) from exc

    def _unreadable(self, exc: Exception) -> JournalError:
        return _unreadable(self.path, exc)

    def _move_aside(self) -> None:
        """``chief.db`` (and its -wal/-shm/.job) -> ``chief.db.bak`` (and ``chief.db.bak-wal``...), for a look later."""
        for suffix in ("", "-wal", "-shm", ".job"):     # .job: the job's marker (chief/identity.py)
            src = Path(f"{self.path}{suffix}")
            if src.exists():
                src.replace(f"{self.path}.bak{suffix}")
                if not suffix:
                    log.warning("starting fresh: moved the old journal %s to %s.bak", self.path, self.path)

    def load(self) -> dict | None:
        """The latest state (the snapshot with the changes since replayed on it), or None for a new
        journal. Raises JournalError if it cannot be read."""
        with self._lock:
            try:
                row = self._db.execute("SELECT state FROM snapshot WHERE id = 1").fetchone()
                changes = self._db.execute("SELECT kind, body FROM changes ORDER BY seq").fetchall()
            except sqlite3.Error as exc:
                raise self._unreadable(exc) from exc
        return _decode(self.path, row, changes)

    def write(self, state: dict, event: str) -> None:
        """Replaces the snapshot (and the changes since) and logs ``event``, atomically and durably
        (before the caller replies)."""
        self._write(event, snapshot=json.dumps(state, separators=(",", ":")))
        self._need_snapshot = "clock" not in state      # changes apply only to a snapshot that has one

    def append(self, changes: dict, event: str, snapshot: Callable[[], dict]) -> None:
        """Journals :meth:`ChiefState.take_changes` (``changes``) and logs ``event``, atomically and
        durably; or, when it is time to compact, ``snapshot()`` (:meth:`ChiefState.journal_snapshot`)."""
        try:
            small = json.dumps([changes["small"], changes["members_meta"]], separators=(",", ":"))
            rows = [("clock", json.dumps(changes["clock"]))]
            if small != self._last_small:
                rows.append(("small", small))
            for kind in ("members", "steps", "tasks"):
                if changes[kind]:
                    rows.append((kind, json.dumps(changes[kind], separators=(",", ":"))))
        except BaseException:
            self._need_snapshot = True      # the changes were taken from the state and are in no row
            raise
        size = sum(len(body) for _, body in rows)
        if changes["whole"] or self._need_snapshot or self._change_bytes + size > max(self.compact_bytes, self._snapshot_bytes):
            self.write(snapshot(), event)
        else:
            self._write(event, rows=rows)
        self._last_small = small

    def _write(self, event: str, snapshot: str | None = None, rows: list[tuple[str, str]] = ()) -> None:
        """One transaction: the whole ``snapshot`` (the changes since deleted), or else the change ``rows``
        appended; and ``event``."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                now = time.time()
                self._total_writes += 1
                if snapshot is not None:
                    self._db.execute("INSERT OR REPLACE INTO snapshot (id, written_at, writes, state) "
                                     "VALUES (1, ?, ?, ?)", (now, self._total_writes, snapshot))
                    self._db.execute("DELETE FROM changes")
                else:
                    self._db.executemany("INSERT INTO changes (kind, body) VALUES (?, ?)", rows)
                cur = self._db.execute("INSERT INTO events (at, event) VALUES (?, ?)", (now, event))
                if cur.lastrowid % 100 == 0:
                    self._db.execute("DELETE FROM events WHERE seq <= ?", (cur.lastrowid - self.keep_events,))
                self._commit()
            except sqlite3.Error as exc:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                self._need_snapshot = True     # what the failed write held is in no row: start over whole
                raise JournalError(f"cannot write the chief journal {self.path}: {_one_line(exc)}") from exc
        if snapshot is not None:
            self.snapshots += 1
            self._snapshot_bytes, self._change_bytes = len(snapshot), 0
        else:
            self._change_bytes += sum(len(body) for _, body in rows)
        self.writes += 1

    def _commit(self) -> None:
        """COMMIT. SQLite can report SQLITE_INTERRUPT for a COMMIT that did commit (it runs the progress
        handler once more after the transaction is done): a connection out of its transaction then says
        the write landed, and it counts as written, not failed. Any other error (a full disk, an I/O
        error) may have rolled the transaction back by itself, so it stays a failure."""
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            if self._db.in_transaction or exc.sqlite_errorcode != sqlite3.SQLITE_INTERRUPT:
                raise

    def events(self, limit: int) -> list[tuple[float, str]]:
        """The newest ``limit`` events, oldest first: ``(unix time, text)``."""
        with self._lock:
            rows = self._db.execute("SELECT at, event FROM events ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        return rows[::-1]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def read_state(path: str | os.PathLike) -> dict | None:
    """The journaled state, opened read-only (by another process, e.g. ``shoal export``, while the chief
    may be running), or None for a journal that holds none. Errors are one :class:`JournalUnreadable` line."""
    path = Path(path)
    if not path.is_file():
        raise JournalUnreadable(f"chief journal {path} does not exist")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5.0)
        try:
            row = db.execute("SELECT state FROM snapshot WHERE id = 1").fetchone()
            changes = db.execute("SELECT kind, body FROM changes ORDER BY seq").fetchall()
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise _unreadable(path, exc) from exc
    return _decode(path, row, changes)


def _unreadable(path: Path, exc: Exception) -> JournalUnreadable:
    return JournalUnreadable(f"chief journal {path} is unreadable or corrupt ({_one_line(exc)}); "
                             f"move it away or pass --fresh to start the job over")


def _one_line(exc: Exception) -> str:
    """An error's text on one line (SQLite's integrity reports and JSON errors can span several)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _decode(path: Path, row, changes: list) -> dict | None:
    """The snapshot ``row`` with the ``changes`` rows replayed on it (None: no snapshot yet)."""
    if row is None:
        return None
    try:
        (text,) = row
        state = json.loads(text)
        if not isinstance(state, dict):
            raise ValueError(f"snapshot is a {type(state).__name__}, not an object")
        return replay(state, [(kind, json.loads(body)) for kind, body in changes])
    except (ValueError, KeyError, TypeError, IndexError, ShoalError) as exc:
        # ShoalError: a task op the queue refuses (a task nobody holds, no dataset): only a corrupt
        # journal holds one
        raise _unreadable(path, exc) from exc


def replay(state: dict, changes: list[tuple[str, object]]) -> dict:
    """The snapshot ``state`` with the journal's ``changes`` (kind, body) applied in order: the state
    as :meth:`ChiefState.to_dict` gave it at the last write, times relative to that write."""
    base = state.pop("clock", None)
    if not changes:
        return state
    now = base
    members = {e["member_id"]: e for e in state["members"]["members"]}
    changed: dict[str, dict] = {}
    ops: list = []
    for kind, body in changes:
        if kind == "clock":
            now = body
        elif kind == "small":
            small, members_meta = body
            state.update(small)
            state["members"].update(members_meta)
        elif kind == "members":
            for row in body:
                members[row["member_id"]] = changed[row["member_id"]] = row
        elif kind == "steps":
            state["step_seconds"].update((k, v) for k, v in body)
        elif kind == "tasks":
            ops.extend(body)
        else:
            raise ValueError(f"unknown change {kind!r}")
    if base is None:
        raise ValueError("changes follow a snapshot without its clock")
    moved = now - base
    for mid, e in members.items():
        if mid in changed:
            members[mid] = Membership.entry_from_row(e, now)
        elif moved:
            members[mid] = {**e, "joined_ago": e["joined_ago"] + moved, "lease_left": e["lease_left"] - moved}
    state["members"]["members"] = list(members.values())
    if ops:
        q = TaskQueue.from_dict(state["tasks"])
        q.replay(ops)
        state["tasks"] = q.to_dict()
    return state
