"""The chief's gRPC server on ``grpc.aio``: one event loop thread instead of a thread per call.

Every member keeps a view watch open and heartbeats four times a lease. On grpcio's thread-pool server
each open watch holds a thread, and with a thousand members the thousand threads and the one thread
that takes every call off gRPC's queue share one GIL: heartbeats waited past their deadline while
the chief's own work took a fraction of a core (bench/chief_grpc.py, bench/RESULTS.md). Here a watch
is a coroutine waiting on an event, and the chief's handlers, which hold its lock for microseconds,
run inline on the loop.

The RPC logic stays in :class:`ChiefServicer` (sync, tested directly); this module adapts it:

- each method is called with a context shim whose ``abort`` raises (as grpcio's sync context does),
  caught here and sent with the aio context;
- what grpcio's interceptors do for the other servers (shoal.net.rpc, shoal.observe.metrics, shoal.security.auth) is done
  in the one wrapper every method goes through: the job token, undecodable requests refused
  INVALID_ARGUMENT, call durations and error counts, and ``GetView`` answering with bytes it
  serialized once for every watcher;
- ``ReportUnreachable`` probes a server (up to a second) and runs on a thread, off the loop.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shoal.security import auth, tls
from shoal.chief.servicer import ChiefServicer
from shoal.errors import ShoalError
from shoal.observe.metrics import observe_rpc
from shoal.proto import shoal_pb2 as pb
from shoal.net.rpc import SERVER_OPTIONS, _env_int, add_port

SERVICE = "shoal.Chief"
REQUESTS = {"Join": pb.JoinRequest, "Heartbeat": pb.HeartbeatRequest, "Leave": pb.LeaveRequest,
            "GetView": pb.ViewRequest, "GetTasks": pb.TaskRequest, "ReportMetrics": pb.MetricsReport,
            "GetJobStats": pb.Empty, "ReportUnreachable": pb.UnreachableReport}
OFF_LOOP = frozenset({"ReportUnreachable"})      # may block (a probe of up to a second)
# gRPC's overload protection (on whenever grpc.max_concurrent_streams is set, as shoal.net.rpc sets it)
# refuses new calls (UNAVAILABLE, "RST_STREAM with error code 7") while more than that many have
# arrived that the server has not taken up yet. With a thousand members the watches re-opened after a
# view change pass that at once, and the heartbeats refused with them lapse leases: a chief would
# rather answer a queued heartbeat late, within its deadline. The per-connection stream limit stays.
# The chief takes control messages only (the largest: a Join's model layout, names and shapes): what it
# reads from anyone before the token is checked is capped far below the servers' frames
CHIEF_MAX_MESSAGE_MB = _env_int("SHOAL_CHIEF_MAX_MESSAGE_MB", 16)
OPTIONS = [("grpc.http.overload_protection", 0)]
WAKE_BATCH = 32            # watches woken per turn of the event loop (_Pacer)
LAG_PROBE_S = 0.05          # the loop's lag is measured this often...
LAG_DECAY = 0.85            # ...and a past peak fades to a fifth in about half a second


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _SyncContext:
    """What ChiefServicer's methods use of a sync grpc context, over an aio one."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self._context = context

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)

    def invocation_metadata(self):
        return self._context.invocation_metadata()

    def peer(self) -> str:
        return self._context.peer()

    def auth_context(self):
        return self._context.auth_context()

    def is_active(self) -> bool:
        return not self._context.done()


class _Undecodable:
    def __init__(self, exc: Exception):
        self.text = f"undecodable request: {exc}"


def _safe(decode: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def safe(raw: bytes):
        try:
            return decode(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's
            return _Undecodable(exc)
    return safe


def _bytes_or_serialized(reply) -> bytes:
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


class _Pacer:
    """Wakes watches ``batch`` at a time, one slice per turn of the event loop.

    A view change wakes every watch of its scope: with a thousand workers, a thousand answers and then
    a thousand re-opened watches. Woken at once, they all run before any call that arrives meanwhile,
    and heartbeats wait for the whole fan-out (a few hundred ms on 2 cores, bench/RESULTS.md). A slice
    at a time, the calls that arrive between slices are taken up between them: the fan-out takes about
    as long, and a heartbeat waits for one slice at most. Thread-safe: the servicer wakes watches
    from the loop and from the ticker thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, batch: int = WAKE_BATCH):
        self._loop = loop
        self._batch = batch
        self._due: collections.deque[asyncio.Event] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def wake(self, event: asyncio.Event) -> None:
        self._due.append(event)
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        for _ in range(self._batch):
            try:
                event = self._due.popleft()
            except IndexError:
                break
            event.set()
        with self._lock:
            if not self._due:
                self._scheduled = False
                return
        self._loop.call_soon(self._run)       # after what became ready meanwhile: calls that arrived


class _Waker:
    """A watch's wake-up: ``set`` from any thread (the servicer calls it under its lock)."""

    __slots__ = ("_pacer", "event")

    def __init__(self, pacer: _Pacer):
        self._pacer = pacer
        self.event = asyncio.Event()

    def set(self) -> None:
        self._pacer.wake(self.event)


class AsyncChief:
    """The ``shoal.Chief`` service on an aio server, over a :class:`ChiefServicer`."""

    def __init__(self, servicer: ChiefServicer, loop: asyncio.AbstractEventLoop):
        self.servicer = servicer
        self.loop = loop
        self.token = auth.job_token()
        self.pacer = _Pacer(loop)

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {}
        for name, request in REQUESTS.items():
            behaviour = self._get_view if name == "GetView" else self._unary(name)
            methods[name] = grpc.unary_unary_rpc_method_handler(
                self._guarded(name, behaviour), request_deserializer=_safe(request.FromString),
                response_serializer=_bytes_or_serialized)
        methods["Watch"] = grpc.unary_stream_rpc_method_handler(
            self._watch, request_deserializer=_safe(pb.ViewRequest.FromString),
            response_serializer=_bytes_or_serialized)
        methods["KeepAlive"] = grpc.stream_stream_rpc_method_handler(
            self._keepalive, request_deserializer=_safe(pb.HeartbeatRequest.FromString),
            response_serializer=_bytes_or_serialized)
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def _refused_token(self, method: str, context) -> None:
        if self.token is not None:
            why = auth.token_refused(self.token, context.invocation_metadata())
            if why:
                auth.REFUSALS.warning("unauthenticated", "refused %s from %s: %s job token", method,
                                      context.peer(), why)
                raise _Aborted(grpc.StatusCode.UNAUTHENTICATED, auth.TOKEN_REFUSAL)

    async def _watch(self, request, context):
        """``Watch``: ``GetView``'s steps in a loop on one stream. Each answer is the view as a long poll
        would get it; the next waits for an epoch past the one read before that answer was built (a
        change in between is sent twice at worst, never missed). The stream ending, however it ends,
        counts as a watch that broke off before its answer (the member's process may be gone,
        chief/membership.py); a live member opens another."""
        s = self.servicer
        try:
            self._refused_token(f"/{SERVICE}/Watch", context)
            if isinstance(request, _Undecodable):
                auth.REFUSALS.warning("invalid", "refused /%s/Watch from %s: %s", SERVICE, context.peer(),
                                      request.text)
                raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, request.text)
            waker = _Waker(self.pacer)
            try:
                scope, _ = s.watch_begin(request, waker)
            except ShoalError as exc:
                raise _Aborted(exc.code, str(exc)) from exc
            asked = pb.ViewRequest(member_id=request.member_id, scope=request.scope, after_epoch=s.after_epoch(request))
            try:
                while True:
                    while not s.watch_done(scope, asked.after_epoch):
                        await waker.event.wait()
                        waker.event.clear()
                    await self._paced(scope)
                    seen = s.views.waits_past(scope)
                    started = time.perf_counter()
                    try:
                        reply = s.watch_answer(asked, scope)
                    except ShoalError as exc:
                        raise _Aborted(exc.code, str(exc)) from exc
                    observe_rpc("Watch", "OK", started)
                    yield reply
                    asked.after_epoch = seen
            finally:
                s.watch_end(request, scope, waker, False)
        except _Aborted as a:
            observe_rpc("Watch", a.code.name, time.perf_counter())
            await context.abort(a.code, a.details)

    async def _paced(self, scope: int) -> None:
        """Waits until a full view may be built again (chief/views.py, FULL_PACE)."""
        if scope == pb.FULL:
            wait = self.servicer.views.full_wait_s()
            if wait > 0:
                await asyncio.sleep(wait)

    async def _keepalive(self, requests, context):
        """Heartbeats on one stream, each answered as ``Heartbeat`` answers it, in order, and counted in
        the metrics as a ``Heartbeat`` call. The job token is checked once, when the stream opens; an
        undecodable request or a refused heartbeat ends the stream with its error, as the call would."""
        heartbeat, shim = self.servicer.Heartbeat, _SyncContext(context)
        try:
            self._refused_token(f"/{SERVICE}/KeepAlive", context)
            async for request in requests:
                started, code = time.perf_counter(), "OK"
                try:
                    if isinstance(request, _Undecodable):
                        auth.REFUSALS.warning("invalid", "refused /%s/KeepAlive from %s: %s", SERVICE,
                                              context.peer(), request.text)
                        raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, request.text)
                    reply = heartbeat(request, shim)
                except _Aborted as a:
                    code = a.code.name
                    raise
                except Exception:
                    code = "UNKNOWN"
                    raise
                finally:
                    observe_rpc("Heartbeat", code, started)
                yield reply
        except _Aborted as a:
            await context.abort(a.code, a.details)

    def _guarded(self, name: str, behaviour):
        method = f"/{SERVICE}/{name}"

        async def call(request, context):
            started, code = time.perf_counter(), "OK"
            try:
                self._refused_token(method, context)
                if isinstance(request, _Undecodable):
                    auth.REFUSALS.warning("invalid", "refused %s from %s: %s", method, context.peer(), request.text)
                    raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, request.text)
                return await behaviour(request, context)
            except _Aborted as a:
                code = a.code.name
                await context.abort(a.code, a.details)
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception:
                code = "UNKNOWN"
                raise
            finally:
                observe_rpc(name, code, started)
        return call

    def _unary(self, name: str):
        fn = getattr(self.servicer, name)
        if name in OFF_LOOP:
            async def off_loop(request, context):
                return await self.loop.run_in_executor(None, fn, request, _SyncContext(context))
            return off_loop

        async def inline(request, context):
            return fn(request, _SyncContext(context))
        return inline

    async def _get_view(self, request, context):
        """``ChiefServicer.GetView``'s long poll as a coroutine (the same steps, chief/servicer.py)."""
        s = self.servicer
        waker = _Waker(self.pacer)
        try:
            scope, deadline = s.watch_begin(request, waker)
        except ShoalError as exc:
            raise _Aborted(exc.code, str(exc)) from exc
        answered = False
        request.after_epoch = s.after_epoch(request)
        try:
            while not s.watch_done(scope, request.after_epoch):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(waker.event.wait(), left)
                except TimeoutError:
                    break
                waker.event.clear()
            if s.watch_done(scope, request.after_epoch):
                await self._paced(scope)
            try:
                reply = s.watch_answer(request, scope)
            except ShoalError as exc:
                raise _Aborted(exc.code, str(exc)) from exc
            answered = True
            return reply
        finally:
            s.watch_end(request, scope, waker, answered)


class AioServer:
    """A ``grpc.aio`` server on its own event-loop thread, driven like a sync ``grpc.Server``."""

    def __init__(self, servicer: ChiefServicer, bind: str, options=tuple(OPTIONS)):
        self._ready = threading.Event()
        self._done = threading.Event()
        self._lag = 0.0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="chief-grpc-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        self.port = self._call(self._bind(servicer, bind, list(options)))

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self._done.set()

    def _call(self, coro, timeout: float | None = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _bind(self, servicer: ChiefServicer, bind: str, options: list) -> int:
        self.health = health.aio.HealthServicer()
        capped = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        self.server = grpc.aio.server(options=capped + [("grpc.max_receive_message_length",
                                                         CHIEF_MAX_MESSAGE_MB << 20)] + options)
        self.server.add_generic_rpc_handlers((AsyncChief(servicer, self.loop).handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        return add_port(self.server, bind, tls.config())

    def start(self) -> None:
        self._call(self.server.start())
        self._lag_probe = asyncio.run_coroutine_threadsafe(self._measure_lag(), self.loop)

    @property
    def lag_s(self) -> float:
        """How late the event loop runs what is due now: how long a call waits before the chief takes it
        up (the largest in the last second or so)."""
        return self._lag

    async def _measure_lag(self) -> None:
        while True:
            asked = self.loop.time()
            await asyncio.sleep(LAG_PROBE_S)
            late = max(0.0, self.loop.time() - asked - LAG_PROBE_S)
            self._lag = max(late, self._lag * LAG_DECAY)

    def set_serving(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def set_all():
            await self.health.set(service, status)
            await self.health.set("", status)
        if self.loop.is_running() and not self._done.is_set():
            self._call(set_all())

    def stop(self, grace_s: float | None) -> None:
        """Stops serving (calls under way get ``grace_s`` to finish), then the loop."""
        if getattr(self, "_lag_probe", None) is not None:
            self._lag_probe.cancel()
        if not self._done.is_set():
            try:
                self._call(self.server.stop(grace_s), timeout=None if grace_s is None else grace_s + 30)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10)

    def wait(self) -> None:
        self._done.wait()
