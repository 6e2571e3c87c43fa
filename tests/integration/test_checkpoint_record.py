"""A full checkpoint disk is part of the job's result: recorded in the chief's journal (which the full disk
cannot hide), reported after a chief restart, and ``shoal export`` refuses the stale checkpoint unless told."""
import errno

from shoal import cli
from shoal.state.checkpoint import load_latest
from shoal.state.checkpoint_store import CheckpointWriter
from shoal.chief.checkpointer import CheckpointConfig, Interval
from shoal.settings.config import JobConfig
from shoal.worker import Trainer
from harness import InProcessCluster

from test_checkpoints import job_stats, mlp, train


def test_a_full_checkpoint_disk_is_journaled_survives_a_chief_restart_and_export_refuses_the_stale_one(
        tmp_path, monkeypatch, capsys):
    root = tmp_path / "ckpts"
    cfg = CheckpointConfig(str(root), Interval(steps=4), keep=3, poll_s=0.05)
    c = InProcessCluster(1, JobConfig(mode="sync", num_shards=1), journal=str(tmp_path / "chief.db"), checkpoint=cfg)
    try:
        model = mlp(0)
        t = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.02)
        train(t, model, until=lambda: job_stats(c).checkpoints_written >= 1)
        good = load_latest(root).step

        def full(self, step, **kwargs):          # the checkpoint disk is full: failed.json cannot be written either
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(CheckpointWriter, "begin", full)
        monkeypatch.setattr("shoal.chief.checkpointer.record_failure", lambda *a: None)
        train(t, model, until=lambda: job_stats(c).checkpoints_failed >= 2)
        stats = job_stats(c)
        missing = list(stats.checkpoint_missing_steps)
        assert len(missing) >= 2 and min(missing) > good and stats.last_applied_step >= max(missing)
        t.close()
        c.stop_chief()
        c.start_chief()                              # a new generation reads the record from the journal
        again = job_stats(c)
        # (the new chief may have tried the same step once more: the disk is still full)
        assert list(again.checkpoint_missing_steps) == missing and again.checkpoints_failed >= stats.checkpoints_failed
        assert "No space left on device" in again.checkpoint_error
    finally:
        c.stop()
    assert not (root / "failed.json").exists()       # nothing on the full disk says it: the journal does
    capsys.readouterr()
    assert cli.main(["export", str(root), str(tmp_path / "m.pt")]) == 73
    _, err = capsys.readouterr()
    assert f"is step {good}, older than the job's last applied update at step {stats.last_applied_step}" in err
    assert str(max(missing)) in err and "--allow-stale" in err and err.count("\n") == 1
    assert not (tmp_path / "m.pt").exists()
    assert cli.main(["export", "--allow-stale", str(root), str(tmp_path / "m.pt")]) == 0
    assert (tmp_path / "m.pt").exists()


def test_export_says_so_when_the_journal_the_pointer_names_is_gone(tmp_path, capsys):
    """A ``shoal local`` run dir in /tmp is removed with its journal: export goes on, with one warning line."""
    from shoal.chief.ckpt_record import write_pointer

    root = tmp_path / "ckpts"
    cfg = CheckpointConfig(str(root), Interval(steps=4), keep=3, poll_s=0.05)
    c = InProcessCluster(1, JobConfig(mode="sync", num_shards=1), checkpoint=cfg)
    try:
        model = mlp(0)
        t = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.02)
        train(t, model, until=lambda: job_stats(c).checkpoints_written >= 1)
        t.close()
    finally:
        c.stop()
    write_pointer(root, "job-gone", tmp_path / "run" / "chief.db")
    capsys.readouterr()
    assert cli.main(["export", str(root), str(tmp_path / "m.pt")]) == 0
    err = capsys.readouterr().err
    assert "is gone: cannot check" in err and err.count("\n") == 1
    assert cli.main(["export", "--journal", str(tmp_path / "run" / "chief.db"), str(root), str(tmp_path / "n.pt")]) == 78
