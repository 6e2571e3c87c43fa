"""Deterministic initial rows: a pure function of (seed, id), vectorised.

Row ``id``'s values come from a SplitMix64 stream seeded by a mix of
``(seed, id)``: output ``k`` (k = 0, 1, ...) gives two 32-bit uniforms, turned by
Box-Muller into normals for columns ``2k`` and ``2k + 1``. A primary, its backup
and a restored copy therefore agree on every untouched row without storing it.
"""
from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_SEED_SALT = np.uint64(0x5EED7AB1E5EED001)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (a bijection; wraps, never warns)."""
    x = x ^ (x >> _S30)
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def initial_rows(seed: int, ids: np.ndarray, dim: int, std: float) -> np.ndarray:
    """``(len(ids), dim)`` float32: ``normal(0, std)`` rows for int64 ``ids``, the same for the same (seed, id)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    n = ids.shape[0]
    if std == 0.0 or n == 0:
        return np.zeros((n, dim), np.float32)
    base = mix64(np.full(1, seed, np.uint64) ^ _SEED_SALT)
    state = mix64(ids.view(np.uint64) ^ base)                      # (n,)
    pairs = (dim + 1) // 2
    steps = (np.arange(1, pairs + 1, dtype=np.uint64) * _GOLDEN)    # (pairs,)
    h = mix64(state[:, None] + steps[None, :])                      # (n, pairs)
    u1 = ((h >> _S32).astype(np.float64) + 1.0) * (1.0 / 4294967296.0)          # (0, 1]
    u2 = (h & np.uint64(0xFFFFFFFF)).astype(np.float64) * (2.0 * np.pi / 4294967296.0)
    r = np.sqrt(-2.0 * np.log(u1)) * std
    out = np.empty((n, pairs, 2), np.float32)
    out[:, :, 0] = r * np.cos(u2)
    out[:, :, 1] = r * np.sin(u2)
    return out.reshape(n, 2 * pairs)[:, :dim].copy() if dim % 2 else out.reshape(n, dim)
