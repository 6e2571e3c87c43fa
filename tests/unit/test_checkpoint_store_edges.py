"""Checkpoint store edges found by mutation testing: pruning never trades a valid checkpoint for a corrupt
one, refusals without ``replace``, closed pending checkpoints, failure records, optimizer-state layout."""
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from shoal.state.checkpoint import load_latest, open_checkpoint
from shoal.state.checkpoint_failures import read_failure, record_failure
from shoal.state.checkpoint_store import (CheckpointWriter, ShardState, list_checkpoints, opt_state_from_flat,
                                          opt_state_to_flat)
from shoal.settings.config import OptimizerSpec, ParamGroupSpec
from shoal.errors import FailedPrecondition, InvalidArgument
from shoal.state.layout import ModelLayout, ShardPlan

LAYOUT = ModelLayout.from_module(torch.nn.Linear(2, 2))
N = LAYOUT.numel


def state(k: int = 0, start: int = 0, stop: int = N, fill: float = 0.0, **kw) -> ShardState:
    values = torch.arange(start, stop, dtype=torch.float32) + fill
    return ShardState(k, start, stop, values, "sgd", {"lr": 0.1}, {}, **kw)


def commit(writer: CheckpointWriter, step: int, fill: float = 0.0, replace: bool = False):
    pending = writer.begin(step, replace=replace)
    pending.write_shard(state(fill=fill))
    return pending.commit(LAYOUT, 1, {"step": step}, replace=replace)


def names(root) -> list[str]:
    return [p.name for p in list_checkpoints(root)]


def ck(step: int) -> str:
    return f"ckpt-{step:012d}"


def corrupt(path) -> None:
    shard = path / "shard-00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


# ---------------------------------------------------------------- pruning

def test_a_corrupt_newer_checkpoint_never_costs_a_valid_one(tmp_path):
    for step in (1, 2, 3):
        commit(CheckpointWriter(tmp_path, keep=2), step)
    corrupt(tmp_path / ck(3))
    commit(CheckpointWriter(tmp_path, keep=2), 4)
    # 4 and 2 are the two newest valid ones; the corrupt 3 is left alone and never counts
    assert names(tmp_path) == [ck(4), ck(3), ck(2)]
    (tmp_path / ck(4) / "manifest.json").unlink()
    assert load_latest(tmp_path).step == 2


def test_a_writer_counts_its_own_commits_as_valid_without_revalidating(tmp_path):
    checked = []

    def validate(path):
        checked.append(path.name)
        open_checkpoint(path)

    writer = CheckpointWriter(tmp_path, keep=2, validate=validate)
    for step in (1, 2, 3):
        commit(writer, step)
    assert names(tmp_path) == [ck(3), ck(2)] and checked == []


def test_default_keep_is_three_and_keep_must_be_positive(tmp_path):
    for step in (1, 2, 3, 4):
        commit(CheckpointWriter(tmp_path), step)
    assert names(tmp_path) == [ck(4), ck(3), ck(2)]
    with pytest.raises(InvalidArgument, match="keep must be >= 1"):
        CheckpointWriter(tmp_path, keep=0)
    CheckpointWriter(tmp_path, keep=1)


def test_prune_without_any_checkpoint_leaves_pending_writes_alone(tmp_path):
    writer = CheckpointWriter(tmp_path)
    pending = [writer.begin(0), writer.begin(1)]
    writer.prune()
    assert all(p.tmp.is_dir() for p in pending)


@pytest.mark.parametrize("removed", ["manifest", "directory"])
def test_prune_tolerates_an_old_checkpoint_removed_meanwhile(tmp_path, removed):
    for step in (1, 2):
        commit(CheckpointWriter(tmp_path, keep=2), step)

    def validate_while_another_pruner_runs(path):
        if removed == "manifest":
            (tmp_path / ck(1) / "manifest.json").unlink(missing_ok=True)
        else:
            shutil.rmtree(tmp_path / ck(1), ignore_errors=True)
        open_checkpoint(path)

    commit(CheckpointWriter(tmp_path, keep=2, validate=validate_while_another_pruner_runs), 3)
    assert names(tmp_path) == [ck(3), ck(2)] and not (tmp_path / ck(1)).exists()


def test_a_checkpoint_whose_manifest_does_not_parse_fully_is_invalid_not_fatal(tmp_path, caplog):
    bad = commit(CheckpointWriter(tmp_path), 1)
    manifest = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "created": "yesterday"}))   # ValueError on open
    with caplog.at_level(logging.WARNING, logger="shoal.state.checkpoint_store"):
        commit(CheckpointWriter(tmp_path, keep=2), 2)
    assert names(tmp_path) == [ck(2), ck(1)]
    assert ck(1) in caplog.text and "not valid" in caplog.text


@pytest.mark.parametrize("error", [ValueError("not a number"), PermissionError(13, "Permission denied")])
def test_a_validator_that_raises_value_error_marks_the_checkpoint_invalid_not_fatal(tmp_path, caplog, error):
    commit(CheckpointWriter(tmp_path), 1)

    def validate(path):
        if path.name == ck(1):
            raise error

    with caplog.at_level(logging.WARNING, logger="shoal.state.checkpoint_store"):
        commit(CheckpointWriter(tmp_path, keep=2, validate=validate), 2)
    assert names(tmp_path) == [ck(2), ck(1)]
    assert ck(1) in caplog.text and "not valid" in caplog.text


# ---------------------------------------------------------------- begin / commit / abort

def test_step_zero_is_a_step_and_negative_steps_are_refused(tmp_path):
    assert commit(CheckpointWriter(tmp_path), 0).name == ck(0)
    with pytest.raises(InvalidArgument, match="step must be >= 0"):
        CheckpointWriter(tmp_path).begin(-1)


def test_begin_creates_missing_parent_directories(tmp_path):
    root = tmp_path / "a" / "b" / "ckpts"
    assert commit(CheckpointWriter(root), 1) == root / ck(1)


def test_begin_refuses_an_existing_step_unless_replace(tmp_path):
    writer = CheckpointWriter(tmp_path)
    commit(writer, 5)
    with pytest.raises(FailedPrecondition, match="already exists"):
        writer.begin(5)
    writer.begin(5, replace=True).abort()


def test_commit_refuses_a_step_committed_meanwhile_and_moves_nothing_aside(tmp_path):
    writer = CheckpointWriter(tmp_path)
    first, second = writer.begin(5), writer.begin(5)
    first.write_shard(state(fill=1.0))
    second.write_shard(state(fill=2.0))
    first.commit(LAYOUT, 1, {})
    with pytest.raises(FailedPrecondition, match="already exists"):
        second.commit(LAYOUT, 1, {})
    second.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == [ck(5)]
    assert torch.equal(load_latest(tmp_path).flat_values(), state(fill=1.0).values)


def test_each_replacement_is_set_aside_under_the_next_number(tmp_path):
    writer = CheckpointWriter(tmp_path)
    for fill in (0.0, 1.0, 2.0, 3.0):
        commit(writer, 5, fill=fill, replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ck(5)] + [f"{ck(5)}.set-aside-{n}" for n in (0, 1, 2)]
    assert torch.equal(load_latest(tmp_path).flat_values(), state(fill=3.0).values)


@pytest.mark.parametrize("end", ["commit", "abort"])
def test_a_committed_or_aborted_checkpoint_takes_nothing_more(tmp_path, end):
    pending = CheckpointWriter(tmp_path).begin(1)
    pending.write_shard(state())
    if end == "commit":
        pending.commit(LAYOUT, 1, {})
    else:
        pending.abort()
        assert not pending.tmp.exists()
    for attempt in (lambda: pending.write_shard(state(k=1)), lambda: pending.commit(LAYOUT, 1, {}),
                    lambda: pending.add_entry({"shard": 1, "start": 0, "stop": 0, "file": "shard-00001.pt",
                                               "sha256": "", "bytes": 0, "version": 0})):
        with pytest.raises(FailedPrecondition, match="already committed or aborted"):
            attempt()
    assert names(tmp_path) == ([ck(1)] if end == "commit" else [])


def test_abort_after_the_temp_dir_was_cleaned_up_is_quiet(tmp_path):
    stale = CheckpointWriter(tmp_path).begin(3)
    commit(CheckpointWriter(tmp_path), 5)       # prunes temp dirs of steps up to 5
    assert not stale.tmp.exists()
    stale.abort()


def test_a_commit_removes_temp_dirs_of_its_own_and_older_steps_and_keeps_newer_ones(tmp_path):
    crashed = [CheckpointWriter(tmp_path).begin(step) for step in (4, 5, 6)]   # writers that died mid-write
    commit(CheckpointWriter(tmp_path), 5, replace=True)
    assert [p.tmp.exists() for p in crashed] == [False, False, True]


def test_a_leftover_temp_entry_that_cannot_be_removed_does_not_fail_the_commit(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / ".tmp-ckpt-1-stale").symlink_to(elsewhere, target_is_directory=True)   # rmtree refuses a link
    assert commit(CheckpointWriter(root), 2) == root / ck(2)
    assert load_latest(root).step == 2 and elsewhere.is_dir()


def test_meta_that_is_not_strict_json_is_refused_and_the_checkpoint_stays_pending(tmp_path):
    pending = CheckpointWriter(tmp_path).begin(1)
    pending.write_shard(state())
    with pytest.raises(InvalidArgument, match="not JSON-able"):
        pending.commit(LAYOUT, 1, {"loss": math.nan})       # NaN is not JSON: other readers would choke
    assert names(tmp_path) == []
    assert pending.commit(LAYOUT, 1, {"loss": 1.5}) == tmp_path / ck(1)
    assert json.loads((tmp_path / ck(1) / "manifest.json").read_text())["meta"] == {"loss": 1.5}


def test_a_bad_optimizer_is_refused_naming_the_shard(tmp_path):
    pending = CheckpointWriter(tmp_path).begin(1)
    with pytest.raises(InvalidArgument, match=r"^shard 0: .*nosuch"):
        pending.write_shard(ShardState(0, 0, N, torch.zeros(N), "nosuch", {"lr": 0.1}, {}))


def test_more_shards_than_elements_leave_empty_shards_that_save_and_load(tmp_path):
    plan = ShardPlan(N, N + 2)              # ShardPlan gives the last two shards no elements
    assert plan.ranges[-1][0] == plan.ranges[-1][1]
    pending = CheckpointWriter(tmp_path).begin(1)
    for k, (a, b) in enumerate(plan.ranges):
        pending.write_shard(state(k, a, b))
    pending.commit(LAYOUT, plan.num_shards, {})
    ckpt = load_latest(tmp_path)
    assert ckpt.num_shards == N + 2 and torch.equal(ckpt.flat_values(), torch.arange(N, dtype=torch.float32))


def test_a_shard_of_a_larger_tensor_saves_only_its_own_elements(tmp_path):
    big = torch.arange(1 << 18, dtype=torch.float32)        # 1 MiB of storage, the shard a view of 6 elements
    pending = CheckpointWriter(tmp_path).begin(1)
    pending.write_shard(ShardState(0, 0, N, big[10:10 + N], "sgd", {"lr": 0.1}, {}))
    assert pending.entry(0)["bytes"] < 64 * 1024
    pending.commit(LAYOUT, 1, {})
    assert torch.equal(load_latest(tmp_path).flat_values(), big[10:10 + N])


def test_add_entry_refuses_a_file_that_is_not_there(tmp_path):
    pending = CheckpointWriter(tmp_path).begin(1)
    entry = {"shard": 0, "start": 0, "stop": N, "file": "shard-00000.pt", "sha256": "0" * 64, "bytes": 1,
             "version": 0}
    with pytest.raises(InvalidArgument, match="has -1 bytes"):
        pending.add_entry(entry)


def test_messages_name_the_expected_counts(tmp_path):
    pending = CheckpointWriter(tmp_path).begin(1)
    with pytest.raises(InvalidArgument, match="with 3 elements"):
        pending.write_shard(ShardState(0, 2, 5, torch.zeros(2), "sgd", {"lr": 0.1}, {}))
    pending.write_shard(state(0, 0, 2))
    with pytest.raises(InvalidArgument, match=r"needs shards 0\.\.2: missing \[1, 2\]"):
        pending.commit(LAYOUT, 3, {})


@pytest.mark.parametrize("shard,start,stop", [(-1, 0, N), (0, -2, 1), (0, -1, 1)])
def test_a_negative_shard_or_start_is_refused(tmp_path, shard, start, stop):
    pending = CheckpointWriter(tmp_path).begin(1)
    with pytest.raises(InvalidArgument, match="bad range"):
        pending.write_shard(ShardState(shard, start, stop, torch.zeros(stop - start), "sgd", {"lr": 0.1}, {}))
    assert list(pending.tmp.iterdir()) == []


def test_a_shard_without_a_version_is_recorded_as_version_zero(tmp_path):
    pending = CheckpointWriter(tmp_path).begin(1)
    pending.write_shard(state())
    assert pending.entry(0)["version"] == 0
    pending.commit(LAYOUT, 1, {})
    assert load_latest(tmp_path).versions == {0: 0}


# ---------------------------------------------------------------- failure records

def test_failures_count_from_one_and_afresh_after_a_newer_success(tmp_path):
    commit(CheckpointWriter(tmp_path), 1)
    record_failure(tmp_path, 3, "disk full")
    assert read_failure(tmp_path) | {"at": 0} == {"step": 3, "error": "disk full", "at": 0, "failures": 1}
    record_failure(tmp_path, 4, "disk full")
    assert read_failure(tmp_path)["failures"] == 2
    commit(CheckpointWriter(tmp_path), 5)
    record_failure(tmp_path, 6, "again")
    assert read_failure(tmp_path)["failures"] == 1


def test_a_success_at_the_failed_step_counts_afresh_and_a_failure_after_it_counts_on(tmp_path):
    commit(CheckpointWriter(tmp_path), 3)
    record_failure(tmp_path, 5, "disk full")
    record_failure(tmp_path, 5, "disk full")
    commit(CheckpointWriter(tmp_path), 5)           # the retry of step 5 (the job's last) succeeded
    record_failure(tmp_path, 6, "again")
    assert (read_failure(tmp_path)["step"], read_failure(tmp_path)["failures"]) == (6, 1)
    record_failure(tmp_path, 6, "again")
    assert read_failure(tmp_path)["failures"] == 2
    tmp_path2 = tmp_path / "b"
    commit(CheckpointWriter(tmp_path2), 5)          # a success, then two failed attempts at its step
    record_failure(tmp_path2, 5, "refused")
    record_failure(tmp_path2, 5, "refused")
    assert read_failure(tmp_path2)["failures"] == 2
    (tmp_path2 / "failed.json").write_text('{"step": 5, "at": "noon", "failures": 4}')   # a hand-edited record
    record_failure(tmp_path2, 7, "refused")
    assert (read_failure(tmp_path2)["step"], read_failure(tmp_path2)["failures"]) == (7, 5)


@pytest.mark.parametrize("manifest", ["{not json", '{"step": 5}', '{"created": null}', "/proc/self/mem"])
def test_a_success_whose_manifest_cannot_be_read_does_not_stop_a_failure_being_counted(tmp_path, manifest):
    record_failure(tmp_path, 5, "disk full")
    path = commit(CheckpointWriter(tmp_path), 5) / "manifest.json"
    path.unlink()
    if manifest.startswith("/"):                   # a regular file whose read fails (EIO at offset 0)
        if not Path(manifest).is_file():
            pytest.skip(f"no {manifest} here")
        path.symlink_to(manifest)
    else:
        path.write_text(manifest)
    record_failure(tmp_path, 5, "disk full")       # which came first is unknown: the failures count on
    assert read_failure(tmp_path)["failures"] == 2


def test_a_failure_is_recorded_under_a_root_not_created_yet(tmp_path):
    root = tmp_path / "job" / "ckpts"              # the first checkpoint failed before anything was written
    record_failure(root, 3, "disk full")
    assert read_failure(root)["step"] == 3 and read_failure(root)["failures"] == 1


def test_recording_a_failure_where_nothing_can_be_written_is_a_warning(tmp_path, caplog):
    root = tmp_path / "a-file"
    root.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="shoal.state.checkpoint_failures"):
        record_failure(root, 3, "boom")
    assert "cannot note the failed checkpoint" in caplog.text and read_failure(root) is None


@pytest.mark.parametrize("text", ['["step", 3]', '{"step": "3"}', '{"error": "x"}', "{not json"])
def test_a_malformed_failure_record_reads_as_none(tmp_path, text):
    (tmp_path / "failed.json").write_text(text)
    assert read_failure(tmp_path) is None


# ---------------------------------------------------------------- optimizer state layout

def test_optimizer_state_of_more_than_one_parameter_is_refused():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    two_groups = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1).state_dict()
    with pytest.raises(InvalidArgument, match="exactly one"):
        opt_state_to_flat(two_groups)
    two_states = {"state": {0: {"step": 1.0}, 1: {"step": 1.0}}, "param_groups": [{"params": [0]}]}
    with pytest.raises(InvalidArgument, match="exactly one"):
        opt_state_to_flat(two_states)


def test_none_entries_are_dropped_and_the_rest_kept():
    sd = {"state": {0: {"momentum_buffer": None, "step": 3, "exp_avg": torch.ones(2)}},
          "param_groups": [{"params": [0]}]}
    tensors, scalars = opt_state_to_flat(sd)
    assert scalars == {"step": 3.0} and list(tensors) == ["exp_avg"]


def test_optimizer_tensors_of_different_lengths_are_refused():
    with pytest.raises(InvalidArgument, match="differ in length"):
        opt_state_from_flat("adam", {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(4)}, {"step": 1.0},
                            {"lr": 0.01})


def test_an_amsgrad_state_restores_an_amsgrad_optimizer():
    """``adam`` does not carry amsgrad as a hyper-parameter: the saved ``max_exp_avg_sq`` turns it on."""
    p = torch.nn.Parameter(torch.linspace(-1, 1, 4))
    opt = torch.optim.Adam([p], lr=0.1, amsgrad=True)
    for g in (torch.ones(4), -3 * torch.ones(4)):
        p.grad = g
        opt.step()
    tensors, scalars = opt_state_to_flat(opt.state_dict())
    assert "max_exp_avg_sq" in tensors
    restored = opt_state_from_flat("adam", tensors, scalars, {"lr": 0.1})
    assert restored["param_groups"][0]["amsgrad"] is True
    q = torch.nn.Parameter(p.detach().clone())
    fresh = torch.optim.Adam([q], lr=0.1)
    fresh.load_state_dict(restored)
    for o, x in ((opt, p), (fresh, q)):
        x.grad = torch.full((4,), 0.5)
        o.step()
    assert torch.equal(q, p)


def _stepped(opt_cls, **kw):
    p = torch.nn.Parameter(torch.linspace(-1, 1, 5))
    opt = opt_cls([p], **kw)
    p.grad = torch.ones(5)
    opt.step()
    return opt


@pytest.mark.parametrize("name,opt_cls,kw", [
    ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (OptimizerSpec("RMSprop", {}, (ParamGroupSpec({"lr": 0.01, "momentum": 0.5}, ((0, 5),)),)).to_json(),
     torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
])
def test_flat_state_attaches_to_the_parameter_torch_loads_it_into(name, opt_cls, kw):
    tensors, scalars = opt_state_to_flat(_stepped(opt_cls, **kw).state_dict())
    q = torch.nn.Parameter(torch.zeros(5))
    fresh = opt_cls([q], **kw)
    fresh.load_state_dict(opt_state_from_flat(name, tensors, scalars, {k: float(v) for k, v in kw.items()}
                                              if not name.startswith("{") else {}))
    assert set(fresh.state[q]) == set(tensors) | set(scalars)
    for key, t in tensors.items():
        assert torch.equal(fresh.state[q][key], t)
