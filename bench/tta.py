"""Time to accuracy (issue 16): how long shoal and torch DDP take to train one model to a test accuracy.

An MLP 64-2048-2048-2048-10 (8.5M parameters, 34.2 MB in fp32: every step moves enough bytes for the
link to matter) on scikit-learn's digits (examples/digits.py's split: 1347 samples to train on, a fixed
450 held out to test), SGD lr 0.02 momentum 0.9, batch 32 per process, trained until the test accuracy
first reaches ``--target`` or ``--max-seconds`` of training have passed. 2 shoal workers and 2 servers
(unreplicated, ``--replicas 1``: DDP keeps no second copy) against DDP over gloo with 2 ranks, in the
same run: each of ``--rounds`` runs DDP and then every case, and a case's ratio is its round's DDP time
over its own (> 1: shoal got there sooner). One JSON line per case per round, then a summary line per
case: the median ratio, the median time and steps to target, and the cores each process used (its CPU
seconds over the case's wall time, evaluations included).

    .venv/bin/python bench/tta.py --link 1gbit --rounds 3
    .venv/bin/python bench/tta.py --link 1gbit --mode sync --cases none none@32:2
    .venv/bin/python bench/tta.py --target 0.5 --max-seconds 60 --rounds 1 --cases none

``--cases``: ``CODEC[/PULL][@SHARDS:WINDOW]`` as in bench/mlp.py: ``bf16/bf16@32:2`` pushes bf16
gradients, pulls bf16 weights, over 32 shards (``--num-shards``) with a push window of 2. ``--link 1gbit``
(root; iproute2) runs every process on its own network namespace whose link ``tc tbf`` shapes to that
rate each way, DDP's ranks included (bench/_hosts.py, as bench/mlp.py does).

Data: shoal's workers take their batches through the chief's tasks (``Trainer.batches``: 4 batches of
32 consecutive samples per task, tasks shuffled per epoch), which sync rounds need; DDP's ranks take the
same 32-sample batches, shuffled per epoch and dealt in turn (bench/_tta.py: ``rank_batches``).

The clock starts when every process is ready (joined the job or the gloo group, model built) and counts
wall time less the evaluations. Worker 0 (rank 0) evaluates the model it trains on (shoal: the weights
of its last pull) on the test split every ``--eval-every`` of its steps (about that many times 64 samples
on either side, with 2 processes); the time between two evaluations bounds how late a crossing is seen,
and a case whose accuracy hovers near the target is noisy from round to round: take several rounds.
What stops while it evaluates, so that no training happens off the clock:

- DDP: every rank meets at a barrier after the evaluating step; the clock stops for the evaluation.
- shoal sync: the other workers wait in the next round for worker 0's push (their step's compute and
  push overlap the evaluation: worker 0's own compute and push stay on the critical path).
- shoal async: the other workers would train on, so worker 0 first holds them: each parks before its
  next step, and the clock stops only once all have parked. Worker 0's wait for them (at most a step of
  theirs, while they train) stays on the clock: with 2 workers, a cost to shoal of about
  1/(4 x --eval-every) of its steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import _procs  # noqa: E402
import _tta  # noqa: E402
from _hosts import Placement, enter  # noqa: E402
from _procs import CTX, Rank  # noqa: E402
from _tta import Case, Point  # noqa: E402
from digits import accuracy, build_model, load  # noqa: E402

HIDDEN, DEPTH = 2048, 3         # 64-2048-2048-2048-10
BATCH, LR, MOMENTUM, SEED = 32, 0.02, 0.9, 0
EPOCHS = 1000                   # the chief's task queue never runs dry: the target or the cap ends a case
READY_TIMEOUT_S = 300
HOLD_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Run:
    target: float
    max_seconds: float
    eval_every: int
    mode: str                   # the shoal cases' mode: async or sync
    workers: int


@dataclasses.dataclass
class Signals:
    """What one case's processes share with each other and the bench."""
    ready: Any                  # Barrier: every process and the bench; the clock starts
    stop: Any                   # Event: the evaluator says stop
    running: Any                # Event: clear while the evaluator holds the others (shoal async)
    hold: Any                   # Value: the number of the latest hold
    parked: Any                 # Array: per worker, the latest hold it parked for
    steps: Any                  # Array: per shoal worker, its steps so far (DDP's ranks step together)
    meet: Any                   # Barrier of the DDP ranks at every evaluation
    out: Any                    # Queue: the evaluator's result

    @classmethod
    def make(cls, n: int) -> "Signals":
        running = CTX.Event()
        running.set()
        return cls(CTX.Barrier(n + 1), CTX.Event(), running, CTX.Value("q", 0), CTX.Array("q", n),
                   CTX.Array("q", n), CTX.Barrier(n), CTX.Queue())


class Evaluator:
    """Worker 0's (rank 0's) clock and curve: the test accuracy of its model every ``eval_every`` of its steps."""

    def __init__(self, run: Run, model: torch.nn.Module, test: tuple, steps_all: Callable[[int], int]):
        self.run, self.model, self.test, self.steps_all = run, model, test, steps_all
        self.clock = _tta.Clock()
        self.curve: list[Point] = []
        self.unheld = 0                 # shoal async: evaluations during which another worker did not park

    def due(self, step: int) -> bool:
        return step % self.run.eval_every == 0

    def evaluate(self, step: int) -> bool:
        """One point of the curve, off the clock; True when training should stop (target reached or time up)."""
        seconds = self.clock.seconds()
        with self.clock.stopped():
            acc = accuracy(self.model, *self.test)
        self.curve.append(Point(seconds, acc, step, self.steps_all(step)))
        return acc >= self.run.target or seconds >= self.run.max_seconds

    def result(self, **extra: Any) -> dict:
        return {"curve": [dataclasses.astuple(p) for p in self.curve],
                "stopped_for_eval_s": round(self.clock.stopped_s, 2), **extra}


# ------------------------------------------------------------------ DDP


def _rank_data(xtr: torch.Tensor, ytr: torch.Tensor, rank: Rank):
    epoch = 0
    while True:
        for b in _tta.rank_batches(len(xtr), BATCH, rank.world, rank.rank, epoch, SEED):
            yield xtr[b * BATCH:(b + 1) * BATCH], ytr[b * BATCH:(b + 1) * BATCH]
        epoch += 1


def _ddp_rank(rank: Rank, run: Run, sig: Signals) -> None:
    rank.join()
    import torch.distributed as dist

    (xtr, ytr), test = load(SEED)
    torch.manual_seed(SEED)
    model = torch.nn.parallel.DistributedDataParallel(build_model(HIDDEN, DEPTH))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sig.ready.wait()
    ev = Evaluator(run, model.module, test, lambda step: step * rank.world) if rank.rank == 0 else None
    for step, (xb, yb) in enumerate(_rank_data(xtr, ytr, rank), start=1):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        if step % run.eval_every:
            continue
        if ev is not None and ev.evaluate(step):
            sig.stop.set()
        sig.meet.wait()                 # the other ranks wait out the evaluation here, and learn whether to stop
        if sig.stop.is_set():
            break
    if ev is not None:
        sig.out.put(ev.result())
    dist.destroy_process_group()


def run_ddp(run: Run, place: Placement) -> dict:
    sig = Signals.make(run.workers)
    procs = _procs.start_ranks(_ddp_rank, place, run.workers, run, sig)
    return _measure(procs, _procs.rank_pids(procs), sig, run)


# ------------------------------------------------------------------ shoal


def _park(sig: Signals, me: int) -> None:
    """Shoal async, a worker other than the evaluator: waits out a hold before its next step."""
    if sig.running.is_set():
        return
    sig.parked[me] = sig.hold.value     # the evaluator numbers the hold before it clears `running`
    sig.running.wait()


def _hold_others(sig: Signals, workers: int) -> bool:
    """Shoal async, the evaluator: the others park before their next step; False if one did not in time."""
    sig.hold.value += 1
    number = sig.hold.value
    sig.running.clear()
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while any(sig.parked[i] != number for i in range(1, workers)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _evaluate_shoal(ev: Evaluator, sig: Signals, run: Run, step: int) -> bool:
    if run.mode == "async" and not _hold_others(sig, run.workers):
        ev.unheld += 1
    stop = ev.evaluate(step)
    if stop:
        sig.stop.set()
    sig.running.set()
    return stop


def _shoal_worker(namespace: str | None, index: int, chief: str, run: Run, case: Case, sig: Signals) -> None:
    enter(namespace)
    torch.set_num_threads(1)
    from shoal.worker import Trainer

    (xtr, ytr), test = load(SEED)
    torch.manual_seed(SEED)
    model = build_model(HIDDEN, DEPTH)
    trainer = Trainer(model, chief=chief, optimizer="sgd", lr=LR, momentum=MOMENTUM, compression=case.codec,
                      pull_codec=case.pull_codec, push_window=case.window,
                      momentum_correction=not case.server_momentum)
    sig.ready.wait()
    ev = Evaluator(run, model, test, lambda _: sum(sig.steps[:])) if index == 0 else None
    batches = trainer.batches((xtr, ytr), batch_size=BATCH, epochs=EPOCHS, seed=SEED)
    try:
        for step, (xb, yb) in enumerate(batches, start=1):
            if ev is None and run.mode == "async":
                _park(sig, index)
            if sig.stop.is_set():
                break
            trainer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            trainer.step()
            sig.steps[index] = step
            if ev is not None and ev.due(step) and _evaluate_shoal(ev, sig, run, step):
                break
    finally:
        batches.close()
    if ev is not None:
        c = trainer.counters
        sig.out.put(ev.result(push_bytes_per_step=c.bytes_pushed // max(1, c.steps),
                              pull_bytes_per_step=c.bytes_pulled // max(1, c.steps),
                              holds_timed_out=ev.unheld))
    trainer.close()


def run_shoal(case: Case, run: Run, place: Placement, ps: int) -> dict:
    with _procs.start_servers(place, ps, run.mode, replicas=1, num_shards=case.shards) as servers:
        sig = Signals.make(run.workers)
        procs = _procs.start_workers(_shoal_worker, place, run.workers, servers.chief, run, case, sig)
        return _measure(procs, _procs.shoal_pids(servers, procs), sig, run)


# ------------------------------------------------------------------ the bench


def _measure(procs: list, pids: dict[str, int], sig: Signals, run: Run) -> dict:
    """Starts the clock with the processes, waits for the evaluator's result, and ends the processes."""
    try:
        sig.ready.wait(timeout=READY_TIMEOUT_S)
    except threading.BrokenBarrierError:
        _procs.join(procs, 0)
        raise RuntimeError(f"the case's processes were not ready in {READY_TIMEOUT_S} s") from None
    before, t0 = _procs.cpu_times(pids), time.monotonic()
    result = _result(sig, procs, t0 + 3 * run.max_seconds + READY_TIMEOUT_S)   # evaluations come on top
    wall = time.monotonic() - t0
    result.update(wall_seconds=round(wall, 1), cores=_procs.cores(before, _procs.cpu_times(pids), wall))
    late = _procs.join(procs, 120)
    if late:
        result["ended_by_bench"] = late
    return result


def _result(sig: Signals, procs: list, deadline: float) -> dict:
    """The evaluator's result; an error if a process failed first or the deadline passed."""
    while time.monotonic() < deadline:
        try:
            return sig.out.get(timeout=1.0)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                return {"curve": [], "error": f"a process of the case failed (exit codes {failed})"}
    return {"curve": [], "error": "no result from the evaluating process in time"}


def _row(round_no: int, name: str, result: dict, args: argparse.Namespace, ddp_seconds: float | None,
         case: Case | None = None) -> dict:
    got = _tta.outcome([Point(*p) for p in result.pop("curve")], args.target)
    curve = got.pop("curve")
    row = {"round": round_no, "case": name, "link": args.link or "loopback", "target": args.target, **got}
    if case is not None:
        row.update(ratio_vs_ddp=_tta.ratio(ddp_seconds, got["seconds"]), ddp_seconds=ddp_seconds,
                   mode=args.mode, workers=args.workers, ps=args.ps, shards=case.shards or args.ps,
                   push_window=case.window, replicas=1)
    else:
        row.update(ranks=args.workers)
    row.update(result)
    row["curve"] = curve
    return row


def run_rounds(args: argparse.Namespace, place: Placement) -> None:
    run = Run(args.target, args.max_seconds, args.eval_every, args.mode, args.workers)
    names = [c.name(args.mode, args.ps) for c in args.cases]
    rows: dict[str, list[dict]] = {_tta.DDP: [], **{n: [] for n in names}}
    for r in range(args.rounds):
        ddp = _row(r, _tta.DDP, run_ddp(run, place), args, None)
        rows[_tta.DDP].append(ddp)
        print(json.dumps(ddp), flush=True)
        for case, name in zip(args.cases, names):
            row = _row(r, name, run_shoal(case, run, place, args.ps), args, ddp["seconds"], case)
            rows[name].append(row)
            print(json.dumps(row), flush=True)
    for name, got in rows.items():
        print(json.dumps(_tta.summarize(name, got)), flush=True)


def _case(spec: str) -> Case:
    """A case whose codecs the worker knows (its own checks), so a typo fails here, not after a start-up."""
    from shoal.net.wire import pull_itemsize
    from shoal.worker.push import GradientEncoder

    try:
        case = _tta.parse_case(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        GradientEncoder(case.codec)
        pull_itemsize(case.pull_codec)
    except ValueError as exc:           # shoal's InvalidArgument is one
        raise argparse.ArgumentTypeError(f"case {spec!r}: {exc}") from None
    return case


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", type=_case, default=[_case(s) for s in ("none", "none@32:2",
                                                                               "bf16/bf16@32:2", "topk")],
                   metavar="CODEC[/PULL][@SHARDS:WINDOW][+server-momentum]",
                   help="shoal cases (default: none none@32:2 bf16/bf16@32:2 topk); +server-momentum keeps a "
                        "sparse codec's momentum on the servers (Trainer(momentum_correction=False))")
    p.add_argument("--mode", default="async", choices=["async", "sync"], help="the shoal cases' mode")
    p.add_argument("--target", type=float, default=0.95, help="test accuracy to reach (default 0.95)")
    p.add_argument("--max-seconds", type=float, default=240.0, help="training seconds a case may take at most")
    p.add_argument("--eval-every", type=int, default=10, help="steps of worker 0 / rank 0 between evaluations")
    p.add_argument("--rounds", type=int, default=3, help="rounds of DDP + every case; medians are reported")
    p.add_argument("--link", metavar="RATE", help="run every process on its own emulated host whose link is "
                                                   "shaped to RATE each way (tc syntax, e.g. 1gbit; needs root)")
    p.add_argument("--workers", type=int, default=2, help="shoal workers, and DDP ranks (default 2)")
    p.add_argument("--ps", type=int, default=None, help="parameter servers (default: as many as --workers)")
    args = p.parse_args(argv)
    args.ps = args.ps or args.workers
    if args.eval_every < 1 or args.workers < 1 or args.rounds < 1 or args.max_seconds <= 0:
        p.error("--eval-every, --workers and --rounds must be >= 1, --max-seconds > 0")
    if not 0 < args.target <= 1:
        p.error(f"--target is a test accuracy in (0, 1], got {args.target}")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load(SEED)                          # the split's cache file, before the processes read it together
    with Placement(_procs.roles(args.workers, args.ps) if args.link else None, args.link) as place:
        run_rounds(args, place)


if __name__ == "__main__":
    main()
