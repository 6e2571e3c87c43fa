"""A member's side of the chief protocol: join with backoff, heartbeats, view watch.

Used by parameter servers and workers alike. Nothing here sits on the training
hot path: heartbeats and the view watch run in background threads, and a chief
outage only shows up as retry lines in the log.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable

import grpc

from shoal.state import convert
from shoal.errors import EXIT_REFUSED, Unreachable
from shoal.net.keepalive import HeartbeatStream
from shoal.members import Counters
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import RETRYABLE, open_channel, with_retries

log = logging.getLogger(__name__)


def exit_refused(why: str) -> None:
    """A member refused the chief now serving (another job's): one line, and the process exits
    ``EXIT_REFUSED`` at once, from whichever thread noticed (a worker's training loop is the user's)."""
    print(f"shoal: error: {why}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(EXIT_REFUSED)

# How long one view watch waits for a change before the chief answers "unchanged" and the member asks
# again. Each re-ask is a call: with a thousand members, 5 s meant 200 calls a second for nothing.
WATCH_S = 25.0


class ChiefClient:
    def __init__(self, address: str, role: int, *, host: str = "", address_advertised: str = "",
                 layout: pb.ModelLayout | None = None, counters: Callable[[], Counters] | None = None,
                 heartbeat_extra: Callable[[pb.HeartbeatRequest], None] | None = None,
                 join_deadline_s: float | None = 120.0, lost_after_s: float | None = None,
                 on_lost: Callable[[str], None] | None = None, view_scope: int = pb.FULL,
                 keepalive: bool = True, on_refused: Callable[[str], None] | None = None):
        self.chief_address = address
        self.view_scope = view_scope     # what this member watches: pb.ROUTING for a worker (chief/views.py)
        self.role = role
        self.host = host
        self.advertised = address_advertised
        self.layout = layout
        self._counters = counters or Counters
        self._heartbeat_extra = heartbeat_extra
        self._join_deadline_s = join_deadline_s
        self.credential = ""             # from the chief at join: who this member is (shoal.security.auth)
        self._lost_after_s = lost_after_s        # heartbeats failing this long: on_lost(why), and they stop
        self._on_lost = on_lost
        # the chief now serving is not of this member's job (its journal was lost): on_refused(why) once, and
        # the heartbeats and the watch stop; without a callback the process exits EXIT_REFUSED (a worker)
        self._on_refused = on_refused or exit_refused
        self.refused = ""
        self.job_id = ""                 # the job this member belongs to, from its first join (chief/identity.py)
        self._join_lock = threading.Lock()       # a re-join from the heartbeat thread never follows a leave
        self._left = False
        self.channel = open_channel(address, lambda: self.credential)
        self.stub = pb_grpc.ChiefStub(self.channel)
        self._beats = HeartbeatStream(lambda: self.stub, use_stream=keepalive)
        self._watch_stream = keepalive       # the view on a Watch stream (else GetView long polls)
        self._watch_call = None
        self.member_id = ""
        self.shard = -1
        self.lease_seconds = 3.0
        self._view: pb.ClusterView | None = None
        self._view_cond = threading.Condition()
        self._listeners: list[Callable[[pb.ClusterView], None]] = []
        self._stop = threading.Event()
        self._beat_now = threading.Event()
        self._threads: list[threading.Thread] = []
        # the chief asks this member to leave (a heartbeat reply's ``leave``: an evicted straggler); called
        # once, from the heartbeat thread, with the chief's reason
        self.on_leave_asked: Callable[[str], None] | None = None
        self._leave_asked = False

    # ------------------------------------------------------------ lifecycle

    def join(self) -> pb.JoinReply:
        req = pb.JoinRequest(role=self.role, address=self.advertised, host=self.host, member_id=self.member_id,
                             view_scope=self.view_scope, job_id=self.job_id,
                             generation=self._view.generation if self._view is not None else 0)
        if self.layout is not None:
            req.layout.CopyFrom(self.layout)
        t0 = time.monotonic()
        try:
            reply = with_retries(lambda: self.stub.Join(req, timeout=10), f"join chief at {self.chief_address}",
                                 deadline_s=self._join_deadline_s)
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE:
                raise
            raise Unreachable(f"gave up after {time.monotonic() - t0:.0f}s waiting to join the chief at "
                              f"{self.chief_address} ({exc.code().name})") from exc
        renamed = self.member_id not in ("", reply.member_id)
        self.member_id, self.shard, self.lease_seconds = reply.member_id, reply.shard, reply.lease_seconds
        self.credential = reply.credential
        if not self.job_id:
            self.job_id = reply.view.job_id
        if renamed and self._watch_call is not None:
            self._watch_call.cancel()        # the open watch is under the old id: the next one under the new
        self._set_view(reply.view)
        log.info("joined chief %s as %s (view epoch %d)", self.chief_address, self.member_id, reply.view.epoch)
        return reply

    def start_background(self) -> None:
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "view-watch")):
            t = threading.Thread(target=target, name=f"{name}-{self.member_id}", daemon=True)
            t.start()
            self._threads.append(t)

    def on_view(self, listener: Callable[[pb.ClusterView], None]) -> None:
        self._listeners.append(listener)
        if self._view is not None:
            listener(self._view)

    def leave(self) -> None:
        """Leaves the job for good: this member id is not used again, even by a heartbeat in flight."""
        with self._join_lock:
            self._left = True
            self._stop.set()
        if self.member_id:
            try:
                self.stub.Leave(pb.LeaveRequest(member_id=self.member_id,
                                                counters=convert.counters_to_pb(self._counters())), timeout=5)
            except grpc.RpcError as exc:
                log.warning("leave: chief unreachable (%s); the lease will expire instead", exc.code().name)

    def heartbeat_now(self) -> None:
        """Sends the next heartbeat at once rather than at its period (news the chief should have soon)."""
        self._beat_now.set()

    def close(self) -> None:
        """Stops the background threads; closing the channel first cancels a watch that is waiting."""
        self._stop.set()
        self._beat_now.set()
        self._beats.close()
        if self._watch_call is not None:
            self._watch_call.cancel()
        self.channel.close()
        for t in self._threads:
            t.join(timeout=2)

    # ------------------------------------------------------------ view

    @property
    def view(self) -> pb.ClusterView | None:
        return self._view

    def _set_view(self, view: pb.ClusterView) -> None:
        if self.job_id and view.job_id and view.job_id != self.job_id:
            self._refuse(f"the chief at {self.chief_address} runs job {view.job_id} (generation {view.generation}), "
                         f"not this member's job {self.job_id}: the journal of job {self.job_id} is missing; "
                         f"restore it and restart the chief, or start job {self.job_id} over")
            return
        with self._view_cond:
            # a newer generation of the job (a chief recovered from its journal) wins even with a lower epoch
            if self._view is not None and (view.generation, view.epoch) <= (self._view.generation, self._view.epoch):
                return
            self._view = view
            self._view_cond.notify_all()
        for listener in self._listeners:
            try:
                listener(view)
            except Exception:  # noqa: BLE001 - a bad listener must not kill the watch
                log.exception("view listener failed")

    def _refuse(self, why: str) -> None:
        """This member will not follow the chief now serving: once, ``on_refused(why)``; background loops stop."""
        with self._view_cond:
            if self.refused:
                return
            self.refused = why
            self._stop.set()
            self._view_cond.notify_all()
        log.error("%s", why)
        self._on_refused(why)

    def wait_view(self, predicate: Callable[[pb.ClusterView], bool], timeout_s: float) -> pb.ClusterView:
        with self._view_cond:
            if not self._view_cond.wait_for(lambda: self._view is not None and predicate(self._view), timeout_s):
                raise TimeoutError(f"cluster view did not become ready in {timeout_s:.0f}s "
                                   f"(epoch {self._view.epoch if self._view else None})")
            return self._view

    def call_timeout_s(self) -> float:
        """The deadline of one call to the chief on a member's hot path (tasks, views, reports): about a
        lease, so a chief that stopped answering (paused, a host that froze) fails the call as a dead one
        would, within a lease, and the caller retries or goes on with what it holds, never hanging."""
        return max(1.0, self.lease_seconds)

    def refresh_view(self) -> pb.ClusterView:
        view = self.stub.GetView(pb.ViewRequest(after_epoch=-1, scope=self.view_scope), timeout=self.call_timeout_s())
        self._set_view(view)
        return view

    # ------------------------------------------------------------ loops

    def _heartbeat_loop(self) -> None:
        period = max(0.05, self.lease_seconds / 4)
        failures = 0
        failing_since = 0.0
        while True:
            self._beat_now.wait(period)
            self._beat_now.clear()
            if self._stop.is_set():
                return
            try:
                reply = self._beats.beat(self._heartbeat_request(), timeout_s=max(1.0, self.lease_seconds / 2))
                if failures:
                    log.info("chief reachable again after %d failed heartbeat(s)", failures)
                failures = 0
                if reply.leave and not self._leave_asked and self.on_leave_asked is not None:
                    self._leave_asked = True
                    self.on_leave_asked(reply.leave)
                if not reply.known:
                    with self._join_lock:
                        if self._left:          # the chief forgot us because we left: that is final
                            return
                        log.warning("chief no longer knows %s (lease expired); joining again", self.member_id)
                        try:
                            self.join()
                        except grpc.RpcError as exc:
                            if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
                                raise
                            self._refuse(f"the chief at {self.chief_address} refused {self.member_id}: {exc.details()}")
                            return
            except ValueError:          # the channel was closed under the call: close() is under way
                if self._stop.is_set():
                    return
                log.exception("heartbeat of %s failed; heartbeats go on", self.member_id)
            except grpc.RpcError as exc:
                if self._stop.is_set():     # close() ended the stream under the heartbeat
                    return
                failures += 1
                now = time.monotonic()
                failing_since = now if failures == 1 else failing_since
                if failures in (1, 10) or failures % 50 == 0:
                    log.warning("heartbeat to chief %s failed (%s), attempt %d", self.chief_address,
                                exc.code().name, failures)
                if self._lost_after_s is not None and now - failing_since >= self._lost_after_s:
                    why = (f"gave up after {now - failing_since:.0f}s without an answer from the chief at "
                           f"{self.chief_address} ({exc.code().name})")
                    log.error("%s", why)
                    if self._on_lost is not None:
                        self._on_lost(why)
                    return
            except Exception:  # noqa: BLE001 - a bug in a callback must not end the lease's heartbeats
                log.exception("heartbeat of %s failed; heartbeats go on", self.member_id)

    def _watch_on_stream(self, after: int, backoff: float) -> float:
        """One ``Watch`` stream, until it ends: every view it sends is taken. A chief that stopped
        answering is noticed by the channel's keepalive pings, which end the stream. Returns the
        backoff before the next stream."""
        try:
            call = self.stub.Watch(pb.ViewRequest(after_epoch=after, member_id=self.member_id,
                                                  scope=self.view_scope, generation=self._generation()))
            self._watch_call = call
            if self._stop.is_set():
                call.cancel()
            for view in call:
                self._set_view(view)
                backoff = 0.1
        except grpc.RpcError as exc:
            if self._stop.is_set():
                return backoff
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                log.info("the chief has no Watch stream; the view is watched with long polls")
                self._watch_stream = False
                return backoff
            if exc.code() not in RETRYABLE and exc.code() is not grpc.StatusCode.CANCELLED:
                log.warning("view watch: %s", exc.code().name)
        except ValueError:          # the channel was closed under the call: close() is under way
            if not self._stop.is_set():
                raise
            return backoff
        self._stop.wait(backoff)
        return min(2.0, backoff * 2)

    def _generation(self) -> int:
        return self._view.generation if self._view is not None else 0

    def _heartbeat_request(self) -> pb.HeartbeatRequest:
        req = pb.HeartbeatRequest(member_id=self.member_id, counters=convert.counters_to_pb(self._counters()))
        if self._heartbeat_extra is not None:
            self._heartbeat_extra(req)
        return req

    def heartbeat_sync(self, timeout_s: float = 5.0) -> None:
        """One heartbeat now, waiting for its answer (with what the callback adds: a worker's task progress), e.g. before leaving."""
        self.stub.Heartbeat(self._heartbeat_request(), timeout=timeout_s)

    def _watch_loop(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            after = self._view.epoch if self._view is not None else -1
            if self._watch_stream:
                backoff = self._watch_on_stream(after, backoff)
                continue
            try:
                # the chief holds the call up to WATCH_S when nothing changes; a lease more and it is not
                # answering (a peer that vanished is noticed sooner, by the channel's keepalive pings)
                view = self.stub.GetView(pb.ViewRequest(after_epoch=after, timeout_seconds=WATCH_S,
                                                        member_id=self.member_id, scope=self.view_scope,
                                                        generation=self._generation()),
                                         timeout=WATCH_S + self.call_timeout_s())
                if not view.unchanged:          # the watch timed out with nothing new
                    self._set_view(view)
                backoff = 0.1
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    log.warning("view watch: %s", exc.code().name)
                self._stop.wait(backoff)
                backoff = min(2.0, backoff * 2)
            except ValueError:          # the channel was closed under the call: close() is under way
                if self._stop.is_set():
                    return
                raise
