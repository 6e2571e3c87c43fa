"""The chief's journal appends what changed, not the whole state (issue 17), and stays crash-safe:
killed at random points (between writes, or inside one), reopened, it holds exactly the state of its
last completed write. Driven by a fake clock in steps of 0.25 s, so times compare exactly."""
import json
import random
import sqlite3

import pytest

from shoal.chief.journal import Journal, JournalError
from shoal.chief.state import ChiefState
from shoal.chief.tasks import DatasetSpec
from shoal.settings.config import JobConfig
from shoal.errors import ShoalError
from shoal.state.layout import ModelLayout, TensorSpec
from shoal.members import Counters, Role

LAYOUT = ModelLayout([TensorSpec("w", (4, 3))])
SPEC = DatasetSpec(size=400, batch_size=4, epochs=3, batches_per_task=2, seed=3)


def plain(d):
    return json.loads(json.dumps(d))


def save(journal, state, event="change"):
    """What the servicer's ``_save`` does."""
    journal.append(state.take_changes(), event, state.journal_snapshot)


def cluster(clock, workers):
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=3.0), clock)
    s.join_ps("h:1")
    s.join_ps("h:2")
    ws = [s.join_worker(LAYOUT).member_id for _ in range(workers)]
    for w in ws:
        s.take_tasks(w, SPEC if w == ws[0] else None, 1)
    return s, ws


@pytest.mark.parametrize("workers", [10, 300])
def test_a_heartbeat_change_appends_a_few_hundred_bytes_whatever_the_cluster_size(tmp_path, clock, workers):
    s, ws = cluster(clock, workers)
    j = Journal(tmp_path / "chief.db")
    save(j, s, "start")
    assert j.snapshots == 1                               # a process's first write is whole
    for i in range(20):
        clock.advance(0.25)
        s.heartbeat(ws[i % len(ws)], Counters(steps=i + 1, samples=4 * (i + 1)), step_seconds=0.5 + i)
        before = j._change_bytes
        save(j, s, "heartbeats")
        assert j._change_bytes - before < 600             # the whole state is ~100 bytes per worker
    assert j.snapshots == 1
    assert j.load() == plain(s.to_dict())


def test_changes_outgrowing_the_snapshot_compact_into_a_new_one(tmp_path, clock):
    s, ws = cluster(clock, 5)
    j = Journal(tmp_path / "chief.db", compact_bytes=0)
    save(j, s)
    for i in range(200):
        clock.advance(0.25)
        s.heartbeat(ws[i % 5], Counters(steps=i + 1))
        save(j, s)
    assert 2 <= j.snapshots < 40
    rows = sqlite3.connect(tmp_path / "chief.db").execute("SELECT count(*) FROM changes").fetchone()[0]
    assert rows < 200
    assert j.load() == plain(s.to_dict())


def test_a_task_queue_put_in_place_after_the_first_write_is_journaled_whole(tmp_path, clock):
    s, ws = cluster(clock, 3)
    j = Journal(tmp_path / "chief.db")
    save(j, s, "start")
    s.take_tasks(ws[0], None, 1)
    save(j, s)
    restored = type(s.tasks).from_dict(s.tasks.to_dict())     # as a checkpoint's queue on resume
    restored.release(ws[1])
    s.tasks = restored
    save(j, s)
    assert j.snapshots == 2
    assert Journal(tmp_path / "chief.db").load() == plain(s.to_dict())


def random_step(s, rng, clock, spec_sent):
    """One event of a random job: joins, heartbeats with progress, task hand-outs with done and dropped
    batches, metrics, leaves, lost leases, promotions."""
    live = [m.member_id for m in s.members.alive(Role.WORKER)]
    r = rng.random()
    clock.advance(rng.choice([0.25, 0.5, 1.0]))
    if r < 0.1 or not live:
        s.join_worker(LAYOUT)
    elif r < 0.15:
        s.join_ps(f"h:{rng.randint(1, 4)}")
    elif r < 0.45:
        w = rng.choice(live)
        held = s.tasks.held_by(w)
        progress = {t.task_id: rng.randint(t.start, t.stop) for t in held[:1]}
        s.heartbeat(w, Counters(steps=rng.randint(0, 99), samples=rng.randint(0, 999)), progress,
                    rng.choice([0.0, 0.5, 0.75]))
        for m in s.members.alive(Role.PS):
            s.heartbeat(m.member_id)
    elif r < 0.8:
        w = rng.choice(live)
        held = s.tasks.held_by(w)
        done = tuple(t.task_id for t in held if rng.random() < 0.7)
        dropped = tuple((t.epoch, t.start, t.start + SPEC.batch_size) for t in held[:1] if rng.random() < 0.1)
        s.take_tasks(w, None if spec_sent else SPEC, rng.randint(0, 2), done, dropped,
                     frozenset(t.task_id for t in held) if rng.random() < 0.8 else frozenset())
        return True
    elif r < 0.85:
        s.report(rng.choice(live), {"loss": rng.random()})
    elif r < 0.9:
        s.leave(rng.choice(live), Counters(steps=7))
    elif r < 0.95:
        clock.advance(3.25)                                # everyone silent for a lease: they expire
        for m in s.members.alive():
            if rng.random() < 0.8:
                s.heartbeat(m.member_id)
        s.tick()
    else:
        s.expire(rng.choice(live), "unreachable")
    return spec_sent


@pytest.mark.parametrize("seed", range(6))
def test_killed_at_random_points_it_reopens_with_the_state_of_its_last_write(tmp_path, clock, seed):
    rng = random.Random(seed)
    path = tmp_path / "chief.db"
    s = ChiefState(JobConfig(num_shards=2, lease_seconds=3.0, recovery="fast"), clock)
    j = Journal(path, compact_bytes=rng.choice([0, 3000, 1 << 20]))
    save(j, s, "start")
    written = plain(s.to_dict())
    spec_sent = False
    kills = torn = 0
    for step in range(400):
        try:
            spec_sent = random_step(s, rng, clock, spec_sent)
        except ShoalError:
            pass                                       # a refused call (as the servicer answers it)
        if rng.random() < 0.1:
            # killed inside this write: SQLite is interrupted after a random number of steps
            budget = [rng.randint(1, 400)]

            def interrupt():
                budget[0] -= 1
                return budget[0] <= 0
            j._db.set_progress_handler(interrupt, 1)
            try:
                save(j, s)
                written = plain(s.to_dict())
            except JournalError:
                torn += 1
            j._db.set_progress_handler(None, 1)
            kill = True
        else:
            save(j, s)
            written = plain(s.to_dict())
            kill = rng.random() < 0.08
        if kill:                                       # the chief dies; a new one opens the journal
            j.close()
            kills += 1
            j = Journal(path, compact_bytes=j.compact_bytes)
            loaded = j.load()
            assert loaded == written, f"seed {seed}, step {step}"
            s = ChiefState.from_dict(loaded, clock)
            spec_sent = s.tasks.spec is not None
    j.close()
    assert Journal(path).load() == written
    assert kills >= 5 and torn >= 1


def test_a_commit_interrupted_after_it_landed_counts_as_written(tmp_path, clock):
    """SQLite runs the progress handler once more after a COMMIT is done, and an interrupt there
    fails the statement although the transaction committed. The journal must not call that write
    failed: the caller would retry or give up on a state that is already on disk."""
    s, ws = cluster(clock, 3)
    j = Journal(tmp_path / "chief.db")
    save(j, s, "start")
    s.heartbeat(ws[0], Counters(steps=5))
    seen = [False]

    def interrupt_once_committed():
        if j._db.in_transaction:
            seen[0] = True
            return False
        return seen[0]
    j._db.set_progress_handler(interrupt_once_committed, 1)
    save(j, s, "heartbeat")                             # no JournalError: it landed
    j._db.set_progress_handler(None, 1)
    assert seen[0] and j.writes == 2 and not j._need_snapshot
    j.close()
    assert Journal(tmp_path / "chief.db").load() == plain(s.to_dict())
