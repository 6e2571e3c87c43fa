"""A member's heartbeats on one ``KeepAlive`` stream to the chief, a deadline on each.

A unary ``Heartbeat`` call costs the chief about twice the CPU of a message on a stream that is
already open (grpc.aio on this 2-core host, bench/RESULTS.md), and every member heartbeats four
times a lease: at a thousand members that difference is the chief's heartbeat latency tail. So a
member opens one stream and sends each heartbeat on it; the chief answers each in order.

A stream has no per-message deadline, so a reader thread takes the answers off the stream and
:meth:`HeartbeatStream.beat` waits for the next one up to its timeout; a heartbeat that is not
answered in time fails as a call past its deadline would (``DEADLINE_EXCEEDED``), and the stream is
dropped and opened afresh on the next beat, as is one the chief ended or broke (a chief restarting).
A chief that has no ``KeepAlive`` (``UNIMPLEMENTED``: an older one) gets unary calls from then on.
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
    """A heartbeat that failed on the stream, with the code a unary call would have failed with."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class HeartbeatStream:
    """Heartbeats over ``stub().KeepAlive``; :meth:`beat` is called from one thread (the heartbeat loop),
    :meth:`close` from any. ``stub`` gives the chief's stub (the client's, which a test may wrap)."""

    def __init__(self, stub: Callable[[], object], use_stream: bool = True):
        self._stub = stub
        self.unary = not use_stream         # the chief has no KeepAlive: plain Heartbeat calls
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue | None = None
        self._replies: queue.SimpleQueue | None = None
        self._call = None
        self._reader: threading.Thread | None = None
        self._closed = False
        self.opened = 0                     # streams opened so far (a new one after each failure)

    def beat(self, request: pb.HeartbeatRequest, timeout_s: float) -> pb.HeartbeatReply:
        if self.unary:
            return self._stub().Heartbeat(request, timeout=timeout_s)
        requests, replies = self._open()
        requests.put(request)
        try:
            reply = replies.get(timeout=timeout_s)
        except queue.Empty:
            self._drop()
            raise StreamError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no answer to a heartbeat on the stream in {timeout_s:.1f}s") from None
        if isinstance(reply, grpc.RpcError):
            self._drop()
            if reply.code() is grpc.StatusCode.UNIMPLEMENTED:
                log.info("the chief has no KeepAlive stream; heartbeats go as single calls")
                self.unary = True
                return self._stub().Heartbeat(request, timeout=timeout_s)
            raise reply
        return reply

    def _open(self) -> tuple[queue.SimpleQueue, queue.SimpleQueue]:
        with self._lock:
            if self._closed:
                raise StreamError(grpc.StatusCode.CANCELLED, "heartbeats closed")
            if self._call is None:
                requests, replies = queue.SimpleQueue(), queue.SimpleQueue()
                self._call = self._stub().KeepAlive(iter(requests.get, None))
                self._requests, self._replies = requests, replies
                self._reader = threading.Thread(target=_read, args=(self._call, replies),
                                                name="heartbeat-stream", daemon=True)
                self._reader.start()
                self.opened += 1
            return self._requests, self._replies

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


def _read(call, replies: queue.SimpleQueue) -> None:
    """The stream's answers, in order, into ``replies``; then the error that ended it."""
    try:
        for reply in call:
            replies.put(reply)
        replies.put(StreamError(grpc.StatusCode.UNAVAILABLE, "the chief ended the heartbeat stream"))
    except grpc.RpcError as exc:
        replies.put(exc)
    except ValueError as exc:            # the channel was closed under the call
        replies.put(StreamError(grpc.StatusCode.CANCELLED, str(exc)))
