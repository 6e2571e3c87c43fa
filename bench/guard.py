"""What the update guard (ps/guard.py) costs a shard's apply: one dense step of a flat shard with the
guard (gradient norm, state saved, finiteness checked after) against the bare optimizer step, in the same
run, per optimizer and shard size. Prints one JSON object per case with the ratio.

    .venv/bin/python bench/guard.py [--numel 1000000 4000000] [--reps 30] [--optimizers sgd adam]

The guard's cost is memory traffic: the norm reads the gradient once, the save copies the weights and
the optimizer's state (reused buffers), the check reads them again.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shoal.config import OptimizerSpec
from shoal.optim import ShardOptimizer
from shoal.ps.guard import grad_norm

SPECS = {"sgd": OptimizerSpec("sgd", {"lr": 0.01, "momentum": 0.9}), "adam": OptimizerSpec("adam", {"lr": 1e-3})}


def timed(fn, reps: int) -> float:
    fn()
    fn()                                  # state allocated, buffers warm
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def case(name: str, numel: int, reps: int) -> dict:
    torch.manual_seed(0)
    grad = torch.randn(numel) * 1e-3
    bare = ShardOptimizer(torch.randn(numel), SPECS[name])
    guarded = ShardOptimizer(torch.randn(numel), SPECS[name])

    def guarded_step():
        grad_norm(grad)
        saved = guarded.save()
        guarded.step(grad)
        if not guarded.finite():
            guarded.restore(saved)

    t_bare = timed(lambda: bare.step(grad), reps)
    t_guard = timed(guarded_step, reps)
    return {"case": f"{name}-{numel}", "optimizer": name, "numel": numel, "bare_ms": round(t_bare * 1e3, 3),
            "guarded_ms": round(t_guard * 1e3, 3), "ratio": round(t_guard / t_bare, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--numel", type=int, nargs="+", default=[1_000_000, 4_000_000])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--optimizers", nargs="+", choices=sorted(SPECS), default=["sgd", "adam"])
    args = p.parse_args()
    torch.set_num_threads(1)
    for name in args.optimizers:
        for n in args.numel:
            print(json.dumps(case(name, n, args.reps)), flush=True)


if __name__ == "__main__":
    main()
