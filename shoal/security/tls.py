"""TLS for every gRPC service and the TCP data channel, set once per process.

``--tls-cert/--tls-key/--tls-ca`` (or ``SHOAL_TLS_CERT``/``SHOAL_TLS_KEY``/
``SHOAL_TLS_CA``; ``--tls-mutual``/``SHOAL_TLS_MUTUAL=1``):

- a role with a certificate and key serves TLS (gRPC and the data channel);
- every role with any TLS setting connects over TLS, checking the server's
  certificate (and its host name or IP) against ``--tls-ca`` (the system's roots
  without one);
- ``--tls-mutual``: servers also require a client certificate signed by
  ``--tls-ca``, so every role then needs its own certificate and key.

Without any setting everything stays plaintext (the default, meant for loopback).
"""
from __future__ import annotations

import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from shoal.errors import InvalidArgument

ENV = {"cert": "SHOAL_TLS_CERT", "key": "SHOAL_TLS_KEY", "ca": "SHOAL_TLS_CA", "mutual": "SHOAL_TLS_MUTUAL"}


@dataclass(frozen=True)
class TLSConfig:
    cert: str = ""
    key: str = ""
    ca: str = ""
    mutual: bool = False

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument(f"--tls-cert and --tls-key go together (got cert {self.cert!r}, key {self.key!r})")
        if self.mutual and not (self.ca and self.cert):
            raise InvalidArgument("--tls-mutual needs --tls-ca (to check clients) and this role's own "
                                  "--tls-cert/--tls-key")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not os.access(path, os.R_OK):
                raise InvalidArgument(f"{flag} {path!r} is not a readable file")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    @property
    def serves(self) -> bool:
        return bool(self.cert)

    def _read(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=self._read(self.ca) if self.mutual else None,
                                           require_client_auth=self.mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca) if self.ca else None,
                                            private_key=self._read(self.key) if self.cert else None,
                                            certificate_chain=self._read(self.cert) if self.cert else None)

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load(ctx.load_cert_chain, self.cert, self.key)
        if self.mutual:
            ctx.verify_mode = ssl.CERT_REQUIRED
            _load(ctx.load_verify_locations, self.ca)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca:
            _load(ctx.load_verify_locations, self.ca)
        if self.cert:
            _load(ctx.load_cert_chain, self.cert, self.key)
        return ctx


def _load(fn, *paths: str) -> None:
    try:
        fn(*paths)
    except (ssl.SSLError, OSError) as exc:
        raise InvalidArgument(f"cannot load TLS material from {', '.join(paths)}: {exc}") from None


_UNSET = object()
_config: "TLSConfig | object" = _UNSET
_contexts: dict[str, ssl.SSLContext] = {}
_lock = threading.Lock()


def from_env() -> TLSConfig:
    mutual = os.environ.get(ENV["mutual"], "").lower() in ("1", "true", "yes", "on")
    return TLSConfig(os.environ.get(ENV["cert"], ""), os.environ.get(ENV["key"], ""),
                     os.environ.get(ENV["ca"], ""), mutual)


def configure(cfg: TLSConfig) -> None:
    """Sets this process's TLS settings (tests; the CLI goes through the environment)."""
    global _config
    with _lock:
        _config = cfg
        _contexts.clear()


def reset() -> None:
    """The next use reads the environment again."""
    global _config
    with _lock:
        _config = _UNSET
        _contexts.clear()


def config() -> TLSConfig:
    global _config
    with _lock:
        if _config is _UNSET:
            _config = from_env()
        return _config  # type: ignore[return-value]


def context(side: str) -> ssl.SSLContext | None:
    """The data channel's SSL context for ``server`` or ``client`` (None: plaintext), built once."""
    cfg = config()
    if not (cfg.serves if side == "server" else cfg.enabled):
        return None
    with _lock:
        ctx = _contexts.get(side)
        if ctx is None:
            ctx = _contexts[side] = cfg.server_context() if side == "server" else cfg.client_context()
        return ctx
