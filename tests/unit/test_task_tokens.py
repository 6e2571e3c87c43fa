"""Task tokens: what they bind, and how strong the secret and the tag are."""
from shoal import tokens

FIELDS = dict(member="worker-1", task_id=7, attempt=2, epoch=1, start=64, stop=128)


def test_a_token_verifies_only_for_the_exact_holder_task_attempt_epoch_and_range():
    secret = tokens.new_secret()
    tok = tokens.sign(secret, **FIELDS)
    assert tokens.verify(secret, tok, **FIELDS)
    for name, other in (("member", "worker-2"), ("task_id", 8), ("attempt", 3), ("epoch", 0), ("start", 65),
                        ("stop", 127)):
        assert not tokens.verify(secret, tok, **{**FIELDS, name: other}), name
    assert not tokens.verify(tokens.new_secret(), tok, **FIELDS)          # another job's secret
    assert not tokens.verify(secret, tok[:-1], **FIELDS)                  # a cut tag
    assert not tokens.verify(secret, b"", **FIELDS)


def test_the_secret_has_256_bits_and_the_tag_128():
    secrets_ = {tokens.new_secret() for _ in range(8)}
    assert len(secrets_) == 8 and all(len(s) >= 32 for s in secrets_)
    # the tag length is part of the protocol: a chief and a ps of versions that cut it differently
    # would refuse every push in a rolling upgrade
    assert len(tokens.sign(tokens.new_secret(), **FIELDS)) == tokens.TOKEN_BYTES == 16
