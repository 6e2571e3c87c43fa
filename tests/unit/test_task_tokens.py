"""Task tokens: what they bind, and how strong the secret and the tag are."""
from shoal.security import tokens

FIELDS = dict(member="worker-1", task_id=7, attempt=2, epoch=1, start=64, stop=128)


def test_a_token_verifies_only_for_the_exact_holder_task_attempt_epoch_and_range():
    secret = tokens.new_secret()
    key = tokens.public_key(secret)
    tok = tokens.sign(secret, **FIELDS)
    assert tokens.verify(key, tok, **FIELDS)
    for name, other in (("member", "worker-2"), ("task_id", 8), ("attempt", 3), ("epoch", 0), ("start", 65),
                        ("stop", 127)):
        assert not tokens.verify(key, tok, **{**FIELDS, name: other}), name
    assert not tokens.verify(tokens.public_key(tokens.new_secret()), tok, **FIELDS)   # another job's chief
    assert not tokens.verify(key, tok[:-1], **FIELDS)                     # a cut signature
    assert not tokens.verify(key, bytes(64), **FIELDS)
    assert not tokens.verify(key, b"", **FIELDS)
    assert not tokens.verify(b"short key", tok, **FIELDS)


def test_the_public_key_a_ps_is_given_verifies_tokens_but_cannot_sign_them():
    secret = tokens.new_secret()
    key = tokens.public_key(secret)
    assert key != secret and len(key) == tokens.KEY_BYTES
    assert not tokens.verify(key, tokens.sign(key, **FIELDS), **FIELDS)   # signing with what a ps holds


def test_the_secret_has_256_bits_and_the_signature_is_ed25519s_64_bytes():
    secrets_ = {tokens.new_secret() for _ in range(8)}
    assert len(secrets_) == 8 and all(len(s) == 32 for s in secrets_)     # the module's docstring: 32 bytes
    # the signature length is part of the protocol: servers refuse any other length
    assert len(tokens.sign(tokens.new_secret(), **FIELDS)) == tokens.TOKEN_BYTES == 64


def test_a_key_is_built_once_per_secret_and_per_public_key_not_per_token(monkeypatch):
    """The chief signs a token per hand-out and a server checks one per pushed task, on the hot path:
    the Ed25519 key objects are kept, not rebuilt from their bytes for every token."""
    built = []
    real_private, real_public = tokens.Ed25519PrivateKey, tokens.Ed25519PublicKey

    class Private:
        @staticmethod
        def from_private_bytes(seed):
            built.append("private")
            return real_private.from_private_bytes(seed)

    class Public:
        @staticmethod
        def from_public_bytes(raw):
            built.append("public")
            return real_public.from_public_bytes(raw)

    monkeypatch.setattr(tokens, "Ed25519PrivateKey", Private)
    monkeypatch.setattr(tokens, "Ed25519PublicKey", Public)
    secret = tokens.new_secret()                      # new: in no cache yet
    key = tokens.public_key(secret)
    toks = [tokens.sign(secret, **{**FIELDS, "task_id": i}) for i in range(5)]
    assert all(tokens.verify(key, tok, **{**FIELDS, "task_id": i}) for i, tok in enumerate(toks))
    assert built == ["private", "public"]
