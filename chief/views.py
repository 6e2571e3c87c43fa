"""What the chief's view watchers wait for and are answered with (``ChiefServicer.GetView``).

Every member keeps a view watch open (a long poll). Two scopes (``pb.ViewScope``):

- FULL (servers, ``shoal status``): every member, woken by every epoch.
- ROUTING (workers): the live servers, the shard routes, the job and its completed epochs, plus the
  number of live workers and the watcher's rank among them, woken only when the servers, routes or
  completed epochs change. A worker joining, leaving, going idle or being expired changes the epoch
  but wakes no other worker: with N workers, worker churn would otherwise cost N answers of an
  O(N)-member view per change, O(N^2) bytes (bench/chief_grpc.py). The rank in a routing view is
  as of its build: it orders a worker's pushes so workers start on different servers (a matter of
  speed, never of correctness), and is not refreshed when other workers come and go.

Each scope's view is built and serialized once per change and handed as the same bytes to every
watcher (a routing answer appends the watcher's rank: protobuf merges concatenated messages). A watch
that times out with nothing new is answered ``unchanged`` with no view in it, rather than the whole
view again (which a watcher already holds). Every method runs with the servicer's lock held, except
:meth:`waits_past` and :meth:`stale`, which read ints.
"""
from __future__ import annotations

import threading
import time

from shoal.state import convert
from shoal.chief.state import ChiefState
from shoal.errors import InvalidArgument
from shoal.members import Role, ranks
from shoal.proto import shoal_pb2 as pb

SCOPES = (pb.FULL, pb.ROUTING)
# A full view is rebuilt at most once per FULL_PACE times what its last build took: with a thousand
# members a build is some ms, and a worker going busy or idle, joining or leaving moves the epoch
# many times a second; built once per epoch, the few full watchers' views took 40% of a loaded
# chief's event loop (bench/chief_grpc.py, py-spy). A watcher gets the epochs in between in one view.
FULL_PACE = 10.0
FULL_WAIT_MAX_S = 0.5      # never longer than this (a server waits on its full view to take over a shard)


def check_scope(scope: int) -> int:
    if scope not in SCOPES:
        raise InvalidArgument(f"unknown view scope {scope}")
    return scope


def routing_key(state: ChiefState) -> tuple:
    """What a routing view shows, but its epoch and the workers' count and ranks (lock held)."""
    v = state.routing_view()
    return (tuple((m.member_id, m.address, m.host, m.state) for m in v.members), v.routes, v.ready, v.job,
            v.fingerprint, v.completed_epochs)


class ViewBoard:
    def __init__(self, state: ChiefState):
        self.state = state
        self.watches: dict[int, set[threading.Event]] = {s: set() for s in SCOPES}
        self._full: tuple[int, bytes] | None = None          # (epoch, the full view's bytes)
        self._full_next = 0.0          # time.monotonic() before which a full view is not built again
        self._routing: tuple[int, bytes] | None = None       # (routing epoch, the routing view's bytes)
        self._ranks: tuple = (None, -1, {})   # (Membership, its live_version, each live worker's rank)
        self._routing_key: tuple | None = None
        self._checked_at = -1          # the state's epoch when the routing key was last compared
        self.routing_epoch = -1        # the newest epoch at which what a routing view shows changed

    # ------------------------------------------------------------ waiting

    def waits_past(self, scope: int) -> int:
        """The epoch a watch of ``scope`` compares its ``after_epoch`` with (no lock: an int read)."""
        return self.state.epoch if scope == pb.FULL else self.routing_epoch

    def full_wait_s(self) -> float:
        """How long a full watcher with a change to see waits before its answer is built (no lock)."""
        return max(0.0, self._full_next - time.monotonic())

    def stale(self) -> bool:
        """The epoch moved without :meth:`changed` (a change made outside the servicer)."""
        return self.state.epoch != self._checked_at

    def _refresh(self) -> bool:
        """Compares what a routing view shows with its last build; True when it changed."""
        epoch = self.state.epoch
        if epoch == self._checked_at:
            return False
        self._checked_at = epoch
        key = routing_key(self.state)
        if key == self._routing_key:
            return False
        self._routing_key, self.routing_epoch = key, epoch
        return True

    def changed(self) -> None:
        """The state may have a new epoch: wake the full watches, and the routing ones if theirs changed."""
        self._wake(pb.FULL)
        if self._refresh():
            self._wake(pb.ROUTING)

    def _wake(self, scope: int) -> None:
        for woke in self.watches[scope]:
            woke.set()

    # ------------------------------------------------------------ answers

    def answer(self, scope: int, member_id: str, fresh: bool) -> bytes:
        """The view of ``scope`` as sent. ``fresh`` (a read that asked for no epoch: ``shoal status``,
        ``refresh_view``) builds it anew, with the step times, counters and straggler flags of now,
        which change without an epoch; the watchers of that epoch get it from then on."""
        if scope == pb.FULL:
            epoch = self.state.epoch
            if fresh or self._full is None or self._full[0] != epoch:
                started = time.thread_time()        # the build's CPU: a thread descheduled meanwhile is not it
                self._full = (epoch, convert.view_to_pb(self.state.view()).SerializeToString())
                cost = time.thread_time() - started
                self._full_next = time.monotonic() + min(FULL_WAIT_MAX_S, FULL_PACE * cost)
            return self._full[1]
        if self._refresh():             # a change nobody announced: the other routing watches see it too
            self._wake(pb.ROUTING)
        if fresh or self._routing is None or self._routing[0] != self.routing_epoch:
            msg = convert.view_to_pb(self.state.routing_view())
            for m in msg.members:
                m.ClearField("counters")        # counters change without a routing change: none shown
            msg.routing_only = True
            msg.num_workers = len(self.state.members.alive(Role.WORKER))
            self._routing = (self.routing_epoch, msg.SerializeToString())
        return self._routing[1] + pb.ClusterView(epoch=self.state.epoch,
                                                 worker_rank=self._rank(member_id)).SerializeToString()

    def joined(self, scope: int, member_id: str) -> pb.ClusterView:
        """The view in a member's JoinReply, built now (its count of workers includes the one joining)."""
        return pb.ClusterView.FromString(self.answer(scope, member_id, fresh=True))

    def _rank(self, member_id: str) -> int:
        members = self.state.members
        if self._ranks[0] is not members or self._ranks[1] != members.live_version:
            self._ranks = (members, members.live_version, ranks(m.member_id for m in members.alive(Role.WORKER)))
        return self._ranks[2].get(member_id, 0)

    @staticmethod
    def unchanged(after_epoch: int) -> bytes:
        return pb.ClusterView(epoch=after_epoch, unchanged=True).SerializeToString()
