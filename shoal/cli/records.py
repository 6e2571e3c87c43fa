"""What a finished ``shoal local`` job leaves behind: its records, read from the chief and the
servers once they settle, and the run summary (``--summary``) built from them."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from shoal import auth, tls
from shoal.cli.status import exactly_once, replicas_identical, shards_readable
from shoal.proto import shoal_pb2 as pb
from shoal.rpc import RETRYABLE

if TYPE_CHECKING:
    from shoal.cli.local import LocalConfig

log = logging.getLogger("shoal.cli.local")      # the supervisor's lines, as before the split


def read_settled(read, settled, settle_s: float, what: str, tick=None, unavailable_s: float = 60.0,
                  ready=None):
    """``read()`` until ``settled(result)`` or ``settle_s`` pass; None (logged) if it cannot be read.

    While the read fails with a retryable status (a chief being restarted), or returns a result that
    is not ``ready`` (a part of it could not be read yet), it is tried again for up to
    ``unavailable_s``, calling ``tick()`` (the supervisor's round) in between; a result still not
    ready then is returned as it is (logged). ``settle_s`` counts from the first ready result.
    """
    start = time.monotonic()
    deadline = None
    while True:
        try:
            result = read()
        except grpc.RpcError as exc:
            if tick is not None and exc.code() in RETRYABLE and time.monotonic() - start < unavailable_s:
                tick()
                time.sleep(0.1)
                continue
            log.warning("could not read %s: %s", what, exc.code().name)
            return None
        if ready is not None and not ready(result):
            if time.monotonic() - start < unavailable_s:
                if tick is not None:
                    tick()
                time.sleep(0.1)
                continue
            log.warning("could not read all of %s within %.0fs; reporting what was read", what, unavailable_s)
            return result
        if deadline is None:
            deadline = time.monotonic() + settle_s
        if settled(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def add_records(summary: dict[str, Any], shards: dict | None, replicas: dict | None, final_step: int | None) -> None:
    """The servers' records into ``summary``: ledgers, exactly-once, versions (and the shards that could
    not be read), replica digests, the final checkpoint's step."""
    if shards is not None:
        summary["ledger"] = {str(sh["shard"]): sh.get("ledger", []) for sh in shards["shards"]}
        summary["exactly_once"] = exactly_once(shards)
        summary["shard_versions"] = {str(sh["shard"]): sh.get("version", -1) for sh in shards["shards"]}
        unread = {str(sh["shard"]): sh.get("error") or "not initialised at its primary"
                  for sh in shards["shards"] if not shards_readable({"shards": [sh]})}
        if unread:      # no version, no ledger: the summary must not read as that shard's record
            summary["shard_errors"] = unread
    if replicas is not None:
        summary["replicas"] = replicas
        summary["replicas_identical"] = replicas_identical(replicas)
    if final_step is not None:
        summary["final_checkpoint_step"] = final_step


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def build_summary(cfg: "LocalConfig", codes: dict[str, int], seconds: float, stats: pb.JobStats | None) -> dict:
    summary: dict = {"mode": cfg.job.mode, "workers": cfg.num_workers, "ps": cfg.num_ps,
                     "authenticated": auth.job_token() is not None, "tls": tls.config().enabled,
                     "compression": cfg.compression, "seconds": round(seconds, 3), "worker_exit_codes": codes,
                     "tensorboard": str(Path(cfg.tensorboard).parent) if cfg.tensorboard else ""}
    if stats is not None:
        summary.update(steps=stats.totals.steps, samples=stats.totals.samples,
                       bytes_pushed=stats.totals.bytes_pushed, bytes_pulled=stats.totals.bytes_pulled,
                       tasks_done=stats.tasks_done, tasks_total=stats.tasks_total,
                       workers_seen=stats.workers_seen, epochs=stats.epochs,
                       batches_per_epoch=stats.batches_per_epoch, lost_shards=list(stats.lost_shards),
                       recovery=stats.job.recovery)
        summary.update({k: v for k, v in sorted(stats.metrics.items())})
        if "test_accuracy" in stats.metric_sources:     # which worker evaluated the job's final weights
            summary["test_accuracy_from"] = stats.metric_sources["test_accuracy"]
        if stats.restored_from:
            summary.update(restored_from=stats.restored_from, restored_step=stats.restored_step)
        if stats.checkpoints_written:
            summary.update(checkpoint_step=stats.checkpoint_step, checkpoints_written=stats.checkpoints_written)
        if stats.checkpoints_failed:
            summary.update(checkpoints_failed=stats.checkpoints_failed,
                           checkpoint_failed_step=stats.checkpoint_failed_step,
                           checkpoint_error=stats.checkpoint_error)
    return summary
