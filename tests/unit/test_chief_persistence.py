"""The chief's state survives a JSON round trip, and its SQLite journal, driven by a fake clock."""
import json
import sqlite3

import pytest

from shoal.errors import InvalidArgument

from shoal.chief import idset
from shoal.chief.journal import Journal, JournalError
from shoal.chief.membership import Counters, MemberState, Membership, Role
from shoal.chief.state import ChiefState
from shoal.chief.tasks import DatasetSpec, TaskQueue
from shoal.settings.config import JobConfig
from shoal.state.layout import ModelLayout, TensorSpec

LAYOUT = ModelLayout([TensorSpec("w", (4, 3)), TensorSpec("b", (3,))])


def through_json(d):
    return json.loads(json.dumps(d))


def test_membership_round_trip_keeps_members_ids_and_remaining_leases(clock):
    m = Membership(lease_seconds=3.0, clock=clock)
    a, b = m.join(Role.WORKER, host="h1"), m.join(Role.WORKER)
    p = m.join(Role.PS, address="h:1")
    m.set_busy(a.member_id, True)
    m.heartbeat(a.member_id, Counters(5, 40, 100, 200))
    m.leave(b.member_id)
    clock.advance(1.0)
    d = through_json(m.to_dict())
    back = Membership.from_dict(d, clock)
    assert back.to_dict() == d
    assert [(x.member_id, x.state) for x in back.all()] == [(a.member_id, MemberState.ALIVE),
                                                            (b.member_id, MemberState.LEFT),
                                                            (p.member_id, MemberState.ALIVE)]
    assert back.get(a.member_id).counters == Counters(5, 40, 100, 200)
    assert back.join(Role.WORKER).member_id == "worker-2"       # ids go on, never reused
    clock.advance(2.5)                                           # leases were not renewed: 3.5 s > 3 s
    assert {x.member_id for x in back.expire()} == {a.member_id, p.member_id}


def test_fresh_leases_on_recovery_keep_live_members(clock):
    m = Membership(lease_seconds=3.0, clock=clock)
    a = m.join(Role.WORKER)
    gone = m.join(Role.WORKER)
    clock.advance(2.9)
    m.heartbeat(a.member_id)
    clock.advance(0.2)
    m.expire()                                                   # `gone` expired before the chief died
    d = m.to_dict()
    clock.advance(60.0)                                          # the chief was down for a minute
    back = Membership.from_dict(d, clock, fresh_leases=True)
    assert back.expire() == []
    assert back.get(gone.member_id).state is MemberState.EXPIRED
    clock.advance(2.9)
    assert back.heartbeat(a.member_id)


def make_queue():
    """A queue in the middle of a job, and the sample ranges already applied ``(epoch, start, stop)``."""
    q = TaskQueue()
    q.configure(DatasetSpec(size=100, batch_size=5, epochs=3, batches_per_task=2, seed=7))
    a = q.take("a", 3)
    b = q.take("b", 2)
    q.complete("a", a[0].task_id)
    q.progress("a", a[1].task_id, a[1].start + 5)               # one of two batches pushed
    q.requeue_batch("b", b[0].epoch, b[0].start, b[0].start + 5)  # a shard dropped b[0]'s first batch
    q.complete("b", b[0].task_id)
    q.release("a")                                               # a's unfinished tasks go back, a[1] resumed
    q.take("b", 9)                                               # into epoch 1
    held = q.held_by("b")[0]
    q.progress("b", held.task_id, held.start + 5)
    applied = [(a[0].epoch, a[0].start, a[0].stop), (a[1].epoch, a[1].start, a[1].start + 5),
               (b[0].epoch, b[0].start + 5, b[0].stop)]
    return q, applied


def test_task_queue_round_trip_keeps_every_field():
    q, _ = make_queue()
    d = through_json(q.to_dict())
    back = TaskQueue.from_dict(d)
    assert back.to_dict() == d
    assert vars(back).keys() == vars(q).keys()
    for name in vars(q):
        assert getattr(back, name) == getattr(q, name), name
    assert (back.total, back.done_count, back.depth, back.completed_epochs) == \
        (q.total, q.done_count, q.depth, q.completed_epochs)


def drain(q, member):
    out = []
    while not q.finished:
        got = q.take(member, 2)
        assert got, "tasks are held elsewhere"
        for t in got:
            q.complete(member, t.task_id)
        out += got
    return out


def test_restored_queue_hands_out_exactly_the_remaining_tasks():
    q, applied = make_queue()
    done_before = idset.decode(q.to_dict()["done"])
    held_b = q.held_by("b")
    back = TaskQueue.from_dict(through_json(q.to_dict()))
    assert back.held_by("b") == held_b                            # b keeps its tasks, attempts and all
    for t in held_b:
        back.complete("b", t.task_id)
    rest = drain(back, "c")
    ids = [t.task_id for t in held_b + rest]
    assert len(ids) == len(set(ids)) and not set(ids) & done_before   # none twice, none done before
    assert back.finished and len(done_before) + len(ids) == back.total
    covered = {e: [] for e in range(q.spec.epochs)}
    for e, start, stop in applied + [(t.epoch, t.start, t.stop) for t in held_b + rest]:
        covered[e] += range(start, stop)
    for e, samples in covered.items():
        assert sorted(samples) == list(range(q.spec.size)), f"epoch {e}"   # every sample exactly once


def test_restored_queue_gives_the_same_hand_outs_as_the_original():
    q, _ = make_queue()
    back = TaskQueue.from_dict(through_json(q.to_dict()))
    for t in q.held_by("b"):
        q.complete("b", t.task_id)
        back.complete("b", t.task_id)
    assert drain(back, "c") == drain(q, "c")


def make_state(clock):
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=2.0), clock)
    p0, _ = s.join_ps("h:1")
    p1, _ = s.join_ps("h:2")
    s.heartbeat(p0.member_id, backups_complete={0: p1.member_id})   # p1 holds a whole copy of shard 0
    w0, w1 = s.join_worker(LAYOUT), s.join_worker(LAYOUT)
    spec = DatasetSpec(size=64, batch_size=8, epochs=2, batches_per_task=2)
    got, _ = s.take_tasks(w0.member_id, spec, 2)
    s.take_tasks(w1.member_id, spec, 1)
    s.take_tasks(w0.member_id, None, 1, done=(got[0].task_id,))
    s.heartbeat(w1.member_id, Counters(3, 24, 10, 20), {s.tasks.held_by(w1.member_id)[0].task_id: 8}, 0.01)
    s.heartbeat(w0.member_id, Counters(5, 40, 10, 20), {}, 0.02)
    s.report(w0.member_id, {"loss": 0.5})
    return s, (p0, p1, w0, w1)


def test_chief_state_round_trip(clock):
    s, (_, _, w0, _) = make_state(clock)
    d = through_json(s.to_dict())
    back = ChiefState.from_dict(d, clock)
    assert back.to_dict() == d
    assert back.view() == s.view()
    assert back.secret == s.secret and back.layout == s.layout and back.totals() == s.totals()
    assert back.metric_sources == {"loss": w0.member_id}          # who reported it survives a restart


def test_a_journal_of_the_snapshot_only_format_still_loads_and_an_unknown_one_is_refused(clock):
    """Format 2 journals append changes after the snapshot; a chief of format 1 would read the
    snapshot alone, so the format says so. A format-1 journal (snapshot only) still loads."""
    from shoal.chief.state import STATE_FORMAT
    s, _ = make_state(clock)
    d = through_json(s.to_dict())
    assert d["format"] == STATE_FORMAT == 3
    back = ChiefState.from_dict({**d, "format": 1}, clock)
    assert back.view() == s.view()
    with pytest.raises(InvalidArgument, match="chief state has format 4, this chief reads 1, 2, 3"):
        ChiefState.from_dict({**d, "format": 4}, clock)


def test_recovery_bumps_the_epoch_renews_leases_and_keeps_identities(clock):
    s, (p0, p1, w0, w1) = make_state(clock)
    d = through_json(s.to_dict())
    clock.advance(30.0)
    back = ChiefState.from_dict(d, clock, recover=True)
    assert back.epoch > s.epoch                                   # clients ignore views that are not newer
    assert back.tick() == []                                      # nobody expires for the chief's downtime
    assert back.heartbeat(w0.member_id) and back.heartbeat(p1.member_id)
    assert back.join_ps("h:2", member_id=p1.member_id) == (back.members.get(p1.member_id), 1)  # same shard
    t = back.tasks.held_by(w1.member_id)[0]
    assert back.sign(w1.member_id, t) == s.sign(w1.member_id, t)  # tokens handed out before still verify
    clock.advance(1.5)
    assert back.heartbeat(w0.member_id) and back.heartbeat(p1.member_id)
    clock.advance(1.0)
    gone = {m.member_id for m in back.tick()}                     # those that did not come back expire as usual
    assert gone == {p0.member_id, w1.member_id}
    assert back.tasks.held_by(w1.member_id) == []
    assert back.routing == {0: p1.member_id, 1: p1.member_id}    # p0's shard went to its backup, p1
    assert back.backups == {}                                     # and nobody is left to back them up


# ---------------------------------------------------------------- journal


def test_journal_write_load_and_reopen(tmp_path):
    path = tmp_path / "chief.db"
    j = Journal(path, keep_events=150)
    assert j.load() is None
    assert j._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    for i in range(250):
        j.write({"format": 1, "n": i}, f"event {i}")
    assert j.load() == {"format": 1, "n": 249}
    j.close()
    again = Journal(path, keep_events=150)
    assert again.load() == {"format": 1, "n": 249}
    events = again.events(1000)
    assert 150 <= len(events) < 250 and events[-1][1] == "event 249"   # bounded, newest kept
    again.close()


def test_corrupt_journal_is_refused_naming_the_file_unless_fresh(tmp_path):
    path = tmp_path / "chief.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(JournalError, match=f"chief journal {path} is unreadable or corrupt.*--fresh"):
        Journal(path)
    j = Journal(path, fresh=True)
    assert j.load() is None and (tmp_path / "chief.db.bak").exists()
    j.close()


def test_unreadable_snapshot_is_refused(tmp_path):
    path = tmp_path / "chief.db"
    Journal(path).close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO snapshot VALUES (1, 0, 1, '{not json')")
    db.commit()
    db.close()
    with pytest.raises(JournalError, match="unreadable or corrupt"):
        Journal(path).load()


def test_shoal_chief_refuses_a_corrupt_journal_with_one_line(tmp_path, capsys):
    from shoal.cli import main
    from shoal.errors import EXIT_REFUSED

    path = tmp_path / "chief.db"
    path.write_bytes(b"\x00garbage" * 512)
    assert main(["chief", "--bind", "127.0.0.1:0", "--journal", str(path)]) == EXIT_REFUSED   # never restarted
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"shoal chief: error: chief journal {path} is unreadable or corrupt")


def test_counters_to_dict_names_every_field():
    """Counters.to_dict is written out by hand for speed: a field added later must not be dropped
    from the journal."""
    import dataclasses
    c = Counters(steps=1, samples=2, bytes_pushed=3, bytes_pulled=4)
    assert c.to_dict() == dataclasses.asdict(c)
    assert sorted(c.to_dict()) == sorted(f.name for f in dataclasses.fields(Counters))
