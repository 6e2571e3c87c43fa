"""Which server serves each shard for a worker, and finding the new one when it fails.

:class:`ShardRoutes` holds one :class:`ShardClient` per shard, at the
primary the chief's view names. When a call fails in a way that means the
server is gone or no longer the primary, :meth:`ShardRoutes.reroute` tells
the chief (so it can promote the backup at once), follows the view to the
new primary and swaps the client. The push and pull retry loops that decide
when to call it live in the Trainer.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from shoal.chief_client import ChiefClient
from shoal.errors import HANDED_OVER, NOT_PRIMARY, Unreachable
from shoal.members import MemberState
from shoal.proto import shoal_pb2 as pb
from shoal.worker.ps_client import ShardClient, is_uninitialised

log = logging.getLogger(__name__)
RETIRE_GRACE_S = 0.5      # how long calls on a server the view moved a shard away from may still finish


def is_failover(exc: grpc.RpcError) -> bool:
    """The shard's server is gone, or is not (any more) the shard's primary: re-read the view."""
    details = exc.details() or ""
    return (exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)   # cancelled: server stopping
            or (exc.code() == grpc.StatusCode.FAILED_PRECONDITION and NOT_PRIMARY in details)
            or (exc.code() == grpc.StatusCode.NOT_FOUND and "does not hold shard" in details))


def went_back(exc: grpc.RpcError) -> bool:
    """The shard is empty, or behind the version this worker saw: it restarted (``--recovery fast``)."""
    return is_uninitialised(exc) or (exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                                     and "push computed on version" in (exc.details() or ""))


class ShardRoutes:
    """``clients[shard]`` is the client of the shard's primary; :meth:`reroute` replaces it after a failure.

    ``clients`` is one dict for the routes' whole life (a reroute swaps an entry), so holders of it see
    every change. ``failover_timeout_s`` bounds the wait for a new primary.
    """

    def __init__(self, chief: ChiefClient, view: pb.ClusterView, make_client: Callable[[int, str], ShardClient],
                 member_id: Callable[[], str]):
        self.chief = chief
        self._make = make_client
        self._member_id = member_id
        self.clients: dict[int, ShardClient] = {r.shard: make_client(r.shard, r.primary_address)
                                                for r in view.shards}
        self._lock = threading.Lock()
        self.failover_timeout_s = 120.0
        self.failovers = 0
        self.moves = 0                        # planned hand-overs followed from the view
        self._retired: list[ShardClient] = []
        chief.on_view(self._follow_view)

    def _follow_view(self, view: pb.ClusterView) -> None:
        """The view moved a shard away from the server this worker calls for it. A primary that left on
        purpose is handed over without a failed call (:meth:`follow`); otherwise (its backup promoted over a
        paused or dead primary) close that client, so a push or pull blocked on the old server fails at
        once and :meth:`reroute` follows the view, rather than waiting out the call's timeout."""
        self.follow(view)
        for route in view.shards:
            client = self.clients.get(route.shard)
            if client is not None and route.primary_address and route.primary_address != client.address \
                    and not client.closed:
                log.info("shard %d: the view names %s primary; leaving %s", route.shard, route.primary_id,
                         client.address)
                client.close()

    def follow(self, view: pb.ClusterView) -> None:
        """A view that names another primary for a shard moves the shard's client before any call fails
        there: a planned hand-over (a ps stopped by SIGTERM; the chief moving a primary to its in-sync
        backup to rebalance, chief/placement.py, with the old primary still a member) or a failover the
        chief already decided. The old client is retired (closed after a grace)."""
        # a reroute under way holds the lock and moves the shard itself (its refresh_view calls this)
        if not self._lock.acquire(blocking=False):
            return
        try:
            for route in view.shards:
                client = self.clients.get(route.shard)
                if client is None or not route.primary_address or route.primary_address == client.address:
                    continue
                log.info("shard %d: handed over to %s at %s; following the view%s", route.shard, route.primary_id,
                         route.primary_address, "" if self._left(client.address, view) else " (a planned move)")
                self.clients[route.shard] = self._make(route.shard, route.primary_address)
                self._retire(client)
                self.moves += 1
        finally:
            self._lock.release()

    def _retire(self, client: ShardClient) -> None:
        """Closes a client the view moved away from after a short grace: a call finishing on a server that
        left on purpose (an RPC under way: milliseconds) has the time it needs, and a call blocked on one
        that stopped answering (the view also drops an expired server) fails then and takes the failover
        path, instead of its own timeout. A call that outlasts the grace on a server that did leave is
        re-sent to the new primary with its key: a duplicate there at worst, never a loss."""
        self._retired.append(client)
        client.retire()     # idle connections close now: a server leaving on purpose waits for that
        timer = threading.Timer(min(RETIRE_GRACE_S, max(self.chief.lease_seconds, 0.1)), client.close)
        timer.daemon = True
        timer.start()

    @staticmethod
    def _left(address: str, view: pb.ClusterView) -> bool:
        """The server at ``address`` is no longer in the job: it left, or its lease ran out (the view lists
        live members only); :meth:`_retire` tells the two apart by whether its calls still finish."""
        states = {m.state for m in view.members if m.address == address}
        return not states or states == {MemberState.LEFT.value}

    def reroute(self, shard: int, failed: ShardClient, exc: grpc.RpcError) -> None:
        """The shard's server failed or is no longer its primary: follow the view to the one that is.

        Waits for a view naming another primary; if none comes within two leases
        (a blip, not a death) it tries the same server again. Gives up after
        ``failover_timeout_s`` (Unreachable: one line, the worker exits 69).
        """
        with self._lock:
            if self.clients[shard] is not failed:          # another thread already moved this shard
                return
            deadline = time.monotonic() + self.failover_timeout_s
            patience = time.monotonic() + 2 * max(self.chief.lease_seconds, 1.0)
            planned = HANDED_OVER in (exc.details() or "")    # the server said so: it left, or the shard moved
            if not planned:
                log.warning("shard %d: %s at %s (%s); looking for its primary", shard, exc.code().name,
                            failed.address, (exc.details() or "")[:120])
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._report_unreachable(shard)
            while True:
                try:
                    view = self.chief.refresh_view()
                except grpc.RpcError:
                    view = self.chief.view
                route = next((r for r in view.shards if r.shard == shard), None) if view else None
                now = time.monotonic()
                if route is not None and (route.primary_address != failed.address or now >= patience):
                    break
                if now >= deadline:
                    raise Unreachable(f"gave up after {self.failover_timeout_s:.0f}s waiting for a primary of shard "
                                      f"{shard} (the last, {failed.address}, failed with {exc.code().name})") from exc
                time.sleep(0.05)
            if planned and route.primary_address != failed.address:
                log.info("shard %d: handed over to %s at %s; following the view (%s said so before the view came)",
                         shard, route.primary_id, route.primary_address, failed.address)
                self.moves += 1
            else:
                if route.primary_address != failed.address:
                    log.warning("shard %d: now served by %s at %s", shard, route.primary_id, route.primary_address)
                self.failovers += 1
            self.clients[shard] = self._make(shard, route.primary_address)
            failed.close()

    def _report_unreachable(self, shard: int) -> None:
        """Tells the chief the shard's primary does not answer: if the chief's probe agrees, it promotes
        the backup now instead of after the lease. Best effort."""
        view = self.chief.view
        route = next((r for r in view.shards if r.shard == shard), None) if view else None
        if route is None:
            return
        try:
            reply = self.chief.stub.ReportUnreachable(
                pb.UnreachableReport(reporter_id=self._member_id(), member_id=route.primary_id),
                timeout=max(1.0, 2 * self.chief.lease_seconds))   # the chief probes it: a lease or so
            if reply.expired:
                log.warning("shard %d: the chief confirmed %s is gone", shard, route.primary_id)
        except grpc.RpcError as exc:
            log.info("could not report %s unreachable: %s", route.primary_id, exc.code().name)

    def close(self) -> None:
        for c in [*self.clients.values(), *self._retired]:
            c.close()
