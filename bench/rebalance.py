"""Shard rebalancing (issue 17): how fast the chief gets back under ceil(shards / servers) primaries
per server after a primary dies and a new server joins, and what it moves to get there.

Two parts, one JSON object per case:

- ``pure``: the chief's state with a fake clock, ``--shards`` 16..1024 on shards/2 servers. A quarter
  of the servers die one after the other (their backups are promoted; the survivors rebalance), as
  many new ones join at once, and every copy under way finishes once per round (a round stands for
  one copy's transfer time). Reports the rounds and moves until balanced against
  the fewest moves that could do it (``moves_over_minimum``), and the CPU per rebalance call.
- ``cluster``: real servers over gRPC in this process (tests/harness.py), two workers training a small
  MLP, sync and async: a primary killed, then a server joined; the seconds from the kill to the
  promotion and from the join to balanced (``balanced_over_promotion``: the two in the same run).

    .venv/bin/python bench/rebalance.py [--parts pure cluster] [--shards 16 64 256 1024] [--modes sync async]
"""
from __future__ import annotations

import argparse
import logging
import json
import math
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from shoal.chief import placement                     # noqa: E402
from shoal.chief.state import ChiefState               # noqa: E402
from shoal.settings.config import JobConfig                     # noqa: E402
from shoal.members import Role                         # noqa: E402

LEASE = 3.0
logging.disable(logging.ERROR)      # the failovers are the point here: their lines would bury the rows


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def live(s: ChiefState) -> list[str]:
    return sorted(m.member_id for m in s.members.alive(Role.PS))


def busiest(s: ChiefState) -> int:
    return max(placement.primaries(s.routing, live(s)).values(), default=0)


def copies_finish(s: ChiefState) -> None:
    """Every backup assigned now holds a whole copy: each primary's heartbeat says so."""
    for p in live(s):
        s.heartbeat(p, backups_complete={k: b for k, b in s.backups.items() if s.routing.get(k) == p})


def pure_case(shards: int) -> dict:
    clock = Clock()
    s = ChiefState(JobConfig(num_shards=shards, lease_seconds=LEASE), clock)
    servers = shards // 2
    for i in range(servers):
        s.join_ps(f"h:{i}")
    clock.now += LEASE
    copies_finish(s)
    s.tick()
    copies_finish(s)
    assert busiest(s) == 2 and len(s.routing) == shards
    kills = max(1, servers // 4)
    for _ in range(kills):                   # one death at a time; survivors rebalance between them
        s.expire(s.routing[0], "killed")
        for _ in range(100):
            copies_finish(s)
            if busiest(s) <= math.ceil(shards / len(live(s))):
                break
    for i in range(kills):
        s.join_ps(f"h:new{i}")
    cap = math.ceil(shards / len(live(s)))
    counts = placement.primaries(s.routing, live(s))
    minimum = sum(max(0, n - cap) for n in counts.values())
    calls, cpu, moves, aimed = 0, 0.0, 0, 0
    real = placement.rebalance

    def timed(*a, **kw):
        nonlocal calls, cpu, moves, aimed
        t0 = time.process_time()
        out = real(*a, **kw)
        cpu += time.process_time() - t0
        calls += 1
        moves += sum("moved from" in line for line in out)
        aimed += sum("to take it over" in line for line in out)
        return out
    placement.rebalance = timed
    try:
        rounds = 0
        while busiest(s) > cap and rounds < 100:
            copies_finish(s)
            rounds += 1
    finally:
        placement.rebalance = real
    return {"part": "pure", "shards": shards, "servers": len(live(s)), "killed_then_joined": kills, "cap": cap,
            "busiest": busiest(s),
            "rounds_to_balance_after_join": rounds, "moves": moves, "minimum_moves": minimum,
            "backups_re_aimed": aimed,
            "moves_over_minimum": round(moves / minimum, 3) if minimum else None,
            "rebalance_calls": calls, "cpu_us_per_rebalance": round(1e6 * cpu / max(calls, 1), 1)}


def cluster_case(mode: str, servers: int, hidden: int, lease: float) -> dict:
    import torch
    import torch.nn.functional as F

    from harness import InProcessCluster, run_threads, wait_until
    from shoal.ps.server import PSServer
    from shoal.worker import Trainer

    shards = 2 * servers
    torch.manual_seed(0)
    x = torch.randn(2048, 32)
    y = (x[:, 0] > 0).long()
    c = InProcessCluster.__new__(InProcessCluster)      # servers != shards: build it by hand
    from shoal.chief.server import ChiefServer
    c.job = JobConfig(mode=mode, num_shards=shards, lease_seconds=lease)
    c.journal = c.checkpoint = None
    c.chief = ChiefServer(c.job, bind="127.0.0.1:0", tick_s=0.05).start()
    c.chief_address = c.chief.address
    c.servers = [PSServer(c.chief_address, bind="127.0.0.1:0").start() for _ in range(servers)]
    models = [torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
              for _ in range(2)]
    steps, marks = [0], {}
    lock = threading.Lock()

    def state_busiest() -> tuple[int, int]:
        with c.chief.servicer.lock:
            s = c.chief.state
            return busiest(s), len(live(s))

    def train(t, m):
        for xb, yb in t.batches((x, y), batch_size=32, epochs=1000, batches_per_task=4):
            t.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            t.step()
            with lock:
                steps[0] += 1
            if "done" in marks:
                return

    def churn():
        try:
            _churn()
        finally:
            marks["done"] = True           # a failed wait stops the training too: its error is the result

    def _churn():
        wait_until(lambda: steps[0] >= 40, timeout_s=120, what="training")
        wait_until(lambda: all(r.backup_complete for r in c.chief.state.view().routes), timeout_s=60,
                   what="whole backups")
        victim = c.chief.state.routing[0]
        i = next(i for i, s in enumerate(c.servers) if s.chief.member_id == victim)
        marks["killed"] = time.monotonic()
        c.kill_ps(i)
        wait_until(lambda: c.chief.state.routing.get(0) != victim, timeout_s=30, what="promotion")
        marks["promoted"] = time.monotonic()
        wait_until(lambda: state_busiest()[0] <= math.ceil(shards / (servers - 1)), timeout_s=30,
                   what="balanced on the survivors")
        c.servers.append(PSServer(c.chief_address, bind="127.0.0.1:0").start())
        marks["joined"] = time.monotonic()
        wait_until(lambda: state_busiest() == (2, servers), timeout_s=30, what="balanced after the join")
        marks["balanced"] = time.monotonic()
        before = steps[0]
        wait_until(lambda: steps[0] > before + 20, timeout_s=30, what="training after the move")
        marks["done"] = True

    trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.01) for m in models]
    try:
        run_threads(*[lambda t=t, m=m: train(t, m) for t, m in zip(trainers, models)], churn, timeout_s=300)
    finally:
        for t in trainers:
            t.close()
        c.stop()
    promo, bal = marks["promoted"] - marks["killed"], marks["balanced"] - marks["joined"]
    numel = sum(p.numel() for p in models[0].parameters())
    return {"part": "cluster", "mode": mode, "servers": servers, "shards": shards, "params": numel,
            "lease_s": lease, "kill_to_promoted_s": round(promo, 3), "join_to_balanced_s": round(bal, 3),
            "balanced_over_promotion": round(bal / promo, 3), "moves_seen_by_workers": sum(t.routes.moves
                                                                                           for t in trainers)
            if all(hasattr(t, "routes") for t in trainers) else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["pure", "cluster"], choices=("pure", "cluster"))
    p.add_argument("--shards", nargs="+", type=int, default=[16, 64, 256, 1024])
    p.add_argument("--modes", nargs="+", default=["sync", "async"])
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lease", type=float, default=1.0)
    a = p.parse_args()
    if "pure" in a.parts:
        for n in a.shards:
            print(json.dumps(pure_case(n)), flush=True)
    if "cluster" in a.parts:
        for mode in a.modes:
            print(json.dumps(cluster_case(mode, a.servers, a.hidden, a.lease)), flush=True)


if __name__ == "__main__":
    main()
