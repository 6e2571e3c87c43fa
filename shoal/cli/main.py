"""The ``shoal`` command: one sub-command per role, plus ``local`` for a whole cluster."""
from __future__ import annotations

import argparse
import logging
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

import grpc

from shoal.config import MODES, RECOVERY, JobConfig, from_sources, load_yaml
from shoal.memory import tune_malloc
from shoal.errors import (EXIT_REFUSED, EXIT_ROLLBACK, EXIT_UNREACHABLE, InvalidArgument, Refused, ShoalError,
                          Unavailable, Unreachable)

log = logging.getLogger("shoal")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, default=None, help="sync (default), async or ssp")
    p.add_argument("--backup-workers", type=int, default=None, help="sync: close a round without the b slowest")
    p.add_argument("--staleness", type=int, default=None, help="ssp: how many versions a worker may run ahead")
    p.add_argument("--lease-seconds", type=float, default=None, help="drop a member after this long without heartbeat")
    p.add_argument("--replicas", type=int, default=None,
                   help="copies of each shard on distinct parameter servers: 1 or 2 (default 2 with 2+ shards)")
    p.add_argument("--recovery", choices=RECOVERY, default=None,
                   help="a shard that lost every copy: consistent (default) rolls back to the newest checkpoint, "
                        "fast goes on from a worker's weights")


def _job_from(args: argparse.Namespace, num_shards: int) -> JobConfig:
    yaml_values = load_yaml(args.config) if getattr(args, "config", None) else {}
    job_keys = {"mode", "backup_workers", "staleness", "lease_seconds", "num_shards", "replicas", "recovery"}
    return from_sources(JobConfig, yaml_values={k: v for k, v in yaml_values.items() if k in job_keys},
                        cli={"mode": args.mode, "backup_workers": args.backup_workers, "staleness": args.staleness,
                             "lease_seconds": args.lease_seconds, "num_shards": num_shards,
                             "replicas": args.replicas, "recovery": args.recovery})


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", default=os.environ.get("SHOAL_CHECKPOINT_DIR"),
                   help="take checkpoints here (shared with every ps); a new job resumes from the newest")
    p.add_argument("--checkpoint-interval", default=os.environ.get("SHOAL_CHECKPOINT_INTERVAL"),
                   help="model updates (500, the default) or a time (30s, 5m) between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=os.environ.get("SHOAL_KEEP_CHECKPOINTS", "3"),
                   help="how many complete checkpoints to keep (default 3)")


def _checkpoint_from(args: argparse.Namespace):
    """The validated checkpoint settings, or None without --checkpoint-dir."""
    from shoal.chief.checkpointer import CheckpointConfig, Interval

    if not args.checkpoint_dir:
        if args.checkpoint_interval:
            raise InvalidArgument(f"--checkpoint-interval {args.checkpoint_interval!r} needs --checkpoint-dir")
        return None
    return CheckpointConfig(str(Path(args.checkpoint_dir).resolve()), Interval.parse(args.checkpoint_interval or "500"),
                            args.keep_checkpoints)


def _serve_until_signalled(server, stop: threading.Event | None = None) -> None:
    """Serves until SIGTERM/SIGINT, or until ``stop`` is set by the server itself."""
    stop = stop or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping")
    server.stop()


def _write_port(path: str | None, port: int) -> None:
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(path)


def cmd_chief(args: argparse.Namespace) -> int:
    from shoal.chief.server import ChiefServer

    job = _job_from(args, args.num_shards)
    server = ChiefServer(job, bind=args.bind, journal=args.journal or None, fresh=args.fresh,
                         checkpoint=_checkpoint_from(args)).start()
    _write_port(args.port_file, server.port)
    done = threading.Event()

    def end_after_stop() -> None:      # stay up a little so every member hears why the job stopped
        server.stopped.wait()
        time.sleep(2 * server.job.lease_seconds)
        done.set()

    threading.Thread(target=end_after_stop, daemon=True).start()
    if server.state.stopped:
        server.stopped.set()
    threading.Thread(target=lambda: (server.failed.wait(), done.set()), daemon=True).start()
    _serve_until_signalled(server, done)
    if server.servicer.failed is not None:
        print(f"shoal chief: error: {server.servicer.failed}", file=sys.stderr)
        return 1
    if server.stopped.is_set():
        print(f"shoal chief: job stopped: {server.state.stopped}", file=sys.stderr)
        return EXIT_ROLLBACK
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    from shoal.ps.server import PSServer

    if not 0 <= args.data_port <= 65535:
        raise InvalidArgument(f"--data-port must be a port number (0: any free one), got {args.data_port}")
    server = PSServer(args.chief, bind=args.bind, advertise=args.advertise,
                      data_port=None if args.no_data_channel else args.data_port).start()
    _write_port(args.port_file, server.port)
    _serve_until_signalled(server)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    os.environ["SHOAL_CHIEF"] = args.chief
    if args.compression:
        os.environ["SHOAL_COMPRESSION"] = args.compression
    if args.pull_codec:
        os.environ["SHOAL_PULL_CODEC"] = args.pull_codec
    if args.transport:
        os.environ["SHOAL_TRANSPORT"] = args.transport
    if args.connect_timeout is not None:
        if not args.connect_timeout > 0:
            raise InvalidArgument(f"--connect-timeout must be > 0 seconds, got {args.connect_timeout:g}")
        os.environ["SHOAL_CONNECT_TIMEOUT"] = str(args.connect_timeout)
    script = Path(args.script)
    if not script.is_file():
        raise ShoalError(f"training script {args.script!r} does not exist")
    sys.argv = [str(script), *args.script_args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except (Refused, Unreachable) as exc:          # one line, and a code that says whether to restart
        print(f"shoal worker: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED if isinstance(exc, Refused) else EXIT_UNREACHABLE
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    from shoal.cli.local import LocalConfig, run_local

    for flag, value in (("--ps", args.ps), ("--workers", args.workers)):
        if value < 1:
            raise InvalidArgument(f"{flag} must be >= 1, got {value}")
    job = _job_from(args, args.ps)
    ckpt = _checkpoint_from(args)
    cfg = LocalConfig(script=args.script, script_args=tuple(args.script_args), num_ps=args.ps,
                      num_workers=args.workers, job=job, compression=args.compression or "none",
                      pull_codec=args.pull_codec or "none", transport=args.transport or "tcp", summary=args.summary or "", run_dir=args.run_dir or "",
                      restart=not args.no_restart, restart_backoff_s=args.restart_backoff,
                      drain_s=args.drain_seconds,
                      checkpoint_dir=ckpt.directory if ckpt else "", checkpoint_interval=args.checkpoint_interval or "",
                      keep_checkpoints=args.keep_checkpoints)
    return run_local(cfg)


def cmd_export(args: argparse.Namespace) -> int:
    from shoal.checkpoint import export_to_file

    try:
        out = export_to_file(args.checkpoint, args.out)
    except OSError as exc:
        raise ShoalError(f"cannot export {args.checkpoint} to {args.out}: {exc}") from exc
    print(f"wrote {out}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from shoal.cli.status import collect, render, to_json

    try:
        snapshot = collect(args.chief)
    except grpc.RpcError as exc:
        raise Unavailable(f"cannot reach the chief at {args.chief}: {exc.code().name}") from exc
    print(to_json(snapshot) if args.json else render(snapshot))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Elastic parameter servers for PyTorch.")
    parser.add_argument("--log-level", default=os.environ.get("SHOAL_LOG_LEVEL", "info"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chief", help="run the chief (membership, data tasks, routing)")
    p.add_argument("--bind", default=os.environ.get("SHOAL_BIND", "0.0.0.0:7070"))
    p.add_argument("--num-shards", type=int, default=int(os.environ.get("SHOAL_NUM_SHARDS", "1")),
                   help="how many parameter shards (one per ps process)")
    p.add_argument("--port-file", help="write the bound port here once serving")
    p.add_argument("--config", help="YAML file with job settings (mode, staleness, ...)")
    p.add_argument("--journal", default=os.environ.get("SHOAL_JOURNAL", ""),
                   help="SQLite file to keep the chief's state in; a restarted chief carries on from it")
    p.add_argument("--fresh", action="store_true", help="move an existing --journal aside and start the job over")
    _job_args(p)
    _checkpoint_args(p)
    p.set_defaults(func=cmd_chief)

    p = sub.add_parser("export", help="write a checkpoint's weights as a plain state_dict (torch.save)")
    p.add_argument("checkpoint", help="a checkpoint directory, or the checkpoint dir (its newest valid checkpoint)")
    p.add_argument("out", help="output file, e.g. model.pt")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("status", help="print the job at a glance")
    p.add_argument("--chief", default=os.environ.get("SHOAL_CHIEF"), required="SHOAL_CHIEF" not in os.environ)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("ps", help="run one parameter server")
    p.add_argument("--chief", default=os.environ.get("SHOAL_CHIEF"), required="SHOAL_CHIEF" not in os.environ)
    p.add_argument("--bind", default=os.environ.get("SHOAL_BIND", "0.0.0.0:0"))
    p.add_argument("--advertise", default=os.environ.get("SHOAL_ADVERTISE", ""),
                   help="host name workers use to reach this server (default: bind host or hostname)")
    p.add_argument("--data-port", type=int, default=os.environ.get("SHOAL_DATA_PORT", "0"),
                   help="port of the raw TCP data channel on the bind host (default 0: any free port)")
    p.add_argument("--no-data-channel", action="store_true",
                   help="offer no TCP data channel: workers push and pull over gRPC")
    p.add_argument("--port-file", help="write the bound port here once serving")
    p.set_defaults(func=cmd_ps)

    for name, helptext in (("worker", "run a training script as a worker"),
                           ("local", "run chief, parameter servers and workers on this host")):
        p = sub.add_parser(name, help=helptext)
        if name == "worker":
            p.add_argument("--chief", default=os.environ.get("SHOAL_CHIEF"),
                           required="SHOAL_CHIEF" not in os.environ)
            p.add_argument("--connect-timeout", type=float, default=None,
                           help="seconds to keep trying to join the chief before exiting with status 69 "
                                "(default: $SHOAL_CONNECT_TIMEOUT or 30)")
        else:
            p.add_argument("--ps", type=int, default=2, help="parameter servers (= shards)")
            p.add_argument("--workers", type=int, default=2)
            p.add_argument("--summary", help="write a JSON run summary here when training ends")
            p.add_argument("--run-dir", help="folder for pids.json and port files (default: a temp dir)")
            p.add_argument("--config", help="YAML file with job settings")
            p.add_argument("--no-restart", action="store_true", help="do not restart crashed roles")
            p.add_argument("--restart-backoff", type=float, default=1.0,
                           help="seconds before the first restart of a crashed role; doubles each time")
            p.add_argument("--drain-seconds", type=float, default=60.0,
                           help="after the script's workers end, wait this long for workers that joined "
                                "from outside to leave before stopping the servers")
            _job_args(p)
            _checkpoint_args(p)
        p.add_argument("--compression", default=None, help="gradient codec, e.g. none, bf16, topk, sign+lz4")
        p.add_argument("--pull-codec", default=None, choices=("none", "fp16", "bf16"))
        p.add_argument("--transport", default=None, choices=("tcp", "grpc"),
                       help="carry pushes and pulls over the parameter servers' TCP data channel (tcp, the "
                            "default, when they offer one) or over gRPC")
        p.add_argument("script")
        p.add_argument("script_args", nargs=argparse.REMAINDER)
        p.set_defaults(func=cmd_worker if name == "worker" else cmd_local)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    tune_malloc()
    try:
        return args.func(args)
    except ShoalError as exc:
        print(f"shoal {args.command}: error: {exc}", file=sys.stderr)
        return 2

