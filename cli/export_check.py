"""``shoal export`` refuses a checkpoint older than the job it came from, unless told ``--allow-stale``.

The job's checkpoint record (chief/ckpt_record.py) lives in the chief's journal, not on the checkpoint
disk, so a disk that filled up cannot hide that later checkpoints failed. The journal is found from
``--journal``, else from the pointer the chief left under the checkpoint directory (``job.json``).
"""
from __future__ import annotations

from pathlib import Path

from shoal.chief.ckpt_record import POINTER, CheckpointRecord, read_pointer
from shoal.chief.journal import read_state
from shoal.errors import EXIT_CHECKPOINT_FAILED, FailedPrecondition


class StaleCheckpoint(FailedPrecondition):
    """The checkpoint to export is older than the job's last applied update: exit ``EXIT_CHECKPOINT_FAILED``."""

    exit_code = EXIT_CHECKPOINT_FAILED


def job_record(root: Path, journal: str = "", warn=None) -> tuple[CheckpointRecord, str] | None:
    """The journaled record of the job whose checkpoints lie under ``root``, and the journal's path; None
    when no journal is named and the pointer names none (a job run without one), or names one that is gone
    (a ``shoal local`` run dir in /tmp, removed): then ``warn(line)`` says the check was not made. A journal
    named with ``--journal`` must be readable."""
    if not journal:
        pointer = read_pointer(root) or {}
        journal = str(pointer.get("journal") or "")
        if not journal:
            return None
        if not Path(journal).is_file():
            if warn is not None:
                warn(f"the job's journal {journal} (named in {Path(root) / POINTER}) is gone: cannot check that "
                     f"this checkpoint is the job's newest state (--journal names another copy)")
            return None
    state = read_state(journal)
    if state is None:
        return None
    return CheckpointRecord.from_dict(state.get("checkpoint_record")), journal


def check_fresh(step: int, path: Path, record: CheckpointRecord, journal: str) -> None:
    """Raises :class:`StaleCheckpoint` (one line naming both steps) when the job went past ``step``."""
    newest = max([record.applied, *record.missing])
    if newest <= step:
        return
    failed = record.missing
    why = (f"checkpoint step(s) {', '.join(map(str, failed))} failed ({record.error})" if failed
           else "a later checkpoint of it was not kept")
    raise StaleCheckpoint(f"checkpoint {path} is step {step}, older than the job's last applied update at step "
                          f"{newest} ({why}; from the chief's journal {journal}); pass --allow-stale to export "
                          f"it anyway")
