"""Network namespaces as hosts: each role gets its own namespace and address on one bridge.

Needs root (``ip netns``); :func:`unavailable` says why not where it cannot run.
Traffic stays inside the namespaces created here: a hub namespace holds the
bridge, every host namespace one end of a veth pair into it.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

SUBNET = "10.213.7"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str:
    """Why namespaces cannot be made here ("" if they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"shoal-probe-{secrets.token_hex(3)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


@dataclass
class Hosts:
    """``add(name)`` makes a host; ``run(name, argv)`` starts a process in it; ``cut``/``heal`` its link."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    addresses: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hub = f"shoal-{self.tag}-hub"
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")

    def ns(self, name: str) -> str:
        return f"shoal-{self.tag}-{name}"

    def add(self, name: str) -> str:
        ns, i = self.ns(name), len(self.addresses) + 1
        inner, outer = f"v{self.tag}{i}a", f"v{self.tag}{i}b"
        _ip("netns", "add", ns)
        _ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", self.hub)
        _ip("-n", self.hub, "link", "set", outer, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.addresses[name] = f"{SUBNET}.{i}"
        return self.addresses[name]

    def _link(self, name: str) -> str:
        i = list(self.addresses).index(name) + 1
        return f"v{self.tag}{i}b"

    def shape(self, name: str, rate: str) -> None:
        """Limits the host's link to ``rate`` (tc syntax: ``1gbit``) each way, as a switch port would:
        a token bucket on the veth's egress at both ends."""
        i = list(self.addresses).index(name) + 1
        for ns, dev in ((self.ns(name), f"v{self.tag}{i}a"), (self.hub, f"v{self.tag}{i}b")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                            "rate", rate, "burst", "256kb", "latency", "10ms"], capture_output=True, text=True,
                           check=True)

    def unshape(self, name: str) -> None:
        """Takes the rate limit of :meth:`shape` off the host's link again (both ends)."""
        i = list(self.addresses).index(name) + 1
        for ns, dev in ((self.ns(name), f"v{self.tag}{i}a"), (self.hub, f"v{self.tag}{i}b")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, text=True)

    def block(self, a: str, b: str, on: bool = True) -> None:
        """Drops every packet between hosts ``a`` and ``b`` (both ways; blackhole routes in their
        namespaces, so every other pair still talks), or lets them through again."""
        for src, dst in ((a, b), (b, a)):
            _ip("-n", self.ns(src), "route", "add" if on else "del", "blackhole", f"{self.addresses[dst]}/32",
                check=on)

    def interface(self, name: str) -> str:
        """The host's network interface, inside its namespace."""
        return f"v{self.tag}{list(self.addresses).index(name) + 1}a"

    def cut(self, name: str) -> None:
        _ip("-n", self.hub, "link", "set", self._link(name), "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.hub, "link", "set", self._link(name), "up")

    def run(self, name: str, argv: list[str], **popen) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns(name), *argv], **popen)

    def output(self, name: str, argv: list[str], timeout_s: float = 30) -> str:
        return subprocess.run(["ip", "netns", "exec", self.ns(name), *argv], capture_output=True, text=True,
                              timeout=timeout_s, check=True).stdout

    def remove(self) -> None:
        for name in list(self.addresses):
            _ip("netns", "del", self.ns(name), check=False)
        _ip("netns", "del", self.hub, check=False)
