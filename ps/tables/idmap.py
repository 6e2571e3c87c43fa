"""A vectorised open-addressing hash map from int64 ids to int64 slots, in numpy.

Linear probing over a power-of-two array of (key, slot) pairs, slot ``-1`` for
an empty cell and ``-2`` for a tombstone (a deleted entry that probes walk
past). Every operation takes a whole batch of ids and loops over probe
*rounds*, not ids: each round is a few numpy gathers over the ids still
probing, and at load <= 1/2 (tombstones counted) almost all ids settle in the
first one or two rounds. Any int64 is a valid key (the emptiness is in the slot).

The position of an id is the top bits of a multiply-xorshift mix that differs
from the one :func:`shoal.state.tables.partition_of` uses, so the ids of one
partition (which share their partition hash modulo the shard count) still
spread over every cell.
"""
from __future__ import annotations

import numpy as np

EMPTY = -1
TOMB = -2
_MIN_CAP = 1024
_K1 = np.uint64(0xFF51AFD7ED558CCD)      # murmur3's fmix64
_K2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def _fmix(ids: np.ndarray) -> np.ndarray:
    x = ids.view(np.uint64) ^ np.uint64(0x2545F4914F6CDD1D)
    x = x ^ (x >> _S33)
    x *= _K1
    x ^= x >> _S33
    x *= _K2
    x ^= x >> _S33
    return x


class IdMap:
    """int64 id -> int64 slot. ``find``/``insert``/``delete`` take arrays of ids."""

    def __init__(self, capacity: int = _MIN_CAP) -> None:
        cap = _MIN_CAP
        while cap < capacity:
            cap *= 2
        self._alloc(cap)
        self.size = 0            # live entries
        self._tombs = 0

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        self._shift = np.uint64(64 - (cap.bit_length() - 1))
        self._mask = cap - 1
        self._kv = np.zeros((cap, 2), np.int64)      # (key, slot) side by side: one cache line per probe
        self._kv[:, 1] = EMPTY

    @property
    def nbytes(self) -> int:
        return self._kv.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (_fmix(ids) >> self._shift).astype(np.int64)

    def _probe(self, ids: np.ndarray) -> np.ndarray:
        """Cell of each id, or -1 where the id is absent."""
        n = ids.shape[0]
        pos = self._home(ids)
        cell = np.full(n, -1, np.int64)
        active = np.arange(n)
        kv = self._kv
        while active.size:
            p = pos[active]
            g = kv.take(p, axis=0)
            s = g[:, 1]
            hit = (s >= 0) & (g[:, 0] == ids[active])
            cell[active[hit]] = p[hit]
            go_on = ~hit & (s != EMPTY)
            active = active[go_on]
            pos[active] = (p[go_on] + 1) & self._mask
        return cell

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where absent."""
        cell = self._probe(ids)
        out = np.full(ids.shape[0], -1, np.int64)
        found = cell >= 0
        out[found] = self._kv[cell[found], 1]
        return out

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Add ``ids`` (unique, none present) with their ``slots``. Deterministic for the same history."""
        n = ids.shape[0]
        if n == 0:
            return
        if 2 * (self.size + self._tombs + n) > self.cap:
            self._rehash(self.size + n)
        pos = self._home(ids)
        active = np.arange(n)
        kv = self._kv
        while active.size:
            p = pos[active]
            free = kv[p, 1] < 0
            cand, cp = active[free], p[free]
            if cand.size:
                uniq, first = np.unique(cp, return_index=True)      # first claimant of each free cell wins
                won = cand[first]
                self._tombs -= int(np.count_nonzero(kv[uniq, 1] == TOMB))
                kv[uniq, 0] = ids[won]
                kv[uniq, 1] = slots[won]
                placed = np.zeros(n, bool)
                placed[won] = True
                keep = ~placed[active]
                active, p = active[keep], p[keep]
            pos[active] = (p + 1) & self._mask
        self.size += n

    def delete(self, ids: np.ndarray) -> np.ndarray:
        """Remove ``ids`` (unique); returns the slots they held (-1 for an absent id, which is skipped)."""
        cell = self._probe(ids)
        out = np.full(ids.shape[0], -1, np.int64)
        found = cell >= 0
        c = cell[found]
        out[found] = self._kv[c, 1]
        self._kv[c, 1] = TOMB
        k = int(c.size)
        self.size -= k
        self._tombs += k
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of every live entry, in cell order."""
        live = self._kv[:, 1] >= 0
        return self._kv[live, 0], self._kv[live, 1]

    def _rehash(self, need: int) -> None:
        ids, slots = self.items()
        cap = _MIN_CAP
        while cap < 4 * need:
            cap *= 2
        cap = max(cap, self.cap if 2 * need <= self.cap // 2 else 0, _MIN_CAP)
        self._alloc(cap)
        self.size = 0
        self._tombs = 0
        if ids.size:
            order = np.argsort(ids, kind="stable")          # a layout that depends on the content alone
            self.insert(ids[order], slots[order])
