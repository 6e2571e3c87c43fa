"""Checkpoints through in-process clusters: consistent cuts while training, resume with another
number of shards, fallback past a corrupt checkpoint, a refused layout, and the CLI surface."""
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from shoal import cli
from shoal.errors import Refused
from shoal.chief.checkpointer import CheckpointConfig, Interval, restore_tasks
from shoal.settings.config import JobConfig
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.state.checkpoint import export_state_dict, list_checkpoints, load_latest, open_checkpoint
from shoal.net.rpc import open_channel
from harness import InProcessCluster, run_threads, wait_until
from shoal.worker import Trainer

SIZE, BATCH, EPOCHS = 256, 16, 3
BATCHES = SIZE // BATCH * EPOCHS


def mlp(seed=0, hidden=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SIZE, 8, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def train(trainer, model, max_steps=None, delay_s=0.0, until=None):
    """``until``: stops early once it returns true (checked after each step)."""
    x, y = data()
    for xb, yb in trainer.batches((x, y), batch_size=BATCH, epochs=EPOCHS):
        trainer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        time.sleep(delay_s)
        trainer.step(samples=len(xb))
        if max_steps is not None and trainer.step_count >= max_steps:
            break
        if until is not None and until():
            break


def cluster(num_ps, root, mode="sync"):
    cfg = CheckpointConfig(str(root), Interval(steps=4), keep=3, poll_s=0.05)
    return InProcessCluster(num_ps, JobConfig(mode=mode, num_shards=num_ps), checkpoint=cfg)


def job_stats(c):
    ch = open_channel(c.chief_address)
    try:
        return pb_grpc.ChiefStub(ch).GetJobStats(pb.Empty(), timeout=5, wait_for_ready=True)  # a chief just restarted
    finally:
        ch.close()


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Checkpoints of a sync job on 2 shards whose two workers stopped part way through.

    The workers train until two checkpoints are committed, not for a fixed number of steps: a
    checkpoint's fsyncs can outlast many steps on a slow disk, and a checkpoint due after the last
    step may not start before the cluster stops. At most 20 of the job's 24 sync rounds, so work
    is left for the resume test."""
    root = tmp_path_factory.mktemp("ckpts")
    c = cluster(2, root)
    try:
        models = [mlp(0), mlp(1)]
        trainers = [Trainer(m, chief=c.chief_address, optimizer="adam", lr=0.02) for m in models]
        def two_taken():
            return c.chief.checkpointer.status.written >= 2
        def part(t, m):
            train(t, m, max_steps=BATCHES // 2 - 4, delay_s=0.03, until=two_taken)
            wait_until(two_taken, timeout_s=60, what="two committed checkpoints")
            t.close()        # leave at once: a sync round must not wait for a worker that stopped stepping
        run_threads(*[lambda t=t, m=m: part(t, m) for t, m in zip(trainers, models)])
        pauses = list(c.chief.checkpointer.pauses)
    finally:
        c.stop()
    return root, pauses


def test_checkpoints_are_taken_while_training_with_short_pauses(interrupted):
    root, pauses = interrupted
    found = list_checkpoints(root)
    assert 2 <= len(found) <= 3                            # --keep-checkpoints 3 prunes the oldest
    ckpt = load_latest(root)
    assert ckpt.num_shards == 2 and set(ckpt.versions.values()) == {ckpt.step}     # one version everywhere
    assert 0 < ckpt.meta["tasks_done"] < ckpt.meta["tasks_total"]
    assert pauses and max(pauses) < 2.0


def test_resume_on_three_shards_restores_weights_and_skips_done_work(interrupted, tmp_path):
    root = tmp_path / "ckpts"
    shutil.copytree(interrupted[0], root)
    ckpt = load_latest(root)
    c = cluster(3, root)
    try:
        stats = job_stats(c)
        assert stats.restored_step == ckpt.step and stats.restored_from == str(ckpt.path)
        # tasks in flight at the cut whose batches were all pushed count as done on resume
        restored = restore_tasks(ckpt.meta["tasks"])
        assert ckpt.meta["tasks_done"] <= stats.tasks_done == restored.done_count < stats.tasks_total
        model = mlp(7)                                     # its own init is ignored: the shards are restored
        t = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.02)
        assert torch.equal(weights(model), ckpt.flat_values())
        assert t.versions == {0: ckpt.step, 1: ckpt.step, 2: ckpt.step}
        train(t, model)
        t.close()
        stats = job_stats(c)
        assert stats.tasks_done == stats.tasks_total
        # task progress reaches the chief with heartbeats, so batches the cut holds may be trained again
        # (their pushes are refused as duplicates, as the ledger check below shows): at most the
        # unfinished tasks of the two workers, four batches each
        assert 0 < t.step_count <= BATCHES - ckpt.meta["tasks_done"] * 4 + 2 * 4
        for ps in c.servers:                               # restored ledger + the rest: each batch once
            for shard in ps.host.shards.values():
                for e in range(EPOCHS):
                    starts = shard.ledger.starts(e)
                    assert set(starts) == set(range(0, SIZE, BATCH)) and set(starts.values()) == {1}
    finally:
        c.stop()


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(interrupted, tmp_path, caplog):
    root = tmp_path / "ckpts"
    shutil.copytree(interrupted[0], root)
    newest, previous = list_checkpoints(root)[:2]
    shard_file = newest / "shard-00001.pt"
    shard_file.write_bytes(shard_file.read_bytes()[:-10] + b"garbage!!!")
    c = cluster(2, root)
    try:
        stats = job_stats(c)
        assert f"skipping checkpoint {newest}" in caplog.text and "corrupt" in caplog.text
        assert stats.restored_from == str(previous)
        model = mlp(3)
        t = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.02)
        assert torch.equal(weights(model), open_checkpoint(previous).flat_values())
        t.close()
    finally:
        c.stop()


def test_resuming_with_another_model_is_refused_with_the_parameter_names(interrupted, tmp_path):
    root = tmp_path / "ckpts"
    shutil.copytree(interrupted[0], root)
    c = cluster(2, root)
    try:
        with pytest.raises(Refused) as err:
            Trainer(mlp(0, hidden=17), chief=c.chief_address)
        details = str(err.value)
        assert "does not match checkpoint" in details
        assert "0.weight: expected [16, 8] float32, got [17, 8] float32" in details
        assert "2.weight: expected [3, 16] float32, got [3, 17] float32" in details
        Trainer(mlp(0), chief=c.chief_address).close()      # the right model still joins
    finally:
        c.stop()


def test_export_writes_a_state_dict_the_model_loads_strictly(interrupted, tmp_path, capsys):
    out = tmp_path / "model.pt"
    assert cli.main(["export", str(interrupted[0]), str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}: step {load_latest(interrupted[0]).step} from {load_latest(interrupted[0]).path}"
    model = mlp(5)
    model.load_state_dict(torch.load(out), strict=True)
    assert torch.equal(weights(model), load_latest(interrupted[0]).flat_values())
    assert export_state_dict(load_latest(interrupted[0])).keys() == model.state_dict().keys()


@pytest.mark.parametrize("argv,message", [
    (["chief", "--checkpoint-dir", "D", "--checkpoint-interval", "5x"],
     "shoal chief: error: --checkpoint-interval '5x' is not a number of steps (like 500) or a time "
     "(like 30s, 5m, 1h) above zero"),
    (["local", "--checkpoint-dir", "D", "--checkpoint-interval", "-3", "train.py"],
     "shoal local: error: --checkpoint-interval '-3' is not a number of steps (like 500) or a time "
     "(like 30s, 5m, 1h) above zero"),
    (["chief", "--checkpoint-interval", "30s"], "shoal chief: error: --checkpoint-interval '30s' needs --checkpoint-dir"),
    (["chief", "--checkpoint-dir", "D", "--keep-checkpoints", "0"],
     "shoal chief: error: --keep-checkpoints must be >= 1, got 0"),
])
def test_bad_checkpoint_flags_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == message


def test_export_of_nothing_is_a_one_line_error(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), str(tmp_path / "m.pt")]) == 2
    assert capsys.readouterr().err.strip() == f"shoal export: error: no valid checkpoint under {tmp_path}"
