"""The chief's signatures: task tokens and member credentials, checked by servers with a public key.

The chief signs each task it hands out (holder, task, attempt, epoch and sample
range) and each member's credential (``shoal.security.auth``). Parameter servers check
the signatures on the hot path without asking the chief.

Signatures are Ed25519 (the ``cryptography`` package, OpenSSL underneath). The
signing key is derived from the job's 32-byte secret, which never leaves the
chief and its journal; a parameter server is given only the public key at
join. So a server, or anyone who joins as one, can check a token or a
credential but cannot make one: forging a claim on a batch or speaking as
another member takes the chief's secret. Every signed message starts with its
kind, so a token can never pass as a credential or the other way round.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

TOKEN_BYTES = 64          # an Ed25519 signature
KEY_BYTES = 32            # an Ed25519 public key
TASK, CREDENTIAL = b"task", b"credential"
KEYS_KEPT = 8             # key objects each cache keeps: a process signs for one job and checks one chief's key


def new_secret() -> bytes:
    return secrets.token_bytes(32)


@functools.lru_cache(maxsize=KEYS_KEPT)
def _signing_key(secret: bytes) -> Ed25519PrivateKey:
    seed = hmac.new(secret, b"shoal signing key v2", hashlib.sha256).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def public_key(secret: bytes) -> bytes:
    """The raw public key that verifies what the holder of ``secret`` signs (safe to hand out)."""
    return _signing_key(secret).public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@functools.lru_cache(maxsize=KEYS_KEPT)
def _verifying_key(key: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(key)


def sign_message(secret: bytes, kind: bytes, text: str) -> bytes:
    return _signing_key(secret).sign(kind + b"\x00" + text.encode())


def verify_message(key: bytes, signature: bytes, kind: bytes, text: str) -> bool:
    """True when ``signature`` over ``kind`` and ``text`` verifies with the public ``key``."""
    if len(key) != KEY_BYTES or len(signature) != TOKEN_BYTES:
        return False
    try:
        _verifying_key(bytes(key)).verify(bytes(signature), kind + b"\x00" + text.encode())
        return True
    except InvalidSignature:
        return False


def _message(member: str, task_id: int, attempt: int, epoch: int, start: int, stop: int) -> str:
    return f"{member}|{task_id}|{attempt}|{epoch}|{start}|{stop}"


def sign(secret: bytes, member: str, task_id: int, attempt: int, epoch: int, start: int, stop: int) -> bytes:
    return sign_message(secret, TASK, _message(member, task_id, attempt, epoch, start, stop))


def verify(key: bytes, token: bytes, member: str, task_id: int, attempt: int, epoch: int,
           start: int, stop: int) -> bool:
    """True when ``token`` is the chief's signature of this holder, task, attempt, epoch and range;
    ``key`` is the chief's public key (:func:`public_key`)."""
    return verify_message(key, token, TASK, _message(member, task_id, attempt, epoch, start, stop))
