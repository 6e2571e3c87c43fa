"""``shoal k8s job.yaml``: Kubernetes manifests for the job, native or as a Kubeflow ``TFJob``.

Native set: a ConfigMap with the job file; a PVC for the chief's journal and the checkpoints
(ReadWriteMany: every parameter server writes its shards' files); the chief as a one-replica
Deployment (``Recreate``: one journal writer) behind a Service; the parameter servers as a
StatefulSet behind a headless Service (stable names ``<job>-ps-K.<job>-ps``, what workers dial) with
a PodDisruptionBudget; the workers as a Deployment that ``kubectl scale`` resizes, and, with an
``autoscaling`` section, a HorizontalPodAutoscaler on the chief's ``shoal_autoscale_desired_workers``
metric. Probes use Kubernetes' native gRPC probes on the health service.

``--tfjob``: the same job as a ``TFJob``; the operator sets ``TF_CONFIG`` and every replica runs
``shoal start``, which takes its role and place from it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from shoal.cli.compose import DATA_PORT, PORT, Dumper, role_args
from shoal.jobfile import JobFile, dump, load_job

JOB_DIR = "/etc/shoal"
JOB_PATH = f"{JOB_DIR}/job.yaml"
STATE = "/var/lib/shoal"
TFJOB_PORT = 2222            # the port the TFJob operator puts in TF_CONFIG (tfjob-port)
GRACE_S = 30                 # SIGTERM, then this long before SIGKILL: a worker hands back its task
DESIRED_METRIC = "shoal_autoscale_desired_workers"
METRICS_PORT = 9400          # every pod's /metrics, announced to Prometheus by the prometheus.io annotations


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


def _pod(job: JobFile, role: str, container: dict, volumes: list[dict], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"labels": {**_meta(job, role=role)["labels"]},
                         "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                                         "prometheus.io/path": "/metrics"}},
            "spec": {"terminationGracePeriodSeconds": GRACE_S, "securityContext": {"fsGroup": 10001},
                     "containers": [container], "volumes": volumes,
                     **spec}}


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
    """ConfigMap, PVC, chief Deployment + Service, ps StatefulSet + headless Service + PDB, workers, HPA."""
    name = job.get("name", "shoal")
    chief_addr = f"{name}-chief:{PORT}"
    num_ps, workers = job.get("cluster.ps", 2), job.get("cluster.workers", 2)
    docs = [_configmap(job), _pvc(job)]

    c, v = _container(job, "chief", _state_args(role_args(job, "chief", chief_addr, JOB_PATH)), PORT, True)
    docs.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(job, "chief", "chief"),
                 "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                          "selector": {"matchLabels": _selector(job, "chief")},
                          "template": _pod(job, "chief", c, v)}})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": _meta(job, "chief", "chief"),
                 "spec": {"selector": _selector(job, "chief"),
                          "ports": [{"name": "grpc", "port": PORT, "targetPort": "grpc"}]}})

    ps_args = [*role_args(job, "ps", chief_addr, JOB_PATH), "--advertise", f"$(POD_NAME).{name}-ps"]
    c, v = _container(job, "ps", _state_args(ps_args), PORT, True)
    c["env"].append({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    c["ports"].append({"name": "data", "containerPort": DATA_PORT})
    docs.append({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(job, "ps", "ps"),
                 "spec": {"serviceName": f"{name}-ps", "replicas": num_ps, "podManagementPolicy": "Parallel",
                          "selector": {"matchLabels": _selector(job, "ps")},
                          "template": _pod(job, "ps", c, v)}})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": _meta(job, "ps", "ps"),
                 "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                          "selector": _selector(job, "ps"),
                          "ports": [{"name": "grpc", "port": PORT}, {"name": "data", "port": DATA_PORT}]}})
    docs.append(_ps_pdb(job))

    c, v = _container(job, "worker", role_args(job, "worker", chief_addr, JOB_PATH), None, False)
    docs.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(job, "worker", "worker"),
                 "spec": {"replicas": workers, "selector": {"matchLabels": _selector(job, "worker")},
                          "template": _pod(job, "worker", c, v)}})
    if job.section("autoscaling"):
        docs.append(_hpa(job))
    return docs


def _hpa(job: JobFile) -> dict[str, Any]:
    """Scales the workers to the chief's desired count: an External metric with an average value of 1
    per pod makes the HPA's replicas ceil(desired / 1) = desired (through a metrics adapter that
    serves the chief's Prometheus metric, e.g. prometheus-adapter)."""
    auto = job.section("autoscaling")
    low = auto.get("min_workers", 1)
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(job, "worker", "worker"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": _meta(job, "worker")["name"]},
                     "minReplicas": low, "maxReplicas": max(low, auto.get("max_workers", low)),
                     "metrics": [{"type": "External", "external": {
                         "metric": {"name": DESIRED_METRIC,
                                    "selector": {"matchLabels": {"job": job.get("name", "shoal")}}},
                         "target": {"type": "AverageValue", "averageValue": "1"}}}],
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 60}}}}


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

    spec = {"runPolicy": {"cleanPodPolicy": "Running"},
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
    else:
        variant = "tfjob" if args.tfjob else "native"
        sys.stdout.write(render(variants[variant](job), job, variant))
    return 0


def add_command(sub: Any, commands: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("k8s", help="write Kubernetes manifests for a job file")
    p.add_argument("job_file", help="the job file (YAML)")
    p.add_argument("--tfjob", action="store_true", help="a Kubeflow TFJob instead of Deployments/StatefulSet")
    p.add_argument("-o", "--out", help="a folder: write shoal.yaml (native) and tfjob.yaml there "
                                       "(default: the chosen variant to standard output)")
    p.set_defaults(func=cmd_k8s)
    commands["k8s"] = p
