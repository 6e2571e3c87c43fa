"""What keeps the chief's views cheap at a thousand members (issue 17; bench/chief_grpc.py measures it),
checked for the answers it must still give:

- ``Membership.alive`` keeps its lists until someone joins or stops being live, and always answers
  what a scan of every member would;
- a routing answer's rank follows who is live, not the epoch;
- a full view is rebuilt at most once per ``FULL_PACE`` times its last build's cost.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.chief import views as views_mod
from shoal.chief.membership import Membership, Role
from shoal.chief.state import ChiefState
from shoal.chief.views import ViewBoard
from shoal.settings.config import JobConfig
from shoal.proto import shoal_pb2 as pb

LEASE = 3.0


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def scanned(ms: Membership, role: Role | None) -> list[str]:
    return [m.member_id for m in ms.all() if m.live and (role is None or m.role is role)]


OPS = st.lists(st.tuples(st.sampled_from(["join_w", "join_ps", "rejoin", "leave", "expire", "expire_now",
                                          "busy", "idle", "heartbeat", "tick"]),
                         st.integers(0, 7)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_alive_answers_what_a_scan_of_every_member_answers_after_any_changes(ops):
    clock = Clock()
    ms = Membership(LEASE, clock)
    for op, k in ops:
        ids = [m.member_id for m in ms.all()]
        target = ids[k % len(ids)] if ids else ""
        if op == "join_w":
            ms.join(Role.WORKER)
        elif op == "join_ps":
            ms.join(Role.PS, address=f"127.0.0.1:{k}")
        elif op == "rejoin" and target:
            ms.join(ms.get(target).role, member_id=target)
        elif op == "leave" and target:
            ms.leave(target)
        elif op == "expire_now" and target:
            ms.expire_now(target, "test")
        elif op in ("busy", "idle") and target and ms.get(target).role is Role.WORKER:
            ms.set_busy(target, op == "busy")
        elif op == "heartbeat" and target:
            ms.heartbeat(target)
        elif op == "tick":
            clock.t += LEASE * k / 4
        elif op == "expire":
            ms.expire()
        for role in (None, Role.WORKER, Role.PS):
            assert [m.member_id for m in ms.alive(role)] == scanned(ms, role), (op, role)


def test_alive_hands_out_a_new_list_each_call():
    ms = Membership(LEASE, Clock())
    ms.join(Role.WORKER)
    first = ms.alive(Role.WORKER)
    first.clear()
    assert [m.member_id for m in ms.alive(Role.WORKER)] == ["worker-0"]


def test_who_is_live_changing_counts_and_a_busy_worker_or_a_heartbeat_does_not():
    clock = Clock()
    ms = Membership(LEASE, clock)
    w = ms.join(Role.WORKER).member_id
    v = ms.live_version
    ms.set_busy(w, True)
    ms.heartbeat(w)
    ms.join(Role.WORKER, member_id=w)          # joining again while alive: the same member
    assert ms.live_version == v
    for change in (lambda: ms.join(Role.PS), lambda: ms.leave(w), lambda: ms.expire_now("ps-0", "test")):
        change()
        assert ms.live_version > v
        v = ms.live_version


def routing_rank(board: ViewBoard, member_id: str) -> int:
    return pb.ClusterView.FromString(board.answer(pb.ROUTING, member_id, fresh=False)).worker_rank


def test_a_routing_answers_rank_follows_who_is_live():
    state = ChiefState(JobConfig(num_shards=1, lease_seconds=LEASE), Clock())
    board = ViewBoard(state)
    a = state.members.join(Role.WORKER).member_id
    b = state.members.join(Role.WORKER).member_id
    assert (routing_rank(board, a), routing_rank(board, b)) == (0, 1)
    state.members.leave(a)
    assert routing_rank(board, b) == 0
    c = state.members.join(Role.WORKER, member_id="worker-1")      # b again: the same member
    assert c.member_id == b and routing_rank(board, b) == 0


def test_a_full_view_waits_pace_times_its_last_builds_cost(monkeypatch):
    now = [50.0]                     # one fake clock for the build's CPU time and for the wall clock
    monkeypatch.setattr(views_mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(views_mod.time, "thread_time", lambda: now[0])
    state = ChiefState(JobConfig(num_shards=1, lease_seconds=LEASE), Clock())
    board = ViewBoard(state)
    assert board.full_wait_s() == 0.0                          # nothing built yet
    view = state.view

    def slow_view():                                          # a build that takes 20 ms on this clock
        now[0] += 0.02
        return view()
    monkeypatch.setattr(state, "view", slow_view)
    board.answer(pb.FULL, "", fresh=False)
    assert abs(board.full_wait_s() - views_mod.FULL_PACE * 0.02) < 1e-9
    now[0] += 0.15
    assert abs(board.full_wait_s() - (views_mod.FULL_PACE * 0.02 - 0.15)) < 1e-9
    now[0] += 0.1
    assert board.full_wait_s() == 0.0
    state.members.join(Role.WORKER)
    state.epoch += 1
    board.answer(pb.FULL, "", fresh=False)                    # a new epoch: built again, the pace restarts
    assert abs(board.full_wait_s() - views_mod.FULL_PACE * 0.02) < 1e-9


def test_a_full_view_never_waits_longer_than_the_cap(monkeypatch):
    now = [50.0]
    monkeypatch.setattr(views_mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(views_mod.time, "thread_time", lambda: now[0])
    state = ChiefState(JobConfig(num_shards=1, lease_seconds=LEASE), Clock())
    board = ViewBoard(state)
    view = state.view

    def very_slow_view():
        now[0] += 1.0
        return view()
    monkeypatch.setattr(state, "view", very_slow_view)
    board.answer(pb.FULL, "", fresh=False)
    assert board.full_wait_s() == views_mod.FULL_WAIT_MAX_S
