"""Shared fixtures: a fake clock, an in-process cluster on ephemeral ports, thread-leak checks."""
from __future__ import annotations

import os
import threading

import pytest

from shoal.settings.config import JobConfig
from harness import InProcessCluster, wait_until


class FakeClock:
    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def _restore_environment():
    """Commands run in-process (``cli.main(["worker", ...])``) hand settings to the script through
    ``os.environ``; each test starts from the environment the session started with."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cluster_factory():
    """Starts in-process clusters; stops them and checks no shoal threads leak."""
    before = {t.ident for t in threading.enumerate()}
    started: list[InProcessCluster] = []

    def make(num_ps: int = 2, **job) -> InProcessCluster:
        c = InProcessCluster(num_ps, JobConfig(**{"num_shards": num_ps, **job}))
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()

    def leaked() -> list[str]:
        return [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()
                and t.name.startswith(("chief-ticker", "heartbeat", "view-watch", "task-feed"))]

    wait_until(lambda: not leaked(), timeout_s=10, what="background threads to stop")
