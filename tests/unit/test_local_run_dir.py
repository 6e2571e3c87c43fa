"""A run directory used before: ``shoal local`` must not take the last run's chief port for this one's.

Found by running ``make run`` twice: the second run read ``runs/chief.port`` left by the first
before its own chief had written it, told every role to join a port nobody served, and failed
after 530 s of workers restarting with exit 69.
"""
import io

import pytest

from shoal.cli.local import LocalCluster, LocalConfig


def test_a_stale_chief_port_is_removed_before_the_chief_starts(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "chief.port").write_text("44149")
    (run / "chief.address").write_text("127.0.0.1:44149")
    (tmp_path / "train.py").write_text("")
    local = LocalCluster(LocalConfig(script=str(tmp_path / "train.py"), run_dir=str(run)), out=io.StringIO())
    seen = {}

    def spawn(name, argv, *args, **kwargs):
        seen[name] = [p.name for p in run.iterdir()]
        raise RuntimeError("stop here")

    monkeypatch.setattr(local, "_spawn", spawn)
    with pytest.raises(RuntimeError, match="stop here"):
        local.start()
    assert "chief.port" not in seen["chief"] and "chief.address" not in seen["chief"]
