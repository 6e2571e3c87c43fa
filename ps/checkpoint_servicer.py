"""Checkpoint control of a parameter server: Freeze / WriteShard / Thaw, and restore at assignment.

The chief drives the protocol (``chief/checkpointer.py``, the ``ShardControl``
service in ``proto/shoal.proto``); this file only turns its requests into
:class:`shoal.ps.shard.Shard` calls and writes this server's shard file into the
checkpoint's temporary directory, which lives on storage every role shares.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from pathlib import Path

from shoal.settings.config import JobConfig
from shoal.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from shoal.state.layout import ShardPlan
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.state.checkpoint import open_checkpoint
from shoal.state.checkpoint_store import TMP_RE, CheckpointWriter, PendingCheckpoint, ShardState
from shoal.ps.consistency import rule_for
from shoal.security import auth
from shoal.ps.host import ShardHost
from shoal.ps.servicer import ps_guard
from shoal.ps.shard import Shard
from shoal.ps.update import count_nonfinite
from shoal.net.rpc import grpc_errors, request_seconds
from shoal.state.tables import read_chain, snapshot_file

log = logging.getLogger(__name__)

DEFAULT_FREEZE_TIMEOUT_S = 10.0
DEFAULT_HOLD_S = 30.0
MAX_FREEZE_S = 600.0           # the longest freeze timeout or hold a request may ask for


class ShardControlServicer(pb_grpc.ShardControlServicer):
    def __init__(self, host: ShardHost):
        self.host = host
        self.guard = ps_guard(host)

    @grpc_errors
    def Digest(self, request, context):
        """A fingerprint of one copy (primary or backup): tests and the run summary compare replicas."""
        shard = self.host.shards.get(request.shard)
        if shard is None:
            raise NotFound(f"this parameter server holds no copy of shard {request.shard}")
        version, sha = shard.digest()
        return pb.DigestReply(shard=request.shard, version=version, sha256=sha,
                              role=self.host.roles.get(request.shard, ""))

    @grpc_errors
    def Freeze(self, request, context):
        self.guard.require(context, auth.OPERATOR)
        timeout_s = request_seconds(request.timeout_seconds, "Freeze timeout_seconds", DEFAULT_FREEZE_TIMEOUT_S,
                                    MAX_FREEZE_S)
        hold_s = request_seconds(request.hold_seconds, "Freeze hold_seconds", DEFAULT_HOLD_S, MAX_FREEZE_S)
        shard = self.host.get(request.shard)
        version = shard.freeze(request.target_version, timeout_s, hold_s)
        return pb.FreezeReply(version=version)

    @grpc_errors
    def WriteShard(self, request, context):
        self.guard.require(context, auth.OPERATOR)
        shard = self.host.get(request.shard)
        directory = _pending_dir(request.directory)
        if request.layout_fingerprint and request.layout_fingerprint != shard.fingerprint:
            raise FailedPrecondition(f"checkpoint for layout {request.layout_fingerprint}; shard {request.shard} "
                                     f"holds {shard.fingerprint}")
        if request.stop - request.start != shard.numel:
            raise InvalidArgument(f"range [{request.start}, {request.stop}) does not fit shard {request.shard} "
                                  f"of {shard.numel} elements")
        state = shard.export_state(request.start, checkpoint=True)
        if state.version != request.version:
            raise FailedPrecondition(f"shard {request.shard} is at version {state.version}, not at the "
                                     f"checkpoint's {request.version} (did its freeze expire?)")
        bad = count_nonfinite(state.values)
        if bad:   # a checkpoint never holds a non-finite weight: the previous one stays the newest
            raise FailedPrecondition(f"shard {request.shard} holds {bad} non-finite weight(s) (NaN/Inf) at "
                                     f"version {state.version}; not written to the checkpoint")
        frozen = shard.thaw() if request.thaw else 0.0
        t0 = time.perf_counter()
        try:
            snaps = state.extra.pop("table_snapshots", None)
            if snaps:
                state.extra["tables"] = write_table_files(shard, directory.parent, state.version, snaps)
            entry = write_shard_file(directory, state)
        except (OSError, RuntimeError) as exc:
            raise _disk_error(exc, request.shard, directory) from None
        log.info("shard %d: wrote %s for checkpoint version %d (%d bytes, %.1f ms); updates held %.1f ms",
                 request.shard, entry["file"], state.version, entry["bytes"], (time.perf_counter() - t0) * 1e3,
                 frozen * 1e3)
        return pb.WriteShardReply(shard=entry["shard"], start=entry["start"], stop=entry["stop"], file=entry["file"],
                                  sha256=entry["sha256"], bytes=entry["bytes"], version=entry["version"],
                                  frozen_seconds=frozen)

    @grpc_errors
    def Thaw(self, request, context):
        self.guard.require(context, auth.OPERATOR)
        shard = self.host.shards.get(request.shard)
        return pb.ThawReply(frozen_seconds=shard.thaw() if shard is not None else 0.0)


def _disk_error(exc: BaseException, shard: int, directory: Path) -> Exception:
    """A checkpoint file that could not be written (a full disk, a read-only or vanished directory) as
    one line for the chief, not a traceback; anything that is no filesystem error is raised as it was."""
    cause = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return exc
    what = f"shard {shard}: cannot write its checkpoint file in {directory}: {cause.strerror or cause}"
    log.warning("%s", what)
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(what)
    return FailedPrecondition(what)


def _pending_dir(directory: str) -> Path:
    path = Path(directory)
    if not TMP_RE.match(path.name) or not path.is_dir():
        raise InvalidArgument(f"{directory!r} is not a checkpoint's temporary directory on this host "
                              f"(is the checkpoint dir shared with every parameter server?)")
    return path


def write_table_files(shard: Shard, root: Path, version: int, snaps: dict[str, dict]) -> dict[str, dict]:
    """Writes each table's checkpoint snapshot (full, or the changes since the last full one) to its own
    fsynced file under ``root/tables/`` (shoal/state/tables.py ``snapshot_file``); returns what the shard file
    records of each table: its spec and the chain of files it restores from. Once a full one is on disk,
    the files older than the full one before it are removed (two generations kept)."""
    out = {}
    for name, snap in snaps.items():
        rel = snapshot_file(shard.shard_id, version, name, snap["kind"])
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(snap["data"])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        entry = {"file": rel, "bytes": len(snap["data"]), "sha256": hashlib.sha256(snap["data"]).hexdigest(),
                 "version": version, "kind": snap["kind"], "rows": snap["rows"]}
        with shard.exclusive():
            previous = shard.tables.ckpt_base.get(name)
            chain = shard.tables.checkpoint_written(name, snap["kind"], snap["mark"], entry)
        if snap["kind"] == "full" and previous is not None:
            _prune_table_files(path.parent, name, int(previous[1]["version"]))
        out[name] = {"spec": snap["spec"], "num_shards": snap["num_shards"], "chain": chain}
    return out


def _prune_table_files(folder: Path, table: str, before: int) -> None:
    for old in folder.glob(f"*-{table}.snap"):
        try:
            if int(old.name.split("-", 1)[0]) < before and old.name.split("-", 2)[2] == f"{table}.snap":
                old.unlink()
        except (ValueError, IndexError, OSError):
            continue


def write_shard_file(directory: Path, state: ShardState) -> dict:
    """Writes one shard's file (fsynced) into a pending checkpoint directory; returns its manifest entry."""
    pending = PendingCheckpoint(CheckpointWriter(directory.parent), state.version, directory)
    pending.write_shard(state)
    return pending.entry(state.shard)


def restore_shard(host: ShardHost, shard: int, path: str, job: JobConfig) -> Shard:
    """Loads shard ``shard`` of this job's plan from checkpoint ``path`` (re-sliced if the job has a
    different number of shards) and installs it in ``host``."""
    t0 = time.monotonic()
    ckpt = open_checkpoint(path)
    plan = ShardPlan(ckpt.layout.numel, job.num_shards)
    state = ckpt.shard_state(plan, shard)
    tables = state.extra.get("tables") or {}
    snapshots = {name: read_chain(str(Path(ckpt.path).parent), entry) for name, entry in tables.items()}
    s = Shard.from_state(state, rule_for(job), ckpt.layout.fingerprint, table_snapshots=snapshots or None)
    host.install(s)
    log.info("shard %d restored from %s: version %d, elements [%d, %d) of %d, from %d saved shard(s), in %.2fs",
             shard, ckpt.path, s.version, state.start, state.stop, ckpt.layout.numel, ckpt.num_shards,
             time.monotonic() - t0)
    return s
