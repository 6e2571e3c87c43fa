"""A checkpoint that cannot be written (a full disk) is a counted, visible error: the chief's stats and
``shoal status`` show it, ``shoal export`` says which step it exports and that later attempts failed."""
import errno

from shoal import cli
from shoal.state.checkpoint import load_latest
from shoal.state.checkpoint_failures import read_failure, record_failure
from shoal.state.checkpoint_store import CheckpointWriter
from shoal.cli.status import collect, render
from shoal.worker import Trainer

from test_checkpoints import cluster, job_stats, mlp, train


def test_a_full_disk_is_counted_shown_and_named_by_export(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ckpts"
    c = cluster(1, root)
    try:
        model = mlp(0)
        t = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.02)
        train(t, model, until=lambda: job_stats(c).checkpoints_written >= 1)
        good = load_latest(root).step

        def full(self, step, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(CheckpointWriter, "begin", full)
        train(t, model, until=lambda: job_stats(c).checkpoints_failed >= 2)
        stats = job_stats(c)
        assert stats.checkpoints_failed >= 2 and stats.checkpoint_failed_step > good
        assert "No space left on device" in stats.checkpoint_error
        assert load_latest(root).step == good                          # nothing half-written took its place
        shown = render(collect(c.chief_address))
        assert f"CHECKPOINTS FAILING: {stats.checkpoints_failed} attempt(s) failed" in shown
        t.close()
    finally:
        c.stop()
    capsys.readouterr()
    assert cli.main(["export", str(root), str(tmp_path / "m.pt")]) == 0
    out, err = capsys.readouterr()
    assert out.strip().startswith(f"wrote {tmp_path / 'm.pt'}: step {good} from ")
    assert "later checkpoint attempt(s) failed" in err and "No space left on device" in err
    assert err.count("\n") == 1                                      # one line


def test_a_disk_that_fills_under_the_servers_is_one_line_naming_it_not_a_traceback(tmp_path, monkeypatch, caplog):
    """The disk fills while the servers write their shard files (torch.save fails with a RuntimeError
    whose cause is the OSError): the chief's error names the full disk, and no server logs an ERROR
    with a traceback for an operational failure."""
    from shoal.ps import checkpoint_servicer

    root = tmp_path / "ckpts"
    c = cluster(1, root)
    try:
        model = mlp(0)
        t = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.02)

        def full(directory, state):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as exc:
                raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from exc
        monkeypatch.setattr(checkpoint_servicer, "write_shard_file", full)
        train(t, model, until=lambda: job_stats(c).checkpoints_failed >= 1)
        error = job_stats(c).checkpoint_error
        assert "RESOURCE_EXHAUSTED" in error and "No space left on device" in error, error
        assert "see the server log" not in error
        assert not [r for r in caplog.records if r.levelname == "ERROR" and r.name == "shoal.net.rpc"]
        t.close()
    finally:
        c.stop()


def test_failures_are_counted_afresh_after_a_checkpoint_succeeds(tmp_path):
    record_failure(tmp_path, 10, "boom")
    record_failure(tmp_path, 12, "boom")
    assert read_failure(tmp_path)["failures"] == 2
    (tmp_path / "ckpt-000000000020").mkdir()
    (tmp_path / "ckpt-000000000020" / "manifest.json").write_text("{}")
    record_failure(tmp_path, 24, "again")
    got = read_failure(tmp_path)
    assert (got["step"], got["error"], got["failures"]) == (24, "again", 1)
