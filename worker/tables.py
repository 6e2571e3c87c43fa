"""The worker's half of the embedding tables: lookups by shard, and each step's row gradients.

A :class:`TableRouter` serves the :mod:`shoal.worker.embedding` modules of a Trainer's model. A
forward hands it the batch's unique ids of a table; it asks each shard that holds some of them
(:func:`shoal.state.tables.partition_of`) for their rows, in parallel, at the version the worker's dense
weights of that shard are at (a sync worker sees the rows of the same round as its weights), and
follows the view when a shard moves. The rows come back as a leaf tensor that autograd fills with
their gradient; :meth:`TableRouter.collect` sums those per id over the step's forwards and splits
them by shard, and each shard's push carries its part as its last frame (``codec "rows"``), under
the push's idempotency key.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import grpc
import numpy as np
import torch

from shoal.errors import InvalidArgument
from shoal.state.tables import pack_rows, specs_to_json, split_by_shard, sum_rows
from shoal.worker.embedding import find_tables
from shoal.worker.routes import is_failover

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 60.0


class RowCache:
    """A table's hot rows on the worker (async/ssp only): a row pulled at step ``s`` serves lookups until
    step ``s + steps``, then is pulled again; at most ``size`` rows, the oldest dropped first. The rows are
    the servers' as of their pull: this worker's own updates since reach them at the next pull, as its
    dense weights do in async mode. Kept as sorted arrays, so a batch's hits are one ``searchsorted``."""

    def __init__(self, size: int, steps: int, dim: int):
        self.size, self.steps = size, steps
        self.ids = np.empty(0, np.int64)
        self.rows = np.empty((0, dim), np.float32)
        self.at = np.empty(0, np.int64)
        self.hits = self.misses = 0

    def get(self, ids: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(hit mask, the hits' rows) of sorted unique ``ids`` at ``step``."""
        if not len(self.ids):
            self.misses += len(ids)
            return np.zeros(len(ids), bool), self.rows[:0]
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        hit = (self.ids[pos] == ids) & (step - self.at[pos] <= self.steps)
        self.hits += int(hit.sum())
        self.misses += int(len(ids) - hit.sum())
        return hit, self.rows[pos[hit]]

    def put(self, ids: np.ndarray, rows: np.ndarray, step: int) -> None:
        keep = ~np.isin(self.ids, ids)
        all_ids = np.concatenate([self.ids[keep], ids])
        all_rows = np.concatenate([self.rows[keep], rows])
        all_at = np.concatenate([self.at[keep], np.full(len(ids), step, np.int64)])
        if len(all_ids) > self.size:            # the oldest go first
            newest = np.argsort(-all_at, kind="stable")[:self.size]
            all_ids, all_rows, all_at = all_ids[newest], all_rows[newest], all_at[newest]
        order = np.argsort(all_ids)
        self.ids, self.rows, self.at = all_ids[order], all_rows[order], all_at[order]


class TableRouter:
    """Serves the tables of ``model`` from the shards of a Trainer (``trainer``: its clients, versions, routes)."""

    def __init__(self, model: torch.nn.Module, num_shards: int, trainer: Any,
                 defaults: tuple[str, dict[str, float]] = ("sgd", {}), cache: tuple[int, int] = (0, 0)):
        self.modules = find_tables(model)
        self.num_shards = num_shards
        self.trainer = trainer
        self.defaults = defaults
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"two served tables share a name: {names}")
        for name, m in self.modules:
            m.table_name, m._router = name, self
        self._pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in names}
        self._pool = ThreadPoolExecutor(max_workers=max(1, num_shards), thread_name_prefix="rows") \
            if self.modules else None
        self.rows_pulled = 0
        self.rows_pushed = 0
        self.rows_prefetched = 0
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rows-ahead") if self.modules else None
        self._ahead_of: dict[str, tuple[np.ndarray, Any]] = {}     # table -> (ids, future of (rows, versions))
        size, steps = cache
        self.caches = {n: RowCache(size, steps, m.embedding_dim) for n, m in self.modules} if size > 0 else {}

    def __bool__(self) -> bool:
        return bool(self.modules)

    def specs(self) -> list[dict]:
        """The tables' declarations (``shoal.ps.tables.TableSpec`` fields)."""
        out = []
        for name, m in self.modules:
            opt, hyper = (m.row_optimizer, {}) if m.row_optimizer else self.defaults
            if m.row_optimizer and m.row_optimizer == self.defaults[0]:
                hyper = dict(self.defaults[1])
            out.append({"name": name, "dim": m.embedding_dim, "num_embeddings": m.num_embeddings,
                        "optimizer": opt, "hyper": {**hyper, **m.hyper}, "init_std": m.init_std, "seed": m.seed,
                        "evict_after_steps": m.evict_after_steps, "evict_min_count": m.evict_min_count})
        return out

    def specs_json(self) -> str:
        return specs_to_json(self.specs()) if self.modules else ""

    # ------------------------------------------------------------ forward

    def lookup(self, module: Any, uniq: torch.Tensor) -> torch.Tensor:
        """The rows (fp32, ``(len(uniq), dim)``) of the unique ids ``uniq`` of ``module``'s table: from a
        :meth:`prefetch` of them where one is fresh enough, else the cache (async/ssp), else the shards."""
        ids = uniq.numpy()
        out = np.empty((len(ids), module.embedding_dim), dtype=np.float32)
        need = np.ones(len(ids), bool)
        ahead = self._ahead_of.pop(module.table_name, None)
        if ahead is not None:
            p_ids, future = ahead
            p_rows, versions = future.result()
            # sync: only rows at the versions the worker's weights are at (a prefetch before the step's
            # update is stale); async/ssp take them (at most the steps since the prefetch old)
            if self.trainer.mode != "sync" or all(v >= self.trainer.versions.get(k, 0) for k, v in versions.items()):
                pos = np.minimum(np.searchsorted(p_ids, ids), max(len(p_ids) - 1, 0))
                hit = (p_ids[pos] == ids) if len(p_ids) else np.zeros(len(ids), bool)
                out[hit] = p_rows[pos[hit]]
                need &= ~hit
                self.rows_prefetched += int(hit.sum())
        if need.any():
            rest = np.flatnonzero(need)
            out[rest] = self._rows_of(module, ids[rest])
        return torch.from_numpy(out)

    def prefetch(self, module: Any, ids: torch.Tensor) -> None:
        """Starts pulling the rows of ``ids`` (a coming batch's) in the background; the next :meth:`lookup`
        of this table takes them (async/ssp: while this batch computes; sync: once the step is done)."""
        uniq = torch.unique(ids.reshape(-1).to(torch.int64).cpu()).numpy()
        assert self._ahead is not None
        self._ahead_of[module.table_name] = (uniq, self._ahead.submit(self._pull, module, uniq))

    def _rows_of(self, module: Any, ids: np.ndarray) -> np.ndarray:
        """Rows of sorted unique ``ids``: the cache's where fresh (async/ssp), the rest from the shards."""
        cache = self.caches.get(module.table_name)
        if cache is None:
            return self._pull(module, ids)[0]
        out = np.empty((len(ids), module.embedding_dim), dtype=np.float32)
        step = self.trainer.step_count
        hit, rows = cache.get(ids, step)
        out[hit] = rows
        miss = np.flatnonzero(~hit)
        if len(miss):
            out[miss] = self._pull(module, ids[miss])[0]
            cache.put(ids[miss], out[miss], step)
        return out

    def _pull(self, module: Any, ids: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
        """The rows of unique ``ids`` from the shards that hold them, one lookup per shard, in parallel; and
        each shard's version they are at."""
        out = np.empty((len(ids), module.embedding_dim), dtype=np.float32)
        parts = split_by_shard(ids, self.num_shards)
        assert self._pool is not None
        futures = {k: self._pool.submit(self._fetch, k, module, np.ascontiguousarray(ids[pos]))
                   for k, pos in parts.items()}
        versions = {}
        for k, pos in parts.items():
            out[pos], versions[k] = futures[k].result()
        self.rows_pulled += len(ids)
        return out, versions

    def _fetch(self, shard: int, module: Any, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """One shard's rows, at the version of the worker's weights of that shard or later."""
        while True:
            client = self.trainer._clients[shard]
            try:
                return client.lookup_rows(module.table_name, ids, min_version=self.trainer.versions.get(shard, 0),
                                          dtype=module.dtype_on_wire, timeout_s=LOOKUP_TIMEOUT_S)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    log.info("shard %d: rows of %s still waiting for version %d", shard, module.table_name,
                             self.trainer.versions.get(shard, 0))
                    continue
                if not is_failover(exc):
                    raise
                self.trainer.routes.reroute(shard, client, exc)

    def record(self, module: Any, uniq: torch.Tensor, rows: torch.Tensor) -> None:
        """A training forward's rows: their gradient goes with the next push."""
        self._pending[module.table_name].append((uniq, rows))

    # ------------------------------------------------------------ step

    def zero_grad(self) -> None:
        """As torch's ``zero_grad()``: gradients from earlier backward passes are dropped; rows of a forward
        whose backward has not run yet stay recorded."""
        for name, recs in self._pending.items():
            self._pending[name] = [(u, r) for u, r in recs if r.grad is None]

    def collect(self) -> dict[int, bytes]:
        """This step's row gradients summed per id, as one :func:`shoal.state.tables.pack_rows` blob per shard
        that holds some; the records are cleared."""
        by_shard: dict[int, list[tuple[str, np.ndarray, np.ndarray]]] = {}
        for name, m in self.modules:
            recs, self._pending[name] = self._pending[name], []
            parts = [(u.numpy(), r.grad.detach().cpu().numpy()) for u, r in recs if r.grad is not None]
            if not parts:
                continue
            ids, grads = sum_rows(parts, m.embedding_dim)
            self.rows_pushed += len(ids)
            for k, pos in split_by_shard(ids, self.num_shards).items():
                by_shard.setdefault(k, []).append((name, ids[pos], grads[pos]))
        return {k: pack_rows(t) for k, t in by_shard.items()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._ahead is not None:
            self._ahead.shutdown(wait=False)
        for _, m in self.modules:
            m._router = None


def row_defaults(optimizer: Any, group: dict | None = None) -> tuple[str, dict[str, float]]:
    """The row optimizer a user's torch optimizer (its ``group``, default the first) stands for, for tables
    without ``optimizer=``: Adagrad -> adagrad (lr, lr_decay, eps, initial_accumulator_value), Adam/AdamW/
    SparseAdam -> adam (lr, betas, eps; SparseAdam's lazy moments), anything else -> sgd (lr). What the rows
    cannot take lazily (weight decay, momentum) is left out, with a warning."""
    name = type(optimizer).__name__
    row = {"Adagrad": "adagrad", "Adam": "adam", "AdamW": "adam", "SparseAdam": "adam"}.get(name, "sgd")
    if group is None:
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
    take = {"adagrad": ("lr", "lr_decay", "eps", "initial_accumulator_value"), "adam": ("lr", "eps"),
            "sgd": ("lr",)}[row]
    hyper = {k: float(group[k]) for k in take if isinstance(group.get(k), (int, float))}
    if row == "adam" and isinstance(group.get("betas"), (tuple, list)):
        hyper["beta1"], hyper["beta2"] = (float(b) for b in group["betas"])
    dropped = [k for k in ("weight_decay", "momentum") if isinstance(group.get(k), (int, float)) and group[k]]
    if dropped:
        log.warning("torch.optim.%s's %s is not applied to embedding rows on the parameter servers (row "
                    "optimizer %s)", name, " and ".join(dropped), row)
    return row, hyper
