"""Membership, routing and task hand-out of the chief, driven by a fake clock."""
import pytest

from shoal.chief.membership import MemberState, Membership, Role
from shoal.chief.state import ChiefState
from shoal.chief.tasks import DatasetSpec
from shoal.settings.config import JobConfig
from shoal.errors import FailedPrecondition
from shoal.state.layout import ModelLayout, TensorSpec

LAYOUT = ModelLayout([TensorSpec("w", (4, 3)), TensorSpec("b", (3,))])


def test_lease_expires_without_heartbeat_and_renews_with_one(clock):
    m = Membership(lease_seconds=3.0, clock=clock)
    a = m.join(Role.WORKER)
    b = m.join(Role.WORKER)
    clock.advance(2.0)
    assert m.heartbeat(a.member_id)
    clock.advance(2.0)                       # b silent for 4 s > lease
    gone = m.expire()
    assert [x.member_id for x in gone] == [b.member_id]
    assert b.state is MemberState.EXPIRED
    assert not m.heartbeat(b.member_id)      # an expired member must join again
    assert [x.member_id for x in m.alive()] == [a.member_id]
    clock.advance(3.5)
    assert [x.member_id for x in m.expire()] == [a.member_id]


def test_rejoin_after_expiry_keeps_identity_and_counters(clock):
    m = Membership(lease_seconds=1.0, clock=clock)
    a = m.join(Role.WORKER)
    a.counters.steps = 7
    clock.advance(2)
    m.expire()
    again = m.join(Role.WORKER, member_id=a.member_id)
    assert again.member_id == a.member_id and again.live and again.counters.steps == 7
    assert m.join(Role.PS, member_id=a.member_id).member_id != a.member_id   # a role cannot take it


def test_view_epoch_changes_with_membership_and_routing(clock):
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=2.0, replicas=1, recovery="fast"), clock)
    e0 = s.epoch
    p0, shard0 = s.join_ps("h:1")
    p1, shard1 = s.join_ps("h:2")
    assert (shard0, shard1) == (0, 1)
    assert s.view().ready and s.epoch > e0
    w = s.join_worker(LAYOUT)
    e1 = s.epoch
    clock.advance(1.5)
    s.heartbeat(p0.member_id), s.heartbeat(w.member_id)
    clock.advance(1.0)
    gone = s.tick()                          # ps-1 missed its lease
    assert [m.member_id for m in gone] == [p1.member_id]
    v = s.view()
    assert s.epoch > e1 and not v.ready and [r.shard for r in v.routes] == [0]
    p2, shard2 = s.join_ps("h:3")
    assert shard2 == 1 and s.view().ready


def routes(s):
    return {r.shard: (r.member_id, r.backup_id) for r in s.view().routes}


def test_each_shard_gets_a_backup_on_another_ps_and_a_dead_primary_is_replaced_by_it(clock):
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=2.0), clock)
    assert s.job.replicas == 2                                   # the default with two or more shards
    p0, _ = s.join_ps("h:1")
    assert routes(s) == {0: (p0.member_id, "")}                  # nobody to back it up yet
    p1, _ = s.join_ps("h:2")
    assert routes(s) == {0: (p0.member_id, p1.member_id), 1: (p1.member_id, p0.member_id)}
    s.heartbeat(p0.member_id, backups_complete={0: p1.member_id})   # p1's copy of shard 0 is whole
    e = s.epoch
    clock.advance(1.5)
    s.heartbeat(p1.member_id)
    clock.advance(1.0)
    assert [m.member_id for m in s.tick()] == [p0.member_id]
    assert s.epoch > e and s.view().ready                        # promoted: the job never lacks a primary
    assert routes(s) == {0: (p1.member_id, ""), 1: (p1.member_id, "")}
    p2, shard = s.join_ps("h:3")                                 # a restarted ps: no free shard, backs up both
    assert shard == -1
    assert routes(s) == {0: (p1.member_id, p2.member_id), 1: (p1.member_id, p2.member_id)}
    s.leave(p2.member_id)
    assert routes(s) == {0: (p1.member_id, ""), 1: (p1.member_id, "")}
    clock.advance(10.0)
    assert [m.member_id for m in s.tick()] == [p1.member_id]     # the last copy of both shards dies
    assert routes(s) == {} and s.lost == [0, 1] and not s.view().ready
    assert s.stopped                                             # --recovery consistent: the job rolls back
    p3, shard = s.join_ps("h:4")
    assert shard == -1 and routes(s) == {}                       # so no server restores and serves a lost shard


def test_backups_spread_over_three_servers_and_survive_a_journal_round_trip(clock):
    s = ChiefState(JobConfig(num_shards=3), clock)
    ps = [s.join_ps(f"h:{i}")[0].member_id for i in range(3)]
    r = routes(s)
    assert [r[k][0] for k in range(3)] == ps
    assert all(r[k][1] and r[k][1] != r[k][0] for k in range(3))
    back = ChiefState.from_dict(s.to_dict(), clock)
    assert routes(back) == r and back.backups == s.backups


def test_one_replica_assigns_no_backups(clock):
    s = ChiefState(JobConfig(num_shards=2, replicas=1), clock)
    s.join_ps("h:1"), s.join_ps("h:2"), s.join_ps("h:3")
    assert all(b == "" for _, b in routes(s).values())


def test_worker_with_different_layout_is_refused_naming_the_first_difference_both_ways(clock, caplog):
    s = ChiefState(JobConfig(), clock)
    s.join_worker(LAYOUT)
    other = ModelLayout([TensorSpec("w", (4, 3)), TensorSpec("b", (4,))])
    with pytest.raises(FailedPrecondition, match=r"b: expected \[3\] float32, got \[4\] float32"):
        s.join_worker(other)
    assert "b: expected [3] float32, got [4] float32" in caplog.text   # the chief's log has it too


def test_workers_are_idle_until_they_hold_tasks(clock):
    s = ChiefState(JobConfig(), clock)
    w = s.join_worker(LAYOUT)
    assert w.state is MemberState.IDLE
    spec = DatasetSpec(size=10, batch_size=5, epochs=1, batches_per_task=1)
    tasks, finished = s.take_tasks(w.member_id, spec, 2)
    assert len(tasks) == 2 and not finished and w.state is MemberState.ALIVE
    tasks2, finished = s.take_tasks(w.member_id, None, 1, done=tuple(t.task_id for t in tasks))
    assert tasks2 == [] and finished and w.state is MemberState.IDLE


def test_a_task_whose_reply_was_lost_is_handed_out_again(clock):
    s = ChiefState(JobConfig(), clock)
    w = s.join_worker(LAYOUT)
    spec = DatasetSpec(size=40, batch_size=5, epochs=1, batches_per_task=2)
    first, _ = s.take_tasks(w.member_id, spec, 2, known=frozenset())
    lost, _ = s.take_tasks(w.member_id, spec, 1, known=frozenset(t.task_id for t in first))   # never arrived
    again, _ = s.take_tasks(w.member_id, spec, 2, known=frozenset(t.task_id for t in first))
    assert again[0] == lost[0]                                            # same task, same attempt
    assert again[1].task_id not in {t.task_id for t in first + lost}      # then a new one
    held = frozenset(t.task_id for t in first + again)
    assert s.take_tasks(w.member_id, spec, 0, known=held)[0] == []        # a report-only call gets none
    rest, _ = s.take_tasks(w.member_id, spec, 8, done=tuple(held), known=held)
    s.take_tasks(w.member_id, spec, 0, done=tuple(t.task_id for t in rest), known=held)
    assert s.tasks.finished


def test_expired_worker_tasks_go_back_to_the_queue(clock):
    s = ChiefState(JobConfig(lease_seconds=1.0), clock)
    a, b = s.join_worker(LAYOUT), s.join_worker(LAYOUT)
    spec = DatasetSpec(size=40, batch_size=5, epochs=1, batches_per_task=2)
    held, _ = s.take_tasks(a.member_id, spec, 2)
    clock.advance(0.8)
    s.heartbeat(b.member_id)
    clock.advance(0.5)
    s.tick()
    assert a.state is MemberState.EXPIRED
    got, _ = s.take_tasks(b.member_id, spec, 4)
    assert [t.task_id for t in got[:2]] == sorted(t.task_id for t in held)   # re-queued first
    s.take_tasks(b.member_id, spec, 0, done=tuple(t.task_id for t in got))
    assert s.tasks.finished


def test_graceful_leave_returns_tasks_immediately(clock):
    s = ChiefState(JobConfig(), clock)
    a, b = s.join_worker(LAYOUT), s.join_worker(LAYOUT)
    spec = DatasetSpec(size=20, batch_size=5, epochs=1, batches_per_task=1)
    held, _ = s.take_tasks(a.member_id, spec, 3)
    s.leave(a.member_id)
    got, _ = s.take_tasks(b.member_id, spec, 4)
    assert {t.task_id for t in got} == {0, 1, 2, 3} and set(t.task_id for t in held) <= {t.task_id for t in got}


def test_stragglers_are_flagged_against_the_median(clock):
    from shoal.chief.stragglers import HOLD, MIN_STEPS
    from shoal.members import Counters
    s = ChiefState(JobConfig(mode="async"), clock, straggler_factor=2.0)    # sync goes by its rounds
    ws = [s.join_worker(LAYOUT) for _ in range(4)]
    spec = DatasetSpec(size=400, batch_size=10, epochs=1, batches_per_task=1)
    for w in ws:
        s.take_tasks(w.member_id, spec, 1)
    for w, secs in zip(ws, (0.10, 0.11, 0.12, 0.35)):
        s.heartbeat(w.member_id, Counters(steps=5), step_seconds=secs)
    for _ in range(HOLD):
        s.watch_stragglers()
    assert s.stragglers() == set()          # its first steps: not judged yet
    for w in ws:
        s.heartbeat(w.member_id, Counters(steps=MIN_STEPS))
    for _ in range(HOLD):
        s.watch_stragglers()                # found slow HOLD times in a row
    assert s.stragglers() == {ws[3].member_id}
    s.heartbeat(ws[3].member_id, step_seconds=0.2)
    for _ in range(HOLD):
        s.watch_stragglers()
    assert s.stragglers() == set()


def test_task_tokens_bind_holder_and_attempt(clock):
    from shoal.security import tokens
    s = ChiefState(JobConfig(), clock)
    a = s.join_worker(LAYOUT)
    t = s.take_tasks(a.member_id, DatasetSpec(size=40, batch_size=10), 1)[0][0]
    tok = s.sign(a.member_id, t)
    assert tokens.verify(tokens.public_key(s.secret), tok, a.member_id, t.task_id, t.attempt, t.epoch, t.start, t.stop)
    assert not tokens.verify(tokens.public_key(s.secret), tok, "worker-9", t.task_id, t.attempt, t.epoch, t.start, t.stop)
    assert not tokens.verify(tokens.public_key(s.secret), tok, a.member_id, t.task_id, t.attempt + 1, t.epoch, t.start, t.stop)


def test_a_broken_watch_cuts_the_lease_short_unless_a_heartbeat_renews_it(clock):
    s = ChiefState(JobConfig(lease_seconds=3.0), clock)
    a = s.join_worker(LAYOUT)
    b = s.join_worker(LAYOUT)
    assert s.members.cut_lease(a.member_id, 1.0) and s.members.cut_lease(b.member_id, 1.0)
    clock.advance(0.75)
    s.heartbeat(b.member_id)                          # b is alive: its heartbeat gives it a full lease again
    clock.advance(0.5)
    assert [m.member_id for m in s.tick()] == [a.member_id]   # a is gone after 1 s, not 3 s
    clock.advance(2.0)
    assert s.tick() == [] and s.members.get(b.member_id).live
    assert not s.members.cut_lease(a.member_id, 1.0)          # already gone


def test_a_dead_worker_is_ended_when_its_watch_and_a_data_connection_both_drop(clock):
    s = ChiefState(JobConfig(lease_seconds=3.0), clock)
    a = s.join_worker(LAYOUT)
    b = s.join_worker(LAYOUT)
    epoch = s.epoch
    s.watch_opened(a.member_id)
    assert s.members.watching(a.member_id)
    assert not s.watch_closed(a.member_id, answered=True)   # answered: nothing to see
    assert not s.members.watching(a.member_id)
    s.watch_opened(a.member_id)
    assert not s.watch_closed(a.member_id, answered=False)  # one sighting: only the lease is cut
    assert s.members.get(a.member_id).live and s.epoch == epoch
    clock.advance(0.2)
    assert s.connection_lost(a.member_id, "ps-0")          # the second, soon after: the process is gone
    assert s.members.get(a.member_id).state is MemberState.EXPIRED and s.epoch == epoch + 1
    # the other order works too
    assert not s.connection_lost(b.member_id, "ps-1")
    assert s.watch_closed(b.member_id, answered=False)
    assert not s.members.alive(Role.WORKER)


def test_connection_sightings_of_a_live_worker_do_not_end_it(clock):
    s = ChiefState(JobConfig(lease_seconds=3.0), clock)
    a = s.join_worker(LAYOUT)
    assert not s.watch_closed(a.member_id, answered=False)
    s.watch_opened(a.member_id)                            # it watched again: the break was a blip
    assert not s.connection_lost(a.member_id, "ps-0")
    s.heartbeat(a.member_id)                               # a heartbeat clears every sighting
    assert not s.watch_closed(a.member_id, answered=False)
    clock.advance(0.9)
    s.heartbeat(a.member_id)
    clock.advance(0.6)                                     # sightings more than a third of a lease apart
    assert not s.connection_lost(a.member_id, "ps-0")
    assert s.members.get(a.member_id).live
    clock.advance(1.01)                                    # a sighting alone cuts the lease to a third
    assert [m.member_id for m in s.tick()] == [a.member_id]
    ps, _ = s.join_ps("h:1")
    assert not s.connection_lost(ps.member_id, "worker-0")  # only workers are judged this way
    assert not s.connection_lost("worker-77", "ps-0")       # unknown: nothing to end


def test_a_worker_that_died_between_two_view_watches_is_ended_after_a_sixth_of_its_lease(clock):
    s = ChiefState(JobConfig(lease_seconds=3.0), clock)
    a = s.join_worker(LAYOUT)
    b = s.join_worker(LAYOUT)
    s.watch_opened(b.member_id)                            # b is alive: it watches the view
    assert not s.connection_lost(a.member_id, "ps-0")      # a has no watch open: dead, or about to re-open
    assert not s.connection_lost(b.member_id, "ps-0")
    clock.advance(0.4)
    assert s.tick() == []
    clock.advance(0.2)                                     # half a second (lease / 6) without a watch
    assert [m.member_id for m in s.tick()] == [a.member_id]
    assert s.members.get(b.member_id).live


def test_a_chief_that_stood_still_extends_every_lease_by_its_own_gap(clock):
    """Paused 10 s with a 1.5 s lease (issue 20): on waking, nobody is expired for the chief's own silence."""
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=1.5), clock)
    s.members.bridge_pauses_over(0.6)          # the ticker checks every 0.2 s
    ps = [s.join_ps(f"h:{i}")[0] for i in range(2)]
    w = s.join_worker(LAYOUT)
    for _ in range(5):                         # a healthy ticker: checks close together, leases renewed
        clock.advance(0.2)
        for m in (*ps, w):
            s.heartbeat(m.member_id)
        assert s.tick() == []
    epoch = s.epoch
    clock.advance(10.0)                        # SIGSTOP: no tick, no heartbeat read
    assert s.tick() == [] and s.epoch == epoch  # the waiting heartbeats come next, not a lost job
    assert all(s.members.get(m.member_id).live for m in (*ps, w)) and not s.lost
    assert s.members.pauses_bridged == 1
    for _ in range(9):                         # ps-1 really died meanwhile: it goes a lease after the wake
        clock.advance(0.2)
        s.heartbeat(ps[0].member_id)
        s.heartbeat(w.member_id)
        s.tick()
    assert [m.member_id for m in s.members.alive()] == [ps[0].member_id, w.member_id]


def test_without_a_pause_a_lapsed_lease_still_expires(clock):
    m = Membership(lease_seconds=1.5, clock=clock)
    m.bridge_pauses_over(0.6)
    a, b = m.join(Role.WORKER), m.join(Role.WORKER)
    for _ in range(10):                        # the chief runs on; b stopped heartbeating
        clock.advance(0.2)
        m.heartbeat(a.member_id)
        m.expire()
    assert a.live and not b.live
    clock.advance(0.5)                         # a gap under the threshold is ordinary jitter: no extension
    m.heartbeat(a.member_id)
    assert m.expire() == [] and m.pauses_bridged == 0


def test_a_backup_is_promoted_only_once_its_primary_said_its_copy_is_whole(clock):
    """Killing the primary before, during and after the backup's first copy (issue 20)."""
    def kill_primary(recovery, report):
        s = ChiefState(JobConfig(num_shards=2, lease_seconds=2.0, recovery=recovery), clock)
        p0, p1 = s.join_ps("h:1")[0], s.join_ps("h:2")[0]
        assert not any(r.backup_complete for r in s.view().routes)       # shoal status: "ps-1*"
        if report:
            s.heartbeat(p0.member_id, backups_complete=report(p0, p1))
        clock.advance(1.5)
        s.heartbeat(p1.member_id)
        clock.advance(1.0)
        assert [m.member_id for m in s.tick()] == [p0.member_id]
        return s, p1

    s, p1 = kill_primary("consistent", None)                             # before or during the copy
    assert s.stopped and "had not finished receiving its copy" in s.stopped and s.lost == [0]
    assert 0 not in s.routing and routes(s) == {1: (p1.member_id, "")}
    p2, shard = s.join_ps("h:3")                 # the supervisor restarts the dead server before the rollback
    assert shard == -1 and 0 not in s.routing    # the stopped job gives it nothing to restore and serve
    s, p1 = kill_primary("consistent", lambda p0, p1: {0: "ps-9", 1: p1.member_id})  # not its backup, not its shard
    assert s.stopped and s.lost == [0]
    s, p1 = kill_primary("fast", None)                                   # goes on with it, and says so
    assert not s.stopped and s.lost == [0] and s.routing[0] == p1.member_id
    s, p1 = kill_primary("consistent", lambda p0, p1: {0: p1.member_id})  # just after: promoted, nothing lost
    assert not s.stopped and s.lost == [] and s.routing == {0: p1.member_id, 1: p1.member_id}


def test_a_new_backup_starts_incomplete_until_its_primary_reports_it(clock):
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=2.0), clock)
    p0, p1 = s.join_ps("h:1")[0], s.join_ps("h:2")[0]
    e = s.epoch
    s.heartbeat(p0.member_id, backups_complete={0: p1.member_id})
    assert s.epoch == e + 1 and [r.backup_complete for r in s.view().routes] == [True, False]
    s.heartbeat(p0.member_id, backups_complete={0: p1.member_id})
    assert s.epoch == e + 1                                              # said again: no new view
    s.leave(p1.member_id)
    p2 = s.join_ps("h:3", member_id=p1.member_id)[0]                     # same id back, as a new backup
    assert [r.backup_complete for r in s.view().routes if r.shard == 0] == [False]
    assert ChiefState.from_dict(s.to_dict(), clock).complete == s.complete


def test_a_backup_its_primary_no_longer_reports_whole_is_not_promoted(clock):
    """nemesis --netns seed 519: the backup's copy was counted whole once, then had to be sent again."""
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=2.0, recovery="consistent"), clock)
    p0, p1 = s.join_ps("h:1")[0], s.join_ps("h:2")[0]
    s.heartbeat(p0.member_id, backups_complete={0: p1.member_id})
    assert [r.backup_complete for r in s.view().routes if r.shard == 0] == [True]
    e = s.epoch
    s.heartbeat(p0.member_id, backups_complete={})                       # p1's copy is being sent again
    assert s.epoch == e + 1 and [r.backup_complete for r in s.view().routes if r.shard == 0] == [False]
    s.heartbeat(p1.member_id, backups_complete={})                       # p1 is not shard 0's primary
    s.heartbeat(p0.member_id, backups_complete={0: p1.member_id})         # whole again: promotable again
    s.heartbeat(p1.member_id, backups_complete={})
    assert s.complete == {0: p1.member_id}
    s.heartbeat(p0.member_id, backups_complete={})
    clock.advance(1.5)
    s.heartbeat(p1.member_id)
    clock.advance(1.0)
    assert [m.member_id for m in s.tick()] == [p0.member_id]
    assert s.stopped and s.lost == [0] and 0 not in s.routing              # rolled back, not promoted
