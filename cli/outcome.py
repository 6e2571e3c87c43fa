"""How a ``shoal local`` run ended, as one exit status and its word (the table in ``shoal/errors.py``).

Pure: a function of the run's summary and of how its roles exited, so a scheduler reading the exit
status learns what the summary says: a run that lost batches under ``--recovery fast`` or whose
checkpoints failed does not exit 0 (docs/exit-codes.md).
"""
from __future__ import annotations

from shoal.errors import (EXIT_CHECKPOINT_FAILED, EXIT_DATA_LOST, EXIT_FAILED, EXIT_OK, EXIT_REFUSED,
                          EXIT_ROLLBACK, EXIT_STOPPED, EXIT_UNREACHABLE, EXIT_USAGE, outcome)

# a role's exit that says why the whole run stopped: ``shoal local`` exits with it, not EXIT_STOPPED
PASSED_ON = (EXIT_USAGE, EXIT_UNREACHABLE, EXIT_ROLLBACK, EXIT_REFUSED)


def stopped_code(role_code: int) -> int:
    """``shoal local``'s exit when a role's exit (``role_code``) stopped the run."""
    return role_code if role_code in PASSED_ON else EXIT_STOPPED


def run_code(summary: dict, ok: bool, broken: str = "", allow_checkpoint_failures: bool = False) -> int:
    """The exit status of a run that got to its end: ``ok`` (the workers finished), ``broken`` (an invariant
    the records break, shoal.cli.records.violation), the summary's lost shards and failed checkpoints."""
    if not ok or broken:
        return EXIT_FAILED
    if summary.get("lost_shards") and summary.get("exactly_once") is not True:
        return EXIT_DATA_LOST          # --recovery fast went on without a shard's updates
    if summary.get("checkpoint_missing_steps") and not allow_checkpoint_failures:
        return EXIT_CHECKPOINT_FAILED  # the job's state at those steps is on no disk (a later commit covers none)
    return EXIT_OK


def mark(summary: dict, code: int) -> dict:
    """The summary with the run's ``exit_code`` and its word (``outcome``)."""
    summary["exit_code"] = code
    summary["outcome"] = outcome(code)
    return summary
