"""The chief's journal holds the job's signing secret: it is created 0600 (its -wal and -shm too) in a
directory it creates 0700, and a journal left readable by others is made private when it is opened."""
import os
import stat

import pytest

from shoal.chief.journal import Journal, JournalUnreadable


def mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_a_new_journal_is_readable_by_its_owner_only(tmp_path):
    old = os.umask(0o022)                       # a common umask: 0644 files, 0755 directories
    try:
        path = tmp_path / "run" / "chief.db"
        j = Journal(path)
        j.write({"secret": "s"}, "first")
        for p in (path, f"{path}-wal", f"{path}-shm"):
            assert mode(p) == 0o600, p
        assert mode(path.parent) == 0o700
        j.close()
    finally:
        os.umask(old)


def test_a_journal_left_readable_is_made_private(tmp_path):
    path = tmp_path / "chief.db"
    Journal(path).close()
    os.chmod(path, 0o644)
    Journal(path).close()
    assert mode(path) == 0o600


def test_a_journal_that_cannot_be_created_is_one_refusal_naming_it(tmp_path):
    with pytest.raises(JournalUnreadable, match="/proc/x"):
        Journal("/proc/x/chief.db")
