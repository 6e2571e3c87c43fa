"""``shoal k8s job.yaml``: Kubernetes manifests for the job, native or as a Kubeflow ``TFJob``.

A job ends (chief/lifecycle.py): once its data is done the chief and its servers drain and exit 0
(non-zero when the job failed), and a worker exits 0. So every role runs as a ``batch/v1`` Job, never
as a Deployment or StatefulSet that would start a finished role again:

Native set: a ConfigMap with the job file; a PVC for the chief's journal and the checkpoints
(ReadWriteMany: every parameter server writes its shards' files); the chief as a one-pod Job
(restarted in place on failure: it carries on from its journal) behind a Service; the parameter
servers as an Indexed Job whose pods keep stable names ``<job>-ps-K.<job>-ps`` (the pod host name an
Indexed Job gives, under a headless Service: what workers dial) with a PodDisruptionBudget; the
workers as a Job with ``completions`` unset and ``parallelism`` the worker count (``kubectl patch job
<job>-worker -p '{"spec":{"parallelism":N}}'`` resizes it; a Job has no scale subresource, so no
HorizontalPodAutoscaler can drive it: with an ``autoscaling`` section the chief's desired count is
in ``shoal status`` and ``shoal_autoscale_desired_workers`` for whatever patches the parallelism).
Finished Jobs are deleted ``TTL_S`` after they end. Every pod meets Pod Security "restricted"
(non-root, no privilege escalation, every capability dropped, the runtime's seccomp profile). Probes
use Kubernetes' native gRPC probes on the health service.

``--tfjob``: the same job as a ``TFJob``; the operator sets ``TF_CONFIG`` and every replica runs
``shoal start``, which takes its role and place from it. Its success policy is the default one: the
TFJob succeeds when the Chief exits 0 (the others are then stopped, ``cleanPodPolicy: Running``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from shoal.cli import alert_rules
from shoal.cli.compose import DATA_PORT, PORT, Dumper, role_args
from shoal.settings.jobfile import JobFile, dump, load_job

JOB_DIR = "/etc/shoal"
JOB_PATH = f"{JOB_DIR}/job.yaml"
STATE = "/var/lib/shoal"
TFJOB_PORT = 2222            # the port the TFJob operator puts in TF_CONFIG (tfjob-port)
GRACE_S = 30                 # SIGTERM, then this long before SIGKILL: a worker hands back its task
METRICS_PORT = 9400          # every pod's /metrics, announced to Prometheus by the prometheus.io annotations
TTL_S = 3600                 # a finished Job (and its pods' logs) is kept this long, then deleted
BACKOFF_LIMIT = 6            # pod restarts a Job allows before it fails
UID = 10001                  # the image's user (Dockerfile)


def _meta(job: JobFile, suffix: str = "", role: str = "") -> dict[str, Any]:
    name = job.get("name", "shoal")
    labels = {"app.kubernetes.io/name": "shoal", "app.kubernetes.io/instance": name}
    if role:
        labels["app.kubernetes.io/component"] = role
    return {"name": f"{name}-{suffix}" if suffix else name, "labels": labels}


def _selector(job: JobFile, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": job.get("name", "shoal"), "app.kubernetes.io/component": role}


def _resources(job: JobFile, role: str) -> dict[str, Any]:
    """The job's resources; accelerators (``nvidia.com/gpu``, any ``vendor/x``) only for workers."""
    out = {}
    for kind, amounts in job.resources.items():
        kept = {k: v for k, v in amounts.items() if role == "worker" or "/" not in k}
        if kept:
            out[kind] = kept
    return out


def _probes(port: int) -> dict[str, Any]:
    return {"readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 3},
            "livenessProbe": {"grpc": {"port": port}, "initialDelaySeconds": 20, "periodSeconds": 10,
                              "failureThreshold": 6}}


def _volumes(job: JobFile, state: bool) -> tuple[list[dict], list[dict]]:
    mounts = [{"name": "job", "mountPath": JOB_DIR, "readOnly": True}]
    volumes = [{"name": "job", "configMap": {"name": _meta(job, "job")["name"]}}]
    if state:
        mounts.append({"name": "state", "mountPath": STATE})
        volumes.append({"name": "state", "persistentVolumeClaim": {"claimName": _meta(job, "state")["name"]}})
    return mounts, volumes


def _container(job: JobFile, role: str, args: list[str], port: int | None, state: bool,
               name: str = "shoal") -> tuple[dict[str, Any], list[dict]]:
    mounts, volumes = _volumes(job, state)
    c: dict[str, Any] = {"name": name, "image": job.get("image", "shoal:latest"), "command": ["shoal"],
                         "args": args, "env": [{"name": "PYTHONUNBUFFERED", "value": "1"},
                                               {"name": "SHOAL_METRICS_PORT", "value": str(METRICS_PORT)},
                                               {"name": "SHOAL_METRICS_HOST", "value": "0.0.0.0"}],
                         "volumeMounts": mounts, "ports": [{"name": "metrics", "containerPort": METRICS_PORT}]}
    if port is not None:
        c["ports"].insert(0, {"name": "grpc", "containerPort": port})
        c.update(_probes(port))
    res = _resources(job, role)
    if res:
        c["resources"] = res
    return c, volumes


RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                        "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def _pod(job: JobFile, role: str, container: dict, volumes: list[dict], **spec: Any) -> dict[str, Any]:
    container = {**container, "securityContext": dict(RESTRICTED_CONTAINER)}    # Pod Security "restricted"
    return {"metadata": {"labels": {**_meta(job, role=role)["labels"]},
                         "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                                         "prometheus.io/path": "/metrics"}},
            "spec": {"terminationGracePeriodSeconds": GRACE_S,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [container], "volumes": volumes,
                     **spec}}


def _batch_job(job: JobFile, role: str, template: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """A ``batch/v1`` Job of ``role``'s pods: restarted in place on failure, never once they exit 0."""
    template["spec"]["restartPolicy"] = "OnFailure"
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(job, role, role),
            "spec": {**spec, "backoffLimit": BACKOFF_LIMIT, "ttlSecondsAfterFinished": TTL_S,
                     "template": template}}


def _configmap(job: JobFile) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, "job"),
            "data": {"job.yaml": dump(job)}}


def _pvc(job: JobFile) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(job, "state"),
            "spec": {"accessModes": ["ReadWriteMany"],
                     "resources": {"requests": {"storage": job.get("checkpointing.storage", "10Gi")}}}}


def _ps_pdb(job: JobFile, role: str = "ps") -> dict[str, Any]:
    # with a backup for every shard one server may go at a time; with one copy, none may
    one = job.get("cluster.replicas", 2 if job.get("cluster.ps", 2) >= 2 else 1) == 2
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(job, "ps", "ps"),
            "spec": {"maxUnavailable": 1 if one else 0, "selector": {"matchLabels": _selector(job, role)}}}


def _state_args(args: list[str]) -> list[str]:
    return [a.replace("/state", STATE) if a.startswith("/state") else a for a in args]


def native(job: JobFile) -> list[dict[str, Any]]:
    """ConfigMap, PVC, chief Job + Service, ps Indexed Job + headless Service + PDB, worker Job."""
    name = job.get("name", "shoal")
    chief_addr = f"{name}-chief:{PORT}"
    num_ps, workers = job.get("cluster.ps", 2), job.get("cluster.workers", 2)
    docs = [_configmap(job), _pvc(job)]

    c, v = _container(job, "chief", _state_args(role_args(job, "chief", chief_addr, JOB_PATH)), PORT, True)
    docs.append(_batch_job(job, "chief", _pod(job, "chief", c, v), completions=1, parallelism=1))
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": _meta(job, "chief", "chief"),
                 "spec": {"selector": _selector(job, "chief"),
                          "ports": [{"name": "grpc", "port": PORT, "targetPort": "grpc"}]}})

    # an Indexed Job names its pods' hosts <job>-ps-K: under the headless Service, <job>-ps-K.<job>-ps
    ps_args = [*role_args(job, "ps", chief_addr, JOB_PATH), "--advertise", f"{name}-ps-$(PS_INDEX).{name}-ps"]
    c, v = _container(job, "ps", _state_args(ps_args), PORT, True)
    c["env"].append({"name": "PS_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
    c["ports"].append({"name": "data", "containerPort": DATA_PORT})
    docs.append(_batch_job(job, "ps", _pod(job, "ps", c, v, subdomain=f"{name}-ps"), completions=num_ps,
                           parallelism=num_ps, completionMode="Indexed"))
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": _meta(job, "ps", "ps"),
                 "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                          "selector": _selector(job, "ps"),
                          "ports": [{"name": "grpc", "port": PORT}, {"name": "data", "port": DATA_PORT}]}})
    docs.append(_ps_pdb(job))

    # completions unset: the Job is done once a worker exits 0 and the others have ended (the data is done)
    c, v = _container(job, "worker", role_args(job, "worker", chief_addr, JOB_PATH), None, False)
    docs.append(_batch_job(job, "worker", _pod(job, "worker", c, v), parallelism=workers))
    return docs


def tfjob(job: JobFile) -> list[dict[str, Any]]:
    """ConfigMap, PVC, the TFJob (Chief, PS, Worker replicas running ``shoal start``) and the ps PDB."""
    def replica(role: str, count: int) -> dict[str, Any]:
        state = role in ("chief", "ps")
        c, v = _container(job, role, ["start", "--config", JOB_PATH], TFJOB_PORT if state else None, state,
                          name="tensorflow")
        if role == "chief":       # TF_CONFIG places the roles; the state volume is the job's own
            c["env"].append({"name": "SHOAL_JOURNAL", "value": f"{STATE}/chief.db"})
            if job.get("checkpointing.dir") or job.get("checkpointing.interval"):
                c["env"].append({"name": "SHOAL_CHECKPOINT_DIR", "value": f"{STATE}/checkpoints"})
        c["ports"] = [{"name": "tfjob-port", "containerPort": TFJOB_PORT},
                      {"name": "metrics", "containerPort": METRICS_PORT}]
        if state:
            c.update(_probes(TFJOB_PORT))
        return {"replicas": count, "restartPolicy": "OnFailure", "template": _pod(job, role, c, v)}

    # the default success policy: the TFJob succeeds when the Chief exits 0 (chief/lifecycle.py)
    spec = {"runPolicy": {"cleanPodPolicy": "Running", "ttlSecondsAfterFinished": TTL_S, "backoffLimit": BACKOFF_LIMIT},
            "tfReplicaSpecs": {"Chief": replica("chief", 1), "PS": replica("ps", job.get("cluster.ps", 2)),
                               "Worker": replica("worker", job.get("cluster.workers", 2))}}
    pdb = _ps_pdb(job)
    # the operator labels its pods training.kubeflow.org/replica-type
    pdb["spec"]["selector"] = {"matchLabels": {"training.kubeflow.org/job-name": job.get("name", "shoal"),
                                               "training.kubeflow.org/replica-type": "ps"}}
    return [_configmap(job), _pvc(job),
            {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": _meta(job), "spec": spec}, pdb]


def render(docs: list[dict[str, Any]], job: JobFile, variant: str) -> str:
    header = (f"# Generated by `shoal k8s{' --tfjob' if variant == 'tfjob' else ''}` from {Path(job.path).name} "
              f"(job {job.get('name', 'shoal')}); regenerate, don't edit.\n")
    return header + yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False)


def cmd_k8s(args: argparse.Namespace) -> int:
    job = load_job(args.job_file)
    variants = {"native": native, "tfjob": tfjob}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for variant, make in variants.items():
            path = out / ("shoal.yaml" if variant == "native" else "tfjob.yaml")
            path.write_text(render(make(job), job, variant))
            print(f"wrote {path}", file=sys.stderr)
        path = out / "prometheus-rule.yaml"      # the alerting rules, for the Prometheus Operator
        path.write_text(alert_rules.render(alert_rules.prometheus_rule(job.get("name", "shoal")), "k8s"))
        print(f"wrote {path}", file=sys.stderr)
    else:
        variant = "tfjob" if args.tfjob else "native"
        sys.stdout.write(render(variants[variant](job), job, variant))
    return 0


def add_command(sub: Any, commands: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("k8s", help="write Kubernetes manifests for a job file")
    p.add_argument("job_file", help="the job file (YAML)")
    p.add_argument("--tfjob", action="store_true", help="a Kubeflow TFJob instead of Deployments/StatefulSet")
    p.add_argument("-o", "--out", help="a folder: write shoal.yaml (native), tfjob.yaml and prometheus-rule.yaml there "
                                       "(default: the chosen variant to standard output)")
    p.set_defaults(func=cmd_k8s)
    commands["k8s"] = p
