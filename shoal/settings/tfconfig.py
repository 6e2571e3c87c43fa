"""``TF_CONFIG``: the cluster spec and this task's place, as Kubeflow's TFJob operator sets it.

    {"cluster": {"chief": ["job-chief-0.ns.svc:2222"], "ps": ["job-ps-0.ns.svc:2222", ...],
                 "worker": ["job-worker-0.ns.svc:2222", ...]},
     "task": {"type": "ps", "index": 0}}

A role started with it needs no other flag: the chief binds its own port, a parameter server binds
its port and advertises its own host name, and both find the chief (``chief``, or ``master`` as
older operators call it) and the number of shards (``len(cluster.ps)``) here.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Mapping

from shoal.errors import InvalidArgument

ENV = "TF_CONFIG"
ROLES = {"chief": "chief", "master": "chief", "ps": "ps", "worker": "worker"}
_ADDRESS = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})$")


@dataclass(frozen=True)
class TFConfig:
    cluster: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int

    @property
    def role(self) -> str:
        """``chief``, ``ps`` or ``worker``: the shoal command this task runs."""
        return ROLES[self.task_type]

    @property
    def chief(self) -> str:
        """The chief's HOST:PORT."""
        return self.cluster["chief"][0]

    @property
    def num_ps(self) -> int:
        return len(self.cluster.get("ps", ()))

    @property
    def address(self) -> str:
        """This task's own HOST:PORT in the cluster spec."""
        return self.cluster[self._key(self.task_type)][self.task_index]

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @staticmethod
    def _key(task_type: str) -> str:
        return "chief" if ROLES.get(task_type) == "chief" else task_type


def parse(text: str) -> TFConfig:
    """Validates a ``TF_CONFIG`` value; every problem is one line naming the field and the value."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{ENV} is not JSON ({exc.args[0] if exc.args else exc}): {text[:80]!r}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{ENV} must be a JSON object with cluster and task, got {text[:80]!r}")
    cluster, task = data.get("cluster"), data.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise InvalidArgument(f"{ENV}.cluster must be a non-empty object of task type -> addresses, "
                              f"got {cluster!r}")
    if not isinstance(task, dict):
        raise InvalidArgument(f"{ENV}.task must be an object with type and index, got {task!r}")
    spec: dict[str, tuple[str, ...]] = {}
    for kind, addresses in cluster.items():
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise InvalidArgument(f"{ENV}.cluster.{kind} must be a list of HOST:PORT strings, got {addresses!r}")
        for a in addresses:
            m = _ADDRESS.match(a)
            if m is None or not 0 < int(m.group("port")) <= 65535:
                raise InvalidArgument(f"{ENV}.cluster.{kind}: {a!r} is not HOST:PORT")
        spec["chief" if kind == "master" else kind] = tuple(addresses)
    chiefs = spec.get("chief", ())
    if len(chiefs) != 1:
        raise InvalidArgument(f"{ENV}.cluster.chief must list exactly one address (the shoal chief), got "
                              f"{list(chiefs)!r}")
    task_type, index = task.get("type"), task.get("index", 0)
    if task_type not in ROLES:
        raise InvalidArgument(f"{ENV}.task.type {task_type!r} is not one of {', '.join(ROLES)}")
    if isinstance(index, bool) or not isinstance(index, int):
        raise InvalidArgument(f"{ENV}.task.index must be an integer, got {index!r}")
    members = spec.get(TFConfig._key(task_type), ())
    if not 0 <= index < len(members):
        raise InvalidArgument(f"{ENV}.task.index {index} is out of range: cluster.{task_type} has "
                              f"{len(members)} address(es)")
    return TFConfig(spec, task_type, index)


def from_env(env: Mapping[str, str] | None = None) -> TFConfig | None:
    """The parsed ``TF_CONFIG`` of ``env`` (default ``os.environ``), or None when it is unset or empty."""
    text = (os.environ if env is None else env).get(ENV, "").strip()
    return parse(text) if text else None
