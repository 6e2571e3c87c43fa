"""Straggler detection from what the job waits on (chief/stragglers.py, ps/round_timing.py), fake clocks."""
import logging

import pytest

from shoal.chief.state import ChiefState
from shoal.chief.stragglers import HOLD, MIN_ROUNDS, MIN_STEPS, RoundBlame, StragglerDetector, StragglerPolicy
from shoal.chief.tasks import DatasetSpec
from shoal.settings.config import JobConfig
from shoal.errors import InvalidArgument
from shoal.state.layout import ModelLayout, TensorSpec
from shoal.members import Counters
from shoal.ps.round_timing import RoundTimer

LAYOUT = ModelLayout([TensorSpec("w", (4,), "float32")])


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def timed_rounds(times: dict[str, float], rounds: int) -> RoundTimer:
    """Sync rounds where each worker pushes ``times[w]`` seconds after the round opened."""
    clock = Clock()
    timer = RoundTimer(clock)
    for _ in range(rounds):
        start = clock.t
        for w, t in sorted(times.items(), key=lambda kv: kv[1]):
            clock.t = start + t
            timer.arrived(w)
        timer.closed()
    return timer


def blame_of(timer: RoundTimer, shard: int = 0) -> list[RoundBlame]:
    return [RoundBlame(shard, b.worker, b.rounds, b.last, b.ratio, b.waited_s) for b in timer.blame()]


def test_a_sync_round_timer_blames_the_worker_it_waited_for():
    (b,) = timed_rounds({"w0": 0.1, "w1": 0.3}, rounds=10).blame()
    assert (b.worker, b.rounds, b.last) == ("w1", 10, 10)
    assert b.ratio == pytest.approx(3.0) and b.waited_s == pytest.approx(2.0)


@pytest.mark.parametrize("workers", [2, 4])
def test_sync_flags_a_worker_three_times_slower_with_any_number_of_workers(workers):
    times = {f"w{i}": 0.1 + 0.001 * i for i in range(workers)}
    times["w1"] = 0.3
    d = StragglerDetector(StragglerPolicy(factor=2.0), sync=True)
    for w, t in times.items():
        d.own_time(w, t)
    d.rounds(blame_of(timed_rounds(times, rounds=MIN_ROUNDS)))
    busy = set(times)
    lines = [line for _ in range(HOLD) for _, line in d.observe(busy, {})]
    assert d.stragglers() == {"w1"}
    assert len(lines) == 1 and "x the others' median" in lines[0] and "8 of the last 8 sync rounds" in lines[0]


def test_sync_flags_nobody_when_equal_workers_settle_into_one_order():
    """With pushes overlapping backward, equally fast workers fall into a fixed order, one always last
    (and far behind the first, which had its wait already): its own time clears it."""
    d = StragglerDetector(StragglerPolicy(factor=2.0), sync=True)
    d.own_time("w0", 0.1)
    d.own_time("w1", 0.105)
    d.rounds(blame_of(timed_rounds({"w0": 0.02, "w1": 0.3}, rounds=MIN_ROUNDS * 2)))
    for _ in range(HOLD + 1):
        d.observe({"w0", "w1"}, {})
    assert d.stragglers() == set()


def test_sync_flags_nobody_the_rounds_do_not_wait_for():
    d = StragglerDetector(StragglerPolicy(factor=2.0), sync=True)
    d.own_time("w0", 0.1)
    d.own_time("w1", 0.3)
    d.rounds(blame_of(timed_rounds({"w0": 0.3, "w1": 0.1}, rounds=MIN_ROUNDS)))   # yet never the last
    for _ in range(HOLD + 1):
        d.observe({"w0", "w1"}, {})
    assert d.stragglers() == set()


def test_async_compares_a_worker_with_the_others_so_two_workers_suffice():
    d = StragglerDetector(StragglerPolicy(factor=2.0), sync=False)
    for _ in range(HOLD):
        d.observe({"a", "b"}, {"a": 0.1, "b": 0.3})
    assert d.stragglers() == {"b"}
    for _ in range(HOLD - 1):                     # fast again: cleared only once it stayed so
        d.observe({"a", "b"}, {"a": 0.1, "b": 0.12})
    d.observe({"a", "b"}, {"a": 0.1, "b": 0.31})  # a blip of slowness restarts the count
    for _ in range(HOLD - 1):
        d.observe({"a", "b"}, {"a": 0.1, "b": 0.12})
    assert d.stragglers() == {"b"}
    assert [(level, line) for level, line in d.observe({"a", "b"}, {"a": 0.1, "b": 0.12})] == \
        [(logging.INFO, "straggler b is no longer slow")]
    assert d.stragglers() == set()


def test_backup_excludes_the_straggler_from_sync_rounds_but_never_every_worker():
    d = StragglerDetector(StragglerPolicy(factor=2.0, action="backup"), sync=False)
    for _ in range(HOLD):
        d.observe({"a", "b"}, {"a": 0.1, "b": 0.3})
    assert d.excluded({"a", "b"}) == {"b"}
    assert d.excluded({"b"}) == set()
    for _ in range(HOLD + 1):
        d.observe({"a", "b"}, {"a": 0.1, "b": 0.1})     # its rounds no longer wait for it: it stays left out
    assert d.excluded({"a", "b"}) == {"b"}


def test_evict_asks_one_straggler_at_a_time_to_leave_and_never_the_last_worker():
    d = StragglerDetector(StragglerPolicy(factor=2.0, action="evict"), sync=False)
    lines = []
    for _ in range(HOLD):
        lines += [line for _, line in d.observe({"a", "b", "c"}, {"a": 0.1, "b": 0.4, "c": 0.5})]
    assert sum("asking straggler" in line for line in lines) == 1
    (asked,) = [w for w in "abc" if d.leave_reason(w)]
    assert "evicted as a straggler" in d.leave_reason(asked)
    d.forget(asked)                                   # it left
    assert not d.leave_reason(asked)
    d = StragglerDetector(StragglerPolicy(factor=2.0, action="evict"), sync=False)
    for _ in range(HOLD + 2):
        d.observe({"b"}, {"b": 0.4})
    assert not d.leave_reason("b")


def test_the_chief_state_publishes_excluded_workers_in_the_view_and_evicts_through_heartbeats():
    clock = Clock()
    s = ChiefState(JobConfig(mode="sync", num_shards=1), clock)
    s.straggling.policy = StragglerPolicy(factor=2.0, action="backup")
    a, b = s.join_worker(LAYOUT), s.join_worker(LAYOUT)
    ps, shard = s.join_ps("127.0.0.1:1")
    spec = DatasetSpec(size=400, batch_size=10, epochs=1, batches_per_task=1)
    for w in (a, b):
        s.take_tasks(w.member_id, spec, 1)
        s.heartbeat(w.member_id, Counters(steps=MIN_STEPS))     # judged only after MIN_STEPS steps
    timer = timed_rounds({a.member_id: 0.1, b.member_id: 0.35}, rounds=MIN_ROUNDS)
    s.round_blame(ps.member_id, blame_of(timer, shard))
    s.straggling.own_time(a.member_id, 0.1)
    s.straggling.own_time(b.member_id, 0.35)
    epoch = s.epoch
    for _ in range(HOLD):
        s.watch_stragglers()
    assert s.epoch > epoch and s.view().excluded == {b.member_id} and s.view().stragglers == {b.member_id}
    s.round_blame("someone-else", blame_of(timed_rounds({a.member_id: 0.4, b.member_id: 0.1}, MIN_ROUNDS), shard))
    assert s.straggling.stragglers() == {b.member_id}      # only a shard's primary speaks for its rounds


def test_a_bad_policy_is_one_line():
    with pytest.raises(InvalidArgument, match="factor must be > 1"):
        StragglerPolicy(factor=1.0)
    with pytest.raises(InvalidArgument, match="'kill' is not one of flag, backup, evict"):
        StragglerPolicy(action="kill")


def test_sync_judges_nobody_before_the_servers_timed_enough_rounds():
    d = StragglerDetector(StragglerPolicy(factor=2.0), sync=True)
    d.own_time("w0", 0.1)
    d.own_time("w1", 0.8)            # its first steps: slow for reasons of their own
    for _ in range(HOLD + 2):
        d.observe({"w0", "w1"}, {})
    assert d.stragglers() == set()
    d.rounds(blame_of(timed_rounds({"w0": 0.1, "w1": 0.8}, rounds=MIN_ROUNDS)))
    for _ in range(HOLD):
        d.observe({"w0", "w1"}, {})
    assert d.stragglers() == {"w1"}
