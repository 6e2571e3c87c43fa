"""The commands that run one role in this process: ``shoal chief``, ``shoal ps`` and ``shoal worker``
(a training script under the launcher). ``shoal.cli.main`` builds the parser and hands them their args."""
from __future__ import annotations

import argparse
import gc
import logging
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

from shoal.cli import observe, security
from shoal.cli.sources import autoscale_policy, straggler_policy
from shoal.errors import (EXIT_REFUSED, EXIT_ROLLBACK, EXIT_UNREACHABLE, JOB_FINISHED, InvalidArgument, Refused,
                          ShoalError, Unreachable)
from shoal.settings.config import JobConfig, from_sources

log = logging.getLogger("shoal")


def _job_from(args: argparse.Namespace, num_shards: int) -> JobConfig:
    # the job file's settings (--config) arrive as the flags' defaults (shoal.cli.sources)
    return from_sources(JobConfig,
                        cli={"mode": args.mode, "backup_workers": args.backup_workers, "staleness": args.staleness,
                             "lease_seconds": args.lease_seconds, "num_shards": num_shards,
                             "replicas": args.replicas, "recovery": args.recovery,
                             "nonfinite": args.nonfinite, "lr_factor": args.lr_factor,
                             "grad_norm_factor": args.grad_norm_factor, "grad_norm_policy": args.grad_norm_policy,
                             "grad_norm_warmup": args.grad_norm_warmup, "expel_after": args.expel_after,
                             "require_batch": args.require_batch})


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


def _freeze_heap() -> None:
    """Moves every object alive now (the imports, some 40 000: the chief does not import torch, whose
    alone are 180 000) out of the garbage collector's reach. Otherwise every full collection scans
    them all, with the chief's event loop stopped, a stall in the heartbeats' latency tail; what is
    created later is collected as before. For a long-running process only: what was garbage at this
    point stays allocated."""
    gc.collect()
    gc.freeze()


def cmd_chief(args: argparse.Namespace) -> int:
    from shoal.chief.server import ChiefServer

    job = _job_from(args, args.num_shards)
    tensorboard, metrics_port = observe.tensorboard_dir(args), observe.metrics_port(args)
    security.warn_if_exposed("shoal chief", args.bind)
    if not args.end_drain >= 0:
        raise InvalidArgument(f"--end-drain must be >= 0 seconds (inf: until stopped), got {args.end_drain:g}")
    server = ChiefServer(job, bind=args.bind, journal=args.journal or None, fresh=args.fresh,
                         checkpoint=_checkpoint_from(args), autoscale=autoscale_policy(args), drain_s=args.end_drain,
                         stragglers=straggler_policy(args))
    server.watch(tensorboard, metrics_port).start()       # a metrics port in use fails before serving
    _freeze_heap()
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
    threading.Thread(target=lambda: (server.closed.wait(), done.set()), daemon=True).start()
    _serve_until_signalled(server, done)
    if server.servicer.lost_journal:        # members of the job whose journal this was reached it
        print(f"shoal chief: error: {server.servicer.lost_journal}", file=sys.stderr)
        return EXIT_REFUSED
    if server.servicer.failed is not None:
        print(f"shoal chief: error: {server.servicer.failed}", file=sys.stderr)
        return 1
    if server.closed.is_set():        # the job ended and drained (chief/lifecycle.py)
        ending = server.state.lifecycle.ending
        if ending.exit_code:
            print(f"shoal chief: the job failed: {ending.result}", file=sys.stderr)
        return ending.exit_code
    if server.stopped.is_set():
        print(f"shoal chief: job stopped: {server.state.stopped}", file=sys.stderr)
        return EXIT_ROLLBACK
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    from shoal.ps.server import PSServer

    if not 0 <= args.data_port <= 65535:
        raise InvalidArgument(f"--data-port must be a port number (0: any free one), got {args.data_port}")
    if not args.chief_timeout > 0:
        raise InvalidArgument(f"--chief-timeout must be > 0 seconds, got {args.chief_timeout}")
    metrics_port = observe.metrics_port(args)
    security.warn_if_exposed("shoal ps", args.bind)
    server = PSServer(args.chief, bind=args.bind, advertise=args.advertise,
                      data_port=None if args.no_data_channel else args.data_port,
                      chief_timeout_s=args.chief_timeout).start()
    try:
        server.serve_metrics(metrics_port)
    except ShoalError:
        server.stop(grace_s=0.5)                          # leaves the job it just joined
        raise
    _write_port(args.port_file, server.port)
    _serve_until_signalled(server, server.done)
    if server.gave_up_reason:
        print(f"shoal ps: error: {server.gave_up_reason}", file=sys.stderr)
        return server.gave_up_code
    if server.job_exit_code:
        print(f"shoal ps: the job failed: {server.job_result}", file=sys.stderr)
        return server.job_exit_code
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    os.environ["SHOAL_CHIEF"] = args.chief
    if args.compression:
        os.environ["SHOAL_COMPRESSION"] = args.compression
    if args.pull_codec:
        os.environ["SHOAL_PULL_CODEC"] = args.pull_codec
    if args.transport:
        os.environ["SHOAL_TRANSPORT"] = args.transport
    _push_window_env(args)
    _epochs_env(args)
    os.environ.update(observe.worker_env(args))
    if args.connect_timeout is not None:
        if not args.connect_timeout > 0:
            raise InvalidArgument(f"--connect-timeout must be > 0 seconds, got {args.connect_timeout:g}")
        os.environ["SHOAL_CONNECT_TIMEOUT"] = str(args.connect_timeout)
    script = Path(args.script)
    if not script.is_file():
        raise ShoalError(f"training script {args.script!r} does not exist")
    from shoal.cli.threads import set_worker_threads
    from shoal.worker.trainer import request_stop

    set_worker_threads()

    def on_sigterm(*_: object) -> None:
        """docker stop, kubectl delete pod, a spot notice: the Trainer hands back its task, leaves and
        exits 0. Outside ``trainer.batches`` (set-up, evaluation), or on a second SIGTERM: die as usual."""
        if not request_stop():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)       # a second one ends the process at once

    signal.signal(signal.SIGTERM, on_sigterm)
    sys.argv = [str(script), *args.script_args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except Refused as exc:
        if JOB_FINISHED in str(exc):              # joined a job that has ended: nothing to do, not a failure
            print(f"shoal worker: {str(exc).split(': ', 1)[-1]}; exiting", file=sys.stderr)
            return 0
        print(f"shoal worker: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except Unreachable as exc:          # one line, and a code that says whether to restart
        print(f"shoal worker: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED if isinstance(exc, Refused) else EXIT_UNREACHABLE
    return 0


def _epochs_env(args: argparse.Namespace) -> None:
    """``--epochs`` reaches ``shoal.worker.distribute()`` in every worker as ``$SHOAL_EPOCHS``."""
    if args.epochs is not None:
        if args.epochs < 1:
            raise InvalidArgument(f"--epochs must be >= 1, got {args.epochs}")
        os.environ["SHOAL_EPOCHS"] = str(args.epochs)


def _push_window_env(args: argparse.Namespace) -> None:
    """``--push-window`` reaches the workers' Trainer as ``$SHOAL_PUSH_WINDOW`` (worker/pipeline.py)."""
    if args.push_window is not None:
        if args.push_window < 0:
            raise InvalidArgument(f"--push-window must be >= 0 (0: every push at once), got {args.push_window}")
        os.environ["SHOAL_PUSH_WINDOW"] = str(args.push_window)
