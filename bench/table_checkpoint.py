"""Table checkpoints: bytes a checkpoint of an embedding table writes, full against incremental.

Drives the shards' table partitions (ps/shard_tables.py over ps/tables' RowTable, what a parameter
server runs) with the row gradients of DLRM batches from examples/ctr_data.py (26 Zipf-distributed
ids a sample into one table), split over ``--shards`` partitions as a job does. After ``--warmup``
steps it takes the checkpoint a server takes first (a full snapshot of every row held), trains
``--steps`` more, and takes the next one (the rows changed since the full one). Prints one JSON
object per case: the bytes each wrote, and the incremental one's over the full one's (the ratio), next
to what a checkpoint of the whole table would be (every row of ``--rows``, as a dense table writes).

    .venv/bin/python bench/table_checkpoint.py --rows 67108864 --steps 1000
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from ctr_data import CTRConfig, CTRDataset  # noqa: E402

from shoal.ps.shard_tables import ShardTables  # noqa: E402
from shoal.state.tables import split_by_shard, sum_rows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2 ** 26)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1000, help="steps before the full checkpoint")
    p.add_argument("--steps", type=int, default=1000, help="steps between the full and the incremental one")
    p.add_argument("--optimizer", default="adagrad", choices=("sgd", "adagrad", "adam", "ftrl"))
    p.add_argument("--zipf", type=float, default=1.05)
    args = p.parse_args()

    data = CTRDataset(CTRConfig(rows=args.rows, seed=0, zipf=args.zipf), "train", (args.warmup + args.steps) *
                      args.batch)
    spec = {"name": "table", "dim": args.dim, "num_embeddings": args.rows, "optimizer": args.optimizer,
            "hyper": {"alpha": 0.05} if args.optimizer == "ftrl" else {"lr": 0.05}, "init_std": 0.05,
            "seed": 0, "evict_after_steps": None, "evict_min_count": 0}
    shards = [ShardTables(k) for k in range(args.shards)]
    for s in shards:
        s.declare([spec], args.shards)
    rng = np.random.default_rng(0)

    def train(first: int, n: int) -> None:
        for step in range(first, first + n):
            _, ids, _ = data.batch(np.arange(step * args.batch, (step + 1) * args.batch))
            uniq, grads = sum_rows([(ids.numpy().reshape(-1),
                                     rng.standard_normal((ids.numel(), args.dim)).astype(np.float32) * 0.01)],
                                   args.dim)
            for k, pos in split_by_shard(uniq, args.shards).items():
                shards[k].apply((("table", uniq[pos], grads[pos]),), step + 1)

    def checkpoint() -> tuple[int, int, str]:
        out = [s.checkpoint_snapshots()["table"] for s in shards]
        for k, snap in enumerate(out):
            shards[k].checkpoint_written("table", snap["kind"], snap["mark"], {"version": 0})
        return sum(len(o["data"]) for o in out), sum(o["rows"] for o in out), out[0]["kind"]

    t0 = time.perf_counter()
    train(0, args.warmup)
    full_bytes, full_rows, kind0 = checkpoint()
    train(args.warmup, args.steps)
    inc_bytes, inc_rows, kind1 = checkpoint()
    held = sum(s.tables["table"].rows for s in shards)
    bpr = shards[0].tables["table"].bytes_per_row
    whole = args.rows * bpr
    common = {"rows": args.rows, "dim": args.dim, "optimizer": args.optimizer, "shards": args.shards,
              "batch": args.batch, "ids_per_sample": 26, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps({"case": "table-checkpoint-full", **common, "kind": kind0, "after_steps": args.warmup,
                      "rows_written": full_rows, "bytes": full_bytes}), flush=True)
    print(json.dumps({"case": "table-checkpoint-incremental", **common, "kind": kind1,
                      "after_steps": args.steps, "rows_written": inc_rows, "bytes": inc_bytes,
                      "ratio_vs_full": round(inc_bytes / full_bytes, 4),
                      "rows_held": held, "bytes_per_row": bpr, "whole_table_bytes": whole,
                      "ratio_vs_whole_table": round(inc_bytes / whole, 6)}), flush=True)


if __name__ == "__main__":
    main()
