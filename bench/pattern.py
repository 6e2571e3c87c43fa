"""A pipelined step's traffic alone: shoal's push-then-pull pattern over gRPC, with no model and no optimizer.

Each of ``--workers`` workers (own network namespace, ``tc tbf`` link as in ``bench/mlp.py --link``) sends
a model's bytes (``--mb``) a step in BLOCKS blocks, at most WINDOW unanswered at a time, the blocks taken
from the ``--ps`` servers in turn starting at a different server per worker (``worker/pipeline.py``'s
order), and pulls each block back the moment its push is answered: what a pipelined async step moves,
without the forward and backward pass, the servers' apply, or the worker's encoding. The servers answer a
push with nothing and a pull with a block of zeros.

The same run measures the link's own floor (``bench/link.py``: the model's bytes one way and both ways
at once over one TCP stream between a worker's and a server's host) and reports each case's step as a
ratio to the both-ways floor. A real step (bench/mlp.py, with its per-step timestamps) that takes this
case's time plus its compute has no overhead of its own in the data path.

    .venv/bin/python bench/pattern.py --pipelines 32:2 64:4 [--link 1gbit] [--rounds 2]   # needs root

One JSON object per case (median over rounds of the workers' median step), then the floor.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from _hosts import Placement, enter
from link import exchange

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
CTX = mp.get_context("spawn")


def _server(namespace: str | None, block: int, ports: mp.Queue, stop: mp.Queue) -> None:
    enter(namespace)
    from shoal.net import rpc
    payload = bytes(block)
    handlers = grpc.method_handlers_generic_handler("pattern", {
        "Push": grpc.unary_unary_rpc_method_handler(lambda request, context: b""),
        "Pull": grpc.unary_unary_rpc_method_handler(lambda request, context: payload)})
    server = grpc.server(futures.ThreadPoolExecutor(16), options=rpc.SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handlers,))
    ports.put(server.add_insecure_port("0.0.0.0:0"))
    server.start()
    stop.get()
    server.stop(0)


def _worker(namespace: str | None, rank: int, addresses: list[str], blocks: int, block: int, window: int,
            steps: int, barrier, out: mp.Queue) -> None:
    enter(namespace)
    from shoal.net import rpc
    channels = [grpc.insecure_channel(a, options=rpc.CHANNEL_OPTIONS) for a in addresses]
    push = [c.unary_unary("/pattern/Push") for c in channels]
    pull = [c.unary_unary("/pattern/Pull") for c in channels]
    for p in pull:
        p(b"", timeout=60)                     # connected, and the first call's costs paid
    payload = bytes(block)
    servers = len(addresses)
    order = [(i, (i + rank) % servers) for i in range(blocks)]
    barrier.wait()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        slots, landed = threading.Semaphore(window), threading.Semaphore(0)
        for _, server in order:
            slots.acquire()
            answer = push[server].future(payload)

            def on_push(_answer, server=server) -> None:
                slots.release()
                pull[server].future(b"").add_done_callback(lambda _pulled: landed.release())
            answer.add_done_callback(on_push)
        for _ in order:
            landed.acquire()
        times.append(time.perf_counter() - t0)
    out.put(statistics.median(times[1:]))


def run_case(place: Placement, workers: int, servers: int, size: int, blocks: int, window: int,
             steps: int) -> float:
    """Seconds of the slowest worker's median step."""
    block = size // blocks
    ports, stops, procs = [], [], []
    for i in range(servers):
        q, stop = CTX.Queue(), CTX.Queue()
        p = CTX.Process(target=_server, args=(place.namespace(f"ps{i}"), block, q, stop))
        p.start()
        procs.append(p)
        stops.append(stop)
        ports.append(q.get(timeout=60))
    addresses = [f"{place.address(f'ps{i}')}:{port}" for i, port in enumerate(ports)]
    barrier, out = CTX.Barrier(workers), CTX.Queue()
    ws = [CTX.Process(target=_worker, args=(place.namespace(f"w{r}"), r, addresses, blocks, block, window,
                                            steps, barrier, out)) for r in range(workers)]
    for w in ws:
        w.start()
    try:
        return max(out.get(timeout=300) for _ in ws)
    finally:
        for w in ws:
            w.join(30)
        for stop in stops:
            stop.put(None)
        for p in procs:
            p.join(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="1gbit", help="tc rate of every host's link, each way")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ps", type=int, default=2)
    p.add_argument("--mb", type=float, default=33.6, help="megabytes a worker pushes (and pulls) a step")
    p.add_argument("--pipelines", nargs="+", default=["2:0", "32:2", "64:4"], metavar="BLOCKS:WINDOW",
                   help="blocks a step and pushes unanswered at once (0: all at once)")
    p.add_argument("--steps", type=int, default=8, help="steps per case (the first is not counted)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    pipes = []
    for pair in args.pipelines:
        try:
            blocks, window = (int(v) for v in pair.split(":"))
        except ValueError:
            raise SystemExit(f"--pipelines takes BLOCKS:WINDOW (e.g. 64:4), got {pair!r}") from None
        pipes.append((blocks, window or blocks))
    size = int(args.mb * 1e6)
    roles = [f"ps{i}" for i in range(args.ps)] + [f"w{r}" for r in range(args.workers)]
    floors: list[float] = []
    steps: dict[tuple[int, int], list[float]] = {pipe: [] for pipe in pipes}
    with Placement(roles, args.link) as place:
        for _ in range(args.rounds):
            floors.append(exchange(place, size, both=True, a_role="w0", b_role="ps0"))
            for blocks, window in pipes:
                steps[(blocks, window)].append(run_case(place, args.workers, args.ps, size, blocks, window,
                                                        args.steps))
    floor = statistics.median(floors)
    for (blocks, window), seconds in steps.items():
        step = statistics.median(seconds)
        print(json.dumps({"case": f"push-then-pull-{blocks}x{window}", "workers": args.workers, "ps": args.ps,
                          "link": args.link, "mb": args.mb, "blocks": blocks, "window": window,
                          "step_ms": round(step * 1e3, 1), "step_ms_per_round": [round(s * 1e3, 1) for s in seconds],
                          "ratio_to_floor": round(step / floor, 3)}), flush=True)
    print(json.dumps({"case": "link-both-ways-floor", "link": args.link, "mb": args.mb,
                      "ms": round(floor * 1e3, 1), "ms_per_round": [round(s * 1e3, 1) for s in floors]}))


if __name__ == "__main__":
    main()
