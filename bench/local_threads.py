"""``shoal local`` with 2 workers against one process, before and after each worker's thread share.

    .venv/bin/python bench/local_threads.py --epochs 8 --mode sync

Cases (one JSON object each), all on ``examples/cnn_bn.py`` (a CNN with BatchNorm, Adam, a shuffled
DataLoader, an evaluation per epoch):

- ``one_process``: ``python examples/cnn_bn.py``, torch's default threads (every core);
- ``one_process_1_thread``: the same with ``OMP_NUM_THREADS=1``;
- ``local_all_cores`` (before): ``shoal local --workers 2`` with ``OMP_NUM_THREADS`` set to this host's
  core count, torch's default, which every worker had before ``shoal local`` set it;
- ``local_shared_cores`` (after): ``shoal local --workers 2`` without ``OMP_NUM_THREADS``: each worker
  gets its share of the cores (cli/threads.py).

Each prints ``wall_s`` (the command's wall time), the test accuracy and ``vs_one_process`` (wall time
over the one-process run's); the ``after`` case also ``vs_before``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "cnn_bn.py")


def _env(threads: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SHOAL_CHIEF")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def one_process(epochs: int, threads: int | None = None) -> dict:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, SCRIPT, "--epochs", str(epochs)], env=_env(threads), capture_output=True,
                         text=True, timeout=1800, cwd=ROOT / "examples")
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    acc = float(re.findall(r"^test accuracy ([0-9.]+)", out.stderr + out.stdout, re.M)[-1])
    return {"wall_s": round(wall, 1), "test_accuracy": acc}


def local(epochs: int, mode: str, threads: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        summary = Path(tmp) / "summary.json"
        t0 = time.monotonic()
        with open(Path(tmp) / "local.log", "w") as log:
            rc = subprocess.run([sys.executable, "-m", "shoal.cli", "local", "--ps", "2", "--workers", "2",
                                 "--mode", mode, "--summary", str(summary), "--run-dir", str(Path(tmp) / "run"),
                                 SCRIPT, "--epochs", str(epochs)], env=_env(threads), stdout=log,
                                stderr=subprocess.STDOUT, timeout=1800).returncode
        wall = time.monotonic() - t0
        if rc != 0:
            raise RuntimeError(f"shoal local failed ({rc}):\n" + (Path(tmp) / "local.log").read_text()[-3000:])
        s = json.loads(summary.read_text())
        return {"wall_s": round(wall, 1), "test_accuracy": s.get("test_accuracy"), "steps": s.get("steps"),
                "exactly_once": s.get("exactly_once")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--mode", default="sync")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(json.dumps({"load_average_1m": os.getloadavg()[0]}), flush=True)
    base = one_process(args.epochs)
    print(json.dumps({"case": "one_process", "epochs": args.epochs, "cores": cores, **base}), flush=True)
    one = one_process(args.epochs, threads=1)
    print(json.dumps({"case": "one_process_1_thread", "epochs": args.epochs, **one,
                      "vs_one_process": round(one["wall_s"] / base["wall_s"], 2)}), flush=True)
    before = local(args.epochs, args.mode, threads=cores)
    print(json.dumps({"case": "local_all_cores", "mode": args.mode, "epochs": args.epochs, "threads_per_worker": cores,
                      **before, "vs_one_process": round(before["wall_s"] / base["wall_s"], 2)}), flush=True)
    after = local(args.epochs, args.mode, threads=None)
    print(json.dumps({"case": "local_shared_cores", "mode": args.mode, "epochs": args.epochs,
                      "threads_per_worker": max(1, cores // 2), **after,
                      "vs_one_process": round(after["wall_s"] / base["wall_s"], 2),
                      "vs_before": round(after["wall_s"] / before["wall_s"], 2)}), flush=True)


if __name__ == "__main__":
    main()
