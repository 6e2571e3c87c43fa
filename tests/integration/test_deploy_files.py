"""docker-compose and Kubernetes files generated from examples/job.yaml, validated offline."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from shoal.cli import compose, k8s
from shoal.cli.main import build_parser, main
from shoal.settings.jobfile import load_job, parse_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "job.yaml"
K8S_VERSION = "1.30.0"          # native gRPC probes are GA since 1.27


@pytest.fixture
def job():
    return load_job(EXAMPLE, env={})


def _parses(argv: list[str]) -> None:
    """The command line parses with shoal's own parser (as the container's `shoal` would)."""
    args = build_parser().parse_args(argv)
    assert args.command in ("chief", "ps", "worker", "start", "health")


def test_the_compose_file_is_valid_and_its_commands_parse(job, tmp_path):
    doc = compose.compose(job, str(EXAMPLE))
    services = doc["services"]
    assert sorted(services) == ["chief", "ps-0", "ps-1", "worker"]
    for name, svc in services.items():
        _parses(svc["command"])
        assert svc["restart"] == "on-failure" and svc["image"] == "shoal:latest"
        if name != "worker":
            _parses(svc["healthcheck"]["test"][2:])       # CMD shoal health ...
            assert "state:/state" in svc["volumes"]
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker    # --scale worker=N needs both absent
    # the chief's port on the host's loopback (shoal status); every role's /metrics in the network
    assert services["chief"]["ports"] == ["127.0.0.1:7070:7070"]
    assert all(svc["environment"]["SHOAL_METRICS_PORT"] in svc["expose"] for svc in services.values())
    assert services["ps-1"]["command"][-2:] == ["--advertise", "ps-1"]
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (make setup installs it)")
    path = tmp_path / "docker-compose.yml"
    path.write_text(compose.render(doc, job))
    out = subprocess.run(["docker-compose", "-f", str(path), "config"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["services"]["worker"]["command"][0] == "worker"


def test_the_committed_deploy_files_are_current(job, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("SHOAL_")]:
        monkeypatch.delenv(name)
    assert (ROOT / "deploy" / "docker-compose.yml").read_text() == \
        compose.render(compose.compose(job, "../examples/job.yaml"), job)
    assert (ROOT / "deploy" / "k8s" / "shoal.yaml").read_text() == k8s.render(k8s.native(job), job, "native")
    assert (ROOT / "deploy" / "k8s" / "tfjob.yaml").read_text() == k8s.render(k8s.tfjob(job), job, "tfjob")


def _restricted(pod: dict) -> None:
    """Pod Security "restricted": non-root, no privilege escalation, every capability dropped, seccomp."""
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_every_native_manifest_validates(job):
    docs = k8s.native(job)
    kinds = [d["kind"] for d in docs]
    # every role a Job: a role that finished (exit 0) is never started again
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "Job", "Service", "Job", "Service",
                     "PodDisruptionBudget", "Job"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for role in ("chief", "ps", "worker"):
        spec = by_name[("Job", f"digits-{role}")]["spec"]
        assert spec["ttlSecondsAfterFinished"] > 0 and spec["template"]["spec"]["restartPolicy"] == "OnFailure"
        _restricted(spec["template"])
    ps = by_name[("Job", "digits-ps")]["spec"]
    assert (ps["completions"], ps["parallelism"], ps["completionMode"]) == (2, 2, "Indexed")
    assert ps["template"]["spec"]["subdomain"] == "digits-ps"
    assert by_name[("Service", "digits-ps")]["spec"]["clusterIP"] == "None"
    container = ps["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--advertise", "digits-ps-$(PS_INDEX).digits-ps"]
    assert container["readinessProbe"]["grpc"] == {"port": 7070}
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}
    _parses(container["args"])
    worker = by_name[("Job", "digits-worker")]["spec"]
    assert "completions" not in worker and worker["parallelism"] == 2
    _parses(worker["template"]["spec"]["containers"][0]["args"])
    # every pod serves /metrics on one port and says so to Prometheus' kubernetes_sd
    for role in ("chief", "ps", "worker"):
        pod = by_name[("Job", f"digits-{role}")]["spec"]["template"]
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        port = int(pod["metadata"]["annotations"]["prometheus.io/port"])
        c = pod["spec"]["containers"][0]
        assert {"name": "metrics", "containerPort": port} in c["ports"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["SHOAL_METRICS_PORT"] == str(port) and env["SHOAL_METRICS_HOST"] == "0.0.0.0"
    # the configmap holds a job file that loads to the same settings
    shipped = parse_job(yaml.safe_load(docs[0]["data"]["job.yaml"]), env={})
    assert shipped.values == job.values and shipped.optimizer == job.optimizer


def test_accelerators_go_to_the_workers_only():
    job = parse_job({"name": "gpu", "resources": {"limits": {"cpu": "4", "nvidia.com/gpu": 1}}}, env={})
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s.native(job)}
    limits = lambda kind, name: docs[(kind, name)]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits("Job", "gpu-worker") == {"cpu": "4", "nvidia.com/gpu": "1"}
    assert limits("Job", "gpu-ps") == {"cpu": "4"}


def test_the_tfjob_variant_has_the_operators_shape(job):
    docs = k8s.tfjob(job)
    for doc in docs:
        if doc["kind"] != "TFJob":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    (tf,) = [d for d in docs if d["kind"] == "TFJob"]
    assert tf["apiVersion"] == "kubeflow.org/v1" and tf["metadata"]["name"] == "digits"
    specs = tf["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "PS", "Worker"}
    # the default success policy (the Chief's exit 0) ends it; the finished TFJob is then cleaned up
    assert "successPolicy" not in tf["spec"] and tf["spec"]["runPolicy"]["ttlSecondsAfterFinished"] > 0
    assert (specs["Chief"]["replicas"], specs["PS"]["replicas"], specs["Worker"]["replicas"]) == (1, 2, 2)
    for role, spec in specs.items():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        # the pod template is a Kubernetes PodTemplateSpec: validate it as one
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": f"digits-{role.lower()}"},
                                      "template": spec["template"]}, K8S_VERSION, strict=True)
        _restricted(spec["template"])
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"           # the operator's default container name
        assert {"name": "tfjob-port", "containerPort": 2222} in container["ports"]
        assert container["args"][:1] == ["start"]
        _parses(container["args"])


def test_the_generators_write_files_and_reject_a_bad_job(tmp_path, capsys):
    assert main(["k8s", str(EXAMPLE), "-o", str(tmp_path / "k8s")]) == 0
    assert sorted(p.name for p in (tmp_path / "k8s").iterdir()) == ["prometheus-rule.yaml", "shoal.yaml", "tfjob.yaml"]
    assert main(["compose", str(EXAMPLE), "-o", str(tmp_path / "dc.yml")]) == 0
    assert yaml.safe_load((tmp_path / "dc.yml").read_text())["services"]["chief"]["volumes"][0].endswith(
        "examples/job.yaml:/job/job.yaml:ro")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {ps: 0}\n")
    capsys.readouterr()
    assert main(["k8s", str(bad)]) == 2 and main(["compose", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("cluster.ps: 0 is not allowed" in line for line in err)


def test_shoal_health_follows_the_health_service(capsys):
    from shoal.net.rpc import create_server, set_serving

    server, port, health = create_server("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        set_serving(health, "shoal.Chief", False)
        assert main(["health", address]) == 1
        assert "NOT_SERVING" in capsys.readouterr().err
        set_serving(health, "shoal.Chief", True)
        assert main(["health", address]) == 0
        assert capsys.readouterr().out.strip() == f"{address}: SERVING"
    finally:
        server.stop(None)
    assert main(["health", address, "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err


def test_the_alert_rules_are_current_and_pass_promtool(tmp_path):
    from shoal.cli import alert_rules

    assert (ROOT / "deploy" / "prometheus" / "shoal-rules.yml").read_text() == \
        alert_rules.render(alert_rules.rule_file(), "rules")
    shipped = yaml.safe_load((ROOT / "deploy" / "k8s" / "prometheus-rule.yaml").read_text())
    assert shipped["kind"] == "PrometheusRule" and shipped["spec"] == alert_rules.rule_file()
    names = {r["alert"] for r in alert_rules.rules()}
    assert {"ShoalWorkerLost", "ShoalJobStalled", "ShoalCheckpointFailing", "ShoalNonFiniteGradients",
            "ShoalLossSpike", "ShoalJobFailed"} <= names
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    rules = tmp_path / "rules.yml"
    rules.write_text(alert_rules.render(alert_rules.rule_file(), "rules"))
    out = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS: 8 rules found" in out.stdout, out.stdout + out.stderr
    # the rules fire on what the roles export: a lost worker, a job whose shards stopped moving; not on a clean one
    notes = {r["alert"]: {k: v.replace("{{ $labels.instance }}", "chief") for k, v in r["annotations"].items()}
             for r in alert_rules.rules()}
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": [str(rules)], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [
            {"series": 'shoal_alerts_total{kind="worker_lost",instance="chief"}', "values": "0 0 1 1 1 1 1 1"},
            {"series": 'shoal_shard_version{shard="0",instance="chief"}', "values": "1 2 3 4 4 4 4 4 4 4 4 4"},
            {"series": 'shoal_live_workers{instance="chief"}', "values": "2x12"},
            {"series": 'shoal_job_phase{phase="running",instance="chief"}', "values": "1x12"},
            {"series": 'shoal_job_exit_code{instance="chief"}', "values": "0x12"}],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "ShoalWorkerLost", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "ShoalWorkerLost", "exp_alerts": [{"exp_labels": {
                    "severity": "warning", "kind": "worker_lost", "instance": "chief"},
                    "exp_annotations": notes["ShoalWorkerLost"]}]},
                {"eval_time": "4m", "alertname": "ShoalJobStalled", "exp_alerts": []},
                {"eval_time": "9m", "alertname": "ShoalJobStalled", "exp_alerts": [{"exp_labels": {
                    "severity": "critical", "instance": "chief"}, "exp_annotations": notes["ShoalJobStalled"]}]},
                {"eval_time": "9m", "alertname": "ShoalJobFailed", "exp_alerts": []}]}]}))
    out = subprocess.run(["promtool", "test", "rules", str(tmp_path / "test.yml")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
