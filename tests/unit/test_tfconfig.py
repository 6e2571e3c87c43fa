"""TF_CONFIG as Kubeflow's TFJob operator sets it: each role finds the chief and its own place."""
from __future__ import annotations

import json

import pytest

from shoal.settings import tfconfig
from shoal.cli.main import build_parser, main
from shoal.cli.sources import apply_sources, start_argv
from shoal.errors import InvalidArgument

CLUSTER = {"chief": ["digits-chief-0.team.svc:2222"],
           "ps": ["digits-ps-0.team.svc:2222", "digits-ps-1.team.svc:2222"],
           "worker": ["digits-worker-0.team.svc:2222", "digits-worker-1.team.svc:2222"]}


def tf_config(task_type: str, index: int, cluster=None) -> str:
    return json.dumps({"cluster": cluster or CLUSTER, "task": {"type": task_type, "index": index},
                       "environment": "cloud"})


def _parse(argv, monkeypatch, value):
    for name in ("SHOAL_CHIEF", "SHOAL_BIND", "SHOAL_ADVERTISE", "SHOAL_NUM_SHARDS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_CONFIG", value)
    parser = build_parser()
    return apply_sources(parser, parser.commands, argv, parser.parse_args(argv))


def test_each_role_takes_its_place_from_tf_config(monkeypatch):
    chief = _parse(["chief"], monkeypatch, tf_config("chief", 0))
    assert (chief.bind, chief.num_shards) == ("0.0.0.0:2222", 2)
    ps = _parse(["ps"], monkeypatch, tf_config("ps", 1))
    assert (ps.chief, ps.bind, ps.advertise) == ("digits-chief-0.team.svc:2222", "0.0.0.0:2222",
                                                 "digits-ps-1.team.svc")
    worker = _parse(["worker", "train.py"], monkeypatch, tf_config("worker", 1))
    assert worker.chief == "digits-chief-0.team.svc:2222"


def test_older_operators_master_is_the_chief(monkeypatch):
    cluster = {"master": ["job-master-0:2222"], "ps": ["job-ps-0:2222"], "worker": ["job-worker-0:2222"]}
    cfg = tfconfig.parse(tf_config("master", 0, cluster))
    assert (cfg.role, cfg.chief, cfg.port) == ("chief", "job-master-0:2222", 2222)


def test_a_flag_still_wins_over_tf_config(monkeypatch):
    ps = _parse(["ps", "--bind", "0.0.0.0:9000", "--chief", "other:1"], monkeypatch, tf_config("ps", 0))
    assert (ps.bind, ps.chief) == ("0.0.0.0:9000", "other:1")


@pytest.mark.parametrize("value, expected", [
    ("{not json", "TF_CONFIG is not JSON"),
    ("[]", "TF_CONFIG must be a JSON object"),
    (json.dumps({"task": {"type": "ps", "index": 0}}), "TF_CONFIG.cluster must be a non-empty object"),
    (json.dumps({"cluster": CLUSTER}), "TF_CONFIG.task must be an object"),
    (tf_config("evaluator", 0), "TF_CONFIG.task.type 'evaluator' is not one of chief, master, ps, worker"),
    (tf_config("ps", 2), "TF_CONFIG.task.index 2 is out of range: cluster.ps has 2 address(es)"),
    (tf_config("ps", "0"), "TF_CONFIG.task.index must be an integer"),
    (tf_config("ps", 0, {**CLUSTER, "ps": ["no-port"]}), "TF_CONFIG.cluster.ps: 'no-port' is not HOST:PORT"),
    (tf_config("ps", 0, {**CLUSTER, "ps": "a:1"}), "TF_CONFIG.cluster.ps must be a list"),
    (tf_config("ps", 0, {k: v for k, v in CLUSTER.items() if k != "chief"}),
     "TF_CONFIG.cluster.chief must list exactly one address"),
])
def test_a_bad_tf_config_is_a_clear_error(value, expected):
    with pytest.raises(InvalidArgument, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        tfconfig.parse(value)


def test_a_role_with_a_bad_tf_config_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", tf_config("ps", 5))
    assert main(["ps"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "TF_CONFIG.task.index 5 is out of range" in err


def test_start_runs_the_role_tf_config_names():
    assert start_argv(tfconfig.parse(tf_config("ps", 0)), "job.yaml", []) == ["ps", "--config", "job.yaml"]
    assert start_argv(tfconfig.parse(tf_config("worker", 0)), None, ["t.py", "--epochs", "1"]) == \
        ["worker", "t.py", "--epochs", "1"]
    with pytest.raises(InvalidArgument, match="a ps takes no script"):
        start_argv(tfconfig.parse(tf_config("ps", 0)), None, ["t.py"])


def test_start_without_tf_config_says_so(monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert main(["start"]) == 2
    assert "shoal start needs TF_CONFIG" in capsys.readouterr().err
