"""The embedding tables' partitions a shard holds, and the row half of its rounds.

Partition ``k`` of every table lives in shard ``k`` (:func:`shoal.state.tables.partition_of`), so the
shard's own machinery covers its rows: a push's row gradients join the push's round under its
idempotency key and ledger entries, a closed round's summed rows travel to the backup inside the
same :class:`~shoal.ps.update.Update` and are applied by the same ``_apply`` on primary and backup,
and a new backup's copy and a checkpoint carry each table's snapshot. The pure state of a
partition is :class:`shoal.ps.tables.RowTable`; this class only routes to it. Not thread-safe on
its own: the shard calls it with its lock held.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Sequence

import numpy as np

from shoal.errors import FailedPrecondition, InvalidArgument
from shoal.state.tables import FULL_EVERY, partition_of, sum_rows

EVICT_EVERY = 64      # shard versions between two eviction passes over the tables that evict

Rows = tuple[tuple[str, np.ndarray, np.ndarray], ...]     # (table, unique ids, fp32 (n, dim) values) each


def _tables_module():
    from shoal.ps import tables    # numpy-only pure state (engineer A's package)
    return tables


class ShardTables:
    """The partitions ``shard`` of ``num_shards`` of each declared table, and the open round's rows."""

    def __init__(self, shard: int, num_shards: int = 0):
        self.shard = shard
        self.num_shards = num_shards      # set by the first declare (the job's shard count)
        self.tables: dict[str, Any] = {}          # name -> RowTable
        self._round: list[tuple[str, np.ndarray, np.ndarray]] = []
        # checkpoints: per table, the full snapshot written last (its mark and file entry) and the
        # checkpoints since; the changes since that mark go into each checkpoint until the next full one
        self.ckpt_base: dict[str, tuple[int, dict]] = {}
        self.ckpt_since_full: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.tables)

    # ------------------------------------------------------------ declaration

    def declare(self, specs: Iterable[dict], num_shards: int) -> list[str]:
        """Creates the tables not held yet; one held already must be declared the same. Returns the new names."""
        t = _tables_module()
        specs = list(specs)
        if not specs:
            return []
        if self.num_shards and num_shards != self.num_shards:
            raise FailedPrecondition(f"shard {self.shard} holds table partitions of {self.num_shards} shards, "
                                     f"not {num_shards}")
        if not 0 <= self.shard < num_shards:
            raise InvalidArgument(f"shard {self.shard} is not one of {num_shards} shards")
        self.num_shards = num_shards
        made = []
        for d in specs:
            spec = t.TableSpec.from_dict(d)
            held = self.tables.get(spec.name)
            if held is not None:
                if held.spec.to_dict() != spec.to_dict():
                    raise FailedPrecondition(f"table {spec.name!r} is held on shard {self.shard} as "
                                             f"{held.spec.to_dict()}, not {spec.to_dict()}")
                continue
            self.tables[spec.name] = t.RowTable(spec, self.shard, self.num_shards)
            made.append(spec.name)
        return made

    def specs(self) -> list[dict]:
        return [self.tables[n].spec.to_dict() for n in sorted(self.tables)]

    def table(self, name: str):
        table = self.tables.get(name)
        if table is None:
            raise InvalidArgument(f"no table {name!r} on shard {self.shard}; tables here: {sorted(self.tables)}")
        return table

    # ------------------------------------------------------------ pushes and rounds

    def check_push(self, rows: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> Rows:
        """A push's row gradients, checked before they join a round: known tables, right width, ids this
        partition holds (fixed tables: in range), summed per id. Non-finite values are the caller's check."""
        out = []
        for name, ids, grads in rows:
            table = self.table(name)
            dim = table.spec.dim
            if grads.ndim != 2 or grads.shape[1] != dim:
                raise InvalidArgument(f"table {name!r} has rows of {dim}, a push sends {tuple(grads.shape)}")
            n = table.spec.num_embeddings
            if n is not None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise InvalidArgument(f"table {name!r}: row id {bad} outside [0, {n})")
            if len(ids) and bool(np.any(partition_of(ids, self.num_shards) != self.shard)):
                raise InvalidArgument(f"table {name!r}: a push to shard {self.shard} names ids another shard holds")
            uniq, summed = sum_rows([(ids, grads)], dim)
            out.append((name, uniq, summed))
        return tuple(out)

    def count_nonfinite(self, rows: Rows) -> int:
        return sum(int(np.count_nonzero(~np.isfinite(g))) for _, _, g in rows)

    def join_round(self, rows: Rows) -> None:
        self._round.extend(rows)

    def close_round(self, workers: int) -> Rows:
        """The open round's rows summed per id and divided by ``workers`` (as the dense average); clears it."""
        parts, self._round = self._round, []
        if not parts:
            return ()
        out = []
        for name in sorted({p[0] for p in parts}):
            ids, grads = sum_rows([(i, g) for n, i, g in parts if n == name], self.tables[name].spec.dim)
            if workers > 1:
                grads = grads / np.float32(workers)
            out.append((name, ids, np.ascontiguousarray(grads, dtype=np.float32)))
        return tuple(out)

    def clear_round(self) -> None:
        self._round = []

    def check_update(self, rows: Rows) -> None:
        """A replicated update's rows: tables held here, right width; finite."""
        for name, ids, grads in rows:
            table = self.table(name)
            if grads.shape != (len(ids), table.spec.dim):
                raise InvalidArgument(f"table {name!r}: an update of {tuple(grads.shape)} for {len(ids)} ids of "
                                      f"{table.spec.dim}")
        bad = self.count_nonfinite(rows)
        if bad:
            raise InvalidArgument(f"shard {self.shard}: an update's rows hold {bad} non-finite value(s) (NaN/Inf)")

    def apply(self, rows: Rows, version: int) -> None:
        """One update's rows (the same call on a primary and on its backup), checked whole before any table
        changes (``RowTable.prepare``, then ``commit``); every :data:`EVICT_EVERY`
        versions, an eviction pass over the tables that evict (deterministic: the backup drops the same rows)."""
        present = {r[0] for r in rows}
        # adam's step count is global (SparseAdam's): a table whose partition got no rows in this update
        # still takes its step, with no rows
        ticks = [(name, np.empty(0, np.int64), np.empty((0, t.spec.dim), np.float32))
                 for name, t in sorted(self.tables.items()) if name not in present and t.spec.optimizer == "adam"]
        todo = [*rows, *ticks]
        prepared = [self.tables[name].prepare(ids, grads, version) for name, ids, grads in todo]   # may refuse
        for (name, _, _), p in zip(todo, prepared):       # all or nothing: none refused, each commits
            self.tables[name].commit(p)
        if version % EVICT_EVERY == 0:
            for table in self.tables.values():
                if table.spec.evicts:
                    table.evict(version)

    def lookup(self, name: str, ids: np.ndarray) -> np.ndarray:
        table = self.table(name)
        n = table.spec.num_embeddings
        if n is not None and len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise InvalidArgument(f"table {name!r}: row id {bad} outside [0, {n})")
        return table.lookup(ids)

    # ------------------------------------------------------------ copies

    def export(self) -> dict[str, dict]:
        """Each table's spec and full snapshot, as plain values (a new backup's copy, a checkpoint)."""
        return {name: {"spec": t.spec.to_dict(), "snapshot": t.snapshot(None).to_bytes(),
                       "num_shards": self.num_shards} for name, t in sorted(self.tables.items())}

    def checkpoint_snapshots(self) -> dict[str, dict]:
        """Each table's snapshot for a checkpoint (lock held, at the cut): a full one every
        :data:`shoal.state.tables.FULL_EVERY` checkpoints (or when none was written yet), else the rows changed
        since the last full one (differential: a checkpoint that failed never breaks the next one's chain).
        :meth:`checkpoint_written` makes a full one the base once its file is safely on disk."""
        out = {}
        for name, t in sorted(self.tables.items()):
            base = self.ckpt_base.get(name)
            if base is None or self.ckpt_since_full.get(name, 0) + 1 >= FULL_EVERY:
                mark, snap, kind = t.mark(), None, "full"
                snap = t.snapshot(None)
            else:
                mark, kind = base[0], "diff"
                snap = t.snapshot(mark)
            out[name] = {"spec": t.spec.to_dict(), "num_shards": self.num_shards, "kind": kind, "mark": mark,
                         "data": snap.to_bytes(), "rows": int(len(snap.ids))}
        return out

    def checkpoint_written(self, name: str, kind: str, mark: int, entry: dict) -> list[dict]:
        """A table's snapshot file of a checkpoint is on disk; returns its restore chain (file entries)."""
        if kind == "full":
            self.ckpt_base[name], self.ckpt_since_full[name] = (mark, entry), 0
            return [entry]
        self.ckpt_since_full[name] = self.ckpt_since_full.get(name, 0) + 1
        return [self.ckpt_base[name][1], entry]

    def restore(self, saved: dict[str, dict], snapshots: dict[str, list[bytes]] | None = None) -> None:
        """Tables from a backup's copy (each entry holds its snapshot) or a checkpoint (``snapshots``: each
        table's chain, read by :func:`shoal.state.tables.read_chain`)."""
        t = _tables_module()
        for name, entry in saved.items():
            self.declare([entry["spec"]], int(entry["num_shards"]))
            chain = snapshots[name] if snapshots is not None else [entry["snapshot"]]
            self.tables[name].restore([t.TableSnapshot.from_bytes(b) for b in chain])

    def digest_into(self, h: "hashlib._Hash") -> None:
        for name in sorted(self.tables):
            h.update(name.encode())
            h.update(self.tables[name].digest())

    def status(self) -> list[dict]:
        out = []
        for name in sorted(self.tables):
            t = self.tables[name]
            out.append({"name": name, "rows": int(t.rows), "bytes": int(t.nbytes),
                        "bytes_per_row": int(t.bytes_per_row), "dim": t.spec.dim,
                        "num_embeddings": t.spec.num_embeddings or 0, "optimizer": t.spec.optimizer})
        return out
