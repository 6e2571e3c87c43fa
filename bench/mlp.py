"""Dense benchmark: two 2048x2048 linear layers (no bias, ReLU between), batch 32 (--batch), random data.

2 workers and 2 parameter servers in async mode (shards not replicated, as DDP
keeps no second copy; ``--replicated`` codecs run once more with replicas), one case per compressor,
against torch DistributedDataParallel over gloo with the same model and batch
(2 processes), in the same run: ``--rounds`` times DDP and then every case,
each case's ratio taken to its own round's DDP. Reports worker steps per second
(mean over workers) and the ratio to DDP, the medians over the rounds, and the
cores each process used (its CPU seconds over the middle half of the timed
window): on a small host the CPU, not the bytes, is what bounds a case. One
JSON object per case.

With ``--link 1gbit`` (root; iproute2) every process runs on its own emulated
host, a network namespace whose link ``tc tbf`` shapes to that rate each way,
DDP's two ranks included: what the codecs buy when the network, not the CPU,
is the bottleneck.

    .venv/bin/python bench/mlp.py [--seconds 10] [--rounds 3] [--codecs none bf16 topk ...] [--also bf16/bf16 ...]
    .venv/bin/python bench/mlp.py --link 1gbit --codecs none bf16 topk --also bf16/bf16 topk/bf16 --replicated
    .venv/bin/python bench/mlp.py --seconds 4 --rounds 1 --codecs none --also --security none token tls

Pipelining (issue 16, worker/pipeline.py): ``--num-shards`` and ``--push-window`` take lists, and
every codec runs once per (shards, window) pair, so pipelining on and off meet DDP in the same
round. ``--workers N`` runs N workers and N DDP ranks (``--ps``: servers, default N); ``--mode sync``
runs the shoal cases in sync rounds:

    .venv/bin/python bench/mlp.py --link 1gbit --codecs none topk --also bf16/bf16 --replicated --pipelines 2:0 32:2
    .venv/bin/python bench/mlp.py --link 1gbit --workers 4 --codecs none --also --replicated --pipelines 4:0 32:2

``--pipelines SHARDS:WINDOW ...`` names the pairs instead of taking every --num-shards x --push-window pair.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.nn.functional as F

import _procs
import _security
from _hosts import Placement, enter
from _procs import CTX, Rank, roles


BATCH = int(os.environ.get("SHOAL_BENCH_BATCH", "32"))   # --batch; spawned processes read it again


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048, bias=False), torch.nn.ReLU(),
                               torch.nn.Linear(2048, 2048, bias=False))


def _loop(step, seconds: float, warmup: int = 3, go_on=lambda in_time, n: in_time, on_start=lambda: None) -> float:
    """Steps per second over ``seconds`` after ``warmup`` steps. ``go_on(in_time, n)``: whether to take step
    ``n`` when the time is up or not (DDP's ranks agree on it, or one waits in an allreduce its
    peer never joins). ``on_start()`` runs when the timed steps begin."""
    x, y = torch.randn(BATCH, 2048), torch.randn(BATCH, 2048)
    for _ in range(warmup):
        step(x, y)
    on_start()
    n, start = 0, time.perf_counter()
    while go_on(time.perf_counter() - start < seconds, n):
        step(x, y)
        n += 1
    return n / (time.perf_counter() - start)


def _shoal_worker(namespace: str | None, index: int, chief: str, codec: str, pull_codec: str, seconds: float, barrier,
                  out: mp.Queue, push_window: int = 0, tasks: bool = False) -> None:
    enter(namespace)
    torch.set_num_threads(1)
    from shoal.worker import Trainer

    model = build()
    trainer = Trainer(model, chief=chief, optimizer="sgd", lr=1e-4, compression=codec, pull_codec=pull_codec,
                      push_window=push_window)
    barrier.wait()

    def step(x, y):
        trainer.zero_grad()
        F.mse_loss(model(x), y).backward()
        trainer.step(samples=len(x))

    if tasks:
        # sync rounds wait for the busy workers, those holding a data task: without tasks every
        # push would close its own round. The same random batches, taken through the chief's tasks.
        g = torch.Generator().manual_seed(0)
        data = (torch.randn(BATCH * 16, 2048, generator=g), torch.randn(BATCH * 16, 2048, generator=g))
        batches = trainer.batches(data, batch_size=BATCH, epochs=1000, batches_per_task=4)

        def step(x, y):                                   # noqa: F811 - the sync variant
            xb, yb = next(batches)
            trainer.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            trainer.step()

    before = []                                           # the bytes of the timed steps only, not the first pull's
    rate = _loop(step, seconds, on_start=lambda: before.append(trainer.counters.to_dict()))
    if tasks:
        batches.close()
    c, b = trainer.counters, before[0]
    steps = max(1, c.steps - b["steps"])
    out.put((rate, (c.bytes_pushed - b["bytes_pushed"]) / steps, (c.bytes_pulled - b["bytes_pulled"]) / steps))
    trainer.close()


def _ddp_worker(rank: Rank, seconds: float, out: mp.Queue) -> None:
    rank.join()
    import torch.distributed as dist

    model = torch.nn.parallel.DistributedDataParallel(build())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(x, y):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    def go_on(in_time: bool, n: int) -> bool:
        if n % 8:                        # the ranks agree every 8 steps: a 1-element allreduce, ~0 cost
            return True
        flag = torch.tensor([int(in_time)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag)

    out.put(_loop(step, seconds, go_on=go_on))
    dist.destroy_process_group()


def run_ddp(seconds: float, place: Placement, world: int = 2) -> float:
    out = CTX.Queue()
    procs = _procs.start_ranks(_ddp_worker, place, world, seconds, out)
    rates = [out.get(timeout=300) for _ in procs]
    _procs.join(procs, 300)
    return sum(rates) / len(rates)


def run_shoal(codec: str, pull_codec: str, seconds: float, place: Placement, replicas: int = 1,
              workers: int = 2, ps: int = 2, num_shards: int | None = None, push_window: int = 0,
              mode: str = "async") -> tuple[tuple, dict]:
    """(steps/s, push bytes/step, pull bytes/step) averaged over the workers, and the cores each
    process used in the middle of the timed window."""
    with _procs.start_servers(place, ps, mode, replicas, num_shards) as servers:
        out, barrier = CTX.Queue(), CTX.Barrier(workers + 1)
        procs = _procs.start_workers(_shoal_worker, place, workers, servers.chief, codec, pull_codec, seconds,
                                     barrier, out, push_window, mode == "sync")
        barrier.wait()
        pids = _procs.shoal_pids(servers, procs)
        time.sleep(seconds * 0.25)            # past the warm-up steps
        before, t0 = _procs.cpu_times(pids), time.monotonic()
        time.sleep(seconds * 0.5)
        cores = _procs.cores(before, _procs.cpu_times(pids), time.monotonic() - t0)
        results = [out.get(timeout=300) for _ in procs]
        _procs.join(procs, 300)
    return tuple(sum(r[i] for r in results) / workers for i in range(3)), cores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batch", type=int, default=32, help="samples per step and process (compute per step)")
    p.add_argument("--codecs", nargs="+", default=["none", "fp16", "bf16", "int8", "topk", "sign", "topk+lz4"],
                   help="gradient codecs; CODEC/PULL (e.g. bf16/bf16) also pulls the weights in PULL")
    p.add_argument("--also", nargs="*", default=["bf16/bf16", "topk/bf16"],
                   help="more CODEC/PULL cases after --codecs")
    p.add_argument("--replicated", nargs="*", default=["none"],
                   help="codecs to run once more with every shard replicated (--replicas 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of DDP + every case; medians are reported")
    p.add_argument("--security", nargs="+", default=["none"], choices=_security.MODES,
                   help="run every shoal case once per mode (token; tls: token and mutual TLS)")
    p.add_argument("--link", metavar="RATE", help="run every process on its own emulated host whose link is "
                                                   "shaped to RATE each way (tc syntax, e.g. 1gbit; needs root)")
    p.add_argument("--workers", type=int, default=2, help="shoal workers, and DDP ranks (default 2)")
    p.add_argument("--ps", type=int, default=None, help="parameter servers (default: as many as --workers)")
    p.add_argument("--mode", default="async", choices=["async", "sync"], help="the shoal cases' mode")
    p.add_argument("--num-shards", type=int, nargs="+", default=None,
                   help="shards (blocks) of the model, one case per value (default: one per server)")
    p.add_argument("--push-window", type=int, nargs="+", default=[0],
                   help="pushes unanswered at once per worker (0: all at once), one case per value")
    p.add_argument("--pipelines", nargs="+", metavar="SHARDS:WINDOW", default=None,
                   help="(shards, window) pairs to run instead of every --num-shards x --push-window pair")
    args = p.parse_args()
    args.ps = args.ps or args.workers
    os.environ["SHOAL_BENCH_BATCH"] = str(args.batch)      # before any process starts
    global BATCH
    BATCH = args.batch
    args.num_shards = args.num_shards or [args.ps]
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with Placement(roles(args.workers, args.ps) if args.link else None, args.link) as place:
        run_cases(args, place)


def _pipeline(pair: str) -> tuple[int, int]:
    """``SHARDS:WINDOW``, e.g. ``32:2``."""
    try:
        shards, window = (int(v) for v in pair.split(":"))
    except ValueError:
        raise SystemExit(f"--pipelines takes SHARDS:WINDOW (e.g. 32:2), got {pair!r}") from None
    return shards, window


def run_cases(args: argparse.Namespace, place: Placement) -> None:
    """Each round runs DDP and then every case; a case's ratio is to the DDP of its own round, and the
    median over rounds is reported (this host's speed drifts by a third between minutes)."""
    link = {"link": args.link or "loopback"}
    pipes = [(n, w) for n in args.num_shards for w in args.push_window] if not args.pipelines else \
        [_pipeline(pair) for pair in args.pipelines]
    cases = [(c, 1, m, *pipe) for c in args.codecs + args.also for m in args.security for pipe in pipes] + \
        [(c, 2, m, *pipe) for c in args.replicated for m in args.security for pipe in pipes]
    ddp_rates: list[float] = []
    runs: dict[tuple, list] = {case: [] for case in cases}
    for _ in range(args.rounds):
        ddp = run_ddp(args.seconds, place, args.workers)
        ddp_rates.append(ddp)
        for case in cases:
            spec, replicas, mode, shards, window = case
            codec, _, pull_codec = spec.partition("/")
            _security.use(mode)
            (rate, pushed, pulled), cores = run_shoal(codec, pull_codec or "none", args.seconds, place, replicas,
                                                      args.workers, args.ps, shards, window, args.mode)
            runs[case].append((rate / ddp, rate, pushed, pulled, cores))
        _security.use("none")
    print(json.dumps({"case": "ddp-gloo", "workers": args.workers, **link,
                      "steps_per_s": round(statistics.median(ddp_rates), 2),
                      "steps_per_s_per_round": [round(r, 2) for r in ddp_rates]}), flush=True)
    for (spec, replicas, mode, shards, window), results in runs.items():
        codec, _, pull_codec = spec.partition("/")
        name = f"shoal-{args.mode}-{codec}" + (f"-pull-{pull_codec}" if pull_codec else "") + \
            ("-replicated" if replicas == 2 else "") + ("" if mode == "none" else f"-{mode}") + \
            (f"-shards{shards}" if shards != args.ps else "") + (f"-window{window}" if window else "")
        ratio, rate, pushed, pulled, cores = sorted(results, key=lambda r: r[0])[len(results) // 2]
        print(json.dumps({"case": name, "workers": args.workers, "ps": args.ps, "shards": shards,
                          "push_window": window, "replicas": replicas, **link,
                          "steps_per_s": round(rate, 2), "push_bytes_per_step": int(pushed),
                          "pull_bytes_per_step": int(pulled), "ratio_vs_ddp": round(ratio, 2),
                          "ratio_per_round": [round(r[0], 2) for r in results], "cores_used": cores}), flush=True)


if __name__ == "__main__":
    main()
