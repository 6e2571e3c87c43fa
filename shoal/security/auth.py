"""Who may call what: the job token, each member's credential, and the checks servers make.

Two layers, both off unless a job token is configured (``--token-file`` or
``SHOAL_TOKEN_FILE``; loopback-only jobs may run without one):

- **The job token** admits a caller to the job at all. Every process of the job
  reads the same file; clients send it in the ``x-shoal-token`` metadata of every
  call, a server interceptor compares it in constant time and answers
  ``UNAUTHENTICATED`` otherwise (the gRPC health service stays open, so probes
  and load balancers keep working). The TCP data channel is reached through a
  ticket that only an authenticated ``OpenChannel`` hands out.
- **A member credential** says which member (and role) a caller is. The chief
  issues one at ``Join``: ``role:member:signature``, the chief's Ed25519
  signature of role and member (``shoal.security.tokens``). Servers verify it with the
  chief's public key, without asking the chief; only the chief holds the
  signing secret, so no worker and no parameter server can speak as another
  member, as a ps, or as the chief's operator. The chief's own calls
  (checkpoint freeze, thaw, write) carry the ``operator`` credential.

The token never travels on a command line and is never logged.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

from shoal.security import tokens
from shoal.errors import InvalidArgument, PermissionDenied

log = logging.getLogger(__name__)

TOKEN_ENV = "SHOAL_TOKEN_FILE"
TOKEN_KEY = "x-shoal-token"
CREDENTIAL_KEY = "x-shoal-credential"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
WORKER, PS, OPERATOR = "worker", "ps", "operator"
OPERATOR_ID = "chief"
OPEN_METHODS = ("/grpc.health.v1.Health/",)    # answered without a token

_UNSET = object()
_token: "bytes | None | object" = _UNSET
_token_lock = threading.Lock()


# ---------------------------------------------------------------- the job token

def read_token_file(path: str | Path) -> bytes:
    """The job token in ``path`` (surrounding whitespace dropped); InvalidArgument naming what is wrong."""
    p = Path(path)
    try:
        text = p.read_text().strip()
        mode = p.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read the token file {path}: {exc}") from None
    if not MIN_TOKEN_CHARS <= len(text) <= MAX_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in text):
        raise InvalidArgument(f"the token file {path} must hold one token of {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} "
                              f"printable characters without spaces (e.g. from: openssl rand -hex 32)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the token file %s can be read by other users (mode %o); chmod 600 it", path, mode & 0o777)
    return text.encode()


def token_path(cli_value: str | None) -> str | None:
    """``--token-file``, else ``$SHOAL_TOKEN_FILE``, else None (no token: authentication off)."""
    return cli_value or os.environ.get(TOKEN_ENV) or None


def write_token_file(path: str | Path) -> Path:
    """A new random token in ``path``, readable by its owner only."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return p


def use_token(token: bytes | None) -> None:
    """Sets this process's job token (None: authentication off): its servers require it, its channels
    send it. Without a call, the first use reads ``$SHOAL_TOKEN_FILE`` (so a training script started
    by ``shoal worker`` or ``shoal local`` finds the token its launcher was given)."""
    global _token
    _token = token


def reset() -> None:
    """Forgets the token: the next use reads ``$SHOAL_TOKEN_FILE`` again (tests)."""
    global _token
    _token = _UNSET


def job_token() -> bytes | None:
    global _token
    if _token is _UNSET:
        with _token_lock:
            if _token is _UNSET:
                path = os.environ.get(TOKEN_ENV)
                _token = read_token_file(path) if path else None
    return _token  # type: ignore[return-value]


# ---------------------------------------------------------------- member credentials

def issue(secret: bytes, member: str, role: str) -> str:
    """``member``'s credential for ``role``, signed by the holder of the job's ``secret`` (the chief)."""
    return f"{role}:{member}:{tokens.sign_message(secret, tokens.CREDENTIAL, f'{role}|{member}').hex()}"


@dataclass(frozen=True)
class Caller:
    member: str
    role: str


_VERIFIED_MAX = 4096
_verified: dict[tuple[bytes, str], Caller] = {}     # credentials are checked on every call: remember good ones


def verify(key: bytes, credential: str) -> Caller | None:
    """The member a credential names, if the chief whose public ``key`` this is signed it; else None."""
    known = _verified.get((key, credential))
    if known is not None:
        return known
    role, sep, rest = credential.partition(":")
    member, sep2, proof = rest.rpartition(":")
    try:
        signature = bytes.fromhex(proof)
    except ValueError:
        return None
    if not (sep and sep2 and member) or not tokens.verify_message(key, signature, tokens.CREDENTIAL,
                                                                  f"{role}|{member}"):
        return None
    if len(_verified) >= _VERIFIED_MAX:
        _verified.clear()
    caller = _verified[(key, credential)] = Caller(member, role)
    return caller


class Guard:
    """A server's role checks. ``key()`` is the chief's public key (empty until the server knows it)."""

    def __init__(self, key: Callable[[], bytes]):
        self._key = key

    @property
    def enabled(self) -> bool:
        return job_token() is not None

    def caller(self, context) -> Caller | None:
        cred = _metadata(context.invocation_metadata(), CREDENTIAL_KEY)
        key = self._key()
        return verify(key, cred) if cred and key else None

    def speaks_for(self, context, member: str) -> bool:
        """True when authentication is off or the caller's credential names ``member``."""
        if not self.enabled:
            return True
        c = self.caller(context)
        return c is not None and c.member == member

    def require(self, context, *roles: str, member: str | None = None) -> None:
        """PermissionDenied unless the caller holds a credential of one of ``roles`` (the operator may
        do anything) and, with ``member``, is that member. A no-op while authentication is off."""
        if not self.enabled:
            return
        c = self.caller(context)
        if c is None:
            raise PermissionDenied(f"this call needs a {' or '.join(roles)} credential from the chief; "
                                   f"the caller presented none that verifies")
        if c.role == OPERATOR:
            return
        if c.role not in roles:
            raise PermissionDenied(f"{c.member} is a {c.role}; this call is for a {' or '.join(roles)}")
        if member is not None and c.member != member:
            raise PermissionDenied(f"{c.member} may not act for {member}")


def _metadata(md, key: str) -> str:
    for k, v in md or ():
        if k == key:
            return v if isinstance(v, str) else v.decode(errors="replace")
    return ""


# ---------------------------------------------------------------- gRPC plumbing

class RateLimitedLog:
    """One WARNING per ``period_s`` for a kind of event, with how many were not logged in between."""

    def __init__(self, period_s: float = 10.0):
        self.period_s = period_s
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forgets what was logged: the next event of each kind is logged (tests)."""
        with self._lock:
            self._last.clear()

    def warning(self, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            last, quiet = self._last.get(kind, (-1e18, 0))
            if now - last < self.period_s:
                self._last[kind] = (last, quiet + 1)
                return
            self._last[kind] = (now, 0)
        log.warning(msg + (f" ({quiet} more like it not logged)" if quiet else ""), *args)


REFUSALS = RateLimitedLog()


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the job token (``UNAUTHENTICATED``), the health service excepted."""

    def __init__(self, token: bytes):
        self._token = token

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        why = token_refused(self._token, details.invocation_metadata)
        return _deny(handler, details.method, why) if why else handler


TOKEN_REFUSAL = "this job needs its token (--token-file)"


def token_refused(token: bytes, metadata) -> str:
    """Why a call's metadata does not carry the job ``token`` ("missing", "wrong"); "" when it does."""
    got = _metadata(metadata, TOKEN_KEY).encode()
    if hmac.compare_digest(got, token):
        return ""
    return "missing" if not got else "wrong"


def _deny(handler: grpc.RpcMethodHandler, method: str, why: str) -> grpc.RpcMethodHandler:
    def abort(request, context):
        REFUSALS.warning("unauthenticated", "refused %s from %s: %s job token", method, context.peer(), why)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, TOKEN_REFUSAL)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the job token and (once known) the member's credential to every call of a channel."""

    def __init__(self, token: bytes, credential: Callable[[], str] | None):
        self._token = token.decode()
        self._credential = credential

    def _details(self, d):
        md = list(d.metadata or ())
        md.append((TOKEN_KEY, self._token))
        cred = self._credential() if self._credential is not None else ""
        if cred:
            md.append((CREDENTIAL_KEY, cred))
        return d._replace(metadata=md) if hasattr(d, "_replace") else _Details(d, md)

    def intercept_unary_unary(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)

    def intercept_stream_stream(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials = getattr(d, "credentials", None)
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


def authenticated(channel: grpc.Channel, credential: Callable[[], str] | None = None) -> grpc.Channel:
    """``channel`` sending this process's job token (and ``credential()``) with every call; unchanged
    while no token is configured."""
    token = job_token()
    if token is None:
        return channel
    return grpc.intercept_channel(channel, _Metadata(token, credential))
