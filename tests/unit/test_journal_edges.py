"""Edges of the chief's journal (chief/journal.py) that mutation testing found untested."""
import sqlite3

import pytest

from shoal.chief.journal import Journal, JournalUnreadable


def test_a_journal_whose_tables_go_bad_after_it_opened_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "chief.db"
    j = Journal(path)
    j.write({"x": 1}, "first")
    other = sqlite3.connect(path)
    other.execute("DROP TABLE changes")        # another process (or a bad disk) spoiled it under the chief
    other.commit()
    other.close()
    with pytest.raises(JournalUnreadable, match=str(path)):
        j.load()
    j.close()


def test_the_snapshot_counts_every_write_across_restarts(tmp_path):
    path = tmp_path / "chief.db"
    j = Journal(path)
    for i in range(3):
        j.write({"x": i}, f"write {i}")
    j.close()
    j = Journal(path)
    assert j.writes == 0                       # this process's own count
    j.write({"x": 3}, "after a restart")
    j.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT writes FROM snapshot WHERE id = 1").fetchone()[0] == 4
