"""A table partition's server-side cost (issue 35): lookup + apply of a batch against the table's size, and the
bytes of an incremental snapshot against a full one.

``apply`` cases: one :class:`shoal.ps.tables.RowTable` (fixed, ``--dim`` fp32, ``--optimizer``) of 2^20 .. 2^26
rows; each step looks up and applies a batch of ``--batch`` unique ids drawn uniformly from the table's ids.
``lazy``: nothing stored before the timed steps (a fresh table: untouched rows cost nothing, a lookup returns
their initial value and an apply stores them). ``stored``: every row of the table stored first (up to
``--stored-max`` rows; memory grows with it). CPU seconds of this process (``time.process_time``) per step,
median over ``--steps`` after ``--warmup``; ``ratio`` is the case's lookup+apply over the 2^20 case of the same
kind, in the same run.

``idmap`` case: the id -> slot map alone, :class:`shoal.ps.tables.idmap.IdMap` (numpy, open addressing)
against a Python ``dict`` (the stdlib alternative), finding a batch of ids in a map of 2^20 and 2^22 entries:
CPU per find and bytes per entry (``tracemalloc`` for the dict, array bytes for the map). Each case also reports
the process's peak RSS so far (VmHWM).

``snapshot`` case: a fixed table of ``--snapshot-rows`` (2^26) rows; ``--stored`` of them stored first (a
trained table), then a mark, then ``--snapshot-steps`` (1,000) steps of ``--batch`` Zipf(``--zipf``) ids
(ranks scattered over the table by a bijective multiply), then the incremental snapshot since the mark. Its
``to_bytes`` length is set against the full snapshot: measured for the stored rows, and for all 2^26 rows
stored computed from the measured bytes per row of the same format (materialising 2^26 rows with their state
takes ~13 GB): the measured full snapshot's header plus its arrays' bytes per row times 2^26. One JSON
object per case.

    .venv/bin/python bench/table_apply.py [--sizes 20 22 24 26] [--steps 30] [--cases apply idmap snapshot]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc

import numpy as np

from shoal.ps.tables import RowTable, TableSpec
from shoal.ps.tables.idmap import IdMap


def peak_rss_mb() -> float:
    """This process's peak resident set so far (VmHWM), MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def populate(table: RowTable, ids: np.ndarray, chunk: int = 1 << 18) -> None:
    dim = table.spec.dim
    zero = np.zeros((chunk, dim), np.float32)
    for a in range(0, ids.size, chunk):
        part = np.sort(ids[a:a + chunk])
        table.apply(part, zero[:part.size], 0)


def apply_case(log2: int, kind: str, args, rng) -> dict:
    n = 1 << log2
    spec = TableSpec("t", args.dim, n, args.optimizer, {}, init_std=0.05, seed=1)
    table = RowTable(spec, 0, 1)
    if kind == "stored":
        populate(table, np.arange(n, dtype=np.int64))
    stored_before = table.rows
    look, app = [], []
    for step in range(args.warmup + args.steps):
        ids = np.sort(rng.choice(n, size=args.batch, replace=False).astype(np.int64))
        grads = rng.standard_normal((ids.size, args.dim)).astype(np.float32)
        lt = cpu(lambda: table.lookup(ids))
        at = cpu(lambda: table.apply(ids, grads, step + 1))
        if step >= args.warmup:
            look.append(lt)
            app.append(at)
    lk, ap = statistics.median(look) * 1e3, statistics.median(app) * 1e3
    return {"case": "apply", "kind": kind, "rows": n, "log2_rows": log2, "stored_before": stored_before,
            "stored_after": table.rows, "batch": args.batch, "dim": args.dim, "optimizer": args.optimizer,
            "lookup_ms": round(lk, 3), "apply_ms": round(ap, 3), "lookup_apply_ms": round(lk + ap, 3),
            "table_nbytes": table.nbytes, "bytes_per_row": table.bytes_per_row, "steps": args.steps}


def idmap_case(log2: int, args, rng) -> dict:
    n = 1 << log2
    keys = rng.choice(1 << 40, size=n, replace=False).astype(np.int64)
    m = IdMap()
    insert_s = cpu(lambda: m.insert(keys, np.arange(n, dtype=np.int64)))
    tracemalloc.start()
    d = dict(zip(keys.tolist(), range(n)))
    dict_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    finds_np, finds_dict = [], []
    for _ in range(args.steps):
        q = np.unique(np.concatenate([keys[rng.integers(0, n, args.batch // 2)],
                                      rng.integers(1 << 41, 1 << 42, args.batch // 2)]))
        got = {}
        finds_np.append(cpu(lambda: got.setdefault("np", m.find(q))))
        finds_dict.append(cpu(lambda: got.setdefault("dict", np.array([d.get(k, -1) for k in q.tolist()]))))
        assert (got["np"] == got["dict"]).all()
    f_np, f_d = statistics.median(finds_np) * 1e3, statistics.median(finds_dict) * 1e3
    out = {"case": "idmap", "entries": n, "batch": int(q.size), "find_ms_numpy": round(f_np, 3),
           "find_ms_dict": round(f_d, 3), "ratio_numpy_over_dict": round(f_np / f_d, 3),
           "bytes_per_entry_numpy": round(m.nbytes / n, 1), "bytes_per_entry_dict": round(dict_bytes / n, 1),
           "insert_s_numpy": round(insert_s, 3)}
    del d
    return out


def zipf_ranks(rng, size: int, vocab: int, s: float) -> np.ndarray:
    """Ranks 1..vocab with P(k) ~ k^-s (inverse CDF of the continuous power law on [1/2, vocab + 1/2])."""
    a, b = 0.5 ** (1 - s), (vocab + 0.5) ** (1 - s)
    x = (a + rng.random(size) * (b - a)) ** (1 / (1 - s))
    return np.clip(np.rint(x).astype(np.int64), 1, vocab)


def snapshot_case(args, rng) -> dict:
    n = args.snapshot_rows
    assert n & (n - 1) == 0, "a power of two, for the bijective scatter"
    spec = TableSpec("t", args.dim, n, args.optimizer, {}, init_std=0.05, seed=1)
    table = RowTable(spec, 0, 1)
    populate(table, rng.choice(n, size=args.stored, replace=False).astype(np.int64))
    mark = table.mark()
    full = table.snapshot(None)
    full_stored = len(full.to_bytes())
    per_row = full.nbytes / full.ids.size            # the arrays' bytes per row; the rest is the header
    header = full_stored - full.nbytes
    del full
    scatter = np.int64(0x9E3779B1)                      # odd: k -> k * c mod 2^k is a bijection
    touched = 0
    t0 = time.process_time()
    for step in range(args.snapshot_steps):
        ranks = zipf_ranks(rng, args.batch, n, args.zipf)
        ids = np.unique((ranks * scatter) & np.int64(n - 1))
        touched += ids.size
        table.apply(ids, rng.standard_normal((ids.size, args.dim)).astype(np.float32) * 0.01, step + 1)
    steps_cpu = time.process_time() - t0
    inc = table.snapshot(mark)
    inc_bytes = len(inc.to_bytes())
    full_all = header + per_row * n
    return {"case": "snapshot", "rows": n, "stored_before": args.stored, "steps": args.snapshot_steps,
            "batch_draws": args.batch, "zipf": args.zipf, "ids_applied": touched, "rows_changed": int(inc.ids.size),
            "incremental_bytes": inc_bytes, "full_bytes_stored_rows": full_stored,
            "snapshot_bytes_per_row": round(per_row, 2), "full_bytes_all_rows_computed": int(full_all),
            "ratio_incremental_over_full_all_rows": round(inc_bytes / full_all, 4),
            "ratio_incremental_over_full_stored": round(inc_bytes / full_stored, 4),
            "apply_cpu_s_per_step": round(steps_cpu / args.snapshot_steps, 5), "table_nbytes": table.nbytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24, 26], help="log2 of the table's rows")
    p.add_argument("--stored-max", type=int, default=22, help="log2 of the largest table stored in full")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--optimizer", default="adagrad")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cases", nargs="+", default=["apply", "idmap", "snapshot"])
    p.add_argument("--snapshot-rows", type=int, default=1 << 26)
    p.add_argument("--stored", type=int, default=1 << 21, help="rows stored before the snapshot case's mark")
    p.add_argument("--snapshot-steps", type=int, default=1000)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    if "apply" in args.cases:
        for kind in ("lazy", "stored"):
            base = None
            for log2 in args.sizes:
                if kind == "stored" and log2 > args.stored_max:
                    continue
                r = apply_case(log2, kind, args, rng)
                base = base or r["lookup_apply_ms"]
                r["ratio_vs_first_size"] = round(r["lookup_apply_ms"] / base, 3)
                r["peak_rss_mb"] = peak_rss_mb()
                print(json.dumps(r), flush=True)
    if "idmap" in args.cases:
        for log2 in (20, 22):
            print(json.dumps({**idmap_case(log2, args, rng), "peak_rss_mb": peak_rss_mb()}), flush=True)
    if "snapshot" in args.cases:
        print(json.dumps({**snapshot_case(args, rng), "peak_rss_mb": peak_rss_mb()}), flush=True)


if __name__ == "__main__":
    main()
