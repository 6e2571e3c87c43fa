"""Task tokens: the chief signs each task it hands out; parameter servers check the signature.

This lets a shard refuse a push for a task the worker does not hold without
asking the chief on the hot path: the token binds holder, task, attempt,
epoch and sample range, signed with a per-job secret the chief gives to
parameter servers when they join.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

TOKEN_BYTES = 16


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _message(member: str, task_id: int, attempt: int, epoch: int, start: int, stop: int) -> bytes:
    return f"{member}|{task_id}|{attempt}|{epoch}|{start}|{stop}".encode()


def sign(secret: bytes, member: str, task_id: int, attempt: int, epoch: int, start: int, stop: int) -> bytes:
    return hmac.new(secret, _message(member, task_id, attempt, epoch, start, stop), hashlib.sha256).digest()[:TOKEN_BYTES]


def verify(secret: bytes, token: bytes, member: str, task_id: int, attempt: int, epoch: int,
           start: int, stop: int) -> bool:
    return hmac.compare_digest(token, sign(secret, member, task_id, attempt, epoch, start, stop))
