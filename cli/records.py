"""What a finished ``shoal local`` job leaves behind: its records, read from the chief and the
servers once they settle, and the run summary (``--summary``) built from them."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from shoal.security import auth, tls
from shoal.cli.status import replicas_identical, shards_readable
from shoal.errors import ShoalError
from shoal.proto import shoal_pb2 as pb
from shoal.net.rpc import RETRYABLE

if TYPE_CHECKING:
    from shoal.cli.local_config import LocalConfig

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


def add_records(summary: dict[str, Any], shards: dict | None, replicas: dict | None, final_step: int | None,
                checkpoint_dir: str = "") -> None:
    """The servers' records into ``summary``: ledgers, exactly-once, versions (and the shards that could
    not be read), replica digests, the final checkpoint's step.

    A shard whose primary could not be read (killed as the job ended; a shard the chief routes to no
    one) takes its records from the newest checkpoint under ``checkpoint_dir`` when that checkpoint
    covers the end of training (``ledger_sources`` says which shard's came from where). Without
    records for every shard, ``exactly_once`` is None (unknown), not False: no violation was seen.
    ``exactly_once_violated`` lists the shards whose records show one (see :func:`judge`)."""
    report = shards if shards is not None else _without_shards(summary)
    if report is not None:
        unread = {str(sh["shard"]): sh.get("error") or "not initialised at its primary"
                  for sh in report["shards"] if not shards_readable({"shards": [sh]})}
        report, sources, ckpt = with_checkpoint_records(report, checkpoint_dir)
        summary["ledger"] = {str(sh["shard"]): sh.get("ledger", []) for sh in report["shards"]}
        holds, why, violated = judge(report)
        summary["exactly_once"] = holds
        summary["exactly_once_violated"] = violated
        if why:
            summary["exactly_once_detail"] = why
        summary["ledger_sources"] = sources
        if ckpt is not None:
            summary["ledger_checkpoint"] = ckpt
        summary["shard_versions"] = {str(sh["shard"]): sh.get("version", -1) for sh in report["shards"]}
        skipped = batches_skipped(report)
        if skipped:
            summary["batches_skipped"] = skipped
        if unread:      # the primary did not answer: its (empty) reply is not taken as that shard's record
            summary["shard_errors"] = unread
        guarded = guard_record(report["shards"])
        if guarded:
            summary["update_guard"] = guarded
    if replicas is not None:
        summary["replicas"] = replicas
        summary["replicas_identical"] = replicas_identical(replicas)
    if final_step is not None:
        summary["final_checkpoint_step"] = final_step


def guard_record(shards: list[dict]) -> dict | None:
    """What the update guard (ps/guard.py) did over the run, from the primaries' status: the updates it
    refused, clipped or rolled back per worker, the steps rolled back, the workers expelled; None: nothing."""
    refused: dict[str, int] = {}
    for sh in shards:
        for w, n in sh.get("guard_refused", {}).items():
            refused[w] = refused.get(w, 0) + n
    rolled = sum(sh.get("rolled_back", 0) for sh in shards)
    expelled = sorted({w for sh in shards for w in sh.get("expelled", ())})
    if not refused and not rolled:
        return None
    return {"refused": refused, "rolled_back": rolled, "expelled": expelled}


def batches_skipped(report: dict) -> int:
    """Pushes the servers refused for NaN/Inf (``--nonfinite``), on the shard that refused the most: each
    names the batch it trained, which the job then counts as skipped (one batch a push, more with
    gradient accumulation)."""
    return max((sum(sh.get("nonfinite", {}).values()) for sh in report["shards"]), default=0)


def _without_shards(summary: dict[str, Any]) -> dict | None:
    """A report with no shard read (the chief did not answer), from what the job stats told: every
    shard's records then come from the final checkpoint, if there is one."""
    if "tasks_total" not in summary:
        return None
    return {"shards": [], "num_shards": summary.get("shards", summary.get("ps", 0)),
            "epochs": {"total": summary.get("epochs", 0), "batches_per_epoch": summary.get("batches_per_epoch", 0)},
            "tasks": {"done": summary.get("tasks_done", 0), "total": summary["tasks_total"]}}


def checkpoint_records(root: str, num_shards: int, tasks_total: int) -> tuple[dict, dict[int, dict]] | None:
    """The newest committed checkpoint under ``root`` if it covers the end of training (it was cut with
    every one of the job's ``tasks_total`` data tasks done, so no update came after it): ``({"step",
    "path"}, {shard: its entry as ``collect`` reports a shard: version, ledger})``; None otherwise (no
    checkpoint, an earlier one, one that cannot be read)."""
    if not root or not tasks_total or num_shards < 1:
        return None
    from shoal.state.checkpoint import load_latest        # torch: only when a shard needs it
    from shoal.state.layout import ShardPlan
    from shoal.ps.ledger import ledger_from_extra

    try:
        ckpt = load_latest(root)
        if ckpt is None or ckpt.meta.get("tasks_total") != tasks_total or ckpt.meta.get("tasks_done") != tasks_total:
            return None
        plan = ShardPlan(ckpt.layout.numel, num_shards)
        states = {k: ckpt.shard_state(plan, k) for k in range(num_shards)}
    except (ShoalError, OSError) as exc:
        log.warning("could not read the records of the checkpoint under %s: %s", root, exc)
        return None
    entries = {k: {"shard": k, "version": st.version, "initialized": True,
                   "ledger": [{"epoch": e.epoch, "batches": e.applied, "max_count": e.max_count}
                              for e in ledger_from_extra(st.extra).summary()]}
               for k, st in states.items()}
    return {"step": ckpt.step, "path": str(ckpt.path)}, entries


def with_checkpoint_records(report: dict, checkpoint_dir: str) -> tuple[dict, dict[str, str], dict | None]:
    """``report`` with every shard of the job listed, each unread one (its primary did not answer, or
    the chief routes it to no one) taken from the final checkpoint when there is one that covers the
    end of training; the source of each shard's records (``primary``, ``checkpoint`` or ``none``);
    the checkpoint used ({"step", "path"}), if any."""
    by_shard = {sh["shard"]: sh for sh in report["shards"]}
    num_shards = max(report.get("num_shards") or 0, max(by_shard, default=-1) + 1)
    unread = [k for k in range(num_shards) if k not in by_shard or not shards_readable({"shards": [by_shard[k]]})]
    found = checkpoint_records(checkpoint_dir, num_shards, report.get("tasks", {}).get("total", 0)) if unread else None
    sources, used = {}, None
    for k in range(num_shards):
        if k not in unread:
            sources[str(k)] = "primary"
        elif found is not None:
            used = found[0]
            by_shard[k] = {**found[1][k], "primary_error": by_shard.get(k, {}).get("error", "no primary")}
            sources[str(k)] = "checkpoint"
        else:
            by_shard.setdefault(k, {"shard": k, "error": "no primary"})
            sources[str(k)] = "none"
    return {**report, "shards": [by_shard[k] for k in sorted(by_shard)]}, sources, used


def judge(report: dict) -> tuple[bool | None, str, list[int]]:
    """``(exactly_once, why, violated shards)`` from a report whose every shard is listed.

    A violation is what a ledger shows: a batch applied twice, a batch of an epoch the job does not
    have, or (once every data task is done) a batch missing. A shard with no records leaves it
    unknown (None) unless another shows a violation; a job stopped before its data was done (a time
    budget) is not exactly-once (False), with no violation."""
    want, epochs = report["epochs"]["batches_per_epoch"], report["epochs"]["total"]
    tasks = report.get("tasks", {})
    finished = bool(tasks.get("total")) and tasks.get("done") == tasks.get("total")
    if not want or not epochs:
        return None, "the job's data (epochs, batches per epoch) is unknown", []
    violated, missing, notes = [], [], []
    unread = [sh["shard"] for sh in report["shards"] if not shards_readable({"shards": [sh]})]
    for sh in report["shards"]:
        if sh["shard"] in unread:
            continue
        ledger = {e["epoch"]: e for e in sh.get("ledger", [])}
        twice = sorted(e for e, row in ledger.items() if row["max_count"] > 1)
        extra = sorted(e for e, row in ledger.items() if e not in range(epochs) or row["batches"] > want)
        short = sum(want - ledger[e]["batches"] if e in ledger else want for e in range(epochs)
                    if ledger.get(e, {"batches": 0})["batches"] < want)
        if twice:
            notes.append(f"shard {sh['shard']} applied a batch twice (epoch(s) {twice})")
        if extra:
            notes.append(f"shard {sh['shard']} holds batches the job's data does not have (epoch(s) {extra})")
        if short and finished:
            notes.append(f"shard {sh['shard']} misses {short} batch(es) though every data task is done")
        if twice or extra or (short and finished):
            violated.append(sh["shard"])
        elif short:
            missing.append(sh["shard"])
    if violated:
        return False, "; ".join(notes), violated
    if unread:
        return None, (f"unknown: shard(s) {unread} could not be read and no checkpoint covers the end of "
                      f"training"), []
    if missing:
        return False, (f"training stopped before its data was done (tasks {tasks.get('done')}/{tasks.get('total')}): "
                       f"shard(s) {missing} did not get every batch"), []
    return True, "", []


def violation(summary: dict[str, Any]) -> str | None:
    """Why the run must not exit 0 for what it saw: exactly-once violated on a shard (its ledger shows
    it), or, in a job that did not ask for ``--recovery fast``, a shard the chief saw lose every copy
    while no records prove its updates kept (the final checkpoint was not cut: the end state is gone).
    A shard ``--recovery fast`` let go (said loudly during the run) does not fail the run."""
    fast = summary.get("recovery") == "fast"
    lost = list(summary.get("lost_shards") or [])
    violated = [k for k in summary.get("exactly_once_violated") or [] if not (fast and k in lost)]
    if violated:
        return f"exactly-once VIOLATED on shard(s) {violated}: {summary.get('exactly_once_detail', '')}"
    if lost and not fast and summary.get("exactly_once", False) is not True:
        return (f"shard(s) {lost} lost every copy holding acknowledged updates and no checkpoint taken at the "
                f"end of training holds them (--recovery {summary.get('recovery', '?')}): the final state is lost")
    return None


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def build_summary(cfg: "LocalConfig", codes: dict[str, int], seconds: float, stats: pb.JobStats | None) -> dict:
    summary: dict = {"mode": cfg.job.mode, "workers": cfg.num_workers, "ps": cfg.num_ps, "shards": cfg.job.num_shards,
                     "authenticated": auth.job_token() is not None, "tls": tls.config().enabled,
                     "compression": cfg.compression, "seconds": round(seconds, 3), "worker_exit_codes": codes,
                     "tensorboard": str(Path(cfg.tensorboard).parent) if cfg.tensorboard else ""}
    if stats is not None:
        summary.update(steps=stats.totals.steps, samples=stats.totals.samples,
                       bytes_pushed=stats.totals.bytes_pushed, bytes_pulled=stats.totals.bytes_pulled,
                       tasks_done=stats.tasks_done, tasks_total=stats.tasks_total,
                       workers_seen=stats.workers_seen, epochs=stats.epochs,
                       batches_per_epoch=stats.batches_per_epoch, lost_shards=list(stats.lost_shards),
                       recovery=stats.job.recovery, job_id=stats.job_id, chief_generation=stats.generation)
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
                           checkpoint_error=stats.checkpoint_error,
                           # failed steps no later checkpoint covers (the chief's journal): exit 73
                           checkpoint_missing_steps=list(stats.checkpoint_missing_steps))
    return summary
