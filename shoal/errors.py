"""The exception hierarchy shared by every role.

Core code raises these; only the servicer boundary (:func:`shoal.net.rpc.grpc_errors`)
turns them into gRPC status codes, and clients branch on ``RpcError.code()``.
"""
from __future__ import annotations

import grpc


class ShoalError(Exception):
    """Base of all shoal errors. ``code`` is the gRPC status it maps to."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ShoalError, ValueError):
    """A request or setting is malformed (bad size, dtype, layout, flag value)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ShoalError):
    """The request is well formed but the state does not allow it (layout differs, not initialised)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(ShoalError):
    """An unknown member, shard or task."""

    code = grpc.StatusCode.NOT_FOUND


class Unavailable(ShoalError):
    """Retryable: the peer is not ready yet or is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ShoalError):
    """A wait (for a version, a view) ran out of time; retryable."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhausted(ShoalError):
    """Retryable back-pressure: e.g. a worker too far ahead under bounded staleness."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PermissionDenied(ShoalError):
    """The caller may not do this (a push for a task it does not hold, a bad token)."""

    code = grpc.StatusCode.PERMISSION_DENIED


# In a refusal of a worker's call by a ps that holds no primary copy of the shard:
# the worker re-reads the cluster view and follows the shard to its primary.
NOT_PRIMARY = "not the primary"
# In such a refusal (and a replicator's) when the ps handed the shard over on purpose: it left the job
# (SIGTERM) or the shard moved to its backup. The worker follows the view without a warning.
HANDED_OVER = "handed over to its backup"

# ---------------------------------------------------------------- exit statuses
# One exit status per outcome, the same for every role (``shoal chief``, ``ps``, ``worker``) and for
# ``shoal local``; ``OUTCOMES`` gives the word the run summary and the last line carry for each.
# docs/exit-codes.md is the table for users: what a supervisor, a TFJob or compose does with each.
# The numbers follow sysexits(3) where one fits.

# Finished: every task done, nothing lost, every checkpoint written.
EXIT_OK = 0

# Crashed: a traceback, a journal the chief cannot write (maybe a full disk), a worker's script that
# failed. Worth a restart (the chief carries on from its journal). Also what the chief and its servers exit
# with when the job ended as failed for a reason without a code of its own (every task done but the final
# checkpoint could not be kept); the reason is one line.
EXIT_FAILED = 1

# Exit status of a bad command line or settings file (argparse's own): "bad settings".
EXIT_USAGE = 2

# ``shoal local`` only: the run stopped because a role failed the same way twice in a row (a crash
# loop) or a role it cannot do without (the chief) gave up; the summary's "error" says which.
EXIT_STOPPED = 3

# Finished, but a shard lost every copy under ``--recovery fast`` and the job went on from the
# shard's initial weights or a checkpoint: batches were lost. (sysexits' EX_DATAERR.)
EXIT_DATA_LOST = 65

# Exit status of a role that gave up waiting on a peer (the chief, a server) after its
# deadline, having said what it waited for and how long. (sysexits' EX_UNAVAILABLE.)
EXIT_UNREACHABLE = 69

# Finished (or stopped) with checkpoints that could not be written, where the user did not opt out
# (``--allow-checkpoint-failures``): the newest checkpoint is older than the job. (EX_CANTCREAT.)
EXIT_CHECKPOINT_FAILED = 73

# Exit status of a chief whose job stopped because a shard lost every copy under
# --recovery consistent: its supervisor restarts the job from the newest checkpoint.
# ``shoal local`` exits with it when there is no checkpoint to roll back to: "stopped: data lost".
EXIT_ROLLBACK = 75

# Exit status of a role the job refused for good (a model that differs from the job's,
# credentials the job does not accept, a journal or checkpoint it cannot read, a chief of another
# job: the journal of this one was lost): restarting it would fail the same way, so a supervisor
# never does. (sysexits' EX_CONFIG.)
EXIT_REFUSED = 78

# Stopped by SIGINT or SIGTERM (``shoal local``; 128 + SIGINT, the shell's convention).
EXIT_INTERRUPTED = 130

OUTCOMES = {
    EXIT_OK: "finished",
    EXIT_FAILED: "failed",
    EXIT_USAGE: "bad settings",
    EXIT_STOPPED: "stopped",
    EXIT_DATA_LOST: "finished with data lost",
    EXIT_UNREACHABLE: "unreachable",
    EXIT_CHECKPOINT_FAILED: "checkpoints failed",
    EXIT_ROLLBACK: "stopped: data lost",
    EXIT_REFUSED: "refused",
    EXIT_INTERRUPTED: "interrupted",
}


def outcome(code: int) -> str:
    """The word for an exit status (``OUTCOMES``); a signal (negative, as subprocess reports it) or an
    unknown status is named by its number."""
    if code < 0:
        return f"killed by signal {-code}"
    return OUTCOMES.get(code, f"exit {code}")

# In the chief's refusal of a worker that joins a job that has ended: the worker exits 0 with one line.
JOB_FINISHED = "the job has finished"


class Unreachable(ShoalError):
    """A role waited on a peer (the chief, a server) past its deadline and gives up; the message says
    what it waited for and for how long. The process exits ``EXIT_UNREACHABLE``."""

    code = grpc.StatusCode.UNAVAILABLE
    exit_code = EXIT_UNREACHABLE


class Refused(FailedPrecondition):
    """The job refused this role for good (its model differs from the job's): exit ``EXIT_REFUSED``."""

    exit_code = EXIT_REFUSED
