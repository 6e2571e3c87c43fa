"""Where a benchmark's processes run: all on loopback, or each on its own emulated host.

``Placement(None)`` keeps every role on 127.0.0.1. ``Placement(roles, "1gbit")``
gives each role a network namespace on one bridge (``tests/system/netns.py``)
and shapes its link to that rate each way with ``tc tbf``, so the bytes a step
moves cost what they would on a cluster's network (the CPU is still this host's).
Subprocesses start under ``prefix(role)``; a multiprocessing child calls
:func:`enter` with ``namespace(role)`` before it opens a socket.
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

CLONE_NEWNET = 0x40000000


def enter(namespace: str | None) -> None:
    """Moves the calling process (before it starts threads) into a named network namespace."""
    if namespace is None:
        return
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(fd)


class Placement:
    def __init__(self, roles: list[str] | None = None, rate: str | None = None):
        self.rate = rate
        self.hosts = None
        if rate is None:
            return
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "system"))
        import netns

        why = netns.unavailable()
        if why:
            raise SystemExit(f"--link needs network namespaces: {why}")
        self.hosts = netns.Hosts()
        try:
            for role in roles or []:
                self.hosts.add(role)
                self.hosts.shape(role, rate)
        except BaseException:
            self.hosts.remove()
            raise

    def address(self, role: str) -> str:
        return "127.0.0.1" if self.hosts is None else self.hosts.addresses[role]

    def namespace(self, role: str) -> str | None:
        return None if self.hosts is None else self.hosts.ns(role)

    def interface(self, role: str) -> str:
        return "lo" if self.hosts is None else self.hosts.interface(role)

    def prefix(self, role: str) -> list[str]:
        return [] if self.hosts is None else ["ip", "netns", "exec", self.hosts.ns(role)]

    def close(self) -> None:
        if self.hosts is not None:
            self.hosts.remove()

    def __enter__(self) -> "Placement":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
