"""Edges of the chief's journal (chief/journal.py) that a cosmic-ray run left untested (bench/RESULTS.md, make mutate)."""
import json
import logging
import sqlite3

import pytest

from shoal.chief.journal import Journal, JournalError, JournalUnreadable


def _changes(clock: float) -> dict:
    """:meth:`ChiefState.take_changes` with only the clock moved: one 3-byte ``clock`` row (``"1.5"``)."""
    return {"whole": False, "clock": clock, "small": {}, "members_meta": {},
            "members": [], "steps": [], "tasks": []}


@pytest.mark.parametrize("compact_bytes", [20, 21])
def test_compaction_comes_when_the_changes_outgrow_compact_bytes_not_when_they_reach_it(tmp_path, compact_bytes):
    j = Journal(tmp_path / "chief.db", compact_bytes=compact_bytes)    # above the 13-byte snapshot: the bar
    snap = lambda: {"clock": 0.0}                           # noqa: E731
    j.append(_changes(0.5), "first", snap)                  # a process's first write is whole
    assert j.snapshots == 1
    outgrown = compact_bytes // 3 + 1                       # the first count of 3-byte changes over the bar
    for i in range(outgrown - 1):                           # 21 bytes reach 21 and outgrow 20; 18 reach neither
        j.append(_changes(i + 1.5), f"change {i}", snap)
    assert j.snapshots == 1 and j.writes == outgrown
    j.append(_changes(8.5), "outgrown", snap)              # 21 > 20, 24 > 21: compact
    assert j.snapshots == 2
    j.append(_changes(9.5), "counted afresh", snap)       # the changes count from 0 after it
    assert j.snapshots == 2
    j.close()


def test_a_process_first_write_is_whole_even_when_nothing_asks_for_it(tmp_path):
    """A restarted chief's clock is not the old one's, so its changes cannot follow the old snapshot."""
    path = tmp_path / "chief.db"
    snap = lambda: {"clock": 0.0}                           # noqa: E731
    for run in range(2):                                    # a new journal, then the same one reopened
        j = Journal(path)
        j.append(_changes(5.0), f"first of run {run}", snap)
        assert j.snapshots == 1
        j.append(_changes(6.0), f"second of run {run}", snap)
        assert j.snapshots == 1
        j.close()
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT count(*) FROM changes").fetchone()[0] == 1    # the first one's went


def test_a_journal_in_directories_not_made_yet_makes_them(tmp_path):
    path = tmp_path / "a" / "b" / "chief.db"
    j = Journal(path)
    j.write({"x": 1}, "first")
    j.close()
    again = Journal(path)
    assert again.load() == {"x": 1}
    again.close()


def test_a_journal_path_sqlite_cannot_open_is_refused_naming_the_file(tmp_path):
    (tmp_path / "chief.db").mkdir()                          # a directory where the file should be
    with pytest.raises(JournalUnreadable, match=f"chief journal {tmp_path / 'chief.db'} is unreadable"):
        Journal(tmp_path / "chief.db")


def test_starting_fresh_says_once_where_the_old_journal_went(tmp_path, caplog):
    path = tmp_path / "chief.db"
    j = Journal(path)
    j.write({"x": 1}, "first")
    j.close()                                                # the last close folds the -wal in and drops it
    with caplog.at_level(logging.WARNING, logger="shoal.chief.journal"):
        again = Journal(path, fresh=True)
    moved = [r for r in caplog.records if "moved the old journal" in r.getMessage()]
    assert len(moved) == 1 and f"{path}.bak" in moved[0].getMessage()
    assert again.load() is None and (tmp_path / "chief.db.bak").exists()
    again.close()


class _FailingEvents:
    """The journal's connection, except that the next event insert fails (a full disk, say)."""

    def __init__(self, db):
        self.db, self.fail = db, True

    def execute(self, sql, *args):
        if self.fail and sql.startswith("INSERT INTO events"):
            self.fail = False
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.db, name)


def test_after_a_failed_write_the_next_one_is_whole(tmp_path):
    """The changes a failed write held were taken from the state and are in no row: appending
    only the next ones would lose them after a reopen."""
    path = tmp_path / "chief.db"
    j = Journal(path)
    snap = lambda: {"clock": 0.0}                           # noqa: E731
    j.append(_changes(1.0), "first", snap)
    j._db = _FailingEvents(j._db)
    with pytest.raises(JournalError, match="disk is full"):
        j.append(_changes(2.0), "fails", snap)
    j.append(_changes(3.0), "after the failure", snap)
    assert j.snapshots == 2
    j.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM changes").fetchone()[0] == 0



def test_an_append_that_fails_before_it_writes_makes_the_next_write_whole(tmp_path):
    """Changes that cannot be serialized were still taken from the state: the next write must be a
    snapshot, or a reopened journal replays the later changes without them."""
    path = tmp_path / "chief.db"
    j = Journal(path)
    snap = lambda: {"clock": 0.0}                           # noqa: E731
    j.append(_changes(1.0), "first", snap)
    bad = {**_changes(2.0), "members": [{"id": "w", "seen": object()}]}
    with pytest.raises(TypeError):
        j.append(bad, "cannot be serialized", snap)
    j.append(_changes(3.0), "after it", snap)
    assert j.snapshots == 2
    j.close()

def test_the_journal_flags_are_keyword_only(tmp_path):
    """A stray positional True must not mean fresh=True, which moves the job's state aside."""
    path = tmp_path / "chief.db"
    with pytest.raises(TypeError):
        Journal(path, True)
    assert not path.exists()
    Journal(path=path).close()


def test_the_event_log_keeps_the_last_1000_to_1099_events_pruned_every_100_writes(tmp_path):
    """docs/architecture.md: a bounded event log of the last 1000 to 1100 events, pruned every 100
    writes (the defaults the chief runs with): never fewer than the newest 1000, the oldest dropped
    100 at a time."""
    j = Journal(tmp_path / "chief.db", synchronous="OFF")
    for i in range(1, 1201):
        j.write({"n": i}, f"event {i}")
        if i in (1000, 1099, 1100, 1199, 1200):
            first = max(1, i // 100 * 100 - 999)
            assert [e for _, e in j.events(5000)] == [f"event {k}" for k in range(first, i + 1)], i
    j.close()


def test_with_the_defaults_changes_are_compacted_once_they_outgrow_one_mib(tmp_path):
    """docs/architecture.md: a write is a whole snapshot when the changes since the last one outgrow
    it, 1 MiB at least (``compact_bytes``' default)."""
    j = Journal(tmp_path / "chief.db", synchronous="OFF")
    snap = lambda: {"clock": 0.0}                           # noqa: E731  (13 bytes)
    j.append(_changes(0.5), "first", snap)                  # a process's first write is whole
    n = (1 << 20) - len("1.5") - len('[""]')                # the clock row and a tasks row: 1 MiB in all
    j.append({**_changes(1.5), "tasks": ["x" * n]}, "a MiB of changes", snap)
    assert (j.snapshots, j.writes) == (1, 2)                # 1 MiB reaches the bar, does not outgrow it
    j.append(_changes(2.5), "3 bytes more", snap)
    assert (j.snapshots, j.writes) == (2, 3)
    j.close()


@pytest.mark.parametrize("kind,body", [
    ("members", [{"role": "worker"}]),              # a member row without its id: KeyError
    ("steps", 5),                                   # not pairs: TypeError
    ("small", [{}]),                                # not [small, members_meta]: ValueError
])
def test_a_change_that_does_not_fit_the_snapshot_is_unreadable_naming_the_file(tmp_path, kind, body):
    path = tmp_path / "chief.db"
    j = Journal(path)
    j.write({"clock": 0.0, "members": {"members": []}, "step_seconds": {}}, "snapshot")
    j.close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO changes (kind, body) VALUES (?, ?)", (kind, json.dumps(body)))
    again = Journal(path)
    with pytest.raises(JournalUnreadable, match=f"chief journal {path} is unreadable"):
        again.load()
    again.close()


@pytest.mark.parametrize("op", [
    ["take", "worker-0", 1],                        # no dataset configured: FailedPrecondition
    ["complete", "worker-0", 7],                    # a task nobody holds: InvalidArgument
    ["configure", {"size": 1}],                     # not a dataset: TypeError
])
def test_a_task_op_that_does_not_fit_the_queue_is_unreadable_naming_the_file(tmp_path, op):
    """Only a corrupt journal holds such an op; the chief must say so ("unreadable, move it away or
    --fresh"), not stop on the queue's own error."""
    from shoal.chief.state import ChiefState
    from shoal.settings.config import JobConfig

    path = tmp_path / "chief.db"
    j = Journal(path)
    j.write(ChiefState(JobConfig(num_shards=1), lambda: 0.0).journal_snapshot(), "snapshot")
    j.close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO changes (kind, body) VALUES (?, ?)", ("tasks", json.dumps([op])))
    again = Journal(path)
    with pytest.raises(JournalUnreadable, match=f"chief journal {path} is unreadable"):
        again.load()
    again.close()


class _Locked(_FailingEvents):
    """The journal's connection, except that the next write cannot start: another connection holds
    the database's write lock past the busy timeout. No transaction is open, so ROLLBACK fails too."""

    def execute(self, sql, *args):
        if self.fail and sql == "BEGIN IMMEDIATE":
            self.fail = False
            raise sqlite3.OperationalError("database is locked")
        return self.db.execute(sql, *args)


def test_a_write_that_cannot_start_is_a_journal_error_and_the_next_write_is_whole(tmp_path):
    j = Journal(tmp_path / "chief.db")
    snap = lambda: {"clock": 0.0}                           # noqa: E731
    j.append(_changes(1.0), "first", snap)
    j._db = _Locked(j._db)
    with pytest.raises(JournalError, match="cannot write the chief journal .*database is locked"):
        j.append(_changes(2.0), "locked out", snap)
    j.append(_changes(3.0), "after it", snap)
    assert (j.snapshots, j.writes) == (2, 2)
    j.close()


class _FailingCommit(_FailingEvents):
    """The journal's connection, except that the next COMMIT fails with ``code``; with ``rolled_back``
    SQLite has rolled the transaction back by itself first (as it may on a full disk or an I/O error)."""

    def __init__(self, db, code, rolled_back):
        super().__init__(db)
        self.code, self.rolled_back = code, rolled_back

    def execute(self, sql, *args):
        if self.fail and sql == "COMMIT":
            self.fail = False
            if self.rolled_back:
                self.db.execute("ROLLBACK")
            exc = sqlite3.OperationalError("commit failed")
            exc.sqlite_errorcode = self.code
            raise exc
        return self.db.execute(sql, *args)


@pytest.mark.parametrize("code,rolled_back", [
    (sqlite3.SQLITE_FULL, True),                    # a full disk: rolled back, out of the transaction
    (sqlite3.SQLITE_INTERRUPT, False),              # interrupted before it landed: still in the transaction
])
def test_a_commit_that_did_not_land_is_a_failed_write(tmp_path, code, rolled_back):
    """Only an interrupt reported after the transaction is done counts as written
    (test_journal_changes.py); any other failed COMMIT is a JournalError, and the next write is whole."""
    path = tmp_path / "chief.db"
    j = Journal(path)
    snap = lambda: {"clock": 0.0}                           # noqa: E731
    j.append(_changes(1.0), "first", snap)
    j._db = _FailingCommit(j._db, code, rolled_back)
    with pytest.raises(JournalError, match="commit failed"):
        j.append(_changes(2.0), "does not land", snap)
    assert j.writes == 1
    j.append(_changes(3.0), "after it", snap)
    assert (j.snapshots, j.writes) == (2, 2)
    j.close()
