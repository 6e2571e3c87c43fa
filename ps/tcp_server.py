"""The ps end of the raw TCP data channel (:mod:`shoal.net.tcp_channel`): Push, Pull and Replicate.

One thread per connection (a worker holds one or a few per shard, a primary
one per shard it forwards to this backup), each serving requests in order.
The semantics are the gRPC data servicer's: the same
:class:`~shoal.ps.servicer.PushAssembly`, the same shard and host calls, the
same error codes. Only the bytes travel differently: a raw fp32 chunk or a
replicated gradient is received straight into the tensor that keeps it, and a
pull sends the shard's cached snapshot straight from its buffer.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import Callable

import grpc
import torch
from google.protobuf.message import DecodeError

from shoal.security import auth, tls
from shoal.net import frames
from shoal.net import tcp_channel as tc
from shoal.errors import InvalidArgument, PermissionDenied, ShoalError
from shoal.proto import shoal_pb2 as pb
from shoal.ps.update_wire import Incoming
from shoal.state.tables import MAX_ROWS_BYTES, ROWS_CODEC
from shoal.ps.servicer import DataServicer, PushAssembly

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0      # a connection that has not said HELLO by then is closed


def _max_connections() -> int:
    raw = os.environ.get("SHOAL_MAX_DATA_CONNECTIONS", "1024")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidArgument(f"SHOAL_MAX_DATA_CONNECTIONS={raw!r} must be a positive integer")
    return n


def _idle_timeout_s() -> float:
    """How long a data connection may sit between requests before it is cut (``SHOAL_DATA_IDLE_SECONDS``,
    default 600; 0: never). A client's pooled connection cut while idle is reopened at its next call."""
    raw = os.environ.get("SHOAL_DATA_IDLE_SECONDS", "600")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and value < float("inf")):
        raise InvalidArgument(f"SHOAL_DATA_IDLE_SECONDS={raw!r} must be a number of seconds >= 0 (0: never)")
    return value


class _Refused(Exception):
    """A request is refused; ``fatal``: the connection cannot be trusted to carry another."""

    def __init__(self, exc: Exception, fatal: bool = False):
        super().__init__(str(exc))
        self.exc, self.fatal = exc, fatal


class DataChannelServer:
    """Listens on ``host:port`` (0: any free port) and serves the data plane of ``servicer``.

    ``on_lost(member_id)`` is called (from the connection's thread) when a peer
    that named itself drops its connection: a worker process that died closes
    every socket it had at once, and this is the ps's sight of that.
    """

    def __init__(self, servicer: DataServicer, host: str = "127.0.0.1", port: int = 0,
                 on_lost: Callable[[str], None] | None = None, max_connections: int = 0):
        self.servicer = servicer
        self.on_lost = on_lost
        self.ticket = secrets.token_bytes(tc.TICKET_BYTES)
        self.hello_timeout_s = HELLO_TIMEOUT_S
        self.idle_timeout_s = _idle_timeout_s()
        self.max_connections = max_connections or _max_connections()
        self._guard_key = lambda: servicer.host.verify_key
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-accept", daemon=True)

    def start(self) -> "DataChannelServer":
        self._thread.start()
        self.servicer.offer = pb.DataChannelOffer(port=self.port, ticket=self.ticket)
        return self

    def close(self) -> None:
        """Stops accepting and cuts every connection (their callers see UNAVAILABLE and fail over)."""
        self.servicer.offer = pb.DataChannelOffer()
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def drain(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the peers to close their connections (a server leaving on purpose:
        its workers follow the view and retire their clients); true when none is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not self._conns:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                auth.REFUSALS.warning("tcp-full", "data channel: %d connections open; refusing one from %s "
                                      "(SHOAL_MAX_DATA_CONNECTIONS)", self.max_connections, peer[0])
                conn.close()
                continue
            tc.tune(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        member, raw = "", conn
        try:
            ctx = tls.context("server")
            if ctx is not None:       # the handshake counts against the HELLO's deadline
                conn.settimeout(self.hello_timeout_s)
                conn = ctx.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._conns.discard(raw)
                    self._conns.add(conn)
            # a peer that is not one of ours is not waited for, however slowly it trickles bytes
            kind, head, body_len = tc.recv_prefix(conn, tc.MAX_HELLO, time.monotonic() + self.hello_timeout_s)
            ticket, member, credential = tc.parse_hello(head) if kind == tc.HELLO else (b"", "", "")
            if kind != tc.HELLO or body_len or not secrets.compare_digest(ticket, self.ticket):
                auth.REFUSALS.warning("tcp-hello", "data channel from %s: no valid ticket; closing", peer[0])
                member = ""
                return
            conn.settimeout(None)
            replicator = self._may_replicate(credential)
            speaks_for = self._speaks_for(credential)
            tc.send(conn, tc.OK)
            # A client opens a connection to make a call at once: the first request is due within the
            # HELLO's time, and every request's head right behind its prefix. Between requests a pooled
            # connection may idle as long as the worker's step takes, up to ``idle_timeout_s``.
            first = True
            while True:
                wait = self.hello_timeout_s if first else self.idle_timeout_s
                kind, head, body_len = tc.recv_prefix(conn, deadline=time.monotonic() + wait if wait else None,
                                                      head_within_s=self.hello_timeout_s)
                conn.settimeout(None)
                first = False
                if not self._request(conn, kind, head, body_len, replicator, speaks_for):
                    return
        except TimeoutError:        # silent past its deadline (HELLO, first request, head, idle): cut, and
            #                         not a worker lost: its client reopens a connection at its next call
            log.debug("data channel from %s (%s): nothing within its deadline; closed", peer[0], member or "?")
        except (ConnectionError, OSError) as exc:
            if not self._closed:
                log.debug("data channel from %s (%s) ended: %s", peer[0], member or "?", exc)
                if member and self.on_lost is not None:
                    self.on_lost(member)
        except Exception:  # noqa: BLE001 - a bug: log it; the client sees the channel close and retries
            log.exception("data channel from %s failed", peer[0])
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._conns.discard(raw)
            conn.close()

    def _may_replicate(self, credential: str) -> bool:
        """Whether this connection may carry REPLICATE: auth off, or a server's (or the operator's) credential."""
        if auth.job_token() is None:
            return True
        key = self._guard_key()
        caller = auth.verify(key, credential) if key and credential else None
        return caller is not None and caller.role in (auth.PS, auth.OPERATOR)

    def _speaks_for(self, credential: str) -> Callable[[str], bool]:
        """Which worker this connection may push as: any while auth is off, else the one its credential names."""
        if auth.job_token() is None:
            return lambda member: True
        key = self._guard_key()
        caller = auth.verify(key, credential) if key and credential else None
        return lambda member: caller is not None and caller.member == member

    def _request(self, conn: socket.socket, kind: int, head: bytes, body_len: int, replicator: bool = True,
                 speaks_for: Callable[[str], bool] = lambda member: True) -> bool:
        """Serves one request; False: the connection must close."""
        try:
            if kind in (tc.PUSH, tc.PUSH_MORE):
                reply = self._push(conn, kind, head, body_len, speaks_for)
                tc.send(conn, tc.OK, reply.SerializeToString())
            elif kind == tc.PULL:
                if body_len:
                    raise _Refused(InvalidArgument("a pull request has no body"), fatal=True)
                self._pull(conn, head)
            elif kind == tc.REPLICATE:
                if not replicator:
                    raise _Refused(PermissionDenied("only a parameter server may replicate to this one"), fatal=True)
                reply = self._replicate(conn, head, body_len)
                tc.send(conn, tc.OK, reply.SerializeToString())
            else:
                raise _Refused(InvalidArgument(f"unknown data-channel request kind {kind}"), fatal=True)
            return True
        except _Refused as r:
            self._refuse(conn, r.exc)
            return not r.fatal

    def _refuse(self, conn: socket.socket, exc: Exception) -> None:
        if isinstance(exc, ShoalError):
            code, text = exc.code, str(exc)
        else:
            log.error("data channel request failed", exc_info=exc)
            code, text = grpc.StatusCode.INTERNAL, f"{type(exc).__name__} on the ps; see its log"
        tc.send(conn, code.value[0], text.encode()[:tc.MAX_HEAD])

    def _push(self, conn: socket.socket, kind: int, head: bytes, body_len: int,
              speaks_for: Callable[[str], bool]) -> pb.PushReply:
        """Receives a push (one PUSH, or PUSH_MORE ... PUSH). After a refused chunk the rest of the
        push is still read, so the connection stays in step, and the refusal is the reply."""
        push, nbytes, error = PushAssembly(self.servicer, speaks_for), 0, None
        while True:
            nbytes += tc.PREFIX.size + len(head) + body_len
            if error is None:
                error = self._chunk(conn, push, head, body_len)
            else:
                tc.discard(conn, body_len)
            if kind == tc.PUSH:
                break
            kind, head, body_len = tc.recv_prefix(conn)
            if kind not in (tc.PUSH, tc.PUSH_MORE):
                raise _Refused(InvalidArgument(f"request kind {kind} inside a push"), fatal=True)
        if error is not None:
            raise _Refused(error)
        try:
            return push.finish(nbytes)
        except Exception as exc:  # noqa: BLE001 - the shard's refusal is the reply
            raise _Refused(exc) from None

    def _chunk(self, conn: socket.socket, push: PushAssembly, head: bytes, body_len: int) -> ShoalError | None:
        """Reads one chunk's body (exactly once, whatever happens) into the push; returns a refusal."""
        try:
            try:
                h = pb.PushHeader.FromString(head)
            except DecodeError as exc:
                raise InvalidArgument(f"corrupt PushHeader: {exc}") from None
            push.check(h)
            raw = h.codec in ("", "none")
            if raw and body_len != 4 * h.numel:
                raise InvalidArgument(f"payload of {body_len} bytes does not hold {h.numel} fp32 values")
        except ShoalError as exc:
            tc.discard(conn, body_len)
            return exc
        if raw:
            tc.recv_exactly(conn, push.raw_target(h))
            return None
        limit = MAX_ROWS_BYTES if h.codec == ROWS_CODEC else 16 * h.numel + (1 << 20)
        if body_len > limit:     # no codec comes near this: a broken or hostile peer
            raise _Refused(InvalidArgument(f"a {h.codec} chunk of {body_len} bytes for {h.numel} elements"),
                           fatal=True)
        payload = bytearray(body_len)
        tc.recv_exactly(conn, memoryview(payload))
        try:
            push.place_encoded(h, memoryview(payload))
        except ShoalError as exc:
            return exc
        return None

    def _replicate(self, conn: socket.socket, head: bytes, body_len: int) -> pb.ReplicateReply:
        """A primary's update, sent whole (ps/update_wire.py): its body is received straight into the
        buffer the backup's step reads, once the header, the sender and the size are checked."""
        try:
            h = pb.ReplicateHeader.FromString(head)
        except DecodeError as exc:
            tc.discard(conn, body_len)
            raise _Refused(InvalidArgument(f"corrupt ReplicateHeader: {exc}")) from None
        try:        # the sender and the size, before the gradient is allocated
            incoming = Incoming(h)
            incoming.check_whole(body_len)
            target = incoming.open(lambda h: self.servicer.host.check_sender(h.shard, h.primary_id,
                                                                             h.shard_numel)).whole()
        except ShoalError as exc:
            tc.discard(conn, body_len)
            raise _Refused(exc) from None
        tc.recv_exactly(conn, target)
        self.servicer.host.count(inbound=tc.PREFIX.size + len(head) + body_len)
        try:
            return pb.ReplicateReply(version=self.servicer.host.replicate(h, incoming.update()))
        except Exception as exc:  # noqa: BLE001 - the host's refusal (fenced, needs a copy) is the reply
            raise _Refused(exc) from None

    def _pull(self, conn: socket.socket, request: bytes) -> None:
        """The shard's weights; for a client that says which version it holds, only the elements
        changed since when that is much less (a delta: their indices, then their values)."""
        try:
            req, shard = self.servicer.pull_ready(request)
            codec = req.codec or "none"
            delta = shard.delta(codec, req.since_version) if req.HasField("since_version") else None
            if delta is None:
                version, raw = shard.snapshot(codec)
        except Exception as exc:  # noqa: BLE001 - a refusal; the connection goes on
            if isinstance(exc, DecodeError):
                exc = InvalidArgument(f"corrupt PullRequest: {exc}")
            raise _Refused(exc) from None
        if delta is not None:
            version, idx, values = delta
            head = pb.PullHeader(shard=req.shard, version=version, offset=0, numel=shard.numel, codec=codec,
                                 shard_numel=shard.numel, delta=True, changed=len(idx))
            raw = idx.tobytes() + values
        else:
            head = pb.PullHeader(shard=req.shard, version=version, offset=0, numel=shard.numel, codec=codec,
                                 shard_numel=shard.numel)
        self.servicer.host.count(outbound=tc.send(conn, tc.OK, head.SerializeToString(), raw))
