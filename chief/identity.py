"""Who a job is: its id, made once by its first chief, and the generation of the chief that serves it.

The id lives in the chief's journal (``ChiefState.job_id``) and in every view the chief publishes;
members hold it from their first join. A chief recovered from the journal is the next generation of
the same job. A chief with no journal, or an empty one, is a new job with a new id: members of the
old job refuse it (``shoal/chief_client.py``) instead of following it or ignoring it.

A marker file beside the journal (``chief.db.job``) says that a job was journaled at that path. A
chief that finds the marker but no journal (deleted, emptied, a volume that came back blank) refuses
to start: the job's state is lost, and starting a new job over it silently is what etcd and ZooKeeper
refuse too (a member whose data directory vanished does not rejoin as a blank one). ``--fresh`` moves
both aside and starts over. Where the marker is gone with the journal (the whole run directory wiped),
the old job's members tell the chief: their join names a job it does not know (``foreign``).
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from shoal.chief.journal import JournalUnreadable
from shoal.errors import Refused

MARKER_SUFFIX = ".job"


def new_job_id() -> str:
    """A fresh job id: ``job-`` and 8 random hex digits (short enough for a log line, 2^32 apart)."""
    return f"job-{secrets.token_hex(4)}"


class JournalLost(JournalUnreadable):
    """A journal that held a job is gone or empty: the chief refuses to start a new job over it
    (``EXIT_REFUSED``); ``--fresh`` starts over on purpose."""


class ForeignJob(Refused):
    """A member of another job reached this chief (it lost its journal, or the member is stray)."""


def marker_path(journal: str | os.PathLike) -> Path:
    return Path(f"{journal}{MARKER_SUFFIX}")


def read_marker(journal: str | os.PathLike) -> dict | None:
    """The job the marker beside ``journal`` names (``{"job_id", "generation"}``), None without one.
    An unreadable marker is a :class:`JournalUnreadable` naming it."""
    path = marker_path(journal)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JournalUnreadable(f"cannot read the job marker {path} ({exc.strerror}); move it away or pass "
                                f"--fresh to start the job over") from exc
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or not isinstance(d.get("job_id"), str) or not d["job_id"]:
            raise ValueError("no job_id")
        return d
    except ValueError as exc:
        raise JournalUnreadable(f"job marker {path} is corrupt ({exc}); move it away or pass --fresh to start "
                                f"the job over") from exc


def write_marker(journal: str | os.PathLike, job_id: str, generation: int) -> None:
    """Writes the marker atomically (a temporary file, fsynced, renamed over it)."""
    path = marker_path(journal)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"job_id": job_id, "generation": generation}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def check_not_lost(journal: str | os.PathLike, saved: dict | None) -> None:
    """Raises :class:`JournalLost` when the journal holds no job (``saved`` is None) but its marker names one."""
    if saved is not None:
        return
    marker = read_marker(journal)
    if marker is not None:
        raise JournalLost(f"chief journal {journal} of job {marker['job_id']} is missing or empty (its marker "
                          f"{marker_path(journal)} is there): the job's state is lost; restore the journal, "
                          f"or pass --fresh to start the job over")


def foreign(job_id: str, generation: int, ours: str, our_generation: int, journal: str, new: bool) -> ForeignJob:
    """The one-line refusal of a member of job ``job_id`` by a chief of job ``ours``."""
    where = (f"a new job started on the empty journal {journal or '(none)'}" if new
             else f"generation {our_generation}")
    return ForeignJob(f"this member belongs to job {job_id} (generation {generation}) but the chief runs job {ours} "
                      f"({where}): the journal of job {job_id} is missing; restore it and restart the chief, "
                      f"or start job {job_id} over")
