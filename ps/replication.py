"""Primary -> backup replication of one shard.

A primary hands every :class:`~shoal.ps.shard.Update` to its shard's
:class:`Replicator` with the shard lock held, so updates leave in version
order. With a backup in step, :meth:`Replicator.start` puts the update on its
way from a sender thread and the primary applies it meanwhile;
:meth:`Replicator.finish` returns once the backup has applied it, and only then
is the shard lock released: a version is never visible (pulled, or
acknowledged to a pushing worker) before the backup holds it, so promoting
the backup loses no acknowledged update. An update the backup does not take
(refused, or the replicator closed) fences this copy, which never serves or
applies again, whatever it applied meanwhile (ps/shard.py).

A new backup first receives a whole copy (:meth:`Replicator._install`, in a
background thread, training goes on); updates made meanwhile queue up and
follow it, then forwarding turns synchronous.

When the backup cannot be reached the replicator keeps retrying until the
chief's view drops it (its lease expired) and names a new one or none: it
never silently acknowledges without a backup the view still lists. A backup
that answers "the primary is someone else" has been promoted over this copy:
the update raises, and the shard is fenced. A replicator closed because the
view dropped this copy raises too (it is not "no backup"): the update it was
carrying is never applied.
"""
from __future__ import annotations

import io
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

import grpc
import torch

from shoal.net import frames, tcp_client
from shoal.errors import HANDED_OVER, Unavailable
from shoal.proto import shoal_pb2 as pb
from shoal.state.checkpoint_store import ShardState
from shoal.ps.ledger import BatchKey
from shoal.ps.shard import Shard
from shoal.ps.update import Update
from shoal.ps.update_wire import update_frames, update_message
from shoal.net.rpc import open_channel
from shoal.net.wire import DataStubs

log = logging.getLogger(__name__)

FENCED = "primary is"          # in a backup's refusal: another ps is the primary now
NEEDS_COPY = "needs a fresh copy"
NO_BACKUP_WARN_S = 2.0         # how long a shard goes without a backup before that is a warning
COPY_TIMEOUT_S = 120.0         # a whole copy may take this long at least (the replicator's timeout if longer)


# ---------------------------------------------------------------- encoding

def replica_bytes(replica: dict) -> bytes:
    """A :meth:`Shard.export_replica` as bytes (torch.save of plain values: loads with weights_only)."""
    st: ShardState = replica["state"]
    obj = {"shard": st.shard, "start": st.start, "stop": st.stop, "values": st.values, "optimizer": st.optimizer,
           "hparams": dict(st.hparams), "opt_state": st.opt_state, "version": st.version, "extra": st.extra,
           "keys": [[k, v] for k, v in replica["keys"]], "clocks": replica["clocks"],
           "pushed": sorted(replica.get("pushed", ()))}
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def replica_from_bytes(data: bytes | bytearray) -> dict:
    obj = torch.load(io.BytesIO(data), weights_only=True)
    state = ShardState(obj["shard"], obj["start"], obj["stop"], obj["values"], obj["optimizer"], obj["hparams"],
                       obj["opt_state"], obj["version"], obj["extra"])
    return {"state": state, "keys": obj["keys"], "clocks": obj["clocks"], "pushed": obj.get("pushed", [])}


def install_frames(shard: int, primary_id: str, version: int, fingerprint: str, data: bytes,
                   chunk_bytes: int) -> Iterator[bytes]:
    for off in range(0, max(1, len(data)), chunk_bytes):
        head = pb.InstallHeader(shard=shard, version=version, primary_id=primary_id, offset=off,
                                total_bytes=len(data), layout_fingerprint=fingerprint)
        yield frames.pack(head, data[off:off + chunk_bytes])


def install_from_frames(frame_iter: Iterator[bytes], check: Callable[[pb.InstallHeader], None] = lambda h: None
                        ) -> tuple[pb.InstallHeader, bytearray]:
    """``check(first header)`` may refuse the copy before its buffer is allocated."""
    first, data, covered = None, bytearray(), 0
    for frame in frame_iter:
        head, payload = frames.unpack(frame, pb.InstallHeader)
        if first is None:
            check(head)
            first, data = head, bytearray(head.total_bytes)     # one buffer, filled in place
        if head.offset != covered or head.shard != first.shard or covered + len(payload) > first.total_bytes:
            raise ValueError(f"install chunk at {head.offset} does not continue at {covered}")
        data[covered:covered + len(payload)] = payload
        covered += len(payload)
    if first is None:       # a copy always travels as one frame at least: the sender gave up before it
        raise NoInstall("the sender closed the copy before its first part")
    if covered != first.total_bytes:
        raise ValueError(f"install carried {covered} of {first.total_bytes} bytes")
    return first, data


class NoInstall(ValueError):
    """An Install stream that ended without a frame: its sender gave up before the first one (a server
    closing its connections as it leaves the job), not a malformed copy."""


# ---------------------------------------------------------------- the primary's side

class Replicator:
    """Forwards one primary shard's updates to its backup (see the module docstring)."""

    def __init__(self, shard_id: int, member_id: Callable[[], str], find_shard: Callable[[], Shard | None],
                 chunk_bytes: int = 1 << 20, retry_s: float = 0.05, timeout_s: float = 30.0,
                 credential: Callable[[], str] = lambda: "", on_in_sync: Callable[[], None] = lambda: None):
        self.shard_id = shard_id
        self._credential = credential          # this ps's member credential: backups take updates from servers only
        self._member_id = member_id
        self._find_shard = find_shard
        self._chunk_bytes = chunk_bytes
        self._retry_s = retry_s
        self._timeout_s = timeout_s
        self._on_in_sync = on_in_sync     # the backup's copy became whole (the ps tells the chief)
        self._lock = threading.Lock()
        self._target: tuple[str, str] | None = None       # (member id, address) of the backup
        self._channel: grpc.Channel | None = None
        self._stubs: DataStubs | None = None
        self._tcp: tcp_client.TcpDataChannel | None = None   # the backup's TCP data channel, if it has one
        self._negotiated = False
        self._state = "none"                             # none | installing | in_sync
        self._pending: list[Update] = []
        self._generation = 0
        self._stop = threading.Event()
        # sends an update to a backup in step while the shard's own thread applies it (start/finish);
        # its one thread starts with the first such update
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replicate-{shard_id}")

    @property
    def state(self) -> str:
        return self._state

    @property
    def backup(self) -> str:
        return self._target[0] if self._target else ""

    @property
    def transport(self) -> str:
        """What carries the updates to the backup: ``tcp``, ``grpc``, or ``""`` (not asked yet, or none)."""
        with self._lock:
            return ("tcp" if self._tcp is not None else "grpc") if self._negotiated else ""

    def set_target(self, member_id: str, address: str) -> None:
        """The view names this shard's backup (empty: none). A new one gets a full copy first."""
        target = (member_id, address) if member_id else None
        with self._lock:
            if target == self._target:
                return
            gen = self._retarget(target)
        if target is None:
            # said once the loss lasts: at the end of a job the servers leave one after the other, and the
            # last one's shards lose their backup a moment before it stops too (no warning on a healthy run)
            timer = threading.Timer(NO_BACKUP_WARN_S, self._warn_no_backup, args=(gen,))
            timer.daemon = True
            timer.start()
            return
        log.info("shard %d: new backup %s at %s; sending it a copy", self.shard_id, *target)
        threading.Thread(target=self._install, args=(gen,), name=f"install-{self.shard_id}", daemon=True).start()

    def _warn_no_backup(self, gen: int) -> None:
        with self._lock:
            still = gen == self._generation and self._target is None and not self._stop.is_set()
        if still:
            log.warning("shard %d: no backup; updates are acknowledged by this primary alone", self.shard_id)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._retarget(None)
        self._sender.shutdown(wait=False)

    def _retarget(self, target: tuple[str, str] | None) -> int:
        """(lock held) Aims at ``target`` (None: no backup): the old backup's channels are closed, what was
        on its way to it is dropped, and a new generation starts (returned): work of the old one stops."""
        self._close_channels()
        self._target, self._generation, self._pending = target, self._generation + 1, []
        self._channel = open_channel(target[1], self._credential) if target else None
        self._stubs = DataStubs(self._channel) if self._channel is not None else None
        self._state = "installing" if target else "none"
        return self._generation

    def _close_channels(self) -> None:
        """Closes the backup's channels (lock held); calls still on them fail and retry on the new ones."""
        if self._channel is not None:
            self._channel.close()
        if self._tcp is not None:
            self._tcp.close()
        self._tcp, self._negotiated = None, False

    # ------------------------------------------------------------ forwarding (shard lock held)

    def start(self, u: Update) -> "tuple[Future, int] | None":
        """Puts ``u`` on its way to a backup in step (shard lock held) and returns at once, for the caller to
        apply it meanwhile and then wait in :meth:`finish`; None when there is nothing to send ahead (no
        backup, or a copy under way: :meth:`finish` does what :meth:`__call__` does). Raises, before
        anything is applied, if the replicator was closed."""
        with self._lock:
            if self._stop.is_set():
                raise Unavailable(f"shard {self.shard_id}: update {u.version} not applied: this copy "
                                  f"was dropped while it was on its way to the backup")
            stubs = self._stubs if self._state == "in_sync" else None
            gen = self._generation
        if stubs is None:
            return None
        try:
            return self._sender.submit(self._send, stubs, u), gen
        except RuntimeError:                        # closed in between
            raise Unavailable(f"shard {self.shard_id}: update {u.version} not applied: this copy "
                              f"was dropped while it was on its way to the backup") from None

    def finish(self, u: Update, sending: "tuple[Future, int] | None") -> None:
        """Returns once the backup holds ``u``: :meth:`__call__`, whose first attempt is the send that
        :meth:`start` began (None: it makes its own)."""
        self(u, sending)

    def __call__(self, u: Update, sending: "tuple[Future, int] | None" = None) -> None:
        """Returns once the backup holds ``u`` (or the view names none, or a copy for a new one is under
        way and will carry it: the chief does not count that one whole yet; a backup counted whole that
        lost its copy gets a fresh one first, see :meth:`_recopy`); raises if the update must not be acknowledged: the backup refused
        it (another ps is primary) or the replicator was closed (the view dropped this copy). ``sending``: the
        first attempt, already under way (:meth:`start`)."""
        warned, recopy = False, False
        while True:
            if sending is not None:                 # the first attempt is already on its way (start)
                (in_flight, gen), sending = sending, None
            else:
                in_flight = None
                with self._lock:
                    if self._stop.is_set():         # closed: this copy is being dropped, not retargeted
                        raise Unavailable(f"shard {self.shard_id}: update {u.version} not applied: this copy "
                                          f"was dropped while it was on its way to the backup")
                    gen, state, stubs = self._generation, self._state, self._stubs
                    if stubs is None:               # no backup (state "none")
                        return
                    if state == "installing":
                        self._pending.append(u)
                        return
            try:
                if in_flight is not None:
                    in_flight.result()
                    return
                if recopy:
                    self._recopy(stubs, u.version)
                    recopy = False
                self._send(stubs, u)
                return
            except ValueError:                      # the view replaced the backup and closed its channel
                if not self._current(gen):
                    continue
                raise
            except grpc.RpcError as exc:
                if not self._current(gen):          # cancelled by a new target: aim again
                    continue
                details = exc.details() or ""
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and FENCED in details:
                    moved = f"{FENCED} {self.backup}" in details and self.state == "in_sync"
                    raise Unavailable(f"backup refused update {u.version}: {details}"
                                      + (f" ({HANDED_OVER})" if moved else "")) from None
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and NEEDS_COPY in details:
                    recopy = True                   # then ``u`` again: acknowledged only once the backup has it
                    continue
                if not warned:
                    log.warning("shard %d: backup %s unreachable (%s); holding update %d until it answers or "
                                "the chief replaces it", self.shard_id, self.backup, exc.code().name, u.version)
                    warned = True
            if self._stop.wait(self._retry_s):
                raise Unavailable(f"shard {self.shard_id}: replicator closed")

    def _send(self, stubs: DataStubs, u: Update) -> int:
        tcp = self._data_channel(stubs)
        if tcp is not None:
            head, body = update_message(self.shard_id, self._member_id(), u)
            return tcp.call(lambda sock: tcp_client.replicate(sock, head, body), self._timeout_s).version
        fr = update_frames(self.shard_id, self._member_id(), u, self._chunk_bytes)
        if len(fr) == 1:
            reply = stubs.replicate_one(fr[0], timeout=self._timeout_s)
        else:
            reply = stubs.replicate(iter(fr), timeout=self._timeout_s)
        return pb.ReplicateReply.FromString(reply).version

    def _data_channel(self, stubs: DataStubs) -> "tcp_client.TcpDataChannel | None":
        """The backup's TCP data channel, asked for once per backup (None: gRPC carries the updates)."""
        with self._lock:
            if self._negotiated or stubs is not self._stubs:
                return self._tcp
            target = self._target
        tcp = tcp_client.negotiate(stubs, target[1], self._member_id, f"shard {self.shard_id} backup",
                                   self._credential) \
            if target is not None else None
        with self._lock:
            if stubs is not self._stubs:            # the view moved on meanwhile: not ours to keep
                if tcp is not None:
                    tcp.close()
                return None
            self._tcp, self._negotiated = tcp, True
            return tcp

    def _recopy(self, stubs: DataStubs, next_version: int) -> None:
        """A backup in step lost its copy (it restarted or re-joined and the view still names it): a fresh
        one goes now, in the caller's thread with the shard's lock held, and update ``next_version`` follows.
        A copy in the background would let this primary acknowledge updates the backup does not hold while
        the chief still counts that backup whole and would promote it."""
        shard = self._find_shard()
        if shard is None:
            raise Unavailable(f"shard {self.shard_id}: update {next_version} not applied: this copy is no "
                              f"longer the primary")
        t0 = time.perf_counter()
        with shard.exclusive():
            replica = shard.export_replica()
        version, size = self._send_copy(stubs, shard, replica)
        log.warning("shard %d: backup %s had lost its copy; sent it a fresh one at version %d (%d bytes in "
                    "%.2fs) before update %d", self.shard_id, self.backup, version, size,
                    time.perf_counter() - t0, next_version)

    def _send_copy(self, stubs: DataStubs, shard: Shard, replica: dict) -> tuple[int, int]:
        """Sends ``replica`` (``shard.export_replica()``) to the backup whole: (its version, its size in bytes)."""
        version = replica["state"].version
        data = replica_bytes(replica)
        stubs.install(install_frames(self.shard_id, self._member_id(), version, shard.fingerprint, data,
                                     self._chunk_bytes), timeout=max(self._timeout_s, COPY_TIMEOUT_S))
        return version, len(data)

    # ------------------------------------------------------------ a full copy for a new backup

    def _current(self, gen: int) -> bool:
        with self._lock:
            return gen == self._generation and not self._stop.is_set()

    def _install(self, gen: int) -> None:
        while self._current(gen):
            shard = self._find_shard()
            if shard is None:                       # not initialised (or restored) yet
                self._stop.wait(self._retry_s)
                continue
            try:
                self._install_once(gen, shard)
                return
            except (grpc.RpcError, ValueError) as exc:   # ValueError: the channel was closed under it
                if not self._current(gen):
                    return
                if isinstance(exc, ValueError):
                    raise
                # FAILED_PRECONDITION: the backup has not seen the view naming this primary yet (a move)
                lag = exc.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[union-attr]
                log.log(logging.INFO if lag else logging.WARNING, "shard %d: copy to backup %s failed (%s); "
                        "retrying", self.shard_id, self.backup, exc.code().name)  # type: ignore[union-attr]
                self._stop.wait(max(self._retry_s, 0.2))

    def _install_once(self, gen: int, shard: Shard) -> None:
        t0 = time.perf_counter()
        with shard.exclusive():
            replica = shard.export_replica()
            with self._lock:
                if gen != self._generation:
                    return
                self._pending = []
                stubs = self._stubs
        assert stubs is not None
        version, size = self._send_copy(stubs, shard, replica)
        for _ in range(3):                          # catch up outside the lock while training goes on
            with self._lock:
                items, self._pending = self._pending, []
            if not items:
                break
            for u in items:
                self._send(stubs, u)
        with shard.exclusive():                     # the last few under the lock, then forward in step
            with self._lock:
                if gen != self._generation:
                    return
                items, self._pending = self._pending, []
            for u in items:
                self._send(stubs, u)
            with self._lock:
                if gen != self._generation:
                    return
                self._state = "in_sync"
        self._on_in_sync()
        log.info("shard %d: backup %s in sync from version %d (%d bytes copied in %.2fs)", self.shard_id,
                 self.backup, version, size, time.perf_counter() - t0)
