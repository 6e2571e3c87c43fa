"""Coordinated checkpoints without sockets: shard freeze/thaw/export/restore, task-queue resume,
interval parsing, and the chief's coordinator driving real shards through the control servicer."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from shoal.chief.checkpointer import (CheckpointConfig, Checkpointer, CheckpointStatus, Interval, restore_tasks,
                                     resume)
from shoal.chief.state import ChiefState
from shoal.chief.tasks import DatasetSpec, TaskQueue
from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from shoal.state.layout import ModelLayout, ShardPlan, TensorSpec
from shoal.proto import shoal_pb2 as pb
from shoal.state.checkpoint import list_checkpoints, load_latest
from shoal.ps.checkpoint_servicer import ShardControlServicer
from shoal.ps.consistency import AsyncRule, SyncRule
from shoal.ps.ledger import BatchKey, Ledger, ledger_from_extra, ledger_to_extra
from shoal.ps.host import ShardHost
from shoal.ps.shard import Shard
from harness import FakeRpcError

SGD = OptimizerSpec("sgd", {"lr": 1.0})
ADAM = OptimizerSpec("adam", {"lr": 0.1})


def ones(v, n=4):
    return torch.full((n,), float(v))


def running(fn, *args):
    """Runs ``fn`` in a thread; returns the future."""
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return fut


# ---------------------------------------------------------------- Shard.freeze / thaw

def test_freeze_holds_pushes_until_thaw():
    s = Shard(0, torch.zeros(4), SGD, AsyncRule(), "fp")
    s.push("a", 0, ones(1))
    assert s.freeze(0) == 1                               # target below the version: held where it is
    late = running(s.push, "a", 1, ones(1))
    time.sleep(0.2)
    assert not late.done() and s.version == 1
    assert s.thaw() > 0.0
    assert late.result(timeout=5).accepted and s.version == 2
    assert s.thaw() == 0.0                                # not frozen: nothing to do


def test_freeze_waits_for_the_target_then_holds():
    s = Shard(0, torch.zeros(4), SGD, AsyncRule(), "fp")
    frozen = running(s.freeze, 2, 5.0)
    s.push("a", 0, ones(1))
    s.push("a", 1, ones(1))                               # reaches the target
    assert frozen.result(timeout=5) == 2
    third = running(s.push, "a", 2, ones(1))
    time.sleep(0.2)
    assert not third.done() and s.version == 2
    s.thaw()
    assert third.result(timeout=5).accepted and s.version == 3


def test_freeze_times_out_when_the_target_is_not_reached():
    s = Shard(0, torch.zeros(4), SGD, AsyncRule(), "fp")
    with pytest.raises(DeadlineExceeded, match="freezing at 3"):
        s.freeze(3, timeout_s=0.1)
    s.thaw()


def test_an_open_sync_round_stays_open_while_frozen():
    s = Shard(0, torch.zeros(4), SGD, SyncRule(), "fp")
    s.set_live_workers({"a", "b"})
    s.push("a", 0, ones(2))
    s.freeze(0)
    s.set_live_workers({"a"})                             # would close the round
    assert s.version == 0 and s.round_pending == 1
    s.thaw()
    assert s.version == 1 and torch.equal(s.values(), ones(-2))


def test_an_expired_hold_lets_updates_go_on(clock):
    s = Shard(0, torch.zeros(4), SGD, AsyncRule(), "fp", clock=clock)
    s.freeze(0, hold_s=5.0)
    clock.advance(6.0)                                    # the chief never thawed it
    assert s.push("a", 0, ones(1)).accepted and s.version == 1


# ---------------------------------------------------------------- export / restore

def test_export_and_restore_continue_identically(tmp_path):
    s = Shard(0, torch.arange(4, dtype=torch.float32), ADAM, AsyncRule(), "fp")
    for i in range(3):
        s.push("a", i, ones(i + 1), batch=BatchKey(0, 8 * i))
    state = s.export_state(start=10)
    assert (state.start, state.stop, state.version) == (10, 14, 3)
    assert state.extra["ledger"] == [[0, 0, 1], [0, 8, 1], [0, 16, 1]]
    assert state.extra["ledger_summary"] == [[0, 3, 1]]
    json.dumps(state.extra)
    s.push("a", 3, ones(9))                               # the copy does not follow the live shard
    assert state.version == 3 and not torch.equal(state.values, s.values())

    again = Shard.from_state(state, AsyncRule(), "fp")
    twin = Shard(0, torch.arange(4, dtype=torch.float32), ADAM, AsyncRule(), "fp")
    for i in range(3):
        twin.push("a", i, ones(i + 1))
    assert again.version == 3 and torch.equal(again.values(), twin.values())
    assert again.ledger.owner(BatchKey(0, 8)) is not None
    assert not again.push("b", 3, ones(1), batch=BatchKey(0, 8)).accepted     # already applied: dropped
    again.push("a", 3, ones(5))
    twin.push("a", 3, ones(5))
    assert torch.equal(again.values(), twin.values())    # Adam moments and step count came along


def test_a_resliced_ledger_keeps_only_batches_every_source_applied():
    a, b = Ledger(), Ledger()
    for start in (0, 8, 16):
        a.record(BatchKey(0, start), "k")
    for start in (0, 8):
        b.record(BatchKey(0, start), "k")
    b.record(BatchKey(0, 0), "k2")
    extra = {"resliced_from": [{"shard": 0, "start": 0, "stop": 5, "extra": ledger_to_extra(a)},
                               {"shard": 1, "start": 5, "stop": 9, "extra": ledger_to_extra(b)}]}
    merged = ledger_from_extra(extra)
    assert merged.starts(0) == {0: 1, 8: 1}
    assert ledger_from_extra({}).summary() == []


# ---------------------------------------------------------------- task queue

def test_restored_task_queue_requeues_tasks_in_flight_from_their_progress():
    q = TaskQueue()
    q.configure(DatasetSpec(size=64, batch_size=4, epochs=2, batches_per_task=2))
    a, b = q.take("w0", 1)[0], q.take("w1", 1)[0]
    q.complete("w0", a.task_id)
    q.progress("w1", b.task_id, b.start + 4)              # one of its two batches was pushed
    saved = json.loads(json.dumps(q.to_dict()))

    r = restore_tasks(saved)
    assert r.done_count == 1 and r.total == q.total and not r.held_by("w1")
    first = r.take("w9", 1)[0]
    assert (first.task_id, first.start, first.stop) == (b.task_id, b.start + 4, b.stop)
    r.complete("w9", first.task_id)
    while got := r.take("w9", 4):
        for t in got:
            r.complete("w9", t.task_id)
    assert r.finished and r.done_count == r.total and a.task_id not in {first.task_id}


# ---------------------------------------------------------------- settings

@pytest.mark.parametrize("text,steps,seconds", [("500", 500, 0.0), ("30s", 0, 30.0), (" 1.5S ", 0, 1.5),
                                                ("2m", 0, 120.0), ("1h", 0, 3600.0)])
def test_interval_parses_steps_or_times(text, steps, seconds):
    assert Interval.parse(text) == Interval(steps=steps, seconds=seconds)


@pytest.mark.parametrize("text", ["", "0", "-5", "5x", "s", "1.5", "0s", "nans", "infs"])
def test_a_bad_interval_is_an_error_quoting_it(text):
    with pytest.raises(InvalidArgument, match=f"--checkpoint-interval {text!r} is not"):
        Interval.parse(text)


def test_keep_must_be_positive():
    with pytest.raises(InvalidArgument, match="--keep-checkpoints must be >= 1, got 0"):
        CheckpointConfig("d", keep=0)


# ---------------------------------------------------------------- the coordinator, no sockets



class FakeContext:
    def abort(self, code, details):
        raise FakeRpcError(code, details)


class DirectClient:
    """A ShardControlClient that calls the servicer in-process (no sockets)."""

    def __init__(self, host: ShardHost, fail_write=lambda: False):
        self.host = host
        self.servicer = ShardControlServicer(host)
        self.fail_write = fail_write

    def version(self, shard, timeout_s=5.0):
        return self.host.get(shard).version

    def freeze(self, shard, target, timeout_s, hold_s):
        return self.servicer.Freeze(pb.FreezeRequest(shard=shard, target_version=target, timeout_seconds=timeout_s,
                                                     hold_seconds=hold_s), FakeContext()).version

    def write(self, shard, directory, version, start, stop, fingerprint, timeout_s):
        if self.fail_write():
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "disk on fire")
        r = self.servicer.WriteShard(pb.WriteShardRequest(shard=shard, directory=str(directory), version=version,
                                                          start=start, stop=stop, layout_fingerprint=fingerprint,
                                                          thaw=True), FakeContext())
        return {"shard": r.shard, "start": r.start, "stop": r.stop, "file": r.file, "sha256": r.sha256,
                "bytes": r.bytes, "version": r.version, "frozen_seconds": r.frozen_seconds}

    def thaw(self, shard, timeout_s=5.0):
        return self.servicer.Thaw(pb.ThawRequest(shard=shard), FakeContext()).frozen_seconds

    def close(self):
        pass


LAYOUT = ModelLayout([TensorSpec("w", (3, 2)), TensorSpec("b", (3,))])


class Job:
    """A chief state with two primaries and one worker, and the two shards behind them."""

    def __init__(self, tmp_path, interval=Interval(steps=2), mode="async", freeze_timeout_s=5.0):
        job = JobConfig(mode=mode, num_shards=2)
        self.state = ChiefState(job, time.monotonic)
        self.state.join_ps("ps:0")
        self.state.join_ps("ps:1")
        self.state.join_worker(LAYOUT)
        self.state.tasks.configure(DatasetSpec(size=32, batch_size=4))
        plan = ShardPlan(LAYOUT.numel, 2)
        self.hosts, self.shards = {}, []
        for k, (a, b) in enumerate(plan.ranges):
            host = ShardHost()
            host.assign(k, job)
            host.create(k, torch.arange(a, b, dtype=torch.float32), ADAM, LAYOUT.fingerprint)
            self.hosts[f"ps:{k}"] = host
            self.shards.append(host.get(k))
        self.failing: set[str] = set()
        self.state.checkpoints = CheckpointStatus()
        self.cp = Checkpointer(self.state, threading.Condition(), CheckpointConfig(str(tmp_path), interval, keep=2,
                                                                             freeze_timeout_s=freeze_timeout_s),
                               connect=lambda addr: DirectClient(self.hosts[addr], lambda: addr in self.failing))

    def push(self, k, n=1):
        for _ in range(n):
            s = self.shards[k]
            s.push("w", s.version, torch.ones(s.numel))


def test_a_shard_that_cannot_reach_the_cut_aborts_it_and_thaws_the_others(tmp_path, caplog):
    j = Job(tmp_path, freeze_timeout_s=0.2)
    j.push(0, 1)
    j.push(1, 3)
    assert j.cp.maybe_checkpoint() is None                # shard 0 would need 2 more updates; none come
    assert "shard 0 still at version 1" in caplog.text and "aborted" in caplog.text
    assert not list_checkpoints(tmp_path) and not list(tmp_path.glob(".tmp-ckpt-*"))
    assert j.shards[1].push("w", 3, torch.ones(j.shards[1].numel)).accepted   # thawed after the abort


def test_coordinator_brings_every_shard_to_one_version_and_commits(tmp_path):
    j = Job(tmp_path)
    j.push(0, 1)
    j.push(1, 3)
    pusher = threading.Timer(0.3, j.push, (0, 2))         # the lagging shard catches up while frozen
    pusher.start()
    path = j.cp.maybe_checkpoint()
    pusher.join()
    ckpt = load_latest(tmp_path)
    assert path == ckpt.path and ckpt.step == 3 and ckpt.versions == {0: 3, 1: 3}
    assert ckpt.meta["version"] == 3 and ckpt.meta["tasks"]["spec"]["size"] == 32 and ckpt.meta["held_ms"] >= 0
    assert j.cp.pauses and j.state.checkpoints.stats()["checkpoint_step"] == 3
    assert all(s.push("w", s.version, torch.ones(s.numel)).accepted for s in j.shards)   # thawed
    assert j.cp.maybe_checkpoint() is None                # 4 - 3 < 2 updates: not due


def test_a_shard_past_the_target_is_caught_up_with_in_a_second_round(tmp_path):
    j = Job(tmp_path, interval=Interval(steps=1))
    j.push(0, 2)
    j.push(1, 3)                                          # moved past the target after the versions were read
    pusher = threading.Timer(0.3, j.push, (0, 1))
    pusher.start()
    path = j.cp.checkpoint(list(j.state.view().routes), LAYOUT, top=2)
    pusher.join()
    assert path is not None and load_latest(tmp_path).versions == {0: 3, 1: 3}


def test_a_failed_write_aborts_thaws_and_tries_again_next_interval(tmp_path, caplog):
    j = Job(tmp_path)
    j.failing.add("ps:1")
    j.push(0, 2)
    j.push(1, 2)
    assert j.cp.maybe_checkpoint() is None
    assert "aborted (UNAVAILABLE: disk on fire); trying again at the next interval" in caplog.text
    assert j.state.checkpoints.stats()["checkpoints_failed"] == 1                # counted, shown in status
    assert "disk on fire" in j.state.checkpoints.stats()["checkpoint_error"]
    assert not list_checkpoints(tmp_path) and not list(tmp_path.glob(".tmp-ckpt-*"))
    assert all(s.push("w", s.version, torch.ones(s.numel)).accepted for s in j.shards)   # nobody stayed frozen
    j.failing.clear()
    assert j.cp.maybe_checkpoint() is None                # at 3: the next try is due at 2 + 2
    j.push(0)
    j.push(1)
    assert j.cp.maybe_checkpoint() is not None and load_latest(tmp_path).step == 4


def test_write_shard_refuses_a_directory_that_is_not_a_pending_checkpoint(tmp_path):
    j = Job(tmp_path)
    client = DirectClient(j.hosts["ps:0"])
    with pytest.raises(FakeRpcError) as err:
        client.write(0, tmp_path, 0, 0, j.shards[0].numel, LAYOUT.fingerprint, 5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temporary directory" in err.value.details()


def test_resuming_checks_the_first_workers_layout_by_name(tmp_path):
    j = Job(tmp_path, interval=Interval(steps=1))
    j.push(0)
    j.push(1)
    ckpt_path = j.cp.maybe_checkpoint()
    s = ChiefState(JobConfig(num_shards=3), time.monotonic)
    status = resume(s, CheckpointConfig(str(tmp_path)))
    assert status.restored_step == 1 and status.restore_path() == str(ckpt_path)
    assert s.tasks.spec == DatasetSpec(size=32, batch_size=4)
    other = ModelLayout([TensorSpec("w", (4, 2)), TensorSpec("b", (3,))])
    with pytest.raises(FailedPrecondition, match=r"w: expected \[3, 2\] float32, got \[4, 2\] float32"):
        s.join_worker(other)
    assert s.layout is None
    s.join_worker(LAYOUT)
    assert s.layout == LAYOUT


def test_no_planned_move_during_a_cut_and_a_cut_whose_primary_changed_is_not_committed(tmp_path, caplog):
    j = Job(tmp_path)
    j.push(0, 2)
    j.push(1, 2)
    seen = []
    client = j.cp._connect("ps:1")
    real_freeze = client.freeze

    def freeze_then_fail_over(shard, target, timeout_s, hold_s):
        seen.append(j.state.moves_held)
        j.state.routing[1] = "ps-9"          # a failover (not a planned move) between the freeze and the commit
        return real_freeze(shard, target, timeout_s, hold_s)

    client.freeze = freeze_then_fail_over
    j.cp._clients["ps:1"] = client
    assert j.cp.maybe_checkpoint() is None
    assert seen and all(n == 1 for n in seen) and j.state.moves_held == 0
    assert "changed primary during the cut" in caplog.text and not list_checkpoints(tmp_path)
