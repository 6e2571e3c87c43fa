"""The replicated push's critical path (issue 16): the primary's own step while the update travels to the
backup (``Replicator.start``/``finish``), against the backup first and then the primary (a plain callable).

One primary shard of ``--numel`` fp32 elements (plain SGD) and a backup ``ShardHost`` in this process,
joined by the replicator's gRPC stubs stood in for by direct calls (as tests/unit/test_replication_edges.py
does): no sockets, so what is measured is the CPU on the critical path (the update's frames, the backup's
decode and step, the primary's step), not a network. Pushes alternate between the two ways, ``--pushes``
of each; each push's wall time from ``push()`` to its acknowledgement. One JSON object per case, then the
ratio (serial over overlapped: > 1 means the overlap is faster).

    .venv/bin/python bench/replication_overlap.py [--numel 4194304] [--pushes 40] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


class DirectBackup:
    """The backup's replication calls, made directly on its ShardHost (what its servicer does on a call)."""

    def __init__(self, host):
        self.host = host

    def _replicate(self, frames):
        from shoal.proto import shoal_pb2 as pb
        from shoal.ps.update_wire import update_from_frames
        head, u = update_from_frames(iter(frames))
        return pb.ReplicateReply(version=self.host.replicate(head, u)).SerializeToString()

    def replicate_one(self, frame, timeout=None):
        return self._replicate([frame])

    def replicate(self, frame_iter, timeout=None):
        return self._replicate(list(frame_iter))

    def install(self, frame_iter, timeout=None):
        from shoal.proto import shoal_pb2 as pb
        from shoal.ps.replication import install_from_frames
        head, data = install_from_frames(frame_iter)
        return pb.ReplicateReply(version=self.host.install_copy(head, data)).SerializeToString()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=4 << 20)
    p.add_argument("--pushes", type=int, default=40)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a ps runs its steps on few)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from shoal.settings.config import JobConfig, OptimizerSpec
    from shoal.ps.consistency import AsyncRule
    from shoal.ps.host import ShardHost
    from shoal.ps.replication import Replicator, install_frames, replica_bytes
    from shoal.ps.shard import Shard

    primary = Shard(0, torch.zeros(args.numel), OptimizerSpec("sgd", {"lr": 0.01}), AsyncRule(), "fp")
    backup = ShardHost()
    backup.member_id, backup.job, backup.primary_of = "ps-1", JobConfig(mode="async"), {0: "ps-0"}
    stubs = DirectBackup(backup)
    stubs.install(install_frames(0, "ps-0", primary.version, primary.fingerprint,
                                 replica_bytes(primary.export_replica()), 1 << 20))
    r = Replicator(0, lambda: "ps-0", lambda: primary, chunk_bytes=1 << 20)
    r._target, r._stubs, r._negotiated, r._state = ("ps-1", "backup:1"), stubs, True, "in_sync"
    ways = {"overlapped": r, "serial": lambda u: r(u)}      # a plain callable: the backup first
    grad = torch.randn(args.numel)
    times: dict[str, list[float]] = {k: [] for k in ways}
    version = 0
    try:
        for i in range(2 * args.pushes + 4):
            name = list(ways)[i % 2]
            primary.replicator = ways[name]
            t0 = time.perf_counter()
            reply = primary.push("w", version, grad, key=f"k{i}")
            took = time.perf_counter() - t0
            assert reply.accepted, reply
            version = reply.version
            if i >= 4:                                      # the first two of each: warm-up
                times[name].append(took)
        same = backup.shards[0].digest() == primary.digest()
    finally:
        r.close()
        backup.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(json.dumps({"case": k, "numel": args.numel, "pushes": len(v), "push_ms_median": round(1e3 * med[k], 2),
                          "push_ms_p90": round(1e3 * sorted(v)[int(0.9 * len(v))], 2), "replicas_identical": same}))
    print(json.dumps({"case": "ratio", "serial_over_overlapped": round(med["serial"] / med["overlapped"], 3)}))


if __name__ == "__main__":
    main()
