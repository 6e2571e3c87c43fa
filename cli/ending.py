"""How ``shoal local`` ends a job: once every worker has finished, read the job's records (stats, each
shard's ledger and version, replica digests, the final checkpoint) before the servers stop, and run the
job again from its newest checkpoint if the chief stopped it meanwhile.

A chief and a primary killed just after training ended (bench/nemesis.py --netns, seed 1020) left the
restarted chief routing both shards to the dead primary; when its lease ran out there was no whole copy
left and the chief stopped the job (``--recovery consistent``). The records had been read by then
(shards unreadable), so the run printed "exactly once UNKNOWN" and exited 0 over a lost end state.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol, TYPE_CHECKING

import grpc

from shoal.cli.status import collect, shards_readable
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import open_channel

if TYPE_CHECKING:
    from shoal.cli.local_config import LocalConfig


class LocalCluster(Protocol):
    """What the ending reads of a running ``shoal local`` cluster (``shoal.cli.local.LocalCluster``)."""

    cfg: "LocalConfig"
    chief_address: str
    rollbacks: int

    def job_stats(self, *args: Any, **kwargs: Any) -> Any: ...
    def shard_report(self, *args: Any, **kwargs: Any) -> Any: ...
    def replica_report(self, *args: Any, **kwargs: Any) -> Any: ...
    def supervise(self, *args: Any, **kwargs: Any) -> Any: ...
    def wait_workers(self, *args: Any, **kwargs: Any) -> Any: ...
    def drain(self, *args: Any, **kwargs: Any) -> Any: ...
    def final_checkpoint(self, *args: Any, **kwargs: Any) -> Any: ...


log = logging.getLogger("shoal.cli.local")

# how long a run whose records look doubtful (a shard unread, the job stopped) waits for the chief to
# decide: a restarted chief routes a shard to a dead primary until its lease runs out, then stops the job
DECIDE_S = 30.0


@dataclass
class Ending:
    codes: dict[str, int]            # the workers' exit codes
    seconds: float                   # from start to the workers' end
    stats: pb.JobStats | None
    shards: dict | None
    replicas: dict | None
    final_step: int | None


def finish(cluster: "LocalCluster", started: float, decide_s: float = DECIDE_S) -> Ending:
    """Waits for the workers and reads the records; reads them again after a rollback the chief forced
    meanwhile (the workers run again first), or once shards that could not be read answer again."""
    while True:
        rollbacks = cluster.rollbacks
        codes = cluster.wait_workers()
        cluster.drain()
        seconds = time.monotonic() - started
        shards = cluster.shard_report()
        replicas = cluster.replica_report()
        final_step = None
        if cluster.cfg.checkpoint_dir and shards is not None:    # the job ends once its final state is saved
            final_step = cluster.final_checkpoint(max((sh.get("version", 0) for sh in shards["shards"]), default=0))
        stats = cluster.job_stats()      # after the final checkpoint: its failure is part of the result
        again = read_again(cluster, rollbacks, stats, shards, decide_s)
        if again is None:
            return Ending(codes, seconds, stats, shards, replicas, final_step)
        log.warning("%s", again)


def read_again(cluster: "LocalCluster", rollbacks: int, stats: pb.JobStats | None, shards: dict | None,
               decide_s: float) -> str | None:
    """Why the records must be read again (None: they stand). The supervisor rolls the job back when the
    chief exits having stopped it; records that look doubtful (a shard unread, a stopped job) under
    ``--recovery consistent`` wait up to ``decide_s`` for the chief to settle it: a rollback, or every
    shard answering again."""
    rolled = "the job was rolled back after its workers had finished: they run again from the newest checkpoint"
    if cluster.rollbacks != rollbacks:
        return rolled
    doubtful = (stats is not None and bool(stats.stopped)) or shards is None or not shards_readable(shards)
    if not doubtful or cluster.cfg.job.recovery == "fast":
        return None
    log.info("some of the job's records could not be read; waiting up to %.0fs for the chief to settle it",
             decide_s)
    deadline = time.monotonic() + decide_s
    while time.monotonic() < deadline:
        cluster.supervise()
        if cluster.rollbacks != rollbacks:
            return rolled
        if _answers_whole(cluster.chief_address):
            return "every shard answers again: reading the job's records again"
        time.sleep(0.2)
    return None


def _answers_whole(address: str) -> bool:
    """The chief runs the job (not stopped) and every shard's primary answers."""
    try:
        channel = open_channel(address)
        try:
            stats = pb_grpc.ChiefStub(channel).GetJobStats(pb.Empty(), timeout=5)
        finally:
            channel.close()
        return not stats.stopped and shards_readable(collect(address))
    except grpc.RpcError:
        return False
