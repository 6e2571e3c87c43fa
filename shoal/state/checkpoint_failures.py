"""The note a failed checkpoint attempt leaves under the checkpoint root (``failed.json``), which
``shoal export`` reads to warn that a checkpoint is older than the job's state. Best effort: the chief's
journal holds the authoritative record (chief/ckpt_record.py)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from shoal.state.checkpoint_store import MANIFEST, _step_of, list_checkpoints

log = logging.getLogger(__name__)


FAILURES = "failed.json"     # under the root: the newest failed checkpoint attempt, for `shoal export`


def record_failure(root: str | Path, step: int, error: str) -> None:
    """Notes under ``root`` that checkpoint ``step`` failed (``error``), counting failures since the newest
    success. Best effort: a full disk may refuse this small file too (the chief's status still counts it)."""
    root = Path(root)
    previous = read_failure(root) or {}
    newest = list_checkpoints(root)
    if newest and previous:
        done, failed = _step_of(newest[0]), previous["step"]
        at = previous.get("at")
        at = at if isinstance(at, (int, float)) else float("inf")        # unknown: the failure stays the later
        # a checkpoint succeeded since: count afresh (at the failed step itself, the times say which came first)
        if done > failed or (done == failed and _created(newest[0]) > at):
            previous = {}
    record = {"step": int(step), "error": error, "at": time.time(), "failures": int(previous.get("failures", 0)) + 1}
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{FAILURES}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, root / FAILURES)
    except OSError as exc:
        log.warning("cannot note the failed checkpoint under %s either (%s)", root, exc)


def _created(path: Path) -> float:
    """The manifest's creation time (-inf when it cannot be read: then it never counts as newer)."""
    try:
        return float(json.loads((path / MANIFEST).read_text(encoding="utf-8"))["created"])
    except (OSError, ValueError, KeyError, TypeError):
        return float("-inf")


def read_failure(root: str | Path) -> dict[str, Any] | None:
    """The newest failed attempt noted under ``root`` (``step``, ``error``, ``failures``), or None."""
    try:
        record = json.loads((Path(root) / FAILURES).read_text())
        return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
    except (OSError, ValueError):
        return None
