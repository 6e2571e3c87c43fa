"""The calling end of the raw TCP data channel (:mod:`shoal.net.tcp_channel`): a worker's pushes and
pulls, and a primary's updates to its backup.

Holds a few connections to one ps (one per concurrent call; usually one),
each opened with the ticket from the ps's gRPC ``OpenChannel`` offer. A
connection that failed mid-call is closed, never reused: its stream position
is unknown. Failures surface as :class:`~shoal.net.tcp_channel.ChannelError` with
the code gRPC would have given (UNAVAILABLE for a lost peer, DEADLINE_EXCEEDED
for a timeout, the ps's own code for a refusal).
"""
from __future__ import annotations

import logging
import select
import socket
import threading
from typing import Callable, TypeVar

import grpc

from shoal.net import tcp_channel as tc
from shoal.security import tls
from shoal.proto import shoal_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")


def split_host(address: str) -> str:
    """The host of ``host:port`` (``[v6]:port`` too)."""
    return address.rsplit(":", 1)[0].strip("[]")



def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle pooled connection was closed by the server (it cuts one idle past
    ``SHOAL_DATA_IDLE_SECONDS``): a server sends nothing unasked, so an idle connection that reads as
    ready holds the peer's close. One poll, no wait; such a connection is replaced, not used."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(ready)

class TcpDataChannel:
    """``member_id`` and ``credential`` are presented with the ticket (callables: a re-join changes them;
    a connection opened under an older identity is closed rather than reused, since the ps judges
    each connection's pushes by the credential of its hello)."""

    def __init__(self, host: str, offer: pb.DataChannelOffer, member_id: Callable[[], str] = lambda: "",
                 connect_timeout_s: float = 5.0, credential: Callable[[], str] = lambda: ""):
        self.host, self.port, self.ticket = host, offer.port, offer.ticket
        self.member_id = member_id
        self.credential = credential
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[socket.socket] = []
        self._opened_as: dict[socket.socket, str] = {}      # the credential each connection's hello carried
        self._busy: set[socket.socket] = set()     # in a call now: close() cuts them short
        self._lock = threading.Lock()
        self._closed = False
        self._retiring = False    # the view moved the shard away: connections close as their calls end

    @property
    def idle_connections(self) -> int:
        """Connections kept for the next call."""
        with self._lock:
            return len(self._idle)

    def connect(self) -> socket.socket:
        """A new connection past the ticket check; OSError if the port cannot be reached."""
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        try:
            tc.tune(sock)
            ctx = tls.context("client")
            if ctx is not None:       # checks the ps's certificate against --tls-ca and the host it was reached at
                sock = ctx.wrap_socket(sock, server_hostname=self.host)
            credential = self.credential()
            tc.send(sock, tc.HELLO, tc.hello(self.ticket, self.member_id(), credential))
            kind, _, _ = tc.recv_prefix(sock)
            if kind != tc.OK:
                raise ConnectionError(f"the ps at {self.host}:{self.port} refused the ticket")
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._opened_as[sock] = credential
        return sock

    def close(self) -> None:
        """Closes the channel; a call blocked on it now (a peer that stopped answering) fails at once with
        CANCELLED rather than at its timeout."""
        with self._lock:
            self._closed, idle, self._idle, busy = True, self._idle, [], list(self._busy)
            self._opened_as.clear()
        for s in idle:
            s.close()
        for s in busy:
            try:
                s.shutdown(socket.SHUT_RDWR)     # wakes the thread blocked in recv/send; it closes the socket
            except OSError:
                pass

    def retire(self) -> None:
        """The view moved the shard away from this server: closes the idle connections now and each busy
        one as its call ends, so a server leaving on purpose sees its peers go as soon as they follow the
        view (it waits for that, ``DataChannelServer.drain``). Calls may still be made until :meth:`close`."""
        with self._lock:
            self._retiring, idle, self._idle = True, self._idle, []
            for s in idle:
                self._opened_as.pop(s, None)
        for s in idle:
            s.close()

    def call(self, fn: Callable[[socket.socket], T], timeout_s: float) -> T:
        """Runs ``fn`` on an idle connection (or a new one) with ``timeout_s`` per socket wait."""
        with self._lock:
            if self._closed:
                raise tc.ChannelError(grpc.StatusCode.CANCELLED, f"data channel to {self.host}:{self.port} closed")
            sock, stale, now = None, [], self.credential()
            while self._idle and sock is None:
                s = self._idle.pop()
                if self._opened_as.get(s, now) == now and not _closed_by_peer(s):   # handed in: as it is
                    sock = s
                else:
                    stale.append(s)
                    self._opened_as.pop(s, None)
            if sock is not None:
                self._busy.add(sock)
        for s in stale:                   # opened before a re-join: the ps would refuse its pushes
            s.close()
        try:
            if sock is None:
                sock = self.connect()
                with self._lock:
                    self._busy.add(sock)
                    closed = self._closed
                if closed:
                    raise OSError("closed while connecting")
            sock.settimeout(timeout_s)
            out = fn(sock)
        except ChannelRefusal as r:       # a whole reply was read: the connection is still good
            self.release(sock)
            raise r.error from None
        except socket.timeout:
            self._discard(sock)
            raise tc.ChannelError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"no answer from {self.host}:{self.port} within {timeout_s:.0f}s") from None
        except OSError as exc:            # ConnectionError included
            self._discard(sock)
            if self._closed:
                raise tc.ChannelError(grpc.StatusCode.CANCELLED, f"data channel to {self.host}:{self.port} "
                                      f"closed during the call") from None
            raise tc.ChannelError(grpc.StatusCode.UNAVAILABLE,
                                  f"data channel to {self.host}:{self.port}: {exc}") from None
        except BaseException:
            self._discard(sock)
            raise
        self.release(sock)
        return out

    def release(self, sock: socket.socket) -> None:
        """Puts a good connection back for the next call (closed instead once the channel is)."""
        with self._lock:
            self._busy.discard(sock)
            if not self._closed and not self._retiring:
                self._idle.append(sock)
                return
            self._opened_as.pop(sock, None)
        sock.close()

    def _discard(self, sock: socket.socket | None) -> None:
        if sock is not None:
            with self._lock:
                self._busy.discard(sock)
                self._opened_as.pop(sock, None)
            sock.close()


class ChannelRefusal(Exception):
    """Raised inside a call when the ps answered with an error (the stream is intact)."""

    def __init__(self, error: tc.ChannelError):
        super().__init__(error.details())
        self.error = error


def read_reply(sock: socket.socket) -> tuple[bytes, int]:
    """Reads a reply's head; a refusal becomes :class:`ChannelRefusal`. Returns (head, body_len)."""
    kind, head, body_len = tc.recv_prefix(sock)
    if kind != tc.OK:
        tc.discard(sock, body_len)
        raise ChannelRefusal(tc.ChannelError(tc.status_code(kind), head.decode(errors="replace")))
    return head, body_len


def negotiate(stubs, address: str, member_id: Callable[[], str], what: str,
              credential: Callable[[], str] = lambda: "") -> TcpDataChannel | None:
    """Asks the ps at ``address`` (its data ``stubs``, :class:`shoal.net.wire.DataStubs`) for its TCP channel
    and opens a first connection. None if it offers none (or is too old to know the call) or the
    channel cannot be reached: gRPC carries the data then. A ps that does not answer raises."""
    try:
        offer = pb.DataChannelOffer.FromString(stubs.open_channel(b"", timeout=10))
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        return None
    if not offer.port:
        return None
    tcp = TcpDataChannel(split_host(address), offer, member_id, credential=credential)
    try:
        tcp.release(tcp.connect())
    except OSError as exc:
        log.warning("%s: cannot reach the TCP data channel at %s:%d (%s); using gRPC, which is slower",
                    what, tcp.host, tcp.port, exc)
        return None
    return tcp


def replicate(sock: socket.socket, head: bytes, grad: memoryview) -> pb.ReplicateReply:
    """Sends one update (its ReplicateHeader and the whole averaged gradient) to a backup."""
    tc.send(sock, tc.REPLICATE, head, grad)
    reply, body_len = read_reply(sock)
    if body_len:
        raise ConnectionError(f"a replicate reply with a {body_len}-byte body: not a shoal peer")
    return pb.ReplicateReply.FromString(reply)


def push(sock: socket.socket, frames: list[tuple[bytes, bytes | memoryview]]) -> tuple[pb.PushReply, int]:
    """Sends one push as ``(PushHeader bytes, payload)`` chunks; returns the reply and the bytes sent."""
    sent = 0
    for i, (head, payload) in enumerate(frames):
        sent += tc.send(sock, tc.PUSH if i == len(frames) - 1 else tc.PUSH_MORE, head, payload)
    head, body_len = read_reply(sock)
    if body_len:
        raise ConnectionError(f"a push reply with a {body_len}-byte body: not a shoal peer")
    return pb.PushReply.FromString(head), sent


def pull(sock: socket.socket, request: bytes, numel: int, itemsize: int,
         into: Callable[[pb.PullHeader, int], memoryview]) -> tuple[pb.PullHeader, int, memoryview]:
    """Asks for a shard's weights (``numel`` elements of ``itemsize`` bytes), or the changed ones (a
    delta: ``changed`` int32 indices, then their values); ``into(header, nbytes)`` gives the writable
    view the body is received into. Returns the header, the bytes received and that view."""
    tc.send(sock, tc.PULL, request)
    head, body_len = read_reply(sock)
    h = pb.PullHeader.FromString(head)
    expected = h.changed * (4 + itemsize) if h.delta else numel * itemsize
    if h.shard_numel != numel or h.offset != 0 or h.numel != numel or body_len != expected or \
            not 0 <= h.changed <= numel:
        tc.discard(sock, body_len)
        raise ChannelRefusal(tc.ChannelError(grpc.StatusCode.INTERNAL,
                                             f"pull of shard {h.shard} sent [{h.offset}, +{h.numel}) of "
                                             f"{h.shard_numel} elements in {body_len} bytes"
                                             f"{f' ({h.changed} changed)' if h.delta else ''}; this client "
                                             f"expects {numel} as {h.codec or 'none'}"))
    target = into(h, body_len)
    tc.recv_exactly(sock, target)
    return h, tc.PREFIX.size + len(head) + body_len, target
