"""A shard as a copy: what a checkpoint or a new backup is made of, and the shard rebuilt from one.

:class:`ShardCopies` is half of :class:`shoal.ps.shard.Shard` (its lock, weights, optimizer, version,
ledger, keys and clocks are the shard's); every method takes the shard's lock.
"""
from __future__ import annotations

import collections
import copy
import hashlib
import time
from typing import Callable

import torch

from shoal.state.checkpoint_store import ShardState
from shoal.settings.config import OptimizerSpec
from shoal.ps.changes import ChangeLog
from shoal.ps.consistency import Rule
from shoal.errors import FailedPrecondition
from shoal.ps.ledger import ledger_from_extra, ledger_to_extra


class ShardCopies:
    def export_state(self, start: int = 0, checkpoint: bool = False) -> ShardState:
        """A copy of everything a restore needs; ``start`` is the shard's offset in the flat model. The
        tables' partitions come whole (a backup's copy) or, for a ``checkpoint``, as the snapshots
        :meth:`ShardTables.checkpoint_snapshots` takes (``extra["table_snapshots"]``: written to their own
        files by the caller, ps/checkpoint_servicer.py)."""
        with self._cond:
            start = start or self.flat_start
            if not self.tables:
                tables = {}
            elif checkpoint:
                tables = {"table_snapshots": self.tables.checkpoint_snapshots()}
            else:
                tables = {"tables": self.tables.export()}
            return ShardState(self.shard_id, start, start + self.numel, self._param.detach().clone(),
                              self.optimizer_spec.saved_name, dict(self.optimizer_spec.hparams),
                              copy.deepcopy(self._opt.state_dict()), self.version,
                              {**ledger_to_extra(self.ledger), "fingerprint": self.fingerprint, **tables})

    def export_replica(self) -> dict:
        """Everything a new backup needs to continue as this shard's copy (lock held by the caller or not)."""
        with self._cond:
            state = self.export_state()
            return {"state": state, "keys": list(self._keys.items()), "clocks": dict(self._clocks),
                    "pushed": sorted(self._pushed)}

    @classmethod
    def from_replica(cls, replica: dict, rule: Rule, clock: Callable[[], float] = time.monotonic) -> "Shard":
        state = replica["state"]
        s = cls.from_state(state, rule, state.extra["fingerprint"], clock)
        s._keys = collections.OrderedDict((str(k), int(v)) for k, v in replica["keys"])
        s._clocks = {str(k): int(v) for k, v in replica["clocks"].items()}
        s._pushed = {str(w) for w in replica.get("pushed", ())}
        return s

    def digest(self) -> tuple[int, str]:
        """``(version, sha256)`` of the weights and the optimizer state: equal on identical copies."""
        with self._cond:
            h = hashlib.sha256(self._param.detach().numpy().tobytes())
            self.tables.digest_into(h)
            for _, st in sorted(self._opt.state_dict()["state"].items()):
                for name in sorted(st):
                    v = st[name]
                    h.update(name.encode())
                    h.update(v.detach().cpu().numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
            return self.version, h.hexdigest()

    @classmethod
    def from_state(cls, state: ShardState, rule: Rule, fingerprint: str,
                   clock: Callable[[], float] = time.monotonic,
                   table_snapshots: dict[str, list[bytes]] | None = None) -> "Shard":
        """A shard rebuilt from a checkpoint: weights, optimizer state, version, ledger and its tables'
        partitions (``table_snapshots``: each table's chain, for a checkpoint that keeps them in files)."""
        sources = state.extra.get("resliced_from", ())
        if any((src.get("extra") or {}).get("tables") for src in sources):
            raise FailedPrecondition(f"shard {state.shard}: the checkpoint holds embedding tables and was saved "
                                     f"with another number of shards; a job with tables restores onto the number "
                                     f"of shards it was saved with")
        s = cls(state.shard, state.values, OptimizerSpec.from_saved(state.optimizer, dict(state.hparams)), rule,
                fingerprint, clock, flat_start=state.start)
        s._opt.load_state_dict(state.opt_state)
        s.version = int(state.version)
        s.changes = ChangeLog(s.numel, s.version, s.optimizer_spec)
        s.ledger = ledger_from_extra(state.extra)
        if state.extra.get("tables"):
            s.tables.restore(state.extra["tables"], table_snapshots)
        return s
