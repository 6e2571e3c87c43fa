"""A member's calls to the chief on one stream, a deadline on each: heartbeats on ``KeepAlive``, a
worker's task requests on ``Tasks``.

A unary ``Heartbeat`` call costs the chief about twice the CPU of a message on a stream that is
already open (grpc.aio on this 2-core host, bench/RESULTS.md), and every member heartbeats four
times a lease: at a thousand members that difference is the chief's heartbeat latency tail. So a
member opens one stream and sends each heartbeat on it; the chief answers each in order.

A stream has no per-message deadline, so a reader thread takes the answers off the stream and
:meth:`HeartbeatStream.beat` waits for the next one up to its timeout; a heartbeat that is not
answered in time fails as a call past its deadline would (``DEADLINE_EXCEEDED``), and the stream is
dropped and opened afresh on the next beat, as is one the chief ended or broke (a chief restarting).
A chief that has no such stream (``UNIMPLEMENTED``: an older one) gets unary calls from then on.
The same holds for ``Tasks``: at a thousand workers, single ``GetTasks`` calls queued for seconds
behind grpc.aio's one new call per turn of its loop (bench/RESULTS.md).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import grpc

from shoal.proto import shoal_pb2 as pb

log = logging.getLogger(__name__)


class StreamError(grpc.RpcError):
    """A request that failed on the stream, with the code a unary call would have failed with."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class CallStream:
    """Requests over ``stub().<stream>``, else ``stub().<unary>`` calls; :meth:`call` is called from one
    thread at a time, :meth:`close` from any. ``stub`` gives the chief's stub (the client's, which a
    test may wrap)."""

    def __init__(self, stub: Callable[[], object], stream: str, unary: str, use_stream: bool = True):
        self._stub = stub
        self._stream_name, self._unary_name = stream, unary
        self.unary = not use_stream         # the chief has no such stream: single calls
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue | None = None
        self._replies: queue.SimpleQueue | None = None
        self._call = None
        self._reader: threading.Thread | None = None
        self._closed = False
        self.opened = 0                     # streams opened so far (a new one after each failure)

    def call(self, request, timeout_s: float):
        if self.unary:
            return getattr(self._stub(), self._unary_name)(request, timeout=timeout_s)
        requests, replies = self._open()
        requests.put(request)
        try:
            reply = replies.get(timeout=timeout_s)
        except queue.Empty:
            self._drop()
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no answer on the {self._stream_name} stream in {timeout_s:.1f}s") from None
        if isinstance(reply, grpc.RpcError):
            self._drop()
            if reply.code() is grpc.StatusCode.UNIMPLEMENTED:
                log.info("the chief has no %s stream; %s goes as single calls", self._stream_name, self._unary_name)
                self.unary = True
                return getattr(self._stub(), self._unary_name)(request, timeout=timeout_s)
            raise reply
        return reply

    def _open(self) -> tuple[queue.SimpleQueue, queue.SimpleQueue]:
        with self._lock:
            if self._closed:
                raise StreamError(grpc.StatusCode.CANCELLED, f"the {self._stream_name} stream is closed")
            if self._call is None:
                requests, replies = queue.SimpleQueue(), queue.SimpleQueue()
                self._call = getattr(self._stub(), self._stream_name)(iter(requests.get, None))
                self._requests, self._replies = requests, replies
                self._reader = threading.Thread(target=_read, args=(self._call, replies, self._stream_name),
                                                name=f"{self._stream_name.lower()}-stream", daemon=True)
                self._reader.start()
                self.opened += 1
            return self._requests, self._replies

    @property
    def closed(self) -> bool:
        return self._closed

    def _drop(self) -> threading.Thread | None:
        """Ends the stream (the next beat opens another): its request iterator, then the call."""
        with self._lock:
            call, requests, reader = self._call, self._requests, self._reader
            self._call = self._requests = self._replies = self._reader = None
        if call is not None:
            requests.put(None)
            call.cancel()
        return reader

    def close(self, timeout_s: float = 2.0) -> None:
        with self._lock:
            self._closed = True
        reader = self._drop()
        if reader is not None:
            reader.join(timeout_s)


class HeartbeatStream(CallStream):
    """Heartbeats over ``KeepAlive`` (else ``Heartbeat`` calls); :meth:`beat` from the heartbeat loop."""

    def __init__(self, stub: Callable[[], object], use_stream: bool = True):
        super().__init__(stub, "KeepAlive", "Heartbeat", use_stream)

    def beat(self, request: pb.HeartbeatRequest, timeout_s: float) -> pb.HeartbeatReply:
        return self.call(request, timeout_s)


def _read(call, replies: queue.SimpleQueue, stream: str) -> None:
    """The stream's answers, in order, into ``replies``; then the error that ended it."""
    try:
        for reply in call:
            replies.put(reply)
        replies.put(StreamError(grpc.StatusCode.UNAVAILABLE, f"the chief ended the {stream} stream"))
    except grpc.RpcError as exc:
        replies.put(exc)
    except ValueError as exc:            # the channel was closed under the call
        replies.put(StreamError(grpc.StatusCode.CANCELLED, str(exc)))
