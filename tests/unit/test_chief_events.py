"""The chief's watcher: which changes between two snapshots are events worth marking."""
from __future__ import annotations

import dataclasses

from shoal.observe.alerts import Alert
from shoal.chief.telemetry import JobEvents, RefusedPushes, Snapshot

BASE = Snapshot(wall=0.0, view_epoch=5, live_workers=2, live_ps=2, queue_depth=3, tasks_done=4, tasks_total=20,
                completed_epochs=0, epochs=2, samples=100, primaries={0: "ps-0", 1: "ps-1"},
                addresses={0: "h:1", 1: "h:2"}, expired=frozenset(), checkpoints=0, checkpoint_step=0,
                stragglers={"worker-0": (False, 10, 0.1), "worker-1": (False, 10, 0.1)})


def test_first_snapshot_is_no_event_and_a_quiet_one_neither():
    ev = JobEvents()
    assert ev.observe(BASE) == []
    assert ev.observe(dataclasses.replace(BASE, tasks_done=6, samples=300)) == []


def test_failover_expiry_checkpoint_view_change_and_straggler():
    ev = JobEvents()
    ev.observe(BASE)
    later = dataclasses.replace(BASE, view_epoch=7, primaries={0: "ps-1", 1: "ps-1"},
                                expired=frozenset({("ps-0", "ps")}), checkpoints=1, checkpoint_step=500,
                                stragglers={"worker-0": (False, 30, 0.1), "worker-1": (True, 12, 0.6)})
    got = {e.kind: e for e in ev.observe(later)}
    assert set(got) == {"view_change", "failover", "lease_expired", "checkpoint", "worker_behind"}
    assert got["failover"].text == "shard 0: primary ps-0 -> ps-1"
    assert got["lease_expired"].text == "ps ps-0 dropped without leaving"
    assert got["checkpoint"].value == 500
    assert got["worker_behind"].member == "worker-1" and got["worker_behind"].value == 12
    again = ev.observe(dataclasses.replace(later, samples=999))
    assert again == []          # each occurrence once


def test_a_shard_refusing_a_workers_pushes_alerts_once_per_occurrence():
    r = RefusedPushes()
    assert r.observe({0: {}, 1: {}}, {0: 10, 1: 10}) == []
    got = r.observe({0: {"worker-1": 3}, 1: {}}, {0: 12, 1: 12})
    assert [(e.kind, e.member, e.value) for e in got] == [("pushes_refused", "worker-1", 12)]
    assert "shard 0" in got[0].text and "3 so far" in got[0].text
    assert "NaN/Inf" in Alert("pushes_refused", "worker-1", 12, 3.0).message()    # every kind has a message
    assert r.observe({0: {"worker-1": 9}}, {0: 13}) == []           # still refusing: the same occurrence
    assert r.observe({0: {"worker-1": 9}}, {0: 20}) == []           # quiet: re-armed
    again = r.observe({0: {"worker-1": 10}, 1: {"worker-0": 1}}, {0: 30, 1: 30})
    assert [(e.member, e.text.split()[1]) for e in again] == [("worker-1", "0"), ("worker-0", "1")]
    assert r.observe({}, {}) == []                                   # a primary that did not answer: nothing
    assert r.observe({0: {"worker-1": 4}}, {0: 31}) == []            # a promoted backup counts from 0 again
    assert [e.value for e in r.observe({0: {"worker-1": 5}}, {0: 32})] == [32]   # and its refusals alert


def test_a_worker_lost_without_leaving_is_one_alert_line(caplog):
    import threading

    from shoal.chief.state import ChiefState
    from shoal.chief.telemetry import ChiefWatch
    from shoal.settings.config import JobConfig
    from shoal.state.layout import ModelLayout, TensorSpec

    now = [0.0]
    state = ChiefState(JobConfig(lease_seconds=1.0), lambda: now[0])
    a = state.join_worker(ModelLayout([TensorSpec("w", (4,), "float32")]))
    state.join_worker(ModelLayout([TensorSpec("w", (4,), "float32")]))
    reported = {}
    watch = ChiefWatch(state, threading.Lock(), report=lambda member, values: reported.update(values))
    try:
        watch.poll()
        now[0] = 5.0
        state.tick()                 # both leases ran out: neither left
        with caplog.at_level("WARNING", logger="shoal.chief.telemetry"):
            watch.poll()
            watch.poll()
        lines = [r.getMessage() for r in caplog.records if "alert:" in r.getMessage()]
        assert len(lines) == 2 and all("dropped without leaving" in line for line in lines)
        assert f"alert/worker_lost/{a.member_id}" in reported
    finally:
        watch.stop()
