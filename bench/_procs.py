"""The processes of the dense benches (bench/mlp.py, bench/tta.py): the roles they place, DDP's ranks
and shoal's workers as spawned processes, the chief and servers as commands, the cores each one used.

A rank's target is called as ``target(rank, *args)`` with a :class:`Rank` (``rank.join()`` enters its
host and joins the gloo group); a worker's as ``target(namespace, index, *args)`` (it enters
``namespace`` itself, before it starts threads).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _hosts import Placement, enter

CTX = mp.get_context("spawn")


def roles(workers: int, ps: int) -> list[str]:
    """The hosts a --link run needs: the chief, the servers, the shoal workers and the DDP ranks."""
    return ["chief", *(f"ps{i}" for i in range(ps)), *(f"w{i}" for i in range(workers)),
            *(f"r{i}" for i in range(workers))]


@dataclass(frozen=True)
class Rank:
    """DDP rank ``rank`` of ``world``: its host and the file store the ranks meet at."""
    namespace: str | None
    interface: str
    rank: int
    world: int
    store: str

    def join(self) -> None:
        """In the rank's own process: enters its host, takes one torch thread, joins the gloo group."""
        enter(self.namespace)
        if self.namespace is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = self.interface
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{self.store}", rank=self.rank, world_size=self.world)


def start_ranks(target, place: Placement, world: int, *args) -> list[mp.Process]:
    """Starts ``world`` DDP ranks (roles ``r0``, ``r1``...)."""
    store = str(Path(tempfile.mkdtemp(prefix="shoal-ddp-")) / "store")
    procs = [CTX.Process(target=target, args=(Rank(place.namespace(f"r{r}"), place.interface(f"r{r}"), r, world,
                                                   store), *args)) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def start_workers(target, place: Placement, workers: int, *args) -> list[mp.Process]:
    """Starts ``workers`` shoal workers (roles ``w0``, ``w1``...)."""
    procs = [CTX.Process(target=target, args=(place.namespace(f"w{i}"), i, *args)) for i in range(workers)]
    for p in procs:
        p.start()
    return procs


def start_servers(place: Placement, ps: int, mode: str, replicas: int = 1, num_shards: int | None = None):
    """A chief and ``ps`` servers (roles ``chief``, ``ps0``...), as a context manager that stops them."""
    from _servers import Servers

    return Servers(ps, mode=mode, extra_chief=("--replicas", str(replicas)), place=place, num_shards=num_shards)


def shoal_pids(servers, workers: list[mp.Process]) -> dict[str, int]:
    return {"chief": servers.procs[0].pid, **{f"ps{i}": p.pid for i, p in enumerate(servers.procs[1:])},
            **{f"worker{i}": p.pid for i, p in enumerate(workers)}}


def rank_pids(ranks: list[mp.Process]) -> dict[str, int]:
    return {f"rank{i}": p.pid for i, p in enumerate(ranks)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_times(pids: dict[str, int]) -> dict[str, float | None]:
    """CPU seconds of each process so far; None for one that has ended."""
    times: dict[str, float | None] = {}
    for name, pid in pids.items():
        try:
            times[name] = cpu_seconds(pid)
        except (OSError, IndexError, ValueError):
            times[name] = None
    return times


def cores(before: dict[str, float | None], after: dict[str, float | None], seconds: float) -> dict[str, float | None]:
    """Cores each process used between two :func:`cpu_times` readings ``seconds`` apart."""
    return {k: None if before[k] is None or after.get(k) is None else round((after[k] - before[k]) / seconds, 2)
            for k in before}


def join(procs: list[mp.Process], timeout_s: float) -> list[int]:
    """Waits up to ``timeout_s`` in all for the processes to end, then ends the rest (SIGTERM, then
    SIGKILL); returns the pids it had to end."""
    deadline = time.monotonic() + timeout_s
    late = []
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            late.append(p.pid)
            p.terminate()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    return late
