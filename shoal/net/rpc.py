"""gRPC plumbing shared by every role: server factory, channels, error mapping, retries."""
from __future__ import annotations

import functools
import os
import logging
import random
import time
from concurrent import futures
from typing import Callable, Iterable, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from google.protobuf.message import DecodeError

from shoal.security import auth, tls
from shoal.errors import InvalidArgument, PermissionDenied, ShoalError
from shoal.observe.metrics import interceptors as metrics_interceptors

log = logging.getLogger(__name__)
T = TypeVar("T")

# Tensors travel in frames far above gRPC's 4 MB default: lift the limits.
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]
CHANNEL_OPTIONS = MESSAGE_OPTIONS + [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that went away (a restarted chief, a ps) is tried again at least every second, not on
    # gRPC's default schedule (1 s growing 1.6x to 120 s), so members re-attach soon after it is back.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidArgument(f"{name}={raw!r} must be a positive integer")
    return int(raw)


# What a server takes from anyone before it knows who they are: one message (a frame; tensors travel
# in chunks far below this) and concurrent calls per connection. Settable for unusual jobs.
MAX_MESSAGE_MB = _env_int("SHOAL_MAX_MESSAGE_MB", 256)
MAX_STREAMS = _env_int("SHOAL_MAX_STREAMS", 1024)
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", MAX_MESSAGE_MB << 20),
    ("grpc.max_concurrent_streams", MAX_STREAMS),
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

# CANCELLED: a server that stops (a chief restarting from its journal) cancels the calls it is serving.
# Every call retried with these is safe to repeat: Join and ReportMetrics are idempotent, and GetTasks
# hands again any task whose reply was lost (worker/data.py).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED})


def create_server(address: str, max_workers: int = 64, interceptors: Iterable[grpc.ServerInterceptor] = (),
                  options: Iterable[tuple[str, object]] = ()) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started-later server bound to ``address`` (port 0 picks a free one); ``interceptors`` go
    innermost, after the metrics, decode and token checks.

    Returns the server, the bound port and its health servicer (status SERVING
    is set by the caller once the role is ready).
    """
    token = auth.job_token()
    # Metrics first, so refused and undecodable calls are counted too.
    interceptors = [*metrics_interceptors(), SafeDecode()] + ([auth.TokenInterceptor(token)] if token is not None else []) \
        + list(interceptors)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="grpc"),
                         options=SERVER_OPTIONS + list(options), interceptors=interceptors)
    cfg = tls.config()
    port = add_port(server, address, cfg)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, port, health_servicer


def add_port(server, address: str, cfg) -> int:
    """Binds ``address`` on a gRPC server (sync or aio); one line naming it when it cannot (a port in use, a
    host that is not this machine's, a port out of range), not gRPC's RuntimeError and its traceback."""
    try:
        port = server.add_secure_port(address, cfg.server_credentials()) if cfg.serves \
            else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise InvalidArgument(f"cannot listen on {address}: the port is in use, or the host is not an address "
                              f"of this machine, or the port is not in 0-65535 (--bind)")
    return port


def set_serving(health_servicer: health.HealthServicer, service: str, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    health_servicer.set(service, status)
    health_servicer.set("", status)


def open_channel(address: str, credential: Callable[[], str] | None = None) -> grpc.Channel:
    """A channel to ``address`` that sends the job token (and ``credential()``, the caller's member
    credential) with every call when the process has a token (:mod:`shoal.security.auth`)."""
    cfg = tls.config()
    channel = grpc.secure_channel(address, cfg.channel_credentials(), options=CHANNEL_OPTIONS) if cfg.enabled \
        else grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return auth.authenticated(channel, credential)


class _Undecodable:
    """What a request that does not parse becomes, so the call is refused INVALID_ARGUMENT (gRPC's own
    answer to a failed deserializer is INTERNAL with an ERROR traceback in the log)."""

    def __init__(self, exc: Exception):
        self.text = f"undecodable request: {exc}"


class SafeDecode(grpc.ServerInterceptor):
    """Turns requests that do not decode into INVALID_ARGUMENT (one rate-limited WARNING line)."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode, method = handler.request_deserializer, details.method

        def safe(raw: bytes):
            try:
                return decode(raw)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's
                return _Undecodable(exc)

        def refuse(bad: _Undecodable, context):
            auth.REFUSALS.warning("invalid", "refused %s from %s: %s", method, context.peer(), bad.text)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.text)

        def checked_stream(requests, context):
            for r in requests:
                if isinstance(r, _Undecodable):
                    raise InvalidArgument(r.text)
                yield r

        kind = (handler.request_streaming, handler.response_streaming)
        if kind == (False, False):
            def unary(request, context, _b=handler.unary_unary):
                return refuse(request, context) if isinstance(request, _Undecodable) else _b(request, context)
            return grpc.unary_unary_rpc_method_handler(unary, safe, handler.response_serializer)
        if kind == (False, True):
            def unary_stream(request, context, _b=handler.unary_stream):
                if isinstance(request, _Undecodable):
                    refuse(request, context)
                return _b(request, context)
            return grpc.unary_stream_rpc_method_handler(unary_stream, safe, handler.response_serializer)
        if kind == (True, False):
            return grpc.stream_unary_rpc_method_handler(
                lambda it, context, _b=handler.stream_unary: _b(checked_stream(it, context), context),
                safe, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            lambda it, context, _b=handler.stream_stream: _b(checked_stream(it, context), context),
            safe, handler.response_serializer)


def grpc_errors(method: Callable) -> Callable:
    """Servicer decorator: the one place where shoal errors become status codes."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except (DecodeError, OverflowError) as exc:   # a header that does not parse, a number out of range
            auth.REFUSALS.warning("invalid", "refused %s from %s: %s", method.__name__, _peer(context), exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method.__name__}: invalid request ({exc})")
        except ShoalError as exc:
            if isinstance(exc, (InvalidArgument, PermissionDenied)):
                auth.REFUSALS.warning(type(exc).__name__, "refused %s from %s: %s", method.__name__,
                                      _peer(context), exc)
            context.abort(exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - the boundary: log and report, never crash the server
            if isinstance(exc, grpc.RpcError) and not context.is_active():
                # reading a request stream whose caller cancelled or went away: nobody is left to answer
                log.info("%s: the caller went away mid-stream", method.__name__)
                return None
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed; see the server log")

    return wrapper


def request_seconds(value: float, what: str, default: float, most: float) -> float:
    """A duration a request asks for: ``default`` when unset (0), else a finite number in (0, most]
    (InvalidArgument otherwise: a NaN or a huge wait must not reach a lock's ``wait``)."""
    if value == 0:
        return default
    if not (0 < value <= most):
        raise InvalidArgument(f"{what} must be between 0 and {most:g} seconds, got {value!r}")
    return value


MAX_ADDRESS = 261     # a DNS name (253) or a bracketed IPv6 address, a colon and a port


def check_address(address: str) -> str:
    """``host:port`` a member says it serves on; InvalidArgument for anything else (a path, a long
    string, a port out of range)."""
    host, sep, port = address.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ok = (sep and 0 < len(address) <= MAX_ADDRESS and port.isdigit() and 0 < int(port) < 65536 and bare
          and all(c.isalnum() or c in ".-_:" for c in bare) and (":" not in bare or host.startswith("[")))
    if not ok:
        raise InvalidArgument(f"{address[:80]!r}{'...' if len(address) > 80 else ''} is not a host:port address")
    return address


def _peer(context) -> str:
    peer = getattr(context, "peer", None)
    return peer() if callable(peer) else "?"


def with_retries(call: Callable[[], T], what: str, deadline_s: float | None = None,
                 first_delay_s: float = 0.1, max_delay_s: float = 1.0,
                 retry_on: frozenset = RETRYABLE, sleep: Callable[[float], None] = time.sleep) -> T:
    """Calls ``call`` until it succeeds, backing off (with jitter) on retryable codes.

    Logs each retry so an unreachable peer is visible; re-raises after ``deadline_s``.
    """
    start = time.monotonic()
    delay, attempt = first_delay_s, 0
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            attempt += 1
            if code not in retry_on or (deadline_s is not None and time.monotonic() - start > deadline_s):
                raise
            level = logging.WARNING if attempt in (1, 5) or attempt % 20 == 0 else logging.DEBUG
            log.log(level, "%s: %s (%s); retrying in %.1fs (attempt %d)", what,
                    code.name if code else "error", _details(exc), delay, attempt)
            sleep(delay * (0.5 + random.random()))
            delay = min(max_delay_s, delay * 2)


def _details(exc: grpc.RpcError) -> str:
    try:
        return exc.details() or ""
    except Exception:  # noqa: BLE001
        return ""


def probe(address: str, timeout_s: float = 1.0) -> bool:
    """True if a server answers at ``address`` (its health service, whatever it says), within ``timeout_s``."""
    channel = open_channel(address)
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        return True
    except grpc.RpcError as exc:
        return exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        channel.close()
