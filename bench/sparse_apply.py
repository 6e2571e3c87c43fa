"""Server CPU per top-k update: the sparse server path against the dense one, in the same run (issue 16).

One shard of ``--numel`` fp32 elements with plain SGD (what momentum
correction leaves a top-k job's server with). Each update is top-k payloads
(``--ratios``) taken the way a ps takes them: ``PushAssembly`` checks the
header, decodes the chunk and offers it to the shard, which applies it and
records it in its change log; after each update a worker's delta pull since
the previous version (``Shard.delta``) is timed too. ``dense`` is the path
before issue 16, run by the same code: the chunk decoded into a zeroed dense
buffer, the dense SGD step, a ``!= 0`` scan into the change log, and delta
pulls that scan the per-element versions. ``sparse`` is the new path. CPU
seconds of this process (``time.process_time``, torch on one thread), per
update, median over ``--updates``; ``sync`` rounds take ``--workers`` pushes
each. Both runs start from the same weights and take the same payloads; the
final digests must match. One JSON object per case.

    .venv/bin/python bench/sparse_apply.py [--numel 4194304] [--ratios 0.01 0.001] [--updates 40]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from shoal import codecs
from shoal.settings.config import OptimizerSpec
from shoal.proto import shoal_pb2 as pb
from shoal.ps import changes
from shoal.ps.consistency import AsyncRule, SyncRule
from shoal.ps.servicer import PushAssembly
from shoal.ps.shard import Shard
from shoal.net.wire import decode_chunk


class _Host:
    completed_epochs = 0

    def __init__(self, shard: Shard):
        self.shard = shard

    def get(self, _):
        return self.shard

    def count(self, **_):
        pass


class _Servicer:
    def __init__(self, shard: Shard):
        self.host = _Host(shard)

    def batches_of(self, _):
        return ()


def run(path: str, mode: str, weights: torch.Tensor, rounds: list[list[bytes]]) -> tuple[list, list, tuple]:
    workers = [f"w{i}" for i in range(len(rounds[0]))]
    shard = Shard(0, weights.clone(), OptimizerSpec("sgd", {"lr": 0.1}), SyncRule() if mode == "sync" else AsyncRule(),
                  "fp")
    shard.set_live_workers(workers)
    servicer = _Servicer(shard)
    # the dense path as it was: no index lists kept, every delta pull scans
    changes.RECENT_ENTRIES = 0.0 if path == "dense" else 0.25
    n = weights.numel()
    apply_s, delta_s = [], []
    for r, payloads in enumerate(rounds):
        t0 = time.process_time()
        for w, payload in zip(workers, payloads):
            head = pb.PushHeader(shard=0, worker_id=w, key=f"{w}-{r}", version=shard.version, offset=0, numel=n,
                                 codec="topk", layout_fingerprint="fp")
            push = PushAssembly(servicer)
            push.check(head)
            if path == "dense":
                push.place(head, decode_chunk("topk", memoryview(payload), n), fresh=True)
            else:
                push.place_encoded(head, memoryview(payload))
            assert push.finish(len(payload)).accepted
        t1 = time.process_time()
        got = shard.delta("none", shard.version - 1)
        t2 = time.process_time()
        assert shard.version == r + 1 and (r == 0 or got is not None)
        apply_s.append(t1 - t0)
        delta_s.append(t2 - t1)
    changes.RECENT_ENTRIES = 0.25
    assert shard.stats.sparse_updates == (len(rounds) if path == "sparse" else 0)
    return apply_s[3:], delta_s[3:], shard.digest()     # the first few warm caches and allocators up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.001])
    p.add_argument("--modes", nargs="+", default=["async", "sync"])
    p.add_argument("--workers", type=int, default=2, help="pushes per sync round")
    p.add_argument("--updates", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    weights = torch.from_numpy(rng.standard_normal(args.numel).astype(np.float32))
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)   # noqa: E731
    for ratio in args.ratios:
        codec = codecs.compressor_from_tag("topk", error_feedback=False, ratio=ratio)
        for mode in args.modes:
            per_round = args.workers if mode == "sync" else 1
            rounds = [[codec.compress(0, torch.from_numpy(rng.standard_normal(args.numel).astype(np.float32)))
                       for _ in range(per_round)] for _ in range(args.updates + 3)]
            dense = run("dense", mode, weights, rounds)
            sparse = run("sparse", mode, weights, rounds)
            print(json.dumps({
                "case": f"topk {ratio:g} {mode}", "numel": args.numel, "k": codec.codec.k(args.numel),
                "pushes_per_update": per_round, "updates": args.updates, "torch_threads": 1,
                "dense_cpu_ms_per_update": ms(dense[0]), "sparse_cpu_ms_per_update": ms(sparse[0]),
                "update_cpu_ratio_dense_over_sparse": round(statistics.median(dense[0]) / statistics.median(sparse[0]), 1),
                "dense_cpu_ms_per_delta_pull": ms(dense[1]), "sparse_cpu_ms_per_delta_pull": ms(sparse[1]),
                "delta_cpu_ratio_dense_over_sparse": round(statistics.median(dense[1]) / statistics.median(sparse[1]), 1),
                "identical_weights": dense[2] == sparse[2]}), flush=True)


if __name__ == "__main__":
    main()
