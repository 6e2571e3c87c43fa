"""Edges of the chief's journal (chief/journal.py) that a cosmic-ray run left untested (bench/RESULTS.md, make mutate)."""
import logging

import pytest

from shoal.chief.journal import Journal, JournalUnreadable


def _changes(clock: float) -> dict:
    """:meth:`ChiefState.take_changes` with only the clock moved: one 3-byte ``clock`` row (``"1.5"``)."""
    return {"whole": False, "clock": clock, "small": {}, "members_meta": {},
            "members": [], "steps": [], "tasks": []}


def test_compaction_comes_when_the_changes_outgrow_compact_bytes_not_when_they_reach_it(tmp_path):
    j = Journal(tmp_path / "chief.db", compact_bytes=21)    # above the 13-byte snapshot, so 21 is the bar
    snap = lambda: {"clock": 0.0}                           # noqa: E731
    j.append(_changes(0.5), "first", snap)                  # a process's first write is whole
    assert j.snapshots == 1
    for i in range(7):                                      # 7 x 3 bytes = 21: reached, not outgrown
        j.append(_changes(i + 1.5), f"change {i}", snap)
    assert j.snapshots == 1 and j.writes == 8
    j.append(_changes(8.5), "outgrown", snap)               # 24 > 21: compact
    assert j.snapshots == 2
    j.close()


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
