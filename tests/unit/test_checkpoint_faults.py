"""Checkpoints under faults: corrupt or partial checkpoints in the directory, pruning around
them, a disk that fills up or turns read-only mid-write, a final checkpoint that fails once."""
from __future__ import annotations

import errno

import pytest
import torch
from test_checkpoint import SGD, Trained, _flip, save
from test_checkpoint_cut import Job

from shoal.state.checkpoint import list_checkpoints, load_latest, open_checkpoint
from shoal.state.checkpoint_store import CheckpointWriter, ShardState, sha256_file
from shoal.dataset import DatasetSpec
from shoal.chief.checkpointer import Interval
from shoal.errors import FailedPrecondition
from shoal.state.layout import ModelLayout, TensorSpec


def every(steps: int) -> Interval:
    return Interval(steps=steps)


def names(root) -> list[str]:
    return [p.name for p in list_checkpoints(root)]


def finish_tasks(j: Job) -> None:
    worker = j.state.members.alive()[-1].member_id
    held: list[int] = []
    while not j.state.tasks.finished:
        tasks, _ = j.state.take_tasks(worker, DatasetSpec(size=32, batch_size=4), 4, done=tuple(held))
        held = [t.task_id for t in tasks]


# ---------------------------------------------------------------- a corrupt checkpoint at the step being written

def test_a_corrupt_checkpoint_at_the_cut_step_is_moved_aside_and_the_cut_is_written(tmp_path, caplog):
    old = Job(tmp_path, interval=every(2))
    old.push(0, 2)
    old.push(1, 2)
    bad = old.cp.maybe_checkpoint()
    _flip(bad / "shard-00001.pt")                         # the newest checkpoint is damaged
    assert load_latest(tmp_path) is None

    j = Job(tmp_path, interval=every(2))         # the job that resumed past it reaches step 2 again
    j.push(0, 2)
    j.push(1, 2)
    path = j.cp.maybe_checkpoint()
    assert path == bad and "skipping this step" not in caplog.text
    ckpt = open_checkpoint(path)                          # valid, and it is this job's state
    assert ckpt.step == 2 and torch.equal(ckpt.flat_values()[:j.shards[0].numel], j.shards[0].export_state(0).values)
    aside = sorted(p.name for p in tmp_path.glob("ckpt-000000000002.set-aside-*"))
    assert aside == ["ckpt-000000000002.set-aside-0"] and "moved" in caplog.text


def test_a_partial_checkpoint_at_the_final_step_does_not_stop_the_final_checkpoint(tmp_path):
    (tmp_path / "ckpt-000000000003").mkdir(parents=True)  # a crash left a directory without its manifest
    (tmp_path / "ckpt-000000000003" / "shard-00000.pt").write_bytes(b"half a file")
    j = Job(tmp_path, interval=every(100))
    j.push(0, 3)
    j.push(1, 3)
    finish_tasks(j)
    path = j.cp.maybe_checkpoint()                        # every task done: the final checkpoint is due
    assert path is not None and open_checkpoint(path).step == 3 and load_latest(tmp_path).step == 3


def test_a_failed_final_checkpoint_is_tried_again_until_it_is_written(tmp_path, caplog):
    j = Job(tmp_path, interval=every(100))
    j.push(0, 3)
    j.push(1, 3)
    finish_tasks(j)
    j.cp.RETRY_FINAL_S = 0.0
    j.failing.add("ps:1")
    assert j.cp.maybe_checkpoint() is None and "aborted" in caplog.text
    j.failing.clear()
    path = j.cp.maybe_checkpoint()                        # no update since: the final state is still unsaved
    assert path is not None and load_latest(tmp_path).step == 3
    assert j.cp.maybe_checkpoint() is None                # and once it is saved, nothing more is due


# ---------------------------------------------------------------- pruning

def test_pruning_never_deletes_a_valid_checkpoint_in_favour_of_corrupt_ones(tmp_path, caplog):
    t = Trained(SGD, 2, steps=1)
    for step in (10, 11, 12):
        _flip(save(tmp_path, t, step, keep=3) / "shard-00000.pt")   # every checkpoint corrupt
    assert load_latest(tmp_path) is None                  # so the job starts over, from step 0
    save(tmp_path, t, 1, keep=3)
    save(tmp_path, t, 2, keep=3)
    assert "ckpt-000000000001" in names(tmp_path)         # the older valid one is kept over the corrupt ones
    save(tmp_path, t, 3, keep=3)
    save(tmp_path, t, 4, keep=3)                          # three valid ones newer than 1: only now 1 goes
    assert names(tmp_path) == ["ckpt-000000000012", "ckpt-000000000011", "ckpt-000000000010",
                               "ckpt-000000000004", "ckpt-000000000003", "ckpt-000000000002"]
    assert load_latest(tmp_path).step == 4


def test_pruning_keeps_a_corrupt_checkpoint_newer_than_the_valid_ones_it_keeps(tmp_path):
    t = Trained(SGD, 1, steps=1)
    for step in (1, 2, 3):
        save(tmp_path, t, step, keep=3)
    _flip(tmp_path / "ckpt-000000000003" / "shard-00000.pt")
    w = CheckpointWriter(tmp_path, keep=2)
    w.prune()
    # newest valid: 2 and 1; the corrupt 3 is newer than both and is left for a person to look at
    assert names(tmp_path) == ["ckpt-000000000003", "ckpt-000000000002", "ckpt-000000000001"]


def test_pruning_validates_each_directory_once(tmp_path):
    t = Trained(SGD, 1, steps=1)
    save(tmp_path, t, 1, keep=3)
    seen: list[str] = []
    w = CheckpointWriter(tmp_path, keep=3, validate=lambda p: seen.append(p.name))
    for step in (2, 3, 4):
        pending = w.begin(step)
        for s in t.states():
            pending.write_shard(s)
        pending.commit(t.layout, 1, {})
    assert seen == ["ckpt-000000000001"] and names(tmp_path)[-1] == "ckpt-000000000002"


# ---------------------------------------------------------------- the checksum covers the whole file

def test_a_flip_past_the_first_read_chunk_is_caught(tmp_path):
    n = 400_000                                           # 1.6 MB of values: more than one 1 MiB read
    state = ShardState(0, 0, n, torch.zeros(n), "sgd", {"lr": 0.1}, {"state": {}, "param_groups": [
        {"params": [0], "lr": 0.1}]}, version=1)
    w = CheckpointWriter(tmp_path, keep=1)
    pending = w.begin(1)
    pending.write_shard(state)
    path = pending.commit(ModelLayout([TensorSpec("w", (n,))]), 1, {})
    file = path / "shard-00000.pt"
    assert file.stat().st_size > (1 << 20) + 4096
    before = sha256_file(file)
    data = bytearray(file.read_bytes())
    data[(1 << 20) + 4096] ^= 0x01                        # one bit, well past the first chunk
    file.write_bytes(bytes(data))
    assert sha256_file(file) != before
    with pytest.raises(FailedPrecondition, match="sha256"):
        open_checkpoint(path)


# ---------------------------------------------------------------- the disk fills up or turns read-only

@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_a_disk_fault_mid_write_aborts_the_checkpoint_and_the_job_goes_on(tmp_path, monkeypatch, caplog, err):
    j = Job(tmp_path)
    j.push(0, 2)
    j.push(1, 2)
    first = j.cp.maybe_checkpoint()
    assert first is not None

    real = torch.save
    calls = {"n": 0}

    def fill_up(obj, f):                                   # the second shard file hits the fault half-written
        calls["n"] += 1
        if calls["n"] == 2:
            f.write(b"\0" * 100)
            raise OSError(err, "injected: " + errno.errorcode[err])
        return real(obj, f)

    monkeypatch.setattr(torch, "save", fill_up)
    j.push(0, 2)
    j.push(1, 2)
    assert j.cp.maybe_checkpoint() is None
    assert "checkpoint at step 4 aborted" in caplog.text and errno.errorcode[err] in caplog.text
    assert names(tmp_path) == [first.name] and not list(tmp_path.glob(".tmp-ckpt-*"))
    assert load_latest(tmp_path).step == 2                # the partial one is never taken as valid
    assert all(s.push("w", s.version, torch.ones(s.numel)).accepted for s in j.shards)   # training goes on
    monkeypatch.setattr(torch, "save", real)        # the disk has room again: the next one is written
    j.push(0, 1)
    j.push(1, 1)
    assert j.cp.maybe_checkpoint() is not None and load_latest(tmp_path).step == 6


def test_the_final_checkpoint_cuts_each_shard_where_it_stands_when_their_versions_differ(tmp_path):
    """Found by bench/nemesis.py (seed 15): a shard one update behind the other at the end of the job
    (a push that one shard applied and the other lost) made every final checkpoint wait for an update
    that never came, and the job ended without its final state saved."""
    j = Job(tmp_path, interval=every(100), freeze_timeout_s=0.3)
    j.push(0, 3)
    j.push(1, 4)
    finish_tasks(j)
    path = j.cp.maybe_checkpoint()
    assert path is not None
    ckpt = open_checkpoint(path)
    assert ckpt.step == 4 and ckpt.versions == {0: 3, 1: 4}
    assert torch.equal(ckpt.flat_values(), torch.cat([s.export_state(0).values for s in j.shards]))
