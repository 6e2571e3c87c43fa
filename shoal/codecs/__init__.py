"""Gradient codecs: lossy encodings of 1-D fp32 tensors, error feedback and lz4.

``get_codec(name, **options)`` returns a :class:`Codec`; :class:`Compressor`
bundles one with :class:`ErrorFeedback` and the optional lz4 layer under a
wire tag (``topk``, ``sign+lz4``); :func:`decode_tagged` decodes by tag.

Payload byte layouts (little-endian, no header; ``n`` = numel, known to the
decoder; ``m = ceil(n / 4096)`` chunks):

=========  =========================================================  ===============
codec      layout                                                     bytes
=========  =========================================================  ===============
none       n x f32                                                    4n
fp16       n x f16 (finite values saturate at +-65504)                2n
bf16       n x bf16 (round to nearest even)                           2n
int8       m x f32 scale (absmax/127), n x i8 in [-127, 127]          4m + n
topk       B x u32 count, k x u16 in-block index, k x f32             4B + 6k
sign       m x f32 scale (mean |x|), ceil(n/8) bytes of bits, LSB     4m + ceil(n/8)
           first, 1 = sign bit clear, unused bits 0
=========  =========================================================  ===============

``topk`` sends ``k = ceil(ratio * n)`` (at least 1; ``ratio`` defaults to
0.01) and decodes any ``k <= n``; ``B = ceil(n / 65536)`` index blocks, indices
strictly increasing (``shoal/codecs/sparse.py``). With lz4 the payload is wrapped in one LZ4
frame with content size and checksum. ``int8``, ``topk`` and ``sign`` are
biased, so :class:`Compressor` applies error feedback to them by default.
"""
from __future__ import annotations

from . import dense, sign, sparse  # noqa: F401  (registers the codecs)
from .base import CHUNK, Codec, CodecError, get_codec, known_codecs, register_codec
from .compressor import Compressor, compressor_from_tag, decode_tagged, decode_tagged_entries, parse_tag
from .feedback import ErrorFeedback
from .lossless import lz4_pack, lz4_unpack

__all__ = [
    "CHUNK", "Codec", "CodecError", "Compressor", "ErrorFeedback", "compressor_from_tag", "decode_tagged",
    "decode_tagged_entries",
    "get_codec", "known_codecs", "lz4_pack", "lz4_unpack", "parse_tag", "register_codec",
]
