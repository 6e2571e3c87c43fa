"""The ``shoal`` command: one sub-command per role, plus ``local`` for a whole cluster."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import grpc

from shoal.cli import alert_rules, compose, k8s, observe, security
from shoal.cli.roles import _checkpoint_from, _epochs_env, _job_from, _push_window_env, cmd_chief, cmd_ps, cmd_worker
from shoal.cli.sources import add_commands as add_source_commands, apply_sources, export_job_file
from shoal.errors import EXIT_USAGE, InvalidArgument, ShoalError, Unavailable
from shoal.memory import tune_malloc
from shoal.settings.config import GRAD_NORM_POLICY, MODES, NONFINITE, RECOVERY
from shoal.settings.jobfile import load_job

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
    p.add_argument("--nonfinite", choices=NONFINITE, default=None,
                   help="a gradient holding NaN/Inf is never applied: skip (default; its batch counts as "
                        "skipped in the ledger and the summary, the run goes on), refuse (the job stops after a "
                        "few in a row from one worker) or stop (the job stops at the first, naming worker and step)")
    p.add_argument("--lr-factor", type=float, default=None,
                   help="update guard: a push may carry a learning rate of at most this times the job's (default 10)")
    p.add_argument("--grad-norm-factor", type=float, default=None,
                   help="update guard: a push's gradient norm at most this times the shard's running median "
                        "(default 100; 0: off)")
    p.add_argument("--grad-norm-policy", choices=GRAD_NORM_POLICY, default=None,
                   help="a push beyond --grad-norm-factor: refuse (default; the batch is trained again) or clip")
    p.add_argument("--grad-norm-warmup", type=int, default=None,
                   help="accepted pushes per shard before the running median is trusted (default 20)")
    p.add_argument("--expel-after", type=int, default=None,
                   help="a worker with this many refused updates in a row is expelled (default 10; 0: never)")
    p.add_argument("--require-batch", action=argparse.BooleanOptionalAction, default=None,
                   help="every push must name a batch of a data task its sender holds (on with shoal local "
                        "--secure; off lets a training loop outside the job's data tasks push)")


_CHIEF_HELP = "the chief's HOST:PORT (default $SHOAL_CHIEF, the job file's cluster.chief or TF_CONFIG)"
_CONFIG_HELP = "the job file (YAML): every setting, nested (see examples/job.yaml); flags win over it"


def _require_chief_and_script(args: argparse.Namespace) -> None:
    if hasattr(args, "chief") and not args.chief:
        raise InvalidArgument("no chief address: give --chief HOST:PORT, set SHOAL_CHIEF, cluster.chief in the "
                              "job file, or TF_CONFIG")
    if hasattr(args, "script") and args.command in ("worker", "local") and not args.script:
        raise InvalidArgument("no training script: name one, or set train.script in the job file (--config)")


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", default=os.environ.get("SHOAL_CHECKPOINT_DIR"),
                   help="take checkpoints here (shared with every ps); a new job resumes from the newest")
    p.add_argument("--checkpoint-interval", default=os.environ.get("SHOAL_CHECKPOINT_INTERVAL"),
                   help="model updates (500, the default) or a time (30s, 5m) between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=os.environ.get("SHOAL_KEEP_CHECKPOINTS", "3"),
                   help="how many complete checkpoints to keep (default 3)")


def cmd_local(args: argparse.Namespace) -> int:
    from shoal.cli.local import LocalConfig, run_local

    _push_window_env(args)
    _epochs_env(args)
    for flag, value in (("--ps", args.ps), ("--workers", args.workers)):
        if value < 1:
            raise InvalidArgument(f"{flag} must be >= 1, got {value}")
    shards = args.num_shards if args.num_shards is not None else args.ps
    if shards < 1:
        raise InvalidArgument(f"--num-shards must be >= 1, got {shards}")
    job = _job_from(args, shards)
    if args.secure and args.require_batch is None:      # a secure job: every push names its batch
        job = dataclasses.replace(job, require_batch=True)
    ckpt = _checkpoint_from(args)
    cfg = LocalConfig(script=args.script, script_args=tuple(args.script_args), num_ps=args.ps,
                      num_workers=args.workers, job=job, compression=args.compression or "none",
                      pull_codec=args.pull_codec or "none", transport=args.transport or "tcp", summary=args.summary or "", run_dir=args.run_dir or "",
                      restart=not args.no_restart, restart_backoff_s=args.restart_backoff,
                      allow_checkpoint_failures=args.allow_checkpoint_failures,
                      drain_s=args.drain_seconds,
                      checkpoint_dir=ckpt.directory if ckpt else "", checkpoint_interval=args.checkpoint_interval or "",
                      keep_checkpoints=args.keep_checkpoints, config=args.config or "", autoscale=args.autoscale,
                      tensorboard=observe.tensorboard_dir(args), metrics_port=observe.metrics_port(args),
                      alerts=observe.alert_config(args), secure=args.secure, hosts=_hosts_from(args.hosts))
    if args.autoscale and not (args.config and load_job(args.config).section("autoscaling")):
        raise InvalidArgument("--autoscale follows the job file's autoscaling section: give --config job.yaml "
                              "with autoscaling: {min_workers, max_workers, target}")
    return run_local(cfg)


def _hosts_from(path: str | None) -> tuple[tuple[str, tuple[str, ...], str], ...]:
    """``shoal local --hosts FILE`` (hidden): a JSON object, role -> {"prefix": argv, "address": bind address}."""
    if not path:
        return ()
    try:
        found = json.loads(Path(path).read_text())
        return tuple((role, tuple(h.get("prefix", ())), h.get("address", "127.0.0.1")) for role, h in found.items())
    except (OSError, ValueError, AttributeError) as exc:
        raise InvalidArgument(f"--hosts {path}: {exc}") from exc


def cmd_compare(args: argparse.Namespace) -> int:
    from shoal.cli.compare import run_compare

    if args.mode:
        raise InvalidArgument(f"shoal compare runs every mode given with --modes; drop --mode {args.mode}")
    for flag, value in (("--ps", args.ps), ("--workers", args.workers)):
        if value < 1:
            raise InvalidArgument(f"{flag} must be >= 1, got {value}")
    return run_compare(args, lambda mode: _job_from(argparse.Namespace(**{**vars(args), "mode": mode}), args.ps))


def cmd_export(args: argparse.Namespace) -> int:
    from shoal.state.checkpoint import export_checkpoint
    from shoal.state.checkpoint_failures import read_failure

    from shoal.cli.export_check import check_fresh, job_record
    from shoal.cli.tables_export import export_tables

    def check(ckpt) -> None:
        if args.allow_stale:
            return
        found = job_record(Path(ckpt.path).parent, args.journal,
                           lambda line: print(f"warning: {line}", file=sys.stderr))
        if found is not None:
            check_fresh(ckpt.step, Path(ckpt.path), *found)

    tables: list[str] = []
    try:
        out, ckpt = export_checkpoint(args.checkpoint, args.out, check,
                                      lambda ck, state, path: tables.extend(export_tables(ck, state, path)))
    except OSError as exc:
        raise ShoalError(f"cannot export {args.checkpoint} to {args.out}: {exc}") from exc
    print(f"wrote {out}: step {ckpt.step} from {ckpt.path}")
    for line in tables:
        print(f"  {line}")
    failure = read_failure(Path(ckpt.path).parent)
    if failure is not None and failure["step"] > ckpt.step:
        print(f"warning: {failure.get('failures', 1)} later checkpoint attempt(s) failed, the newest at step "
              f"{failure['step']} ({failure.get('error', '?')}): this export is older than the job's state",
              file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from shoal.cli.status import collect, render, to_json

    if args.watch is not None:
        from shoal.cli.watch import watch

        if not args.watch > 0:
            raise InvalidArgument(f"--watch takes seconds between refreshes (> 0), got {args.watch}")
        return watch(lambda: (to_json if args.json else render)(collect(args.chief)), args.watch)
    try:
        snapshot = collect(args.chief)
    except grpc.RpcError as exc:
        raise Unavailable(f"cannot reach the chief at {args.chief}: {exc.code().name}") from exc
    try:
        print(to_json(snapshot) if args.json else render(snapshot), flush=True)
    except BrokenPipeError:         # `shoal status | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
    return 0


def _env_number(name: str, fallback: float, kind: type) -> float:
    """A flag's default from ``$name``; a value that is not a number is one line naming the variable."""
    raw = os.environ.get(name)
    if raw is None:
        return fallback
    try:
        return kind(raw)
    except ValueError:
        print(f"shoal: error: ${name}: {raw!r} is not {'an integer' if kind is int else 'a number'}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Elastic parameter servers for PyTorch.")
    parser.add_argument("--log-level", default=os.environ.get("SHOAL_LOG_LEVEL", "info"),
                        help="debug, info (default, or $SHOAL_LOG_LEVEL), warning or error")
    sub = parser.add_subparsers(dest="command", required=True)

    commands = parser.commands = sub.choices   # name -> sub-parser: the job file and TF_CONFIG fill defaults
    p = sub.add_parser("chief", help="run the chief (membership, data tasks, routing)")
    p.add_argument("--bind", default=os.environ.get("SHOAL_BIND", "127.0.0.1:7070"),
                   help="address to listen on (default loopback; 0.0.0.0:7070 for every interface)")
    security.add_token_arg(p)
    p.add_argument("--num-shards", type=int, default=_env_number("SHOAL_NUM_SHARDS", 1, int),
                   help="how many parameter shards (one per ps process)")
    p.add_argument("--port-file", help="write the bound port here once serving")
    p.add_argument("--config", help=_CONFIG_HELP)
    p.add_argument("--journal", default=os.environ.get("SHOAL_JOURNAL", ""),
                   help="SQLite file to keep the chief's state in; a restarted chief carries on from it")
    p.add_argument("--fresh", action="store_true", help="move an existing --journal aside and start the job over")
    p.add_argument("--end-drain", type=float, default=os.environ.get("SHOAL_END_DRAIN", "30"),
                   metavar="SECONDS",
                   help="once the job has ended, keep the chief and its servers up at most this long (workers "
                        "evaluate and read the final weights; default 30, sooner once no worker is left for a "
                        "lease), then they all exit with the job's exit code; inf: until stopped")
    _job_args(p)
    _checkpoint_args(p)
    observe.add_args(p)
    p.set_defaults(func=cmd_chief)

    from shoal.cli.compare import add_parser as add_compare

    add_compare(sub, _job_args)
    sub.choices["compare"].set_defaults(func=cmd_compare)

    p = sub.add_parser("export", help="write a checkpoint's weights as a plain state_dict (torch.save); "
                                      "fixed embedding tables go into it, dynamic ones beside it as "
                                      "<out>.<table>.rows.npz")
    p.add_argument("checkpoint", help="a checkpoint directory, or the checkpoint dir (its newest valid checkpoint)")
    p.add_argument("out", help="output file, e.g. model.pt")
    p.add_argument("--journal", default=os.environ.get("SHOAL_JOURNAL", ""),
                   help="the job's chief journal, which records failed checkpoints (default: the one the chief "
                        "named in <checkpoint dir>/job.json)")
    p.add_argument("--allow-stale", action="store_true",
                   help="export a checkpoint older than the job's last applied update (exit 73 without it)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("status", help="print the job at a glance")
    p.add_argument("--chief", default=os.environ.get("SHOAL_CHIEF"), help=_CHIEF_HELP)
    p.add_argument("--config", help=_CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh in place every SECONDS (default 2) until Ctrl-C")
    security.add_token_arg(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("ps", help="run one parameter server")
    p.add_argument("--chief", default=os.environ.get("SHOAL_CHIEF"), help=_CHIEF_HELP)
    p.add_argument("--config", help=_CONFIG_HELP)
    p.add_argument("--bind", default=os.environ.get("SHOAL_BIND", "127.0.0.1:0"),
                   help="address to listen on (default loopback; 0.0.0.0:PORT for every interface)")
    security.add_token_arg(p)
    p.add_argument("--advertise", default=os.environ.get("SHOAL_ADVERTISE", ""),
                   help="host name workers use to reach this server (default: bind host or hostname)")
    p.add_argument("--data-port", type=int, default=os.environ.get("SHOAL_DATA_PORT", "0"),
                   help="port of the raw TCP data channel on the bind host (default 0: any free port)")
    p.add_argument("--no-data-channel", action="store_true",
                   help="offer no TCP data channel: workers push and pull over gRPC")
    p.add_argument("--chief-timeout", type=float, default=_env_number("SHOAL_CHIEF_TIMEOUT", 300.0, float),
                   help="give up (exit 69) after this many seconds without reaching the chief (default 300)")
    p.add_argument("--port-file", help="write the bound port here once serving")
    observe.add_args(p, tensorboard=False)
    p.set_defaults(func=cmd_ps)

    for name, helptext in (("worker", "run a training script as a worker"),
                           ("local", "run chief, parameter servers and workers on this host")):
        p = sub.add_parser(name, help=helptext)
        if name == "worker":
            p.add_argument("--chief", default=os.environ.get("SHOAL_CHIEF"), help=_CHIEF_HELP)
            p.add_argument("--config", help=_CONFIG_HELP)
            p.add_argument("--connect-timeout", type=float, default=None,
                           help="seconds to keep trying to join the chief before exiting with status 69 "
                                "(default: $SHOAL_CONNECT_TIMEOUT or 30)")
        else:
            p.add_argument("--ps", type=int, default=2, help="parameter servers")
            p.add_argument("--num-shards", type=int, default=None,
                           help="parameter shards (default: one per server); the chief spreads them over the "
                                "servers, at most ceil(shards / servers) primaries each")
            p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
            p.add_argument("--summary", help="write a JSON run summary here when training ends")
            p.add_argument("--run-dir", help="folder for pids.json and port files (default: a temp dir)")
            p.add_argument("--config", help=_CONFIG_HELP)
            p.add_argument("--no-restart", action="store_true", help="do not restart crashed roles")
            p.add_argument("--allow-checkpoint-failures", action="store_true",
                           help="a run whose checkpoints failed exits 0, not 73 (docs/exit-codes.md)")
            p.add_argument("--autoscale", action="store_true",
                           help="start and stop workers to follow the chief's desired count (the job file's "
                                "autoscaling section); --workers is the count to start with")
            p.add_argument("--restart-backoff", type=float, default=1.0,
                           help="seconds before the first restart of a crashed role; doubles each time")
            p.add_argument("--drain-seconds", type=float, default=60.0,
                           help="after the script's workers end, wait this long for workers that joined "
                                "from outside to leave before stopping the servers")
            p.add_argument("--secure", action="store_true",
                           help="generate a job token in the run dir and give it to every role")
            p.add_argument("--hosts", help=argparse.SUPPRESS)   # role -> argv prefix and address (JSON file)
            _job_args(p)
            _checkpoint_args(p)
        security.add_token_arg(p)
        p.add_argument("--compression", default=None, help="gradient codec, e.g. none, bf16, topk, sign+lz4")
        p.add_argument("--pull-codec", default=None, choices=("none", "fp16", "bf16"),
                       help="codec of weight pulls: bf16 or fp16 halve their bytes (default none)")
        p.add_argument("--transport", default=None, choices=("tcp", "grpc"),
                       help="carry pushes and pulls over the parameter servers' TCP data channel (tcp, the "
                            "default, when they offer one) or over gRPC")
        p.add_argument("--push-window", type=int, default=None,
                       help="pushes a worker leaves unanswered at once, each shard's pull starting when its push "
                            "is answered (default: $SHOAL_PUSH_WINDOW or 0, every push at once); for slow "
                            "links, with --num-shards well above the servers (bench/RESULTS.md, issue 16)")
        observe.add_args(p, alerts=True)
        p.add_argument("--epochs", type=int, default=None,
                       help="epochs the job trains, for a script that adopts shoal with "
                            "shoal.worker.distribute() (as $SHOAL_EPOCHS; default: the job file's train.epochs)")
        p.add_argument("script", nargs="?", help="the training script (default: the job file's train.script)")
        p.add_argument("script_args", nargs=argparse.REMAINDER)
        p.set_defaults(func=cmd_worker if name == "worker" else cmd_local)
    add_source_commands(sub, commands)
    for module in (compose, k8s, alert_rules):        # deployment generators
        module.add_command(sub, commands)
    parser.set_defaults(run_argv=main)       # shoal start runs the role TF_CONFIG names through main again
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args = apply_sources(parser, parser.commands, argv, args)
        _require_chief_and_script(args)
    except ShoalError as exc:
        print(f"shoal {args.command}: error: {exc}", file=sys.stderr)
        return 2
    export_job_file(args)
    _setup_logging(args.log_level)
    tune_malloc()
    try:
        security.apply(args)
        return args.func(args)
    except ShoalError as exc:
        print(f"shoal {args.command}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", EXIT_USAGE)   # e.g. EXIT_REFUSED: a supervisor must not restart it

