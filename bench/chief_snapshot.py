"""What a journal compaction costs the chief (issue 17): one whole snapshot of a big job's state.

The chief's journal appends changes and now and then writes the whole state instead (compaction,
chief/journal.py). That write runs on the chief's event loop, so every call waiting meanwhile waits
for it: its wall time is a stall in the heartbeat latency tail. Per size (workers; 4 servers on
top), one process builds a :class:`ChiefState` whose dataset has ``--tasks-per-worker`` tasks per
worker, hands out and finishes ``--done`` of them, leaves two in flight per worker, then times (the
median of ``--repeat``) the parts of one compaction: ``to_dict``, ``json.dumps``, the SQLite write,
and the whole ``Journal.write(journal_snapshot())``; then the bytes, and a restart's ``load`` plus
``ChiefState.from_dict``.

``--tree DIR`` runs every size again with another checkout's ``shoal`` first on ``PYTHONPATH`` (a
tree with ``shoal/{ps,chief,worker,proto}`` linked as ``scripts/mutate.py`` makes them), in the same
run, and adds a line per size with the ratios (other tree over this one).

    .venv/bin/python bench/chief_snapshot.py                          # 100, 1000, 10000 workers
    git worktree add /tmp/old 5caa64d && for d in proto ps worker chief; do ln -s ../$d /tmp/old/shoal/$d; done
    .venv/bin/python bench/chief_snapshot.py --sizes 1000,10000 --tree /tmp/old
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_case(n: int, tasks_per_worker: int, done_frac: float, repeat: int) -> dict:
    from shoal.chief.journal import Journal
    from shoal.chief.state import ChiefState
    from shoal.chief.tasks import DatasetSpec
    from shoal.settings.config import JobConfig
    from shoal.state.layout import ModelLayout, TensorSpec
    import shoal.chief.state as state_mod

    logging.disable(logging.CRITICAL)
    gc.collect()
    gc.freeze()             # as `shoal chief` does once started (cli/main.py); the state comes after
    now = [1000.0]
    state = ChiefState(JobConfig(num_shards=4, lease_seconds=3.0), lambda: now[0])
    for i in range(4):
        state.join_ps(f"127.0.0.1:{7000 + i}")
    layout = ModelLayout([TensorSpec("w", (1000,), "float32")])
    workers = [state.join_worker(layout).member_id for _ in range(n)]
    spec = DatasetSpec(size=tasks_per_worker * n, batch_size=1, epochs=1, batches_per_task=1)
    to_finish = int(done_frac * tasks_per_worker * n)
    held: dict[str, tuple] = {w: () for w in workers}
    finished = 0
    while finished < to_finish:
        for w in workers:
            got, _ = state.take_tasks(w, spec, 1, done=held[w], known=frozenset(held[w]))
            finished += len(held[w])
            held[w] = tuple(t.task_id for t in got)
            if finished >= to_finish:
                break
    for w in workers:                       # two in flight per worker
        state.take_tasks(w, spec, 2, done=held[w], known=frozenset(held[w]))
    parts: dict[str, list[float]] = {"to_dict_ms": [], "json_ms": [], "write_ms": [], "compaction_ms": []}
    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal(Path(tmp) / "chief.db")
        for _ in range(repeat):
            t0 = time.perf_counter()
            d = state.journal_snapshot()
            t1 = time.perf_counter()
            text = json.dumps(d, separators=(",", ":"))
            t2 = time.perf_counter()
            journal._write([("snapshot", text)], "bench")
            t3 = time.perf_counter()
            journal.write(state.journal_snapshot(), "bench")
            t4 = time.perf_counter()
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[k].append(1e3 * v)
        journal.close()
        t0 = time.perf_counter()
        loaded = Journal(Path(tmp) / "chief.db").load()
        ChiefState.from_dict(loaded, lambda: now[0], recover=True)
        restart_ms = 1e3 * (time.perf_counter() - t0)
    return {"workers": n, "tasks": tasks_per_worker * n, "tasks_done": state.tasks.done_count,
            "state_format": state_mod.STATE_FORMAT, "snapshot_bytes": len(text),
            **{k: statistics.median(v) for k, v in parts.items()}, "restart_load_ms": restart_ms,
            "repeat": repeat}


def run_sizes(sizes: list[int], args, tree: Path | None) -> list[dict]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    rows = []
    for n in sizes:
        cmd = [sys.executable, __file__, "--case", str(n), "--tasks-per-worker", str(args.tasks_per_worker),
               "--done", str(args.done), "--repeat", str(args.repeat)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=tree or ROOT)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["tree"] = str(tree) if tree else "this"
        if args.label:
            row["label"] = args.label
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--tasks-per-worker", type=int, default=100)
    ap.add_argument("--done", type=float, default=0.5, help="fraction of the tasks finished before measuring")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tree", type=Path, help="also run every size against this checkout, for ratios")
    ap.add_argument("--label", default="")
    ap.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.tasks_per_worker, args.done, args.repeat)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    mine = run_sizes(sizes, args, None)
    if args.tree:
        other = run_sizes(sizes, args, args.tree.resolve())
        for a, b in zip(mine, other):
            print(json.dumps({"workers": a["workers"], "ratio": f"{b['tree']} over this",
                              **{k: b[k] / a[k] for k in ("snapshot_bytes", "to_dict_ms", "json_ms", "write_ms",
                                                          "compaction_ms", "restart_load_ms")}}), flush=True)


if __name__ == "__main__":
    main()
