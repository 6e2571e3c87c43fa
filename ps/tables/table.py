"""One partition of one embedding table: :class:`RowTable`, the pure state a shard holds.

Storage: a row, its optimizer state, its update count, its last-updated step
and its change stamp share one *slot* of arrays grown by doubling; an
:class:`~shoal.ps.tables.idmap.IdMap` maps ids to slots, and slots freed by
eviction are reused (last freed, first reused) before fresh ones.

Only :meth:`apply` (``commit(prepare(...))``) and :meth:`evict` (and :meth:`restore`)
change the state, and both are deterministic functions of their arguments and the
state, so a primary and a backup fed the same stream hold the same rows in the
same slots. :meth:`lookup` stores no row: a row that was never updated is its
initial value, a pure function of (seed, id) (:func:`~shoal.ps.tables.init.initial_rows`);
it only keeps the initial rows it computed in a small memo that the next applies
read instead of computing them again (a saving, never a different value).
Not thread-safe: the shard calls every method with its lock held.

Incremental checkpoints: each change stamps the row's slot with the current
epoch; :meth:`mark` closes an epoch and returns its number; ``snapshot(m)``
carries the rows stamped after mark ``m`` and the ids evicted after it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np

from shoal.errors import FailedPrecondition, InvalidArgument
from shoal.ps.tables.idmap import IdMap
from shoal.ps.tables.init import initial_rows
from shoal.ps.tables.optimizers import row_optimizer
from shoal.ps.tables.snapshot import TableSnapshot
from shoal.ps.tables.spec import TableSpec

_MIN_ROWS = 256
_MEMO_LOOKUPS = 4         # initial rows of this many recent lookups are kept for the applies that follow them
_MEMO_BYTES = 4 << 20     # ... of lookups whose new rows take at most this many bytes each
# bytes of bookkeeping per stored row: id, count, last step, stamp (int64 each), live flag, and two
# (key, slot) cells of the id map (its load is kept <= 1/2)
_META_BYTES = 8 * 4 + 1 + 2 * 16


@dataclass(eq=False)
class PreparedApply:
    """An update :meth:`RowTable.prepare` checked and computed, for :meth:`RowTable.commit`."""

    table: "RowTable"
    changes: int              # the table's change count it was prepared at
    ids: np.ndarray
    slots: np.ndarray         # -1 where fresh
    fresh: np.ndarray         # bool: ids with no stored row yet
    rows: np.ndarray | None   # the new rows (n, dim)
    state: dict[str, np.ndarray]
    step: int
    t: int


def _partition_of(ids: np.ndarray, num_partitions: int) -> np.ndarray:
    from shoal.state.tables import partition_of          # the core's one placement function (worker and server)

    return np.asarray(partition_of(ids, num_partitions))


class RowTable:
    """The rows of partition ``partition`` (of ``num_partitions``) of the table ``spec``."""

    def __init__(self, spec: TableSpec, partition: int, num_partitions: int) -> None:
        if not isinstance(spec, TableSpec):
            raise InvalidArgument(f"RowTable needs a TableSpec, got {type(spec).__name__}")
        if not isinstance(num_partitions, int) or num_partitions < 1:
            raise InvalidArgument(f"table {spec.name!r}: num_partitions must be an int >= 1, got {num_partitions!r}")
        if not isinstance(partition, int) or not 0 <= partition < num_partitions:
            raise InvalidArgument(f"table {spec.name!r}: partition must be in [0, {num_partitions}), "
                                  f"got {partition!r}")
        self.spec = spec
        self.partition = partition
        self.num_partitions = num_partitions
        self._opt = row_optimizer(spec.optimizer)
        self._hyper = spec.resolved_hyper()
        self._init_state = {k: np.float32(self._opt.initial(k, self._hyper)) for k in self._opt.state}
        self._reset()

    # ------------------------------------------------------------------ storage
    def _reset(self) -> None:
        d = self.spec.dim
        self._map = IdMap()
        self._cap = _MIN_ROWS
        self._used = 0                                   # slots ever handed out (fresh ones start here)
        self._free = np.zeros(0, np.int64)               # freed slots, reused from the end
        self._ids = np.zeros(self._cap, np.int64)
        self._rows = np.zeros((self._cap, d), np.float32)
        self._state = {k: np.zeros((self._cap, d), np.float32) for k in self._opt.state}
        self._count = np.zeros(self._cap, np.int64)
        self._last = np.zeros(self._cap, np.int64)
        self._stamp = np.zeros(self._cap, np.int64)
        self._live = np.zeros(self._cap, bool)
        self._t = 0                                      # applies so far (the optimizer's step count)
        self._epoch = 1                                  # stamp of changes now; mark() closes it
        self._deleted: list[tuple[int, np.ndarray]] = []  # (epoch, ids evicted in it)
        self._memo: list[tuple[np.ndarray, np.ndarray]] = []  # recent lookups' initial rows (sorted ids, rows)
        self._changes = 0                                # commits and evictions so far (prepare/commit guard)

    def _grow(self, need: int) -> None:
        cap = self._cap
        while cap < need:
            cap *= 2
        if cap == self._cap:
            return

        def bigger(a: np.ndarray) -> np.ndarray:
            out = np.zeros((cap,) + a.shape[1:], a.dtype)
            out[:self._used] = a[:self._used]
            return out

        self._ids, self._rows, self._count = bigger(self._ids), bigger(self._rows), bigger(self._count)
        self._last, self._stamp, self._live = bigger(self._last), bigger(self._stamp), bigger(self._live)
        self._state = {k: bigger(v) for k, v in self._state.items()}
        self._cap = cap

    def _allocate(self, k: int) -> np.ndarray:
        reuse = min(k, self._free.size)
        slots = self._free[self._free.size - reuse:][::-1].copy()
        self._free = self._free[:self._free.size - reuse]
        fresh = k - reuse
        if fresh:
            self._grow(self._used + fresh)
            slots = np.concatenate([slots, np.arange(self._used, self._used + fresh, dtype=np.int64)])
            self._used += fresh
        return slots

    # ------------------------------------------------------------------ checks
    def _check_ids(self, ids: np.ndarray, what: str) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise InvalidArgument(f"table {self.spec.name!r}: {what} ids must be a 1-D integer array, "
                                  f"got shape {ids.shape} dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        n = self.spec.num_embeddings
        if n is not None and ids.size:
            bad = (ids < 0) | (ids >= n)
            if bad.any():
                raise InvalidArgument(f"table {self.spec.name!r}: id {int(ids[bad][0])} out of range "
                                      f"[0, {n}) ({int(bad.sum())} of {ids.size} ids)")
        if self.num_partitions > 1 and ids.size:
            wrong = _partition_of(ids, self.num_partitions) != self.partition
            if wrong.any():
                raise InvalidArgument(f"table {self.spec.name!r}: id {int(ids[wrong][0])} belongs to another "
                                      f"partition than {self.partition} of {self.num_partitions}")
        return ids

    def _refuse(self, why: str) -> None:
        raise InvalidArgument(f"table {self.spec.name!r} partition {self.partition}: {why}; update refused, "
                              f"nothing changed")

    # ------------------------------------------------------------------ reads
    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """``(n, dim)`` float32 rows of int64 ``ids``; a never-updated row is its initial value (not stored)."""
        ids = self._check_ids(ids, "lookup")
        slots = self._map.find(ids)
        present = slots >= 0
        if present.all():
            return self._rows.take(slots, axis=0)
        out = np.empty((ids.size, self.spec.dim), np.float32)
        out[present] = self._rows.take(slots[present], axis=0)
        absent = ~present
        new_ids = ids[absent]
        rows = initial_rows(self.spec.seed, new_ids, self.spec.dim, self.spec.init_std)
        out[absent] = rows
        if new_ids.size * (4 * self.spec.dim + 8) <= _MEMO_BYTES:
            if not (new_ids[1:] > new_ids[:-1]).all():       # pulls come as np.unique's sorted ids
                order = np.argsort(new_ids, kind="stable")
                new_ids, rows = new_ids[order], rows[order]
            self._memo = [(new_ids, rows)] + self._memo[:_MEMO_LOOKUPS - 1]
        return out

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        """Initial rows of ``ids`` for an apply: from the last few lookups' where they computed them (a pure
        function of (seed, id), so the memo is only a saving: a pull's rows are usually applied a step later),
        else afresh."""
        out = np.empty((ids.size, self.spec.dim), np.float32)
        todo = np.ones(ids.size, bool)
        for memo_ids, memo_rows in self._memo:
            if not todo.any():
                break
            want = np.flatnonzero(todo)
            pos = np.searchsorted(memo_ids, ids[want])
            np.minimum(pos, memo_ids.size - 1, out=pos)
            hit = memo_ids[pos] == ids[want]
            out[want[hit]] = memo_rows[pos[hit]]
            todo[want[hit]] = False
        if todo.any():
            out[todo] = initial_rows(self.spec.seed, ids[todo], self.spec.dim, self.spec.init_std)
        return out

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Whether each id has a stored row (was updated and not evicted since)."""
        return self._map.find(self._check_ids(ids, "contains")) >= 0

    def row_meta(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(update count, last-updated step) of each id; 0 and -1 for an id with no stored row."""
        slots = self._map.find(self._check_ids(ids, "row_meta"))
        present = slots >= 0
        count = np.zeros(slots.size, np.int64)
        last = np.full(slots.size, -1, np.int64)
        count[present] = self._count[slots[present]]
        last[present] = self._last[slots[present]]
        return count, last

    @property
    def rows(self) -> int:
        """Rows stored (updated at least once and not evicted since)."""
        return self._map.size

    @property
    def step_count(self) -> int:
        """Applies so far (the optimizer's step count ``t``)."""
        return self._t

    @property
    def bytes_per_row(self) -> int:
        """Bytes one stored row costs: its values, its optimizer state and the bookkeeping (id map at load 1/2)."""
        return 4 * self.spec.dim * (1 + len(self._opt.state)) + _META_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (arrays grown by doubling hold up to 2x the rows stored, plus the id map)."""
        arrays = [self._ids, self._rows, self._count, self._last, self._stamp, self._live, self._free,
                  *self._state.values()]
        memo = sum(i.nbytes + r.nbytes for i, r in self._memo)
        return sum(a.nbytes for a in arrays) + self._map.nbytes + sum(d.nbytes for _, d in self._deleted) + memo

    # ------------------------------------------------------------------ writes
    def apply(self, ids: np.ndarray, grads: np.ndarray, step: int,
              hyper: Mapping[str, float] | None = None) -> None:
        """One optimizer step on rows ``ids`` (unique int64) with ``grads`` ((n, dim) float32) at table step ``step``.

        Refuses (``InvalidArgument``, nothing changed) a bad id, a repeated id, a
        non-finite gradient, or an update that would leave a non-finite row or
        optimizer state. Counts one optimizer step (``t``) even with no ids.
        ``apply`` is ``commit(prepare(...))``.
        """
        self.commit(self.prepare(ids, grads, step, hyper))

    def prepare(self, ids: np.ndarray, grads: np.ndarray, step: int,
                hyper: Mapping[str, float] | None = None) -> PreparedApply:
        """The checks and arithmetic of :meth:`apply`, changing nothing: raises where ``apply`` would refuse.
        :meth:`commit` then stores the result and cannot fail, so an update that spans several tables (and a
        dense slice) can be checked whole before any part of it changes."""
        ids = self._check_ids(ids, "apply")
        d = self.spec.dim
        grads = np.asarray(grads)
        if grads.shape != (ids.size, d) or grads.dtype.kind != "f":
            raise InvalidArgument(f"table {self.spec.name!r}: apply needs float grads of shape ({ids.size}, {d}), "
                                  f"got {grads.shape} {grads.dtype}")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise InvalidArgument(f"table {self.spec.name!r}: step must be an int >= 0, got {step!r}")
        h = self._hyper if not hyper else self.spec.resolved_hyper(hyper)
        grads = grads.astype(np.float32, copy=False)
        if ids.size:
            if not np.isfinite(grads).all():            # (a flat check first: a per-row one is 10x the cost)
                finite = np.isfinite(grads).all(axis=1)
                self._refuse(f"non-finite gradient for id {int(ids[~finite][0])} "
                             f"({int((~finite).sum())} of {ids.size} rows)")
            if not (ids[1:] > ids[:-1]).all():          # strictly increasing (np.unique's output) is unique
                s = np.sort(ids)
                dup = s[1:] == s[:-1]
                if dup.any():
                    self._refuse(f"id {int(s[1:][dup][0])} appears more than once in one apply")
        t = self._t + 1
        if ids.size == 0:
            return PreparedApply(self, self._changes, ids, ids, ids.astype(bool), None, {}, int(step), t)
        slots = self._map.find(ids)
        present = slots >= 0
        fresh = ~present
        if not fresh.any():                             # rows all stored: gathers, no masks
            rows = self._rows.take(slots, axis=0)
            state = {k: arr.take(slots, axis=0) for k, arr in self._state.items()}
        else:
            rows = np.empty((ids.size, d), np.float32)
            ps = slots[present]
            rows[present] = self._rows.take(ps, axis=0)
            rows[fresh] = self._initial(ids[fresh])
            state = {}
            for k, arr in self._state.items():
                v = np.empty((ids.size, d), np.float32)
                v[present] = arr.take(ps, axis=0)
                v[fresh] = self._init_state[k]
                state[k] = v
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):    # checked just below
            self._opt.step(rows, state, grads, h, t)
        if not (np.isfinite(rows).all() and all(np.isfinite(v).all() for v in state.values())):
            bad = ~np.isfinite(rows).all(axis=1)
            for v in state.values():
                bad |= ~np.isfinite(v).all(axis=1)
            self._refuse(f"the update would leave a non-finite row or optimizer state for id "
                         f"{int(ids[bad][0])} ({int(bad.sum())} of {ids.size} rows); rolled back")
        return PreparedApply(self, self._changes, ids, slots, fresh, rows, state, int(step), t)

    def commit(self, p: PreparedApply) -> None:
        """Store a :meth:`prepare`'d update. It must be this table's, prepared since its last change."""
        if p.table is not self or p.changes != self._changes:
            raise FailedPrecondition(f"table {self.spec.name!r}: a prepared update is committed to the table and "
                                     f"state it was prepared on only (the table changed since, or another table)")
        self._changes += 1
        self._t = p.t
        if p.ids.size == 0:
            return
        slots, fresh = p.slots, p.fresh
        if fresh.any():
            new_ids = p.ids[fresh]
            new_slots = self._allocate(new_ids.size)
            self._map.insert(new_ids, new_slots)
            slots[fresh] = new_slots
            self._ids[new_slots] = new_ids
            self._count[new_slots] = 0
            self._live[new_slots] = True
        self._rows[slots] = p.rows
        for k, v in p.state.items():
            self._state[k][slots] = v
        self._count[slots] += 1
        self._last[slots] = p.step
        self._stamp[slots] = self._epoch

    def evict(self, step: int) -> int:
        """Drop the rows the spec's policy names at table step ``step``; returns how many.

        A row goes when ``step - last_updated_step > evict_after_steps`` or its
        update count is below ``evict_min_count``. Its slot is reused; a later
        lookup sees its initial value again, a later apply starts it afresh.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise InvalidArgument(f"table {self.spec.name!r}: step must be an int >= 0, got {step!r}")
        if not self.spec.evicts or self._map.size == 0:
            return 0
        n = self._used
        gone = np.zeros(n, bool)
        if self.spec.evict_after_steps is not None:
            gone |= (step - self._last[:n]) > self.spec.evict_after_steps
        if self.spec.evict_min_count > 0:
            gone |= self._count[:n] < self.spec.evict_min_count
        gone &= self._live[:n]
        slots = np.flatnonzero(gone)
        if slots.size == 0:
            return 0
        order = np.argsort(self._ids[slots], kind="stable")
        slots = slots[order]
        ids = self._ids[slots]
        self._changes += 1
        self._map.delete(ids)
        self._live[slots] = False
        self._free = np.concatenate([self._free, slots[::-1]])
        self._deleted.append((self._epoch, ids))
        return int(slots.size)

    # ------------------------------------------------------------------ checkpoints
    def mark(self) -> int:
        """Close the current epoch: a later ``snapshot(mark)`` carries only what changed after this call."""
        m = self._epoch
        self._epoch += 1
        return m

    def forget_deletions(self, upto_mark: int) -> None:
        """Drop the eviction log up to ``upto_mark`` (after a full checkpoint no chain needs it)."""
        self._deleted = [(e, ids) for e, ids in self._deleted if e > upto_mark]

    def snapshot(self, since_mark: int | None = None) -> TableSnapshot:
        """Every stored row (``since_mark=None``) or the rows changed and ids evicted after ``since_mark``."""
        n = self._used
        sel = self._live[:n].copy()
        if since_mark is not None:
            if isinstance(since_mark, bool) or not isinstance(since_mark, (int, np.integer)) \
                    or not 0 <= since_mark < self._epoch:
                raise InvalidArgument(f"table {self.spec.name!r}: since_mark must be a mark this table issued "
                                      f"(0..{self._epoch - 1}), got {since_mark!r}")
            sel &= self._stamp[:n] > since_mark
        slots = np.flatnonzero(sel)
        slots = slots[np.argsort(self._ids[slots], kind="stable")]
        deleted = np.zeros(0, np.int64)
        if since_mark is not None:
            parts = [ids for e, ids in self._deleted if e > since_mark]
            if parts:
                deleted = np.unique(np.concatenate(parts))
        return TableSnapshot(spec=self.spec.to_dict(), partition=self.partition,
                             num_partitions=self.num_partitions, since=None if since_mark is None else int(since_mark),
                             upto=self._epoch - 1, t=self._t, ids=self._ids[slots], rows=self._rows[slots],
                             state={k: v[slots] for k, v in self._state.items()}, count=self._count[slots],
                             last_step=self._last[slots], deleted=deleted)

    def restore(self, snapshots: Sequence[TableSnapshot]) -> None:
        """Replace the state by a full snapshot then incrementals, in order. On an error nothing changes."""
        snaps = list(snapshots)
        if not snaps or not snaps[0].full:
            raise FailedPrecondition(f"table {self.spec.name!r}: restore needs a full snapshot first, got "
                                     f"{'nothing' if not snaps else 'an incremental since mark %s' % snaps[0].since}")
        fresh = RowTable(self.spec, self.partition, self.num_partitions)
        prev = None
        for i, s in enumerate(snaps):
            fresh._check_snapshot(s, i, prev)
            if s.deleted.size:
                gone = fresh._map.delete(np.ascontiguousarray(s.deleted, np.int64))
                gone = gone[gone >= 0]
                fresh._live[gone] = False
                fresh._free = np.concatenate([fresh._free, gone[::-1]])
            fresh._upsert(s)
            prev = s
        fresh._t = prev.t
        fresh._epoch = prev.upto + 1
        fresh._stamp[:] = 0
        fresh._changes = self._changes + 1                 # an update prepared before the restore is stale
        self.__dict__.update(fresh.__dict__)

    def _check_snapshot(self, s: TableSnapshot, i: int, prev: TableSnapshot | None) -> None:
        where = f"table {self.spec.name!r}: snapshot {i}"
        mine = self.spec.to_dict()
        for k in ("name", "dim", "num_embeddings", "optimizer", "init_std", "seed"):
            if s.spec.get(k) != mine[k]:
                raise FailedPrecondition(f"{where} is of another table: {k} {s.spec.get(k)!r}, this one {mine[k]!r}")
        if (s.partition, s.num_partitions) != (self.partition, self.num_partitions):
            raise FailedPrecondition(f"{where} is partition {s.partition} of {s.num_partitions}, "
                                     f"this one {self.partition} of {self.num_partitions}")
        if i and s.full:
            raise FailedPrecondition(f"{where} is a full one; only the first may be")
        if prev is not None and not (s.since <= prev.upto and s.upto >= prev.upto):
            raise FailedPrecondition(f"{where} (changes since mark {s.since}, up to {s.upto}) does not follow the "
                                     f"one before it (up to mark {prev.upto}): a gap or the wrong order")
        n, d = s.ids.shape[0], self.spec.dim
        shapes = [s.ids.shape == (n,), s.rows.shape == (n, d), s.count.shape == (n,), s.last_step.shape == (n,),
                  sorted(s.state) == sorted(self._opt.state), all(v.shape == (n, d) for v in s.state.values())]
        if not all(shapes):
            raise InvalidArgument(f"{where} is malformed: {n} ids, rows {s.rows.shape}, "
                                  f"state {{{', '.join(f'{k}: {v.shape}' for k, v in s.state.items())}}}")
        if n and not (np.isfinite(s.rows).all() and all(np.isfinite(v).all() for v in s.state.values())):
            raise InvalidArgument(f"{where} holds non-finite rows or optimizer state")
        self._check_ids(s.ids, f"snapshot {i}")

    def _upsert(self, s: TableSnapshot) -> None:
        ids = np.ascontiguousarray(s.ids, np.int64)
        if ids.size == 0:
            return
        slots = self._map.find(ids)
        new = slots < 0
        if new.any():
            ns = self._allocate(int(new.sum()))
            self._map.insert(ids[new], ns)
            slots[new] = ns
            self._ids[ns] = ids[new]
            self._live[ns] = True
        self._rows[slots] = s.rows
        for k, v in s.state.items():
            self._state[k][slots] = v
        self._count[slots] = s.count
        self._last[slots] = s.last_step

    # ------------------------------------------------------------------ export / compare
    def iter_export(self, chunk_rows: int = 1 << 20) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, rows) in increasing id order, in chunks: a fixed table's every id of this partition (untouched
        ones at their initial value), a dynamic table's stored rows."""
        n = self.spec.num_embeddings
        if n is None:
            ids = self._ids[:self._used][self._live[:self._used]]
            ids = np.sort(ids)
            for a in range(0, ids.size, chunk_rows):
                chunk = ids[a:a + chunk_rows]
                yield chunk, self.lookup(chunk)
            return
        for a in range(0, n, chunk_rows):
            chunk = np.arange(a, min(n, a + chunk_rows), dtype=np.int64)
            if self.num_partitions > 1:
                chunk = chunk[_partition_of(chunk, self.num_partitions) == self.partition]
            yield chunk, self.lookup(chunk)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of the whole partition at once (see :meth:`iter_export`)."""
        parts = list(self.iter_export())
        if not parts:
            return np.zeros(0, np.int64), np.zeros((0, self.spec.dim), np.float32)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def digest(self) -> bytes:
        """A hash of the logical state (rows, optimizer state, counters, step count), independent of slot layout."""
        snap = self.snapshot(None)
        h = hashlib.blake2b(digest_size=32)
        h.update(json.dumps({"dim": self.spec.dim, "optimizer": self.spec.optimizer, "t": self._t,
                             "partition": self.partition, "n": int(snap.ids.size)}, sort_keys=True).encode())
        for a in (snap.ids, snap.rows, snap.count, snap.last_step, *(snap.state[k] for k in sorted(snap.state))):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.digest()
