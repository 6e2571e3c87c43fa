"""What the update guard (ps/guard.py) costs a shard's apply: one dense step of a flat shard with the
guard (gradient norm, the state saved unless the step's bound proves it finite, finiteness checked
after) against the bare optimizer step, and against the guard saving every step, in the same run, per
optimizer and shard size. Prints one JSON object per case with the ratios (of the fastest call of each:
see ``timed``).

    .venv/bin/python bench/guard.py [--numel 1000000 4000000] [--reps 30] [--optimizers sgd adam]

The guard's cost is memory traffic: the norm and the largest magnitude read the gradient, the check
reads the weights and the optimizer's state after the step, and a save (only where the bound does not
hold: the first step, a huge gradient or learning rate, an optimizer with no known bound) copies them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shoal.settings.config import OptimizerSpec
from shoal.state.optim import ShardOptimizer, magnitude
from shoal.ps.guard import grad_norm

SPECS = {"sgd": OptimizerSpec("sgd", {"lr": 0.01, "momentum": 0.9}), "adam": OptimizerSpec("adam", {"lr": 1e-3})}


def timed(fn, reps: int) -> float:
    """The fastest of ``reps`` calls: on a shared host other processes only ever add time, so the minimum
    is the estimate of the call's own cost that noise disturbs least (the median is printed beside it)."""
    fn()
    fn()                                  # state allocated, buffers warm
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    timed.medians.append(statistics.median(out))
    return min(out)


timed.medians = []


def case(name: str, numel: int, reps: int) -> dict:
    torch.manual_seed(0)
    grad = torch.randn(numel) * 1e-3
    bare = ShardOptimizer(torch.randn(numel), SPECS[name])
    guarded = ShardOptimizer(torch.randn(numel), SPECS[name])
    always = ShardOptimizer(torch.randn(numel), SPECS[name])

    def guarded_step():                   # what Shard.push and Shard._apply add to the step
        grad_norm(grad)
        saved = guarded.save() if guarded.needs_save(magnitude(grad)) else None
        guarded.step(grad)
        if not guarded.finite() and saved is not None:
            guarded.restore(saved)

    def always_saved_step():              # the same with every step saved (no bound)
        grad_norm(grad)
        saved = always.save()
        always.step(grad)
        if not always.finite():
            always.restore(saved)

    timed.medians.clear()
    t_bare = timed(lambda: bare.step(grad), reps)
    t_guard = timed(guarded_step, reps)
    t_always = timed(always_saved_step, reps)
    med = [round(m * 1e3, 3) for m in timed.medians]
    return {"case": f"{name}-{numel}", "optimizer": name, "numel": numel, "bare_ms": round(t_bare * 1e3, 3),
            "guarded_ms": round(t_guard * 1e3, 3), "ratio": round(t_guard / t_bare, 3),
            "always_saved_ms": round(t_always * 1e3, 3), "always_saved_ratio": round(t_always / t_bare, 3),
            "medians_ms": {"bare": med[0], "guarded": med[1], "always_saved": med[2]}}


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
