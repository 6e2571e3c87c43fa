"""Where a command's settings come from besides its flags: the job file (``--config``) and ``TF_CONFIG``.

Precedence, lowest first: built-in defaults, the job file, ``TF_CONFIG`` (placement only: the chief's
address, this task's bind port and host name, the number of shards), ``SHOAL_*`` variables, flags.
Both become the sub-command's argparse defaults, so a flag given on the command line always wins.
Also the small commands that only read settings: ``shoal config --print``, ``shoal health``,
``shoal start`` (a role from ``TF_CONFIG``).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping

from shoal.settings import tfconfig
from shoal.settings.config import JobConfig
from shoal.errors import InvalidArgument, ShoalError
from shoal.settings.jobfile import ENV_JOB_FILE, JobFile, dump, load_job

TF_COMMANDS = ("chief", "ps", "worker", "status")


def tf_defaults(tf: tfconfig.TFConfig, command: str, dests: Mapping[str, Any]) -> dict[str, Any]:
    """What ``TF_CONFIG`` says for ``command``'s flags; a SHOAL_* variable for a flag keeps its say."""
    out: dict[str, Any] = {"chief": tf.chief}
    if command == tf.role and command in ("chief", "ps"):
        out["bind"] = f"0.0.0.0:{tf.port}"
    if command == "ps" and tf.role == "ps":
        out["advertise"] = tf.host
    if command == "chief" and tf.num_ps:
        out["num_shards"] = tf.num_ps
    return {k: v for k, v in out.items() if k in dests and f"SHOAL_{k.upper()}" not in os.environ}


def apply_sources(parser: argparse.ArgumentParser, commands: Mapping[str, argparse.ArgumentParser],
                  argv: list[str] | None, args: argparse.Namespace) -> argparse.Namespace:
    """Parses ``argv`` again with the job file's and TF_CONFIG's values as the command's defaults."""
    path = getattr(args, "config", None)
    job = load_job(path) if path else None
    tf = tfconfig.from_env() if args.command in TF_COMMANDS else None
    if job is None and tf is None:
        return args
    present = vars(args)
    defaults = job.defaults_for(args.command, present) if job else {}
    if job is not None and getattr(args, "script", None):
        defaults.pop("script_args", None)     # a script named on the command line brings its own arguments
    if tf is not None:
        defaults.update(tf_defaults(tf, args.command, present))
    commands[args.command].set_defaults(**defaults)
    if job is not None and job.get("log_level") and "SHOAL_LOG_LEVEL" not in os.environ:
        parser.set_defaults(log_level=job.get("log_level"))
    out = parser.parse_args(argv)
    if job is not None and not getattr(args, "script", None) and not getattr(out, "script_args", True):
        out.script_args = list(defaults.get("script_args", []))   # argparse gives REMAINDER no default
    return out


def export_job_file(args: argparse.Namespace) -> None:
    """Names the job file in ``$SHOAL_JOB_FILE`` for the script's Trainer (and a local cluster's workers)."""
    if getattr(args, "config", None):
        os.environ[ENV_JOB_FILE] = os.path.abspath(args.config)


def autoscale_policy(args: argparse.Namespace):
    """The chief's autoscaling policy: the job file's ``autoscaling`` section (None without one)."""
    from shoal.chief.autoscale import AutoscalePolicy

    section = load_job(args.config).section("autoscaling") if getattr(args, "config", None) else {}
    try:
        return AutoscalePolicy.from_section(section) if section else None
    except InvalidArgument as exc:
        raise InvalidArgument(f"{args.config}: {exc}") from None


def straggler_policy(args: argparse.Namespace):
    """The chief's straggler handling: the job file's ``straggler_detection`` section (None without one)."""
    from shoal.chief.stragglers import StragglerPolicy

    section = load_job(args.config).section("straggler_detection") if getattr(args, "config", None) else {}
    try:
        return StragglerPolicy.from_section(section) if section else None
    except InvalidArgument as exc:
        raise InvalidArgument(f"{args.config}: {exc}") from None


def job_config(job: JobFile) -> JobConfig:
    """The job file's training settings as the chief's :class:`JobConfig` (checks how they combine)."""
    values = {"mode": job.get("train.mode"), "backup_workers": job.get("train.backup_workers"),
              "staleness": job.get("train.staleness"), "num_shards": job.get("cluster.ps"),
              "lease_seconds": job.get("cluster.lease_seconds"), "replicas": job.get("cluster.replicas"),
              "recovery": job.get("recovery")}
    try:
        return JobConfig(**{k: v for k, v in values.items() if v is not None})
    except InvalidArgument as exc:
        raise InvalidArgument(f"{job.path}: {exc}") from None


def validate(job: JobFile) -> None:
    """Everything a role would check at start-up: the settings dataclasses, the codec, the interval."""
    from shoal.chief.checkpointer import Interval
    from shoal.codecs import known_codecs

    job_config(job)
    codec = job.get("compression.codec")
    if codec is not None and codec not in known_codecs():
        raise InvalidArgument(f"{job.path}: compression.codec: {codec!r} is not one of "
                              f"{', '.join(sorted(known_codecs()))}")
    if job.get("checkpointing.interval") is not None:
        Interval.parse(job.get("checkpointing.interval"))
    if job.get("checkpointing.interval") is not None and not job.get("checkpointing.dir"):
        raise InvalidArgument(f"{job.path}: checkpointing.interval needs checkpointing.dir")


def cmd_config(args: argparse.Namespace) -> int:
    job = load_job(args.job_file)
    validate(job)
    print(dump(job), end="")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the server at ADDRESS says SERVING, 1 otherwise (for container health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shoal.net.rpc import open_channel

    try:    # TLS when this process's environment (SHOAL_TLS_*, the role's own) says the roles speak it
        with open_channel(args.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"shoal health: {args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"shoal health: {args.address}: {name}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{args.address}: {name}")
    return 0


def start_argv(tf: tfconfig.TFConfig, config: str | None, rest: list[str]) -> list[str]:
    """The ``shoal`` command line of this task's role: ``shoal start`` runs it."""
    argv = [tf.role]
    if config:
        argv += ["--config", config]
    if tf.role == "worker":
        argv += rest
    elif rest:
        raise InvalidArgument(f"a {tf.role} takes no script or arguments, got {' '.join(rest)!r}")
    return argv


def cmd_start(args: argparse.Namespace) -> int:
    """Runs the role TF_CONFIG names through ``args.run_argv`` (the CLI's ``main``, set by its parser)."""
    tf = tfconfig.from_env()
    if tf is None:
        raise ShoalError(f"shoal start needs {tfconfig.ENV} (the cluster spec and this task's type and index)")
    return args.run_argv(start_argv(tf, args.config, [*([args.script] if args.script else []), *args.script_args]))


def add_commands(sub: Any, commands: dict[str, argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="check a job file and print the merged, validated settings")
    p.add_argument("--print", action="store_true", help="print the result (the default)")
    p.add_argument("job_file", help="the job file (YAML)")
    p.set_defaults(func=cmd_config)
    commands["config"] = p

    p = sub.add_parser("health", help="exit 0 when the server at HOST:PORT is serving (gRPC health)")
    p.add_argument("address", help="HOST:PORT of a chief or parameter server")
    p.add_argument("--service", default="", help="a named service (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing when healthy")
    p.set_defaults(func=cmd_health)
    commands["health"] = p

    p = sub.add_parser("start", help="run the role TF_CONFIG names (chief, ps or worker), placed by it")
    p.add_argument("--config", help="the job file (YAML)")
    p.add_argument("script", nargs="?", help="a worker's training script (default: the job file's train.script)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_start)
    commands["start"] = p
