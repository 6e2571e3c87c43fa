"""Deterministic initial rows: a pure function of (seed, id), vectorised.

Row ``id``'s values come from a SplitMix64 stream seeded by a mix of
``(seed, id)``: output ``k`` (k = 0, 1, ...) gives two 32-bit uniforms, for
columns ``2k`` and ``2k + 1``, each turned into a normal by the inverse normal
CDF, linearly interpolated in a table of 2^14 quantiles (the quantiles of
``(i + 1/2) / 2^14``; the extreme tails are extrapolated from the last two, so
values stay within about 4.3 standard deviations). Only integer operations,
``+``, ``*`` and ``floor`` run per value (no ``log``/``cos``), in float64 rounded to
float32 at the end, so a primary, its backup and a restored copy, on any host,
agree on every untouched row without storing it.
"""
from __future__ import annotations

import functools
from statistics import NormalDist

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)
_SEED_SALT = np.uint64(0x5EED7AB1E5EED001)
_K = 1 << 14


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (a bijection; wraps, never warns)."""
    x = x ^ (x >> _S30)
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


@functools.cache
def _quantiles() -> np.ndarray:
    nd = NormalDist()
    return np.array([nd.inv_cdf((i + 0.5) / _K) for i in range(_K)], np.float64)


def _normals(u32: np.ndarray) -> np.ndarray:
    """float64 standard normals from uint64 arrays holding 32-bit uniforms."""
    q = _quantiles()
    # the uniform (u + 1/2) / 2^32 as a position among the K quantiles: u' * K - 1/2
    pos = u32.astype(np.float64) * (_K / 4294967296.0) + (0.5 * _K / 4294967296.0 - 0.5)
    i = pos.astype(np.int64)                 # truncation: floor for pos >= 0; pos in [-1/2, 0) gives 0 too
    np.minimum(i, _K - 2, out=i)
    frac = pos - i
    lo = q.take(i)
    return lo + frac * (q.take(i + 1) - lo)


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
    u = np.empty((n, pairs, 2), np.uint64)
    np.right_shift(h, _S32, out=u[:, :, 0])
    np.bitwise_and(h, _LOW32, out=u[:, :, 1])
    z = _normals(u).reshape(n, 2 * pairs)
    z *= std
    return z[:, :dim].astype(np.float32)
