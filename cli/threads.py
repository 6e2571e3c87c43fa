"""Intra-op threads for the workers ``shoal local`` starts on one host.

torch's default is one intra-op thread per core in every process: two workers
on one host each run as many threads as there are cores and spend their time
fighting over them (a 2-worker run measured 3.4x slower than with one thread
each, bench/notes/issue-36.md). torchrun sets ``OMP_NUM_THREADS=1`` per process;
``shoal local`` gives each worker its share of the cores instead, unless the
user set ``OMP_NUM_THREADS``.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("shoal.cli.local")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:              # not Linux
        return os.cpu_count() or 1


def worker_threads(workers: int, cores: int | None = None) -> int:
    """Intra-op threads per worker: its share of the cores, at least one."""
    return max(1, (cores if cores is not None else usable_cores()) // max(1, workers))


_SAID: set[tuple[int, int, int]] = set()


class WorkerThreads:
    """The environment each started worker gets (``OMP_NUM_THREADS``, read by torch at start); said once."""

    def __init__(self, workers: int, env: dict[str, str] | None = None):
        self.workers = workers
        self._user_set = "OMP_NUM_THREADS" in (os.environ if env is None else env)

    def env(self) -> dict[str, str]:
        if self._user_set:
            return {}
        cores = usable_cores()
        threads = worker_threads(self.workers, cores)
        said = (threads, cores, self.workers)
        if said not in _SAID:           # once a process (shoal compare runs several local clusters)
            _SAID.add(said)
            log.info("each worker uses %d intra-op thread(s): %d core(s) shared by %d worker(s) "
                     "(set OMP_NUM_THREADS to choose)", threads, cores, self.workers)
        return {"OMP_NUM_THREADS": str(threads)}


def set_worker_threads() -> int | None:
    """``shoal worker`` on its own host: its share is every core it may run on (its CPU affinity, which
    torch's default, the machine's physical cores, ignores in a container limited to a few of them).
    Nothing when the user set ``OMP_NUM_THREADS`` (``shoal local`` sets it for its workers). Said once;
    returns the count set."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    import torch

    threads = usable_cores()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.info("this worker uses %d intra-op thread(s), one per core it may run on (set OMP_NUM_THREADS "
                 "to choose)", threads)
    return threads
