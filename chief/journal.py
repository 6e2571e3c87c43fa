"""The chief's journal: its whole state in SQLite, so a chief that dies comes back where it was.

One row holds the newest :meth:`ChiefState.to_dict` snapshot as JSON; every
write replaces it and appends a line to a bounded event log (the last
``keep_events`` events with timestamps, for debugging), in one transaction.
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

import grpc

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
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    event TEXT NOT NULL
);
"""


class JournalError(ShoalError):
    """The journal cannot be read or written (retryable for clients: the chief restarts from it)."""

    code = grpc.StatusCode.UNAVAILABLE


class JournalUnreadable(JournalError):
    """The journal exists but cannot be read: a restarted chief would fail the same way every time,
    so the process exits ``EXIT_REFUSED`` and a supervisor does not restart it."""

    exit_code = EXIT_REFUSED


class Journal:
    def __init__(self, path: str | os.PathLike, *, fresh: bool = False, synchronous: str = "NORMAL",
                 keep_events: int = 1000):
        if synchronous.upper() not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {', '.join(SYNCHRONOUS)}, got {synchronous!r}")
        self.path = Path(path)
        self.keep_events = keep_events
        self.writes = 0
        self.write_seconds = 0.0
        self._lock = threading.Lock()
        if fresh:
            self._move_aside()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
        except sqlite3.Error as exc:
            raise self._unreadable(exc) from exc
        try:
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise sqlite3.DatabaseError(f"journal_mode is {mode}, not wal")
            self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
            check = self._db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check}")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT writes FROM snapshot WHERE id = 1").fetchone()
        except sqlite3.Error as exc:
            self._db.close()
            raise self._unreadable(exc) from exc
        self._total_writes = row[0] if row else 0

    def _unreadable(self, exc: Exception) -> JournalError:
        return JournalUnreadable(f"chief journal {self.path} is unreadable or corrupt ({exc}); "
                            f"move it away or pass --fresh to start the job over")

    def _move_aside(self) -> None:
        """``chief.db`` (and its -wal/-shm) -> ``chief.db.bak`` (and ``chief.db.bak-wal``...), for a look later."""
        for suffix in ("", "-wal", "-shm"):
            src = Path(f"{self.path}{suffix}")
            if src.exists():
                src.replace(f"{self.path}.bak{suffix}")
                if not suffix:
                    log.warning("starting fresh: moved the old journal %s to %s.bak", self.path, self.path)

    def load(self) -> dict | None:
        """The latest snapshot, or None for a new journal. Raises JournalError if it cannot be read."""
        with self._lock:
            try:
                row = self._db.execute("SELECT state FROM snapshot WHERE id = 1").fetchone()
            except sqlite3.Error as exc:
                raise self._unreadable(exc) from exc
        if row is None:
            return None
        try:
            state = json.loads(row[0])
        except ValueError as exc:
            raise self._unreadable(exc) from exc
        if not isinstance(state, dict):
            raise self._unreadable(ValueError(f"snapshot is a {type(state).__name__}, not an object"))
        return state

    def write(self, state: dict, event: str) -> None:
        """Replaces the snapshot and logs ``event``, atomically and durably (before the caller replies)."""
        text = json.dumps(state, separators=(",", ":"))
        t0 = time.perf_counter()
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                now = time.time()
                self._total_writes += 1
                self._db.execute("INSERT OR REPLACE INTO snapshot (id, written_at, writes, state) VALUES (1, ?, ?, ?)",
                                 (now, self._total_writes, text))
                cur = self._db.execute("INSERT INTO events (at, event) VALUES (?, ?)", (now, event))
                if cur.lastrowid % 100 == 0:
                    self._db.execute("DELETE FROM events WHERE seq <= ?", (cur.lastrowid - self.keep_events,))
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                raise JournalError(f"cannot write the chief journal {self.path}: {exc}") from exc
        self.writes += 1
        self.write_seconds += time.perf_counter() - t0

    def events(self, limit: int = 50) -> list[tuple[float, str]]:
        """The newest ``limit`` events, oldest first: ``(unix time, text)``."""
        with self._lock:
            rows = self._db.execute("SELECT at, event FROM events ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        return rows[::-1]

    def close(self) -> None:
        with self._lock:
            self._db.close()
