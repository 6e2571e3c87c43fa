"""Starts a chief and parameter servers as separate processes for a benchmark in this process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _hosts import Placement


class Servers:
    """The chief runs as role ``chief``, the servers as ``ps0``, ``ps1``... of ``place`` (default: loopback)."""

    def __init__(self, num_ps: int, mode: str = "async", extra_chief: tuple[str, ...] = (),
                 place: Placement | None = None, num_shards: int | None = None):
        place = place or Placement()
        self.tmp = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
        self.procs: list[subprocess.Popen] = []
        port_file = self.tmp / "chief.port"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = open(self.tmp / "servers.log", "w")
        self.procs.append(subprocess.Popen(
            [*place.prefix("chief"), sys.executable, "-m", "shoal.cli", "--log-level", "warning", "chief",
             "--bind", f"{place.address('chief')}:0",
             "--port-file", str(port_file), "--num-shards", str(num_shards or num_ps), "--mode", mode, *extra_chief],
            stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline:
                raise RuntimeError("chief did not start: " + (self.tmp / "servers.log").read_text())
            time.sleep(0.05)
        self.chief = f"{place.address('chief')}:{port_file.read_text().strip()}"
        for i in range(num_ps):
            self.procs.append(subprocess.Popen(
                [*place.prefix(f"ps{i}"), sys.executable, "-m", "shoal.cli", "--log-level", "warning", "ps",
                 "--chief", self.chief, "--bind", f"{place.address(f'ps{i}')}:0"],
                stdout=log, stderr=subprocess.STDOUT, env=env))

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
