"""The chief never touches tensors, so it never imports torch: every chief start (a ``shoal local``
job waits for it before starting anything else, a restarted chief keeps the job waiting) would
otherwise spend the seconds torch's import costs. Its TensorBoard events go through the
``tensorboard`` package and read back exactly like a ``SummaryWriter``'s."""
from __future__ import annotations

import subprocess
import sys

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shoal.state.checkpoint import CheckpointWriter, ShardState, load_latest
from shoal.state.layout import ModelLayout, TensorSpec


def _without_torch(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter, then fails it if torch got imported."""
    check = "\nimport sys\nassert 'torch' not in sys.modules, 'torch was imported'\nprint('no torch')\n"
    return subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True, timeout=120)


def test_the_chief_command_and_its_server_import_no_torch():
    r = _without_torch("import shoal.cli.main\nimport shoal.chief.server\nimport shoal.chief.tb_writer")
    assert r.returncode == 0 and "no torch" in r.stdout, r.stdout + r.stderr


def test_the_check_bites_when_torch_is_imported():
    r = _without_torch("import shoal.chief.server\nimport shoal.state.layout, torch")
    assert r.returncode != 0 and "torch was imported" in r.stderr


def test_a_chief_resuming_opens_and_validates_a_checkpoint_without_torch(tmp_path):
    layout = ModelLayout([TensorSpec("w", (3,))])
    pending = CheckpointWriter(tmp_path).begin(7)
    pending.write_shard(ShardState(0, 0, 3, torch.arange(3, dtype=torch.float32), "sgd",
                                   {"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
                                    "nesterov": 0.0}, {"state": {}, "param_groups": [{"params": [0]}]}, 5))
    pending.commit(layout, 1, {"tasks": None})
    assert load_latest(tmp_path).step == 7
    r = _without_torch(f"from shoal.state.checkpoint import load_latest\nfrom shoal.state.checkpoint_store import "
                       f"CheckpointWriter\nc = load_latest({str(tmp_path)!r})\nassert c.step == 7 and "
                       f"c.versions == {{0: 5}}, c\nCheckpointWriter({str(tmp_path)!r}).prune()")
    assert r.returncode == 0 and "no torch" in r.stdout, r.stdout + r.stderr


def _events(run_dir) -> tuple[dict, dict]:
    ea = EventAccumulator(str(run_dir))
    ea.Reload()
    scalars = {tag: [(e.step, e.wall_time, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    texts = {tag: [(e.step, e.wall_time, e.tensor_proto.SerializeToString()) for e in ea.Tensors(tag)]
             for tag in ea.Tags()["tensors"]}
    return scalars, texts


def test_the_chief_writes_the_events_a_summary_writer_writes(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from shoal.chief.tb_writer import EventWriter

    for name, writer in (("torch", SummaryWriter(log_dir=str(tmp_path / "torch"), flush_secs=5)),
                         ("chief", EventWriter(str(tmp_path / "chief"), flush_secs=5))):
        for step in (1, 2, 3):
            writer.add_scalar("cluster/live_workers", step * 2, step, walltime=1000.0 + step)
            writer.add_scalar("shards/version_0", 10.5 * step, step, walltime=1000.0 + step)
        writer.add_text("events", "ps-1 lease expired; failover of shard 0", 3, walltime=1003.5)
        writer.close()
        writer.close()                          # twice, as ChiefWatch.stop and the server's stop may
    ours, theirs = _events(tmp_path / "chief"), _events(tmp_path / "torch")
    assert ours == theirs
    assert ours[0]["cluster/live_workers"] == [(1, 1001.0, 2.0), (2, 1002.0, 4.0), (3, 1003.0, 6.0)]
    assert list(ours[1]) == ["events/text_summary"]


def test_an_unwritable_directory_is_an_os_error_as_with_a_summary_writer(tmp_path):
    from shoal.chief.tb_writer import EventWriter

    (tmp_path / "file").write_text("")
    try:
        EventWriter(str(tmp_path / "file" / "chief"))
    except OSError:
        pass
    else:
        raise AssertionError("no OSError for a log dir under a regular file")
