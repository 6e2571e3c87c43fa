"""``topk``: only the ``k`` largest-magnitude elements are sent.

Byte layout (little-endian). The tensor is cut into blocks of 65536 elements
(``B = ceil(numel / 65536)``, the last one possibly shorter):

- ``B`` x uint32: how many entries each block has;
- ``k`` x uint16: each entry's index inside its block, blocks in order and
  indices strictly increasing (so every global index is too, and ``< numel``);
- ``k`` x float32: the values.

That is ``4B + 6k`` bytes: 6 per entry instead of 8 with plain int32 indices,
so 1% top-k is 66x smaller than fp32 rather than 50x. ``k`` follows from the
payload length, so a decoder accepts any ``k <= numel`` whatever ratio the
sender used; this codec sends ``k = ceil(ratio * numel)`` (at least 1, at most
``numel``; 0 for an empty tensor). Every other element decodes to zero.

Selection is exact. On CUDA it is ``torch.topk``; on the CPU a strided sample
first estimates a magnitude threshold that about ``1.3k`` elements pass, NumPy
finds those (its compare and ``flatnonzero`` take a third of torch's time
here), and ``torch.topk`` runs only over them (falling back to a full
``torch.topk`` when fewer than ``k`` pass): 4.5 ms instead of 51 ms for 1% of
4M elements on one core.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .base import (Buffer, Codec, CodecError, as_bytes, check_input, check_numel, read_tensor, register_codec,
                   to_bytes)

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS  # elements per block of block-local uint16 indices
_SAMPLE_STRIDE = 64      # one sampled element per this many
_MIN_SAMPLED_NUMEL = 1 << 16  # below this a full topk is already cheap
_MARGIN = 1.3            # candidates aimed for, as a multiple of k


def topk_indices(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, unordered) of the ``k`` largest entries of the non-negative 1-D ``a``."""
    n = a.numel()
    if a.is_cuda or n < _MIN_SAMPLED_NUMEL or k * 8 > n:
        return torch.topk(a, k, sorted=False).indices
    sample = a[::_SAMPLE_STRIDE]
    rank = min(sample.numel(), math.ceil(k * sample.numel() / n * _MARGIN) + 16)
    threshold = float(torch.topk(sample, rank, sorted=False).values.min())
    candidates = torch.from_numpy(np.flatnonzero(a.numpy() >= threshold))
    if candidates.numel() < k or candidates.numel() > n // 4:
        return torch.topk(a, k, sorted=False).indices
    return candidates[torch.topk(a[candidates], k, sorted=False).indices]


@register_codec
class TopKCodec(Codec):
    """Sparsification to the top ``ratio`` fraction of elements by magnitude."""

    name = "topk"
    sparse = True
    biased = True

    def __init__(self, ratio: float = 0.01):
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 < ratio <= 1.0:
            raise CodecError(f"topk ratio must be a number in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    def __repr__(self) -> str:
        return f"TopKCodec(ratio={self.ratio})"

    def k(self, numel: int) -> int:
        """How many elements this codec sends for a tensor of ``numel``."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(round(self.ratio * numel, 6))))

    def encode(self, x: torch.Tensor) -> bytes:
        return self._encode(check_input(x))[0]

    def encode_with_approx(self, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        x = check_input(x)
        payload, idx, values = self._encode(x)
        return payload, torch.zeros_like(x).index_copy_(0, idx, values)

    def encode_residual_(self, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """What was sent is exactly the entries at the chosen indices: the residual is ``x`` with
        those zeroed, in place (no dense approximation is built)."""
        x = check_input(x)
        payload, idx, _ = self._encode(x)
        return payload, x.index_fill_(0, idx, 0.0)

    def _encode(self, x: torch.Tensor) -> tuple[bytes, torch.Tensor, torch.Tensor]:
        idx = torch.sort(topk_indices(x.abs(), self.k(x.numel()))).values
        values = x[idx]
        counts = torch.bincount(idx >> BLOCK_BITS, minlength=num_blocks(x.numel())).to(torch.int32)
        local = idx & (BLOCK - 1)
        local16 = torch.where(local >= BLOCK // 2, local - BLOCK, local).to(torch.int16)   # uint16 bits
        return to_bytes(counts, local16, values), idx, values

    def decode(self, buf: Buffer, numel: int) -> torch.Tensor:
        view, numel = as_bytes(buf), check_numel(numel)
        blocks = num_blocks(numel)
        if view.nbytes < 4 * blocks or (view.nbytes - 4 * blocks) % 6:
            raise CodecError(f"topk payload of {view.nbytes} bytes for {numel} elements is not {blocks} block "
                             f"count(s) and whole (uint16, fp32) entries")
        k = (view.nbytes - 4 * blocks) // 6
        if k > numel:
            raise CodecError(f"topk payload holds {k} entries, more than the {numel} elements")
        out = torch.zeros(numel, dtype=torch.float32)
        counts = np.frombuffer(view, dtype="<u4", count=blocks).astype(np.int64)
        if int(counts.sum()) != k:
            raise CodecError(f"topk block counts add up to {int(counts.sum())}, the payload holds {k} entries")
        if k == 0:
            return out
        local = np.frombuffer(view, dtype="<u2", count=k, offset=4 * blocks).astype(np.int64)
        idx = np.repeat(np.arange(blocks, dtype=np.int64) << BLOCK_BITS, counts) + local
        if idx[-1] >= numel:
            raise CodecError(f"topk index out of range [0, {numel}): last {idx[-1]}")
        if k > 1 and not (np.diff(idx) > 0).all():
            raise CodecError("topk indices are not strictly increasing")
        values = read_tensor(view, torch.float32, k, offset=4 * blocks + 2 * k)
        return out.index_copy_(0, torch.from_numpy(idx), values)

    def encoded_size(self, numel: int) -> int:
        return 4 * num_blocks(numel) + 6 * self.k(numel)

    def encoded_size_bound(self, numel: int) -> int:
        return 4 * num_blocks(numel) + 6 * numel


def num_blocks(numel: int) -> int:
    """How many index blocks cover ``numel`` elements."""
    return -(-numel // BLOCK)
