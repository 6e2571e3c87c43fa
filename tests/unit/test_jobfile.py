"""The job file (shoal/settings/jobfile.py) and how the CLI merges it with SHOAL_* variables and flags."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shoal.cli.main import build_parser, main
from shoal.cli.sources import apply_sources, job_config
from shoal.errors import InvalidArgument
from shoal.settings.jobfile import load_job, parse_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "job.yaml"


def _parse(argv: list[str]):
    parser = build_parser()
    return apply_sources(parser, parser.commands, argv, parser.parse_args(argv))


def test_the_example_loads_into_the_settings():
    job = load_job(EXAMPLE, env={})
    cfg = job_config(job)
    assert (cfg.mode, cfg.num_shards, cfg.replicas, cfg.recovery) == ("sync", 2, 2, "consistent")
    assert job.get("train.batch_size") == 32 and job.get("checkpointing.interval") == "60s"
    assert job.optimizer.name == "adam" and job.optimizer.hparams["lr"] == 0.003
    assert job.resources["limits"]["memory"] == "2Gi"


def test_the_issue_sample_loads():
    doc = yaml.safe_load("""
    train: {mode: sync, backup_workers: 0, staleness: 2, batch_size: 32, epochs: 15}
    optimizer: {name: adam, lr: 0.001}
    compression: {codec: topk, ratio: 0.01, pull: bf16}
    cluster: {ps: 2, workers: 4, replicas: 2, lease_seconds: 3}
    checkpointing: {dir: ./ckpt, interval: 60s, keep: 3}
    recovery: consistent
    autoscaling: {min_workers: 1, max_workers: 8, target: queue}
    straggler_detection: {factor: 2.0, action: flag}
    resources: {requests: {cpu: "2", memory: 4Gi}, limits: {cpu: "4", memory: 8Gi, nvidia.com/gpu: 1}}
    image: shoal:latest
    """)
    job = parse_job(doc, env={})
    assert job.compression == "topk:0.01"
    assert job.resources["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("doc, expected", [
    ({"checkpointing": {"interval": "60x"}}, "checkpointing.interval: '60x'"),
    ({"checkpointing": {"interval": True}}, "checkpointing.interval: True"),
    ({"train": {"modes": "sync"}}, "train.modes: unknown setting; train has mode,"),
    ({"trian": {"mode": "sync"}}, "trian: unknown setting; known sections: alerts, autoscaling,"),
    ({"train": {"epochs": "ten"}}, "train.epochs: 'ten' is not an integer; allowed: an integer >= 1"),
    ({"train": {"mode": "fast"}}, "train.mode: 'fast' is not allowed; allowed: one of sync, async, ssp"),
    ({"train": {"mode": "async", "backup_workers": 1}}, "train.backup_workers: 1 needs train.mode sync"),
    ({"cluster": {"replicas": 3}}, "cluster.replicas: 3 is not allowed; allowed: an integer 1 or 2"),
    ({"cluster": {"lease_seconds": 0}}, "cluster.lease_seconds: 0 is not allowed; allowed: a number > 0"),
    ({"cluster": 4}, "cluster: 4 is a int; allowed: a mapping of"),
    ({"optimizer": {"name": "adam", "betas": 0.9}}, "optimizer.betas: unknown setting; adam has"),
    ({"optimizer": {"name": "adam", "lr": "fast"}}, "optimizer.lr: 'fast' is not a number"),
    ({"resources": {"limits": {"cpu": "lots"}}}, "resources.limits.cpu: 'lots' is not a quantity"),
    ({"resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}},
     "resources.requests.memory: '8Gi' is above its limit '4Gi'"),
    ({"autoscaling": {"min_workers": 5, "max_workers": 2}}, "autoscaling.min_workers: 5 is above"),
    ({"autoscaling": {"target": "step_rate"}}, "autoscaling.step_rate: missing"),
    ({"straggler_detection": {"action": "kill"}}, "straggler_detection.action: 'kill' is not allowed"),
])
def test_a_bad_value_is_one_line_naming_its_key_path(doc, expected):
    with pytest.raises(InvalidArgument) as err:
        parse_job(doc, source="job.yaml: ", env={})
    message = str(err.value)
    assert expected in message and message.startswith("job.yaml: ") and "\n" not in message


def test_the_legacy_flat_form_still_loads():
    job = parse_job({"mode": "async", "staleness": 2, "lease-seconds": 5}, env={})
    assert (job.get("train.mode"), job.get("train.staleness"), job.get("cluster.lease_seconds")) == ("async", 2, 5.0)


def test_file_below_environment_below_flags(tmp_path, monkeypatch):
    path = tmp_path / "job.yaml"
    path.write_text("train: {mode: ssp, staleness: 3}\ncluster: {ps: 3, lease_seconds: 4}\n"
                    "checkpointing: {dir: /tmp/c, interval: 5m, keep: 2}\nchief: {bind: 127.0.0.1:0}\n")
    for name in ("SHOAL_STALENESS", "SHOAL_NUM_SHARDS", "SHOAL_BIND", "SHOAL_MODE", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    args = _parse(["chief", "--config", str(path)])
    assert (args.mode, args.staleness, args.num_shards, args.bind) == ("ssp", 3, 3, "127.0.0.1:0")
    assert (args.checkpoint_dir, args.checkpoint_interval, args.keep_checkpoints) == ("/tmp/c", "5m", 2)
    monkeypatch.setenv("SHOAL_STALENESS", "5")
    assert _parse(["chief", "--config", str(path)]).staleness == 5
    assert _parse(["chief", "--config", str(path), "--staleness", "7"]).staleness == 7


def test_the_worker_takes_script_compression_and_chief_from_the_file(tmp_path, monkeypatch):
    for name in ("SHOAL_CHIEF", "SHOAL_COMPRESSION", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "job.yaml"
    path.write_text("train: {script: train.py, args: [--hidden, '8']}\ncluster: {chief: 'h:7070'}\n"
                    "compression: {codec: topk, ratio: 0.05, lz4: true, pull: bf16}\n")
    args = _parse(["worker", "--config", str(path)])
    assert (args.script, args.script_args, args.chief) == ("train.py", ["--hidden", "8"], "h:7070")
    assert (args.compression, args.pull_codec) == ("topk+lz4:0.05", "bf16")
    args = _parse(["worker", "--config", str(path), "other.py", "--epochs", "1"])
    assert (args.script, args.script_args) == ("other.py", ["--epochs", "1"])


def test_config_print_shows_the_merged_result(capsys, monkeypatch):
    monkeypatch.setenv("SHOAL_MODE", "async")
    assert main(["config", "--print", str(EXAMPLE)]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["mode"] == "async"                 # the environment beats the file
    assert shown["optimizer"]["beta2"] == 0.999              # with every default filled in
    assert shown["resources"]["requests"]["memory"] == "1Gi"


def test_config_print_of_a_bad_file_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("checkpointing: {dir: /x, interval: soon}\n")
    assert main(["config", "--print", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "checkpointing.interval: 'soon'" in err
    assert main(["config", "--print", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read job file" in capsys.readouterr().err


def test_a_role_without_a_chief_anywhere_is_a_clear_error(monkeypatch, capsys):
    for name in ("SHOAL_CHIEF", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert main(["ps"]) == 2
    assert "no chief address" in capsys.readouterr().err


def test_the_trainer_reads_the_train_and_optimizer_sections(tmp_path, monkeypatch):
    from shoal.worker import Trainer

    monkeypatch.delenv("SHOAL_JOB_FILE", raising=False)
    assert Trainer.job_section("train") == {} and Trainer._optimizer_spec(None, {}).name == "sgd"
    path = tmp_path / "job.yaml"
    path.write_text("train: {batch_size: 16, epochs: 3}\noptimizer: {name: adamw, lr: 0.01}\n")
    monkeypatch.setenv("SHOAL_JOB_FILE", str(path))
    assert Trainer.job_section("train") == {"batch_size": 16, "epochs": 3}
    assert Trainer.job_section("optimizer")["name"] == "adamw"
    spec = Trainer._optimizer_spec(None, {"weight_decay": 0.1})        # the script's values win
    assert (spec.name, spec.hparams["lr"], spec.hparams["weight_decay"]) == ("adamw", 0.01, 0.1)
    assert Trainer._optimizer_spec("sgd", {}).name == "sgd"


def test_a_launcher_names_the_job_file_for_the_script(tmp_path, monkeypatch):
    from shoal.cli.sources import export_job_file

    monkeypatch.setenv("SHOAL_JOB_FILE", "")          # restored (unset) after the test
    parser = build_parser()
    export_job_file(parser.parse_args(["worker", "--chief", "h:1", "--config", "rel/job.yaml", "t.py"]))
    import os
    assert os.environ["SHOAL_JOB_FILE"] == os.path.abspath("rel/job.yaml")


def test_a_bad_shoal_variable_is_blamed_by_name_not_on_the_file(tmp_path, capsys, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text("cluster: {lease_seconds: 3}\n")
    with pytest.raises(InvalidArgument, match=r"^\$SHOAL_LEASE_SECONDS \(overriding the job file's "
                                              r"cluster.lease_seconds\): 'abc' is not a number"):
        load_job(job, env={"SHOAL_LEASE_SECONDS": "abc"})
    monkeypatch.setenv("SHOAL_NUM_SHARDS", "x")
    with pytest.raises(SystemExit) as exited:
        main(["chief"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == "shoal: error: $SHOAL_NUM_SHARDS: 'x' is not an integer"


def test_the_logging_and_alerts_sections_load_and_are_checked():
    job = parse_job({"logging": {"tensorboard": "runs/tb"}, "alerts": {"loss_spike": 3, "warmup": 20}}, env={})
    assert job.get("logging.tensorboard") == "runs/tb" and job.get("alerts.loss_spike") == 3.0
    with pytest.raises(InvalidArgument, match=r"alerts.loss_spike: 1 is not allowed; allowed: a number above 1"):
        parse_job({"alerts": {"loss_spike": 1}}, env={})
