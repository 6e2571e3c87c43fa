"""Dense codecs: every element is sent, at full or reduced precision.

Byte layouts (little-endian, ``n`` = numel, ``m = ceil(n / 4096)`` chunks):

* ``none``: ``n`` x float32, the values as they are (``4n`` bytes).
* ``fp16``: ``n`` x IEEE float16 (``2n`` bytes). Finite values beyond the fp16
  range saturate to +-65504 instead of becoming inf; inf and NaN stay as they are.
* ``bf16``: ``n`` x bfloat16, the high 16 bits of the fp32 value after
  round-to-nearest-even (``2n`` bytes).
* ``int8``: ``m`` x float32 chunk scales, then ``n`` x int8 ``q`` in [-127, 127]
  (``4m + n`` bytes). Chunk ``j`` has ``scale_j = absmax(chunk_j) / 127`` and
  element ``i`` decodes to ``q_i * scale_(i // 4096)``, so the error per element
  is at most ``scale / 2``. An all-zero chunk has scale 0.
"""
from __future__ import annotations

import torch

from .base import (Buffer, ChunkScaledCodec, Codec, CodecError, as_bytes, check_encoded_scales, check_input,
                   check_length, check_numel, chunk_rows, num_chunks, read_scales, read_tensor, register_codec, scale_chunks_,
                   to_bytes)

FP16_MAX = 65504.0


class _CastCodec(Codec):
    """A codec that sends each element as ``wire_dtype`` and widens it back to fp32."""

    wire_dtype: torch.dtype = torch.float32

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.wire_dtype)

    def encode(self, x: torch.Tensor) -> bytes:
        return to_bytes(self._cast(check_input(x)))

    def decode(self, buf: Buffer, numel: int) -> torch.Tensor:
        view, numel = as_bytes(buf), check_numel(numel)
        check_length(self.name, view, self.encoded_size(numel), numel)
        return read_tensor(view, self.wire_dtype, numel).to(torch.float32)

    def encoded_size(self, numel: int) -> int:
        return numel * torch.empty((), dtype=self.wire_dtype).element_size()


@register_codec
class NoneCodec(_CastCodec):
    """Raw fp32: lossless, the reference for the others."""

    name = "none"
    wire_dtype = torch.float32


@register_codec
class Fp16Codec(_CastCodec):
    """IEEE half precision (10-bit mantissa, relative error <= 2**-11 in the normal range)."""

    name = "fp16"
    wire_dtype = torch.float16

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        half = x.to(torch.float16)
        if x.numel():
            lo, hi = torch.aminmax(x)
            if bool(torch.maximum(hi, -lo) > FP16_MAX):  # rare: saturate, but keep real infs
                saturated = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
                half = torch.where(torch.isfinite(x), saturated, half)
        return half


@register_codec
class Bf16Codec(_CastCodec):
    """bfloat16 (fp32 range, 7-bit mantissa, relative error <= 2**-8)."""

    name = "bf16"
    wire_dtype = torch.bfloat16


@register_codec
class Int8Codec(ChunkScaledCodec):
    """Symmetric 8-bit quantisation with one absmax scale per 4096-element chunk."""

    name = "int8"

    def _encode(self, x: torch.Tensor, want_approx: bool) -> tuple[bytes, torch.Tensor | None]:
        n = x.numel()
        rows = chunk_rows(x)
        scales = rows.abs().amax(dim=1).div_(127.0) if n else rows.new_zeros(0)
        divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
        q = torch.div(rows, divisor).round_().clamp_(-127, 127).to(torch.int8)
        payload = to_bytes(scales, q.view(-1)[:n])
        check_encoded_scales(self.name, payload, scales.numel())
        approx = None
        if want_approx:
            approx = q.to(torch.float32).mul_(scales.unsqueeze(1)).view(-1)[:n]
        return payload, approx

    def decode(self, buf: Buffer, numel: int) -> torch.Tensor:
        view, numel = as_bytes(buf), check_numel(numel)
        m = num_chunks(numel)
        check_length(self.name, view, self.encoded_size(numel), numel)
        scales = read_scales(self.name, view, m)
        q = read_tensor(view, torch.int8, numel, offset=4 * m)
        if numel and int(q.min()) < -127:
            raise CodecError("int8 payload holds -128, outside the encoder's range [-127, 127]")
        return scale_chunks_(q.to(torch.float32), scales)

    def encoded_size(self, numel: int) -> int:
        return 4 * num_chunks(numel) + numel
