"""Error feedback: what biased codecs drop is carried into later steps, not lost."""
from __future__ import annotations

import logging

import pytest
import torch

from shoal.codecs import CodecError, Compressor, ErrorFeedback, get_codec

N, STEPS = 5000, 200  # 5000 elements: two chunks for int8/sign, the second one partial


def run(name: str, error_feedback: bool, steps: int = STEPS, **options) -> tuple[torch.Tensor, torch.Tensor, Compressor]:
    """Sends ``steps`` gradients ``mu + noise``; returns (sum of true, sum of decoded) in fp64 and the compressor."""
    gen = torch.Generator().manual_seed(1)
    mu = torch.randn(N, generator=gen) * 0.1
    comp = Compressor(name, error_feedback=error_feedback, **options)
    true = torch.zeros(N, dtype=torch.float64)
    sent = torch.zeros(N, dtype=torch.float64)
    for _ in range(steps):
        grad = mu + torch.randn(N, generator=gen)
        true += grad
        sent += comp.decompress(comp.compress("block", grad), N)
    return true, sent, comp


# (codec, options, max relative error of the summed gradient with EF, max final |residual| / |grad|)
CASES = [("topk", {"ratio": 0.05}, 0.15, 3.5), ("topk", {"ratio": 0.01}, 0.4, 9.0),
         ("sign", {}, 0.07, 1.6), ("int8", {}, 0.001, 0.03)]


@pytest.mark.parametrize("name, options, max_rel, max_residual", CASES, ids=lambda v: str(v))
def test_sum_of_sent_gradients_converges_to_sum_of_true(name, options, max_rel, max_residual):
    true, sent, comp = run(name, True, **options)
    residual = comp.feedback.residual("block")
    # Nothing is lost: what was not sent yet is exactly the residual.
    torch.testing.assert_close(true - sent, residual.double(), rtol=0, atol=1e-3)
    rel = float((true - sent).norm() / true.norm())
    assert rel < max_rel
    # The residual stays bounded (a few gradients' worth) while the sums grow with the step count.
    assert float(residual.norm()) < max_residual * (N ** 0.5)
    # Without error feedback the dropped part accumulates.
    true_plain, sent_plain, plain = run(name, False, **options)
    assert plain.feedback is None and torch.equal(true_plain, true)
    assert float((true_plain - sent_plain).norm() / true_plain.norm()) > 4 * rel


def test_relative_error_shrinks_with_more_steps():
    rels = []
    for steps in (25, 100, 400):
        true, sent, _ = run("topk", True, steps=steps, ratio=0.05)
        rels.append(float((true - sent).norm() / true.norm()))
    assert rels[0] > rels[1] > rels[2]


def test_residual_is_corrected_minus_decoded():
    codec = get_codec("topk", ratio=0.1)
    ef = ErrorFeedback(codec)
    gen = torch.Generator().manual_seed(2)
    g1, g2 = torch.randn(50, generator=gen), torch.randn(50, generator=gen)
    p1 = ef.encode("a", g1)
    assert p1 == codec.encode(g1)
    r1 = g1 - codec.decode(p1, 50)
    assert torch.equal(ef.residual("a"), r1)
    assert int((r1 == 0).sum()) == 5
    p2 = ef.encode("a", g2)
    assert p2 == codec.encode(g2 + r1)
    torch.testing.assert_close(ef.residual("a"), g2 + r1 - codec.decode(p2, 50), rtol=0, atol=1e-6)
    assert torch.equal(g1, torch.randn(50, generator=torch.Generator().manual_seed(2)))  # inputs untouched


def test_keys_are_independent_and_reset_clears():
    ef = ErrorFeedback(get_codec("sign"))
    x = torch.linspace(-1, 2, 64)
    ef.encode(("shard", 0), x)
    ef.encode(("shard", 64), -x)
    assert len(ef) == 2
    torch.testing.assert_close(ef.residual(("shard", 0)), -ef.residual(("shard", 64)))
    ef.discard(("shard", 0))
    assert ef.residual(("shard", 0)) is None and len(ef) == 1
    ef.reset()
    assert len(ef) == 0


def test_unbiased_codecs_keep_no_residual():
    ef = ErrorFeedback(get_codec("bf16"))
    x = torch.randn(100, generator=torch.Generator().manual_seed(3))
    assert ef.encode(0, x) == get_codec("bf16").encode(x)
    assert len(ef) == 0


def test_shape_change_drops_residual_with_warning(caplog):
    ef = ErrorFeedback(get_codec("topk", ratio=0.1))
    ef.encode("k", torch.arange(1.0, 21.0))
    with caplog.at_level(logging.WARNING, logger="shoal.codecs.feedback"):
        payload = ef.encode("k", torch.arange(1.0, 11.0))
    assert "dropping the residual" in caplog.text
    assert payload == get_codec("topk", ratio=0.1).encode(torch.arange(1.0, 11.0))
    assert ef.residual("k").shape == (10,)


def test_failed_encode_keeps_residual():
    ef = ErrorFeedback(get_codec("int8"))
    ef.encode("k", torch.linspace(-1, 1, 33))
    before = ef.residual("k").clone()
    with pytest.raises(CodecError):
        ef.encode("k", torch.full((33,), float("nan")))
    assert torch.equal(ef.residual("k"), before)


@pytest.mark.parametrize("ratio", [0.01, 0.001, 0.2])
def test_top_k_fuses_the_sum_into_its_selection_with_the_same_result(ratio):
    """Large blocks take the one-pass CPU path (sum and compare per cache-sized chunk; 0.2 sends too
    many for a sampled threshold): the payload and the residual equal summing first, then encoding."""
    n = 300_007                                            # not a multiple of the chunk
    codec = get_codec("topk", ratio=ratio)
    gen = torch.Generator().manual_seed(5)
    grad, residual = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 3
    kept_grad, kept_residual = grad.clone(), residual.clone()
    for r in (None, residual):
        payload, left = codec.encode_feedback(grad, r)
        want_payload, want_left = codec.encode_residual_(grad.clone() if r is None else grad + r)
        assert payload == want_payload and torch.equal(left, want_left)
        assert int((left == 0).sum()) >= codec.k(n)
    assert torch.equal(grad, kept_grad) and torch.equal(residual, kept_residual)   # inputs untouched


def test_large_blocks_sent_plus_residual_add_up_to_what_was_pushed():
    n = 200_000
    comp = Compressor("topk", ratio=0.01)
    gen = torch.Generator().manual_seed(6)
    true = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    for _ in range(5):
        grad = torch.randn(n, generator=gen)
        true += grad
        sent += comp.decompress(comp.compress("block", grad), n)
    residual = comp.feedback.residual("block").double()
    torch.testing.assert_close(sent + residual, true, rtol=0, atol=1e-5)
