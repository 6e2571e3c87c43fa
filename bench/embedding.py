"""Embedding benchmark: a DLRM-style click-through model (examples/ctr.py) with one table of ``rows`` x 16
fp32 shared by 26 Zipf-distributed sparse features, batch 256 (--batch), synthetic data (examples/ctr_data.py).

For each table size (default 2^20, 2^22, 2^24, 2^26 rows), in the same run:

- **ddp**: torch DistributedDataParallel over gloo, 2 ranks on loopback, the table an
  ``nn.EmbeddingBag(sparse=True)`` replicated on every rank (weights and Adagrad state: 2 x rows x 16 x 4
  bytes per rank). Run only where it fits: the two ranks' computed need (the table twice, plus what a
  rank holds besides, measured at the first size run) must stay under --ddp-budget-gib (default: half
  of MemAvailable at the start, as the host is shared). Where it does not fit, the line says so and
  gives the computed bytes per rank instead of a measurement.
- **shoal**: 2 servers + 2 workers (bench/_procs.py on loopback), the table built on the ``meta``
  device and served by the servers (never allocated on a worker), the same model, optimizer (Adagrad:
  the table's group lr 0.05, the dense group's 0.01) and batches, ``--mode`` (default async; sync takes
  the batches through DistributedSampler, as sync rounds wait for the workers holding a data task),
  ``--replicas`` (default 2: every table partition has a backup).

Reports samples/s over the timed window (both workers together), each worker's peak RSS (VmHWM from
/proc/<pid>/status, read by the worker itself after its last step), each server's VmHWM, the unique rows
a batch touches, and shoal's samples/s over DDP's at the same size (the ratio, same run). One JSON object
per case. ``--rounds N`` runs DDP and shoal N times per size, alternating, and reports the medians (and each
round's figure): on a shared host one round's ratio can be off by 2x.

    .venv/bin/python bench/embedding.py --sizes 20 22 --seconds 20                  # DDP and shoal at 2^20, 2^22
    .venv/bin/python bench/embedding.py --sizes 22 --seconds 20 --rounds 3         # medians of 3 rounds
    .venv/bin/python bench/embedding.py --sizes 20 22 24 26 --seconds 20           # the whole range (big: see free -g)
    .venv/bin/python bench/embedding.py --sizes 20 22 --only ddp                    # one side only
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import _procs
from _hosts import Placement
from _procs import CTX, Rank

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

DIM, INIT_STD, LR, TABLE_LR = 16, 0.05, 0.01, 0.05
POOL = 32                     # distinct batches per process, generated before the timed steps and cycled


def vm_hwm() -> int:
    """This process's peak resident set size in bytes (VmHWM)."""
    return _status_bytes("self", "VmHWM")


def _status_bytes(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def _batches(rows: int, batch: int, index: int, seed: int = 0) -> list:
    """``POOL`` batches for process ``index`` (disjoint samples per process), made before timing starts."""
    from ctr_data import CTRConfig, CTRDataset

    ds = CTRDataset(CTRConfig(rows=rows, seed=seed), "train", (index + 1) * POOL * batch)
    return [ds.batch(range((index * POOL + i) * batch, (index * POOL + i + 1) * batch)) for i in range(POOL)]


class _Pool(torch.utils.data.Dataset):
    """The workers' batches made up front, as a dataset the chief's tasks index (sync rounds need tasks:
    a round waits for the workers holding one). ``__getitems__`` gathers a batch from the made tensors."""

    def __init__(self, rows: int, batch: int, workers: int):
        parts = [b for i in range(workers) for b in _batches(rows, batch, i)]
        self.dense, self.ids, self.clicks = (torch.cat([b[k] for b in parts]) for k in range(3))

    def __len__(self) -> int:
        return len(self.clicks)

    def __getitems__(self, idx: list[int]):
        i = torch.as_tensor(idx)
        return self.dense[i], self.ids[i], self.clicks[i]


def _model(rows: int, table_device: str | None):
    import torch
    from ctr import DLRM, optimizers

    torch.manual_seed(0)
    model = DLRM(rows, DIM, init_std=INIT_STD, table_device=table_device)
    return model, optimizers(model, "adagrad", LR, TABLE_LR)[0]


class _Endless:
    """``batches[n]`` of :func:`_timed` from a DataLoader's iterations, one epoch after another."""

    def __init__(self, loader):
        self.loader, self.it = loader, iter(loader)

    def __len__(self) -> int:
        return 1 << 62

    def __getitem__(self, n: int):
        while True:
            try:
                return next(self.it)
            except StopIteration:
                self.it = iter(self.loader)


def _timed(step, batches: list, seconds: float, warmup: int, go_on=lambda in_time, n: in_time) -> tuple[float, int]:
    """(steps per second over ``seconds`` after ``warmup`` steps, steps timed)."""
    for i in range(warmup):
        step(*batches[i % len(batches)])
    n, start = 0, time.perf_counter()
    while go_on(time.perf_counter() - start < seconds, n):
        step(*batches[n % len(batches)])
        n += 1
    return n / (time.perf_counter() - start), n


def _ddp_rank(rank: Rank, rows: int, batch: int, seconds: float, warmup: int, out) -> None:
    rank.join()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.sparse.check_sparse_tensor_invariants.disable()
    batches = _batches(rows, batch, rank.rank)
    model, opt = _model(rows, None)
    ddp = torch.nn.parallel.DistributedDataParallel(model)

    def step(dense, ids, clicks):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(ddp(dense, ids), clicks).backward()
        opt.step()

    def go_on(in_time: bool, n: int) -> bool:
        if n % 8:                        # the ranks agree every 8 steps (or one waits in an allreduce alone)
            return True
        flag = torch.tensor([int(in_time)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag)

    rate, n = _timed(step, batches, seconds, warmup, go_on)
    out.put({"rank": rank.rank, "steps_per_s": rate, "steps": n, "vm_hwm": vm_hwm()})
    dist.destroy_process_group()


def _shoal_worker(namespace: str | None, index: int, chief: str, rows: int, batch: int, seconds: float,
                  warmup: int, mode: str, workers: int, barrier, out) -> None:
    from _hosts import enter

    enter(namespace)
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    from shoal.worker import DistributedOptimizer

    model, opt = _model(rows, "meta")             # the table on meta: its rows live on the servers
    opt = DistributedOptimizer(opt, model, chief=chief)
    if mode == "sync":                            # the batches through the chief's tasks, as a user's loop
        from ctr_data import collate
        from torch.utils.data import DataLoader

        from shoal.worker import DistributedSampler

        pool = _Pool(rows, batch, workers)
        loader = DataLoader(pool, batch_size=batch, collate_fn=collate, sampler=DistributedSampler(
            pool, batch_size=batch, epochs=10_000, shuffle=False))
        batches = _Endless(loader)
    else:
        batches = _batches(rows, batch, index)
    barrier.wait()

    def step(dense, ids, clicks):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(dense, ids), clicks).backward()
        opt.step()

    rate, n = _timed(step, batches, seconds, warmup)
    out.put({"rank": index, "steps_per_s": rate, "steps": n, "vm_hwm": vm_hwm()})
    opt.close()


def unique_rows(rows: int, batch: int) -> float:
    """Mean distinct table rows a batch of the pool touches (what a step pulls and pushes)."""
    import numpy as np

    return float(np.mean([len(np.unique(ids.numpy())) for _, ids, _ in _batches(rows, batch, 0)]))


def _collect(out, procs: list, timeout_s: float) -> list[dict]:
    """Each process's result, by rank; fails at once when one of them ends without giving one."""
    import queue

    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                _procs.join(procs, 10)
                raise RuntimeError(f"process {dead[0].pid} ended with status {dead[0].exitcode} before its "
                                   f"result (its traceback is above)") from None
            if time.monotonic() > deadline:
                _procs.join(procs, 10)
                raise RuntimeError(f"no result from {len(procs) - len(results)} process(es) in {timeout_s:.0f}s")
    return sorted(results, key=lambda r: r["rank"])


def run_ddp(rows: int, args: argparse.Namespace) -> dict:
    out = CTX.Queue()
    procs = _procs.start_ranks(_ddp_rank, Placement(), args.workers, rows, args.batch, args.seconds, args.warmup, out)
    results = _collect(out, procs, args.timeout)
    _procs.join(procs, args.timeout)
    return {"samples_per_s": sum(r["steps_per_s"] for r in results) * args.batch,
            "worker_vm_hwm_bytes": [r["vm_hwm"] for r in results], "steps": [r["steps"] for r in results]}


def run_shoal(rows: int, args: argparse.Namespace) -> dict:
    place = Placement()
    with _procs.start_servers(place, args.ps, args.mode, args.replicas) as servers:
        out, barrier = CTX.Queue(), CTX.Barrier(args.workers + 1)
        procs = _procs.start_workers(_shoal_worker, place, args.workers, servers.chief, rows, args.batch,
                                     args.seconds, args.warmup, args.mode, args.workers, barrier, out)
        barrier.wait(timeout=args.timeout)
        results = _collect(out, procs, args.timeout)
        server_hwm = [_status_bytes(p.pid, "VmHWM") for p in servers.procs[1:]]
        _procs.join(procs, args.timeout)
    return {"samples_per_s": sum(r["steps_per_s"] for r in results) * args.batch,
            "worker_vm_hwm_bytes": [r["vm_hwm"] for r in results], "server_vm_hwm_bytes": server_hwm,
            "steps": [r["steps"] for r in results]}


def table_bytes(rows: int) -> int:
    return rows * DIM * 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24, 26], help="log2 of the table's rows")
    p.add_argument("--batch", type=int, default=256, help="samples per step and worker")
    p.add_argument("--seconds", type=float, default=20.0, help="timed seconds per case")
    p.add_argument("--warmup", type=int, default=5, help="steps before the timed window")
    p.add_argument("--workers", type=int, default=2, help="shoal workers and DDP ranks")
    p.add_argument("--ps", type=int, default=2, help="parameter servers")
    p.add_argument("--mode", default="async", choices=["async", "sync"],
                   help="shoal's mode (sync: the workers take the pool's batches through the chief's tasks)")
    p.add_argument("--replicas", type=int, default=2, help="copies of every shard (2: a backup each)")
    p.add_argument("--only", choices=["ddp", "shoal"], help="run one side only")
    p.add_argument("--ddp-budget-gib", type=float, default=None,
                   help="run DDP only where its ranks' computed need stays under this (default: MemAvailable/2)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of DDP + shoal per size; medians are reported (this host's speed drifts)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a case's processes")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    budget = int((args.ddp_budget_gib * 2 ** 30) if args.ddp_budget_gib else mem_available() // 2)
    ddp_rest = None           # what a DDP rank holds besides its table and Adagrad state (measured)
    for log2 in args.sizes:
        rows = 2 ** log2
        line = {"rows": rows, "log2_rows": log2, "dim": DIM, "batch": args.batch, "workers": args.workers,
                "unique_rows_per_batch": round(unique_rows(rows, args.batch), 1),
                "table_bytes": table_bytes(rows)}
        need = None if ddp_rest is None else 2 * table_bytes(rows) + ddp_rest
        ddp_fits = args.only != "shoal" and not (need is not None and need * args.workers > budget)
        ddp_runs, shoal_runs = [], []
        for _ in range(args.rounds):          # DDP then shoal in each round: a ratio is to its own round's DDP
            if ddp_fits:
                ddp_runs.append(run_ddp(rows, args))
                rest = max(ddp_runs[-1]["worker_vm_hwm_bytes"]) - 2 * table_bytes(rows)
                ddp_rest = rest if ddp_rest is None else max(ddp_rest, rest)
            if args.only != "ddp":
                shoal_runs.append(run_shoal(rows, args))
        if args.only != "shoal":
            if ddp_fits:
                ddp = {"ran": True, **_merged(ddp_runs), "computed_bytes_per_rank": 2 * table_bytes(rows) + ddp_rest}
            else:
                ddp = {"ran": False, "computed_bytes_per_rank": need,
                       "why": f"{args.workers} ranks x {need / 2 ** 30:.2f} GiB > budget {budget / 2 ** 30:.1f} GiB"}
            print(json.dumps({"case": "ddp-gloo", **line, **_rounded(ddp)}), flush=True)
        if shoal_runs:
            ratios = [s["samples_per_s"] / d["samples_per_s"] for s, d in zip(shoal_runs, ddp_runs)]
            print(json.dumps({"case": f"shoal-{args.mode}", "ps": args.ps, "replicas": args.replicas, **line,
                              **_rounded(_merged(shoal_runs)),
                              "ratio_vs_ddp": round(statistics.median(ratios), 2) if ratios else None,
                              "ratio_per_round": [round(r, 2) for r in ratios]}), flush=True)


def _merged(runs: list[dict]) -> dict:
    """Rounds of one case: the median samples/s (and each round's), the peak memory over all rounds."""
    out = {"samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
           "samples_per_s_per_round": [round(r["samples_per_s"], 1) for r in runs]}
    for key in ("worker_vm_hwm_bytes", "server_vm_hwm_bytes"):
        if key in runs[0]:
            out[key] = [max(v) for v in zip(*(r[key] for r in runs))]
    out["steps"] = [r["steps"] for r in runs]
    return out


def _rounded(d: dict) -> dict:
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in d.items()}


if __name__ == "__main__":
    main()
