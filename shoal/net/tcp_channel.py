"""The raw TCP data channel: message framing shared by the ps and the worker.

gRPC Python moves bulk bytes at a fraction of what a socket does here (it
copies each message into and out of its slices and parses it again; see
``bench/RESULTS.md``). So push and pull can also travel over one long-lived
TCP connection per shard and worker, negotiated over gRPC: the worker asks the
ps's data service for an offer (``OpenChannel``: a port and a ticket), connects,
and presents the ticket followed by its member id (``HELLO``). The ps thus
knows whose connection it is: one that the peer drops while it is a live
worker is reported to the chief, which with its own evidence (that worker's
view watch broke too) drops the worker at once instead of after its lease. Payloads go from the tensor's memory to the socket and
from the socket into the destination tensor (``recv_into``), with no framing
copy on either side.

Every message in either direction is ``[prefix][head][body]``, the prefix being
``kind: u8, 3 pad bytes, head_len: u32, body_len: u64`` (little-endian). A
request's head is a protobuf (``PushHeader``, ``PullRequest``, and from a
primary to its backup ``ReplicateHeader``) or the ticket;
a reply's kind is 0 for OK or a gRPC status code, and a failed reply's head is
the error text. Errors reach the caller as :class:`ChannelError`, a
``grpc.RpcError`` with ``code()`` and ``details()``, so the worker's failover
logic treats both transports alike.
"""
from __future__ import annotations

import socket
import struct
import time

import grpc

PREFIX = struct.Struct("<BxxxIQ")
HELLO, PUSH_MORE, PUSH, PULL, REPLICATE = 1, 2, 3, 4, 5
OK = 0
TICKET_BYTES = 16
MAX_HEAD = 1 << 20                  # a protobuf header or an error text; larger is a broken peer
SOCKET_BUFFER = 4 << 20
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class ChannelError(grpc.RpcError):
    """A failed call on the TCP channel, shaped like a gRPC error."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


MAX_HELLO = TICKET_BYTES + 1024     # ticket, member id, credential: a longer HELLO is not a shoal peer


def hello(ticket: bytes, member_id: str, credential: str = "") -> bytes:
    """The head of a HELLO: the ticket, then the caller's member id (may be empty) and, when
    authentication is on, after a NUL byte its member credential (:mod:`shoal.security.auth`)."""
    return ticket + member_id.encode() + (b"\0" + credential.encode() if credential else b"")


def parse_hello(head: bytes) -> tuple[bytes, str, str]:
    """``(ticket, member_id, credential)`` of a HELLO head."""
    member, _, credential = head[TICKET_BYTES:].partition(b"\0")
    return head[:TICKET_BYTES], member.decode(errors="replace"), credential.decode(errors="replace")


def status_code(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def tune(sock: socket.socket, keepalive_s: int = 10) -> None:
    """Low latency for small replies, big buffers for big bodies, and dead-peer detection.

    A peer that vanishes without a FIN (a cut link, a powered-off host) is noticed
    by keepalive probes when idle and by ``TCP_USER_TIMEOUT`` while data is unacked,
    about as soon as gRPC's own keepalive would.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", keepalive_s), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", (keepalive_s + 6) * 1000)):
        if hasattr(socket, name):       # Linux; elsewhere the defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def send(sock: socket.socket, kind: int, head: bytes = b"", body: bytes | memoryview = b"") -> int:
    """Sends one message; ``body`` goes straight from its buffer. Returns the bytes sent."""
    nbody = memoryview(body).nbytes
    sock.sendall(PREFIX.pack(kind, len(head), nbody) + head)
    if nbody:
        sock.sendall(body)
    return PREFIX.size + len(head) + nbody


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fills ``view`` (a writable byte view) from the socket; a closed peer is ``ConnectionError``.
    With ``deadline`` (``time.monotonic()``), a peer still sending then is ``TimeoutError``, however
    slowly it trickles."""
    got, n = 0, view.nbytes
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer did not finish its message in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the data channel")
        got += k


def recv_prefix(sock: socket.socket, max_head: int = MAX_HEAD, deadline: float | None = None,
                head_within_s: float | None = None) -> tuple[int, bytes, int]:
    """Reads a message's prefix and head: ``(kind, head, body_len)``; the body is the caller's to read.
    ``head_within_s``: once the prefix is in, its head must follow within this many seconds (a peer that
    announces a large head and stalls holds the buffer no longer than that)."""
    raw = bytearray(PREFIX.size)
    recv_exactly(sock, memoryview(raw), deadline)
    kind, head_len, body_len = PREFIX.unpack(raw)
    if head_len > max_head:
        raise ConnectionError(f"a data-channel header of {head_len} bytes: not a shoal peer")
    if head_within_s is not None:
        soon = time.monotonic() + head_within_s
        deadline = soon if deadline is None else min(deadline, soon)
    head = bytearray(head_len)
    if head_len:
        recv_exactly(sock, memoryview(head), deadline)
    return kind, bytes(head), body_len


def discard(sock: socket.socket, n: int, chunk: int = 1 << 20) -> None:
    """Reads and drops ``n`` bytes (the body of a request that was refused)."""
    scratch = memoryview(bytearray(min(n, chunk)))
    while n > 0:
        k = min(n, scratch.nbytes)
        recv_exactly(sock, scratch[:k])
        n -= k
