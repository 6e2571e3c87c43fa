"""``sign``: scaled signSGD, one bit per element plus one fp32 scale per chunk.

Byte layout (little-endian, ``n`` = numel, ``m = ceil(n / 4096)`` chunks):
``m`` x float32 scales, then ``ceil(n / 8)`` bytes of sign bits (``4m +
ceil(n / 8)`` bytes). Element ``i`` is bit ``i % 8`` (least significant first)
of bit byte ``i // 8``: 1 when the sign bit of ``x_i`` is clear (``x_i >= +0``),
0 when it is set (negative or ``-0.0``); the unused high bits of the last byte
are 0. Chunk ``j``'s scale is ``mean(|x|)`` over its elements,
and element ``i`` decodes to ``+-scale_(i // 4096)``.

Why per-chunk mean |x|: for a chunk ``c`` the scaled sign ``s * sign(x_c)``
with ``s = mean|x_c|`` is the least-squares best, leaving error
``||x_c||^2 - ||x_c||_1^2 / d_c``; summed over chunks this is never more than
one tensor-wide scale leaves (Cauchy-Schwarz), so error feedback has less to
carry, at a cost of 4 bytes per 512 bytes of bits.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import (Buffer, ChunkScaledCodec, CodecError, as_bytes, ceil_div, check_encoded_scales, check_length, check_numel, chunk_counts, chunk_rows, num_chunks, read_scales, register_codec,
                   scale_chunks_, to_bytes)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Packs a 1-D 0/1 uint8 tensor 8 per byte, least significant bit first (zero-padded).

    Works on any device: eight bit bytes are read as one little-endian int64
    and folded into its low byte with three shift-or steps.
    """
    padded = bits
    if bits.numel() % 8:
        padded = torch.zeros(ceil_div(bits.numel(), 8) * 8, dtype=torch.uint8, device=bits.device)
        padded[:bits.numel()] = bits
    word = padded.view(torch.int64)
    word = word | (word >> 7)
    word = word | (word >> 14)
    word = word | (word >> 28)
    return (word & 0xFF).to(torch.uint8)


@register_codec
class SignCodec(ChunkScaledCodec):
    """1-bit sign compression with a mean-|x| scale per 4096-element chunk."""

    name = "sign"

    def _encode(self, x: torch.Tensor, want_approx: bool) -> tuple[bytes, torch.Tensor | None]:
        n = x.numel()
        rows = chunk_rows(x)
        scales = rows.abs().sum(dim=1).div_(chunk_counts(n, x.device))
        payload = to_bytes(scales, pack_bits(torch.signbit(x).logical_not_().to(torch.uint8)))
        check_encoded_scales(self.name, payload, scales.numel())
        approx = None
        if want_approx:
            approx = torch.copysign(scales.unsqueeze(1).expand_as(rows), rows).view(-1)[:n]
        return payload, approx

    def decode(self, buf: Buffer, numel: int) -> torch.Tensor:
        view, numel = as_bytes(buf), check_numel(numel)
        m = num_chunks(numel)
        check_length(self.name, view, self.encoded_size(numel), numel)
        scales = read_scales(self.name, view, m)
        packed = np.frombuffer(view, dtype=np.uint8, offset=4 * m)
        if numel % 8 and packed[-1] >> (numel % 8):
            raise CodecError("sign payload has bits set past the last element")
        bits = np.unpackbits(packed, count=numel, bitorder="little")
        out = torch.from_numpy(bits).to(torch.float32).mul_(2.0).sub_(1.0)
        return scale_chunks_(out, scales)

    def encoded_size(self, numel: int) -> int:
        return 4 * num_chunks(numel) + ceil_div(numel, 8)
