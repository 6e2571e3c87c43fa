"""Network faults for ``bench/nemesis.py --netns``: every role on a host of its own.

Each host is a network namespace with one veth into a bridge (tests/system/netns.py's
``Hosts``); traffic never leaves the namespaces made here. ``shoal local`` runs on a
host of its own (``ops``, never faulted) and starts each role on its host through its
hidden ``--hosts`` file (an ``ip netns exec NS`` prefix and a bind address per role),
so it still supervises, restarts and reads the records as on loopback. The faults:

- ``partition``: one host's link down for some seconds (a worker, a server or the chief),
  then up again;
- ``split_chief_ps``: the chief and one server cannot reach each other (blackhole routes in
  their two namespaces) while the workers reach both; healed after some seconds;
- ``slow_link``: one host's link limited to ``SLOW_RATE`` (tc tbf, both ends) for some seconds.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "system"))
import netns  # noqa: E402

NET_ACTIONS = ("partition", "split_chief_ps", "slow_link")
ROLES = ("chief", "ps0", "ps1", "worker0", "worker1")
HOSTS = (*ROLES, "outside", "ops")      # outside: join_leave's worker; ops: shoal local itself
SLOW_RATE = "4mbit"
_STEPS = ("import sys\nfrom shoal.proto import shoal_pb2 as pb, shoal_pb2_grpc as g\nfrom shoal.net.rpc import open_channel\n"
          "print(g.ChiefStub(open_channel(sys.argv[1])).GetJobStats(pb.Empty(), timeout=2).totals.steps)")


def unavailable() -> str:
    return netns.unavailable()


def draw(rng, action: str, lease_s: float) -> tuple[str, float]:
    """A net fault's target and duration (called only for NET_ACTIONS, so other draws stay as they were)."""
    if action == "partition":                   # within the lease, or well past it
        return rng.choice(ROLES), round(rng.choice((0.5 * lease_s, 3.0 * lease_s)), 2)
    if action == "split_chief_ps":
        return rng.choice(("ps0", "ps1")), round(rng.uniform(0.5 * lease_s, 4.0 * lease_s), 2)
    return rng.choice(ROLES), round(rng.uniform(2.0, 6.0), 2)


def leftover(tag: str) -> list[str]:
    """Namespaces of hosts tagged ``tag`` that still exist."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return [n.split()[0] for n in names if n.startswith(f"shoal-{tag}-")]


class Net:
    """The hosts of one run; ``close()`` removes them (always call it) and returns any left behind."""

    def __init__(self, work: Path):
        self.hosts = netns.Hosts()
        try:
            for name in HOSTS:
                self.hosts.add(name)
            self.file = work / "hosts.json"
            self.file.write_text(json.dumps({r: {"prefix": self.prefix(r), "address": self.hosts.addresses[r]}
                                             for r in ROLES}))
        except BaseException:
            self.hosts.remove()
            raise

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts.ns(host)]

    def local_args(self) -> list[str]:
        return ["--hosts", str(self.file)]

    def steps(self, chief: str) -> int:
        """The job's worker steps, asked from the ops host (the chief is not reachable from here)."""
        try:
            r = subprocess.run([*self.prefix("ops"), sys.executable, "-c", _STEPS, chief], capture_output=True,
                               text=True, timeout=15)
            return int(r.stdout.strip() or 0)
        except (subprocess.TimeoutExpired, ValueError):
            return 0

    def apply(self, action: str, target: str, seconds: float, note: Callable[[str], None]) -> None:
        h = self.hosts
        if action == "partition":
            h.cut(target)
            note(f"partition: {target} cut off for {seconds}s")
            try:
                time.sleep(seconds)
            finally:
                h.heal(target)
                note(f"partition of {target} healed")
        elif action == "split_chief_ps":
            h.block("chief", target)
            note(f"split: chief and {target} cut from each other for {seconds}s (workers reach both)")
            try:
                time.sleep(seconds)
            finally:
                h.block("chief", target, on=False)
                note(f"split of chief and {target} healed")
        elif action == "slow_link":
            try:
                h.shape(target, SLOW_RATE)
            except subprocess.CalledProcessError as exc:
                note(f"slow_link {target}: not applied ({exc.stderr.strip()}): already slowed?")
                return
            note(f"slow_link: {target} limited to {SLOW_RATE} for {seconds}s")
            try:
                time.sleep(seconds)
            finally:
                h.unshape(target)
                note(f"slow_link of {target} lifted")
        else:
            raise ValueError(f"not a network fault: {action}")

    def close(self) -> list[str]:
        self.hosts.remove()
        return leftover(self.hosts.tag)
