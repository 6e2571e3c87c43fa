"""Prometheus metrics: the one registry of shoal's metric names, the RPC interceptor, the HTTP endpoint.

Every role serves ``/metrics`` when started with ``--metrics-port`` (0 picks a free
port, which the role logs and, with ``$SHOAL_METRICS_DIR``, writes as a Prometheus
``file_sd`` target file named after its member). Names follow Prometheus
conventions: ``_total`` counters, ``_seconds`` and ``_bytes`` units, labels for
what varies (method, status code, shard, phase).

Counters and histograms are updated where things happen (the RPC interceptor, the
worker's telemetry thread); gauges of role state (live workers, shard versions)
are read at scrape time by a collector each role registers (:func:`register_state`),
so nothing on the training path updates them.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)

RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# ---- every role: gRPC calls it serves
RPC_DURATION = Histogram("shoal_rpc_duration_seconds", "Time to serve a gRPC call, by method and status code",
                         ["method", "code"], buckets=RPC_BUCKETS)
RPC_ERRORS = Counter("shoal_rpc_errors_total", "gRPC calls answered with a status other than OK",
                     ["method", "code"])

# ---- worker
STEPS = Counter("shoal_steps_total", "Training steps (pushes of every shard) this worker finished")
SAMPLES = Counter("shoal_samples_total", "Training samples this worker stepped on")
PUSH_BYTES = Counter("shoal_push_bytes_total", "Gradient bytes this worker sent to parameter servers")
PULL_BYTES = Counter("shoal_pull_bytes_total", "Weight bytes this worker received from parameter servers")
STEP_SECONDS = Histogram("shoal_step_phase_seconds", "Time of one training step, by phase "
                         "(compute, push, pull, wait)", ["phase"], buckets=STEP_BUCKETS)
LOSS = Gauge("shoal_train_loss", "The latest training loss the script passed to trainer.step(loss=...)")
GRAD_NORM = Gauge("shoal_gradient_norm", "L2 norm of the latest gradient, before compression")
STALENESS = Gauge("shoal_staleness_versions", "Updates other workers applied between this worker's pull "
                  "and its push (the largest over shards) at the latest step")
COMPRESSION_RATIO = Gauge("shoal_compression_ratio", "fp32 gradient bytes over the bytes pushed, latest step")
ALERTS = Counter("shoal_alerts_total", "Alerts raised (loss spike, gradient norm spike, non-finite loss, "
                 "worker behind, pushes refused for NaN/Inf)", ["kind"])

# ---- chief
CHECKPOINT_SECONDS = Histogram("shoal_checkpoint_duration_seconds", "Time from freezing the shards to "
                               "committing a checkpoint", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
LEASE_EXPIRATIONS = Counter("shoal_lease_expirations_total", "Members dropped without leaving (lease ran out, "
                            "connection lost)", ["role"])
FAILOVERS = Counter("shoal_failovers_total", "Shards whose primary moved to another parameter server")
VIEW_CHANGES = Counter("shoal_view_changes_total", "Cluster view epochs published")


# What each role's ``/metrics`` serves (:func:`role_registry`): its own families, never another role's, so an
# ``avg``/``min`` over a job is not dragged to 0 by roles that never train
COMMON = (RPC_DURATION, RPC_ERRORS)
ROLE_FAMILIES = {
    "worker": (STEPS, SAMPLES, PUSH_BYTES, PULL_BYTES, STEP_SECONDS, LOSS, GRAD_NORM, STALENESS, COMPRESSION_RATIO,
               ALERTS),
    "chief": (CHECKPOINT_SECONDS, LEASE_EXPIRATIONS, FAILOVERS, VIEW_CHANGES, ALERTS),
    "ps": (),
}
ROLES = tuple(ROLE_FAMILIES)

_info_lock = threading.Lock()
_info: dict[str, str] = {}          # process-wide job labels (job, mode) for shoal_job_info


def set_info(**labels: str) -> None:
    """Job labels of this process's ``shoal_job_info`` (``mode=...``; ``job`` defaults to the job file's name)."""
    with _info_lock:
        _info.update({k: str(v) for k, v in labels.items() if v})


def _job_name() -> str:
    if "job" in _info:
        return _info["job"]
    path = os.environ.get("SHOAL_JOB_FILE", "")
    if path:
        try:
            from shoal.settings.jobfile import load_job
            return str(load_job(path).get("name", "shoal"))
        except Exception:  # noqa: BLE001 - a label is never worth failing a scrape
            pass
    return os.environ.get("SHOAL_JOB_NAME", "shoal")


class _InfoCollector:
    """``shoal_build_info`` and ``shoal_job_info{job,mode,role,member}``, both 1: join on them in PromQL."""

    def __init__(self, role: str):
        self.role = role
        self.member = ""

    def collect(self):
        import platform

        from shoal import __version__
        build = GaugeMetricFamily("shoal_build_info", "shoal's version and runtime; always 1",
                                  labels=["version", "python", "grpc"])
        build.add_metric([__version__, platform.python_version(), grpc.__version__], 1.0)
        yield build
        with _info_lock:
            mode = _info.get("mode", "")
        job = GaugeMetricFamily("shoal_job_info", "The job this process belongs to and its role in it; always 1",
                                labels=["job", "mode", "role", "member"])
        job.add_metric([_job_name(), mode, self.role, self.member], 1.0)
        yield job

    def describe(self):
        return []


class _RoleStates:
    """The scrape-time collectors (:func:`register_state`) of one role: keys ``role`` or ``role/...``."""

    def __init__(self, role: str):
        self.role = role

    def collect(self):
        with _state_lock:
            mine = [c for k, c in _collectors.items() if k == self.role or k.startswith(self.role + "/")]
        for c in mine:
            yield from c.collect()

    def describe(self):
        return []


def role_registry(role: str) -> tuple[CollectorRegistry, _InfoCollector]:
    """A registry holding ``role``'s families only, its scrape-time state, and the info metrics."""
    from shoal.errors import InvalidArgument

    if role not in ROLE_FAMILIES:
        raise InvalidArgument(f"unknown metrics role {role!r}; known: {', '.join(ROLES)}")
    registry = CollectorRegistry(auto_describe=True)
    for family in (*COMMON, *ROLE_FAMILIES[role]):
        registry.register(family)
    registry.register(_RoleStates(role))
    info = _InfoCollector(role)
    registry.register(info)
    return registry, info


def metric_names() -> list[str]:
    """The names this module registers (for docs and tests)."""
    return sorted(m._name for m in (RPC_DURATION, RPC_ERRORS, STEPS, SAMPLES, PUSH_BYTES, PULL_BYTES, STEP_SECONDS,
                                     LOSS, GRAD_NORM, STALENESS, COMPRESSION_RATIO, ALERTS, CHECKPOINT_SECONDS,
                                     LEASE_EXPIRATIONS, FAILOVERS, VIEW_CHANGES))


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Times every unary and streaming call a server handles and counts the ones that fail, by method and code.

    The code is what the servicer aborted with (``context.code()``), OK when it returned,
    UNKNOWN when it raised past the boundary. Streaming replies are timed until the
    handler returns its iterator's last item.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            return handler._replace(unary_unary=_timed_unary(handler.unary_unary, method))
        if handler.stream_unary:
            return handler._replace(stream_unary=_timed_unary(handler.stream_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=_timed_stream(handler.unary_stream, method))
        if handler.stream_stream:
            return handler._replace(stream_stream=_timed_stream(handler.stream_stream, method))
        return handler


def _code_of(context) -> str:
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc: no code() on the server context
        code = None
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


def observe_rpc(method: str, code: str, started: float) -> None:
    """Records one call a server handled: its duration, and its code when it failed."""
    RPC_DURATION.labels(method, code).observe(time.perf_counter() - started)
    if code != "OK":
        RPC_ERRORS.labels(method, code).inc()


def _timed_unary(behaviour: Callable, method: str) -> Callable:
    def call(request, context):
        started = time.perf_counter()
        code = "UNKNOWN"
        try:
            reply = behaviour(request, context)
            code = _code_of(context)
            return reply
        except Exception:
            code = _code_of(context)
            code = "UNKNOWN" if code == "OK" else code
            raise
        finally:
            observe_rpc(method, code, started)
    return call


def _timed_stream(behaviour: Callable, method: str) -> Callable:
    def call(request, context):
        started = time.perf_counter()
        code = "UNKNOWN"
        try:
            yield from behaviour(request, context)
            code = _code_of(context)
        except Exception:
            code = _code_of(context)
            code = "UNKNOWN" if code == "OK" else code
            raise
        finally:
            observe_rpc(method, code, started)
    return call


def interceptors() -> list[grpc.ServerInterceptor]:
    """What :func:`shoal.net.rpc.create_server` installs: RPC metrics cost two clock reads and a histogram update."""
    return [RpcMetricsInterceptor()]


class StateCollector:
    """A Prometheus collector that reads gauges from a role's state at scrape time."""

    def __init__(self, read: Callable[[], Iterable[GaugeMetricFamily]]):
        self._read = read

    def collect(self):
        try:
            yield from self._read()
        except Exception:  # noqa: BLE001 - a scrape must never take a role down
            log.exception("reading metrics failed")

    def describe(self):
        return []


_state_lock = threading.Lock()
_collectors: dict[str, StateCollector] = {}


def register_state(key: str, read: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
    """Registers (or replaces, for a restarted role in the same process) the collector named ``key``."""
    with _state_lock:
        old = _collectors.pop(key, None)
        if old is not None:
            REGISTRY.unregister(old)
        _collectors[key] = StateCollector(read)
        REGISTRY.register(_collectors[key])


def unregister_state(key: str) -> None:
    with _state_lock:
        old = _collectors.pop(key, None)
        if old is not None:
            REGISTRY.unregister(old)


def gauge(name: str, doc: str, labels: list[str] | None = None,
          values: Iterable[tuple[list[str], float]] | float | None = None) -> GaugeMetricFamily:
    """A gauge family for a collector: one value, or ``(label values, value)`` pairs."""
    if labels is None:
        return GaugeMetricFamily(name, doc, value=float(values or 0))
    g = GaugeMetricFamily(name, doc, labels=labels)
    for label_values, value in values or ():
        g.add_metric(label_values, float(value))
    return g


class MetricsEndpoint:
    """``/metrics`` over HTTP on ``host:port`` (port 0: a free one); ``port`` is the bound one.

    ``host`` defaults to ``$SHOAL_METRICS_HOST`` or loopback; the chief and the parameter
    servers pass their own bind host, so a role that listens for peers is scraped there too.
    """

    def __init__(self, port: int, host: str | None = None, role: str | None = None):
        from shoal.errors import InvalidArgument

        if not 0 <= port <= 65535:
            raise InvalidArgument(f"--metrics-port must be a port number (0: any free one), got {port}")
        host = host if host is not None else os.environ.get("SHOAL_METRICS_HOST", "127.0.0.1")
        self.host = host
        # ``role``: serve that role's families only (role_registry); None: every family in the process
        registry, self._info = role_registry(role) if role is not None else (REGISTRY, None)
        try:
            self._server, self._thread = start_http_server(port, addr=host or "0.0.0.0", registry=registry)
        except OSError as exc:
            raise InvalidArgument(f"--metrics-port {port}: cannot listen on {host or '0.0.0.0'}:{port} "
                                  f"({exc.strerror or exc})") from None
        self.port = self._server.server_port
        self.url = f"http://{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{self.port}/metrics"

    def announce(self, role: str, member: str) -> None:
        """Logs the URL and, with ``$SHOAL_METRICS_DIR``, writes ``<dir>/<member>.json`` for Prometheus file_sd."""
        log.info("metrics for %s at %s", member or role, self.url)
        if self._info is not None:
            self._info.member = member
        directory = os.environ.get("SHOAL_METRICS_DIR")
        if not directory or not member:
            return
        target = self.url.split("//", 1)[1].split("/", 1)[0]
        path = Path(directory) / f"{member}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps([{"targets": [target], "labels": {"role": role, "member": member}}]))
            tmp.replace(path)
        except OSError as exc:
            log.warning("cannot write the metrics target file %s: %s", path, exc)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def bind_host(bind: str) -> str:
    """The host part of a role's ``--bind`` (``0.0.0.0:7070`` -> ``0.0.0.0``; ``[::1]:0`` -> ``::1``)."""
    return bind.rsplit(":", 1)[0].strip("[]")


def from_env_or(port: int | None) -> int | None:
    """``--metrics-port`` if given, else ``$SHOAL_METRICS_PORT``; None (off) when neither is set."""
    if port is not None:
        return port
    raw = os.environ.get("SHOAL_METRICS_PORT", "")
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        from shoal.errors import InvalidArgument
        raise InvalidArgument(f"SHOAL_METRICS_PORT must be a port number, got {raw!r}") from None
