"""The job's checkpoint record, kept in the chief's journal (not on the checkpoint disk, which may be full).

Which checkpoint steps failed that no later commit covers (the *missing* steps), the newest committed
step, the newest step an attempt saw (the job's last applied update as the chief knows it) and the last
error. The run summary and ``JobStats`` report it, a chief recovered from its journal still has it, and
``shoal export`` reads it from the journal to refuse a checkpoint older than the job
(``cli/export_check.py``). A pointer under the checkpoint directory (``job.json``, written when the
chief starts, before any disk can have filled) leads ``shoal export`` to the journal.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

POINTER = "job.json"      # under the checkpoint root: {"job_id", "journal"}
KEEP_FAILED = 64          # the failed steps kept (the newest): enough to name them, bounded in the journal


@dataclass
class CheckpointRecord:
    committed: int = 0                  # the newest committed checkpoint's step
    applied: int = 0                    # the newest step a checkpoint attempt saw
    failed: list[int] = field(default_factory=list)   # steps whose attempt failed, oldest first
    failures: int = 0                   # failed attempts in the job's life (all its chiefs)
    error: str = ""                     # why the newest one failed

    def failed_attempt(self, step: int, error: str) -> None:
        self.applied = max(self.applied, step)
        if step not in self.failed:
            self.failed = (self.failed + [step])[-KEEP_FAILED:]
        self.failures += 1
        self.error = error

    def committed_at(self, step: int) -> None:
        self.committed = max(self.committed, step)
        self.applied = max(self.applied, step)

    def saw(self, step: int) -> None:
        self.applied = max(self.applied, step)

    @property
    def missing(self) -> list[int]:
        """Failed steps that no later committed checkpoint covers: the job's state there is on no disk."""
        return [s for s in self.failed if s > self.committed]

    def to_dict(self) -> dict:
        return {"committed": self.committed, "applied": self.applied, "failed": list(self.failed),
                "failures": self.failures, "error": self.error}

    @classmethod
    def from_dict(cls, d: dict | None) -> "CheckpointRecord":
        d = d or {}
        return cls(int(d.get("committed", 0)), int(d.get("applied", 0)), [int(s) for s in d.get("failed", [])],
                   int(d.get("failures", 0)), str(d.get("error", "")))


def record_stats(r: CheckpointRecord) -> dict:
    """The ``JobStats`` fields from the journaled record: failures over the job's life (all its chiefs)."""
    if not r.failures:
        return {"last_applied_step": r.applied}
    return {"checkpoints_failed": r.failures, "checkpoint_failed_step": r.failed[-1] if r.failed else 0,
            "checkpoint_error": r.error, "checkpoint_missing_steps": r.missing, "last_applied_step": r.applied}


def write_pointer(root: str | os.PathLike, job_id: str, journal: str | os.PathLike | None) -> None:
    """Leaves ``job.json`` under the checkpoint root naming the job and its journal. Best effort: a disk
    already full says so in a warning (``shoal export --journal`` then finds the journal)."""
    root = Path(root)
    body = {"job_id": job_id, "journal": str(Path(journal).resolve()) if journal else ""}
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{POINTER}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(body) + "\n")
        os.replace(tmp, root / POINTER)
    except OSError as exc:
        log.warning("cannot leave %s under %s (%s): shoal export needs --journal to find the job's record",
                    POINTER, root, exc.strerror)


def read_pointer(root: str | os.PathLike) -> dict | None:
    try:
        d = json.loads((Path(root) / POINTER).read_text())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None
