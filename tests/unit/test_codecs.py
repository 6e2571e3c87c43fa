"""Round trips, payload layouts and malformed-payload rejection of shoal.codecs."""
from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest
import torch

from shoal.codecs import (CHUNK, CodecError, Compressor, compressor_from_tag, decode_tagged, get_codec,
                          known_codecs, lz4_pack, lz4_unpack, parse_tag)

SIZES = [0, 1, 7, 4097, 100003]
NAMES = ["bf16", "fp16", "int8", "none", "sign", "topk"]


def randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def roundtrip(name: str, x: torch.Tensor, **options) -> tuple[bytes, torch.Tensor]:
    codec = get_codec(name, **options)
    payload = codec.encode(x)
    assert isinstance(payload, bytes)
    assert len(payload) == codec.encoded_size(x.numel())
    y = codec.decode(payload, x.numel())
    assert y.dtype == torch.float32 and y.shape == (x.numel(),) and y.device.type == "cpu"
    return payload, y


def chunk_absmax(x: np.ndarray) -> np.ndarray:
    return np.array([np.abs(x[i:i + CHUNK]).max() for i in range(0, x.size, CHUNK)], dtype=np.float64)


# ---------------------------------------------------------------- registry

def test_known_codecs_and_unknown_name_message():
    assert known_codecs() == NAMES
    with pytest.raises(CodecError) as info:
        get_codec("zip")
    assert str(info.value) == "unknown compressor 'zip'; known: bf16, fp16, int8, none, sign, topk"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, float("nan"), "0.1", True])
def test_bad_topk_ratio_is_quoted(ratio):
    with pytest.raises(CodecError, match=re.escape(repr(ratio))):
        get_codec("topk", ratio=ratio)


def test_unknown_option_rejected():
    with pytest.raises(CodecError, match="ratio"):
        get_codec("fp16", ratio=0.1)
    assert get_codec("topk", ratio=1).k(10) == 10


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("n", SIZES)
def test_none_is_exact(n):
    x = randn(n)
    payload, y = roundtrip("none", x)
    assert torch.equal(y, x)
    assert payload == x.numpy().tobytes()


@pytest.mark.parametrize("n", SIZES)
def test_fp16_error_bound(n):
    x = randn(n) * 3
    _, y = roundtrip("fp16", x)
    assert torch.equal(y, x.half().float())
    assert bool(((y - x).abs() <= x.abs() * 2**-11 + 2**-25).all())


def test_fp16_saturates_finite_values_but_keeps_inf_and_nan():
    _, y = roundtrip("fp16", torch.tensor([1e6, -1e6, 1.0, float("inf"), -float("inf"), 65519.0, 65520.0]))
    assert y.tolist() == [65504.0, -65504.0, 1.0, float("inf"), -float("inf"), 65504.0, 65504.0]
    _, y = roundtrip("fp16", torch.tensor([float("nan"), 2.0]))
    assert math.isnan(y[0]) and y[1] == 2.0


@pytest.mark.parametrize("n", SIZES)
def test_bf16_error_bound(n):
    x = randn(n) * 1e10
    _, y = roundtrip("bf16", x)
    assert torch.equal(y, x.bfloat16().float())
    assert bool(((y - x).abs() <= x.abs() * 2**-8).all())


@pytest.mark.parametrize("n", SIZES)
def test_int8_error_within_half_a_step(n):
    x = randn(n) * torch.linspace(0.01, 10, n)  # chunks with very different ranges
    payload, y = roundtrip("int8", x)
    m = math.ceil(n / CHUNK)
    assert len(payload) == 4 * m + n
    scales = np.frombuffer(payload, "<f4", m).astype(np.float64)
    np.testing.assert_allclose(scales, chunk_absmax(x.numpy()) / 127, rtol=1e-6)
    per_elem = np.repeat(scales, CHUNK)[:n]
    err = np.abs(y.numpy().astype(np.float64) - x.numpy())
    assert (err <= per_elem / 2 * (1 + 1e-5) + 1e-12).all()
    q = np.frombuffer(payload, np.int8, n, 4 * m)
    assert q.min(initial=0) >= -127 and (n == 0 or np.abs(q).max() == 127)


def test_int8_zero_chunk():
    x = torch.zeros(CHUNK + 3)
    x[-1] = 2.0
    payload, y = roundtrip("int8", x)
    assert struct.unpack("<2f", payload[:8]) == (0.0, pytest.approx(2 / 127))
    assert torch.equal(y, x)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ratio", [0.01, 0.3])
def test_topk_keeps_exactly_the_largest(n, ratio):
    x = randn(n)
    payload, y = roundtrip("topk", x, ratio=ratio)
    k = 0 if n == 0 else max(1, math.ceil(ratio * n))
    blocks = -(-n // 65536)
    assert len(payload) == 4 * blocks + 6 * k
    expected = np.sort(np.argsort(-np.abs(x.numpy()), kind="stable")[:k])
    kept = np.flatnonzero(y.numpy())
    np.testing.assert_array_equal(kept, expected)
    assert torch.equal(y[expected], x[expected])
    counts = np.frombuffer(payload, "<u4", blocks)
    np.testing.assert_array_equal(counts, np.bincount(expected >> 16, minlength=blocks))
    np.testing.assert_array_equal(np.frombuffer(payload, "<u2", k, 4 * blocks), expected & 0xFFFF)


@pytest.mark.parametrize("pattern", ["periodic", "sparse"])
def test_topk_sampling_fallbacks_stay_exact(pattern):
    n = 1 << 17
    x = randn(n, seed=3) * 1e-3
    if pattern == "periodic":  # every sampled element is large: the sampled threshold is too high
        x[::64] += torch.linspace(10, 20, n // 64)
    else:  # fewer non-zeros than k: the threshold is 0 and everything passes
        x.zero_()
        x[torch.randperm(n, generator=torch.Generator().manual_seed(4))[:100]] = torch.linspace(1, 2, 100)
    _, y = roundtrip("topk", x, ratio=0.05)
    k = math.ceil(0.05 * n)
    expected = np.sort(np.argsort(-np.abs(x.numpy()), kind="stable")[:k])
    assert torch.equal(y[expected], x[expected])
    assert int((y != 0).sum()) == int((x[expected] != 0).sum())


def test_topk_with_ties_at_the_kth_magnitude_sends_exactly_k():
    n = 1 << 17
    x = randn(n, seed=5) * 1e-3
    tied = torch.randperm(n, generator=torch.Generator().manual_seed(6))[:10000]
    x[tied] = torch.where(torch.arange(10000) % 2 == 0, 1.0, -1.0)
    payload, y = roundtrip("topk", x, ratio=0.05)
    k = math.ceil(0.05 * n)
    assert len(payload) == 4 * 2 + 6 * k
    kept = np.flatnonzero(y.numpy())
    assert len(kept) == k and bool((y[kept].abs() == 1.0).all())


@pytest.mark.parametrize("n", SIZES)
def test_sign_is_sign_times_chunk_mean(n):
    x = randn(n)
    payload, y = roundtrip("sign", x)
    m = math.ceil(n / CHUNK)
    assert len(payload) == 4 * m + math.ceil(n / 8)
    xs = x.numpy().astype(np.float64)
    means = np.array([np.abs(xs[i:i + CHUNK]).mean() for i in range(0, n, CHUNK)])
    ref = np.where(xs >= 0, 1.0, -1.0) * np.repeat(means, CHUNK)[:n]
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5)
    bits = np.packbits(xs >= 0, bitorder="little")
    assert payload[4 * m:] == bits.tobytes()


def test_sign_of_zeros_follows_the_sign_bit():
    payload, y = roundtrip("sign", torch.tensor([0.0, -0.0, 2.0, -2.0]))
    assert payload[4] == 0b0101
    assert y.tolist() == [1.0, -1.0, 1.0, -1.0]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [0, 1, 7, 4097])
def test_encode_with_approx_matches_decode(name, n):
    codec = get_codec(name)
    x = randn(n, seed=5)
    x[1::3] = 0.0
    x[2::5] = -0.0
    payload, approx = codec.encode_with_approx(x)
    assert payload == codec.encode(x)
    assert torch.equal(approx, codec.decode(payload, n))


@pytest.mark.parametrize("name", NAMES)
def test_decode_accepts_views_and_returns_writable_tensor(name):
    codec = get_codec(name)
    x = randn(100, seed=6)
    payload = codec.encode(x)
    framed = bytearray(b"head" + payload + b"tail")
    y = codec.decode(memoryview(framed)[4:4 + len(payload)], 100)
    assert torch.equal(y, codec.decode(payload, 100))
    y.add_(1.0)  # owns its memory
    assert bytes(framed[4:-4]) == payload


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_matches_cpu(name):
    codec = get_codec(name)
    x = randn(3 * CHUNK + 5, seed=7)
    payload, approx = codec.encode_with_approx(x.cuda())
    assert approx.is_cuda
    torch.testing.assert_close(codec.decode(payload, x.numel()), codec.decode(codec.encode(x), x.numel()))
    torch.testing.assert_close(approx.cpu(), codec.decode(payload, x.numel()), rtol=0, atol=0)


# ---------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("bad", [torch.zeros(2, 2), torch.zeros(3, dtype=torch.float64), [1.0, 2.0]])
def test_encode_rejects_non_1d_fp32(bad):
    with pytest.raises(CodecError, match="1-D float32|torch.Tensor"):
        get_codec("topk").encode(bad)


@pytest.mark.parametrize("name", ["int8", "sign"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_scaled_codecs_reject_non_finite_input(name, value):
    x = randn(10)
    x[3] = value
    with pytest.raises(CodecError, match="inf or NaN"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [0, 1, 7, 4097])
def test_decode_rejects_wrong_length(name, n):
    codec = get_codec(name)
    payload = codec.encode(randn(n))
    for bad in (payload + b"\0", payload[:-1] if payload else b"\0\0\0\0\0\0\0\0"):
        with pytest.raises(CodecError):
            codec.decode(bad, n)
    if name in ("none", "fp16", "bf16", "int8"):  # the size is a function of numel that tells n from n + 1
        with pytest.raises(CodecError, match=f"must be {codec.encoded_size(n + 1)} bytes"):
            codec.decode(payload, n + 1)
    if name == "topk" and n:     # (numel 0 has no block count, so its message is about the layout)
        with pytest.raises(CodecError, match="more than" if codec.k(n) > 1 else "block count"):
            codec.decode(payload, codec.k(n) - 1)


@pytest.mark.parametrize("numel", [-1, 1.5, True, "3"])
def test_decode_rejects_bad_numel(numel):
    with pytest.raises(CodecError, match="numel"):
        get_codec("none").decode(b"\0" * 12, numel)


def topk_payload(indices: list[int], values: list[float] | None = None, counts: list[int] | None = None) -> bytes:
    """A topk payload of one index block (10-element tensors), counts given or right."""
    values = values if values is not None else [1.0] * len(indices)
    counts = counts if counts is not None else [len(indices)]
    return (np.array(counts, "<u4").tobytes() + np.array(indices, "<u2").tobytes()
            + np.array(values, "<f4").tobytes())


@pytest.mark.parametrize("indices, message", [
    ([0, 10], "out of range"), ([2, 2], "strictly increasing"),
    ([3, 1], "strictly increasing"), ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9], "more than"),
])
def test_topk_rejects_bad_indices(indices, message):
    with pytest.raises(CodecError, match=message):
        get_codec("topk").decode(topk_payload(indices), 10)


def test_topk_rejects_counts_that_do_not_add_up():
    with pytest.raises(CodecError, match="add up"):
        get_codec("topk").decode(topk_payload([1, 4], counts=[3]), 10)
    with pytest.raises(CodecError, match="block count"):
        get_codec("topk").decode(b"\1\0", 10)


def test_topk_indices_span_blocks():
    n = 3 * 65536 + 5
    idx = [0, 65535, 65536, 2 * 65536 + 7, n - 1]
    payload = (np.array([2, 1, 1, 1], "<u4").tobytes() + np.array([i & 0xFFFF for i in idx], "<u2").tobytes()
               + np.arange(1, 6, dtype="<f4").tobytes())
    y = get_codec("topk").decode(payload, n)
    assert np.flatnonzero(y.numpy()).tolist() == idx and y[idx].tolist() == [1, 2, 3, 4, 5]
    bad = np.array([1, 2, 1, 1], "<u4").tobytes() + payload[16:]     # 65535 counted in block 1: decreasing
    with pytest.raises(CodecError, match="strictly increasing"):
        get_codec("topk").decode(bad, n)


def test_topk_decodes_any_k():
    y = get_codec("topk", ratio=0.5).decode(topk_payload([1, 4, 9], [2.0, -3.0, 0.5]), 10)
    assert y.tolist() == [0, 2, 0, 0, -3, 0, 0, 0, 0, 0.5]


@pytest.mark.parametrize("name", ["int8", "sign"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_scaled_codecs_reject_bad_scale(name, scale):
    codec = get_codec(name)
    payload = bytearray(codec.encode(randn(CHUNK + 1)))
    payload[4:8] = struct.pack("<f", scale)
    with pytest.raises(CodecError, match="scale"):
        codec.decode(bytes(payload), CHUNK + 1)


def test_int8_rejects_minus_128():
    payload = bytearray(get_codec("int8").encode(randn(5)))
    payload[6] = 0x80
    with pytest.raises(CodecError, match="-128"):
        get_codec("int8").decode(bytes(payload), 5)


def test_sign_rejects_padding_bits():
    payload = bytearray(get_codec("sign").encode(-torch.ones(5)))
    assert payload[4] == 0
    payload[4] = 0b0010_0000
    with pytest.raises(CodecError, match="past the last"):
        get_codec("sign").decode(bytes(payload), 5)


def test_decode_rejects_non_buffer():
    with pytest.raises(CodecError, match="bytes-like"):
        get_codec("none").decode("abcd", 1)


# ---------------------------------------------------------------- lz4 and Compressor

@pytest.mark.parametrize("payload", [b"", b"x", bytes(100000), np.arange(50000, dtype="<i4").tobytes()])
def test_lz4_roundtrip(payload):
    packed = lz4_pack(payload)
    assert lz4_unpack(packed) == payload
    assert lz4_unpack(memoryview(packed)) == payload
    if payload == bytes(100000):
        assert len(packed) < 1000


def test_lz4_rejects_corrupt_input():
    packed = lz4_pack(np.arange(5000, dtype="<i4").tobytes())
    flipped = bytearray(packed)
    flipped[len(packed) // 2] ^= 0x01
    for bad, message in [(b"", "truncated|corrupt"), (b"not an lz4 frame", "corrupt"), (packed[:-3], "truncated"),
                         (bytes(flipped), "corrupt"), (packed + b"junk", "stray")]:
        with pytest.raises(CodecError, match=message):
            lz4_unpack(bad)
    with pytest.raises(CodecError, match="more than the 100 bytes"):
        lz4_unpack(packed, max_size=100)


@pytest.mark.parametrize("tag", ["none", "fp16+lz4", "bf16", "int8+lz4", "topk", "sign+lz4"])
def test_compressor_roundtrip_by_tag(tag):
    comp = compressor_from_tag(tag)
    assert comp.tag == tag and comp.name == tag.split("+")[0] and comp.lz4 == tag.endswith("+lz4")
    x = randn(9000, seed=8)
    buf = comp.compress(("shard", 0), x)
    codec = get_codec(comp.name)
    expected = codec.decode(codec.encode(x), x.numel())  # first step: the residual is still zero
    assert torch.equal(comp.decompress(buf, x.numel()), expected)
    assert torch.equal(decode_tagged(tag, buf, x.numel()), expected)


def test_compressor_applies_error_feedback_only_to_biased_codecs():
    assert Compressor("topk").feedback is not None
    assert Compressor("topk", error_feedback=False).feedback is None
    assert Compressor("bf16").feedback is None
    comp = Compressor("topk", ratio=0.1)
    x = randn(100, seed=9)
    first, second = comp.compress(0, x), comp.compress(0, x)
    assert first != second  # the second send carries the first one's residual
    assert comp.feedback.residual(0) is not None
    comp.reset()
    assert comp.compress(0, x) == first


def test_bad_tags():
    assert parse_tag("topk+lz4") == ("topk", True)
    with pytest.raises(CodecError, match="known: bf16, fp16, int8, none, sign, topk"):
        parse_tag("zip+lz4")
    with pytest.raises(CodecError, match="unknown compressor 'topk\\+zstd'"):
        decode_tagged("topk+zstd", b"", 0)
    with pytest.raises(CodecError, match="corrupt"):
        decode_tagged("topk+lz4", b"\0" * 16, 10)
