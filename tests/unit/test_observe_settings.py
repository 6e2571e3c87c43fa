"""Where the observability settings come from: flags, environment, the job file; bad values are one line."""
from __future__ import annotations

import argparse

import pytest

from shoal.observe.alerts import AlertConfig
from shoal.cli import observe
from shoal.errors import InvalidArgument


def args(tmp_path, yaml_text: str | None = None, **kw) -> argparse.Namespace:
    config = None
    if yaml_text is not None:
        config = tmp_path / "job.yaml"
        config.write_text(yaml_text)
    base = dict(config=str(config) if config else None, tensorboard=None, metrics_port=None,
                alert_loss_spike=None, alert_grad_spike=None)
    return argparse.Namespace(**{**base, **kw})


def test_job_file_sections(tmp_path, monkeypatch):
    for var in ("SHOAL_TENSORBOARD", "SHOAL_METRICS_PORT", "SHOAL_ALERT_LOSS_SPIKE", "SHOAL_ALERT_WARMUP"):
        monkeypatch.delenv(var, raising=False)
    a = args(tmp_path, "mode: async\nlogging:\n  tensorboard: runs/tb\nalerts:\n  loss-spike: 4\n  warmup: 50\n")
    assert observe.tensorboard_dir(a) == "runs/tb"
    assert observe.alert_config(a) == AlertConfig(loss_spike=4, warmup=50)
    a.tensorboard, a.alert_loss_spike = "elsewhere", 6.0          # the command line wins
    assert observe.tensorboard_dir(a) == "elsewhere" and observe.alert_config(a).loss_spike == 6.0
    monkeypatch.setenv("SHOAL_ALERT_WARMUP", "7")                 # the environment over the file
    assert observe.alert_config(a).warmup == 7
    env = observe.worker_env(a)
    assert env["SHOAL_TENSORBOARD"] == "elsewhere" and env["SHOAL_ALERT_LOSS_SPIKE"] == "6.0"
    assert "SHOAL_METRICS_PORT" not in env


@pytest.mark.parametrize("text, message", [
    ("alerts:\n  loss_spike: 0.5\n", "loss_spike must be a factor above 1"),
    ("alerts:\n  loss_spikes: 3\n", "unknown setting 'loss_spikes'"),
    ("alerts: 3\n", "'alerts' must be a mapping"),
    ("logging:\n  tensorbord: x\n", "unknown setting(s) tensorbord under logging"),
])
def test_bad_job_file_values(tmp_path, text, message):
    a = args(tmp_path, text)
    with pytest.raises(InvalidArgument) as err:
        observe.alert_config(a)
        observe.tensorboard_dir(a)
    assert message in str(err.value)


def test_metrics_port_range_and_local_layout(tmp_path, monkeypatch):
    monkeypatch.delenv("SHOAL_METRICS_PORT", raising=False)
    with pytest.raises(InvalidArgument, match="got 70000"):
        observe.metrics_port(args(tmp_path, metrics_port=70000))
    monkeypatch.setenv("SHOAL_METRICS_PORT", "abc")
    with pytest.raises(InvalidArgument, match="SHOAL_METRICS_PORT must be a port number, got 'abc'"):
        observe.metrics_port(args(tmp_path))

    class Cfg:
        metrics_port, num_ps, tensorboard, alerts = 9100, 2, "tb/run", AlertConfig()

    assert observe.local_role_flags(Cfg, "chief", 0) == ["--tensorboard", "tb/run", "--metrics-port", "9100"]
    assert observe.local_role_flags(Cfg, "ps", 1) == ["--metrics-port", "9102"]
    assert observe.local_worker_env(Cfg, 1, tmp_path)["SHOAL_METRICS_PORT"] == "9104"
