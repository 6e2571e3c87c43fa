"""``shoal local``: a whole cluster as separate processes on this host.

Starts the chief, the parameter servers and the workers, streams their logs
with role prefixes, writes a run summary, and stops every child on Ctrl-C or
when the workers are done. Children die with the supervisor (PR_SET_PDEATHSIG),
so a killed supervisor leaves no orphans.
"""
from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import grpc

from shoal.observe.alerts import AlertConfig
from shoal.security import auth, tls
from shoal.cli.certs import make_local_pki
from shoal.settings.config import JobConfig
from shoal.cli.outcome import mark, run_code, stopped_code
from shoal.errors import EXIT_INTERRUPTED, EXIT_ROLLBACK, EXIT_STOPPED, InvalidArgument, outcome
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import RETRYABLE, open_channel
from shoal.cli.local_config import LocalConfig  # noqa: F401  (re-exported: shoal.cli.local.LocalConfig)
from shoal.cli.scaler import WorkerScaler
from shoal.cli.status import collect, exactly_once, replica_digests, replicas_identical, shards_readable
from shoal.cli.progress import Console, result_lines
from shoal.cli.records import add_records, build_summary, read_settled, violation, write_json
from shoal.cli import observe
from shoal.cli.ending import finish
from shoal.cli.threads import WorkerThreads
from shoal.cli.supervise import RestartPolicy, failure_signature, job_data_done, stopped_in_journal, traceback_tail

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def guard_flags(job: JobConfig) -> list[str]:
    """The update guard's settings as the chief's flags (ps/guard.py)."""
    return ["--lr-factor", repr(job.lr_factor), "--grad-norm-factor", repr(job.grad_norm_factor),
            "--grad-norm-policy", job.grad_norm_policy, "--grad-norm-warmup", str(job.grad_norm_warmup),
            "--expel-after", str(job.expel_after), "--require-batch" if job.require_batch else "--no-require-batch"]


class JobStopped(RuntimeError):
    """The job cannot go on (and cannot roll back). ``exit_code``: ``shoal local``'s (shoal/cli/outcome.py)."""

    def __init__(self, message: str, exit_code: int = EXIT_STOPPED):
        super().__init__(message)
        self.exit_code = exit_code


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], out: IO[str]):
        self.name = name
        self.started = time.monotonic()
        self.last_line = ""            # the child's last line of output: on a failure, usually why
        self.tail: collections.deque[str] = collections.deque(maxlen=40)   # its last lines (a traceback)
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self._pump = threading.Thread(target=self._stream, args=(out,), name=f"log-{name}", daemon=True)
        self._pump.start()

    def _stream(self, out: IO[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            out.write(f"[{self.name}] {line}")
            out.flush()
            if line.strip():
                self.last_line = line.strip()
                self.tail.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", self.name, grace_s)
                self.proc.kill()
                self.proc.wait()
        self._pump.join(timeout=2)


class LocalCluster:
    def __init__(self, cfg: LocalConfig, out: IO[str] = sys.stdout):
        self.cfg = cfg
        self.out = out
        self.children: dict[str, Child] = {}
        self.run_dir = Path(cfg.run_dir or tempfile.mkdtemp(prefix="shoal-local-"))
        # the chief's journal (its signing secret, 0600 itself) and the job token live here: a run dir this
        # creates is its owner's only (mkdtemp's is too); one the user named keeps the mode it has
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # one TensorBoard run per role, under one folder per run, so runs of several modes overlay
        tb_parent = Path(cfg.tensorboard) if cfg.tensorboard else self.run_dir / "tb"
        self.cfg = cfg = replace(cfg, tensorboard=str(tb_parent / (cfg.run_name or observe.run_name(cfg.job.mode))))
        if cfg.secure:
            self._secure()
        self.chief_address = ""
        self._launch: dict[str, tuple[list[str], dict[str, str] | None]] = {}
        self.policy = RestartPolicy(cfg.restart, cfg.max_restarts, cfg.restart_backoff_s)
        self.restarts = self.policy.restarts
        self._gone: set[str] = set()          # servers left down (no restart): the job goes on without them
        self.exits: dict[str, int] = {}       # workers that ended for good: name -> exit status
        self.after_data: set[str] = set()     # workers that failed once the job's data was done: not a failure
        self.rollbacks = 0
        self._restart_at: dict[str, float] = {}
        self.scaler: WorkerScaler | None = None
        self.threads = WorkerThreads(cfg.num_workers)      # each worker's share of the cores

    def _secure(self) -> None:
        """A job token and mutual TLS for every role started from here (their files in the run dir),
        unless the command line already gave them."""
        if auth.job_token() is None:
            os.environ[auth.TOKEN_ENV] = str(auth.write_token_file(self.run_dir / "job.token"))
            auth.reset()
            auth.job_token()
        if not tls.config().enabled:
            for name, path in make_local_pki(self.run_dir / "tls").items():
                os.environ[tls.ENV[name]] = path
            os.environ[tls.ENV["mutual"]] = "1"
            tls.reset()
            tls.config()

    def _host(self, name: str) -> tuple[list[str], str]:
        """The argv prefix that starts ``name`` on its host, and the address it binds there."""
        for role, prefix, address in self.cfg.hosts:
            if role == name:
                return list(prefix), address
        return [], "127.0.0.1"

    def _spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> Child:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHOAL_METRICS_DIR": str(self.run_dir / "metrics"),
               **(extra_env or {})}
        child = Child(name, [*self._host(name)[0], sys.executable, "-m", "shoal.cli", *args], env, self.out)
        self.children[name] = child
        self._launch[name] = (args, extra_env)
        self._write_pids()
        return child

    def _write_pids(self) -> None:
        tmp = self.run_dir / "pids.json.tmp"
        tmp.write_text(json.dumps({n: c.pid for n, c in self.children.items()}))
        tmp.replace(self.run_dir / "pids.json")

    def _wait_port(self, path: Path, child: Child) -> int:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return int(path.read_text())
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode} before serving")
            time.sleep(0.05)
        raise RuntimeError(f"{child.name} did not report its port within {self.cfg.startup_timeout_s:.0f}s")

    def start(self) -> None:
        job = self.cfg.job
        port_file = self.run_dir / "chief.port"
        for stale in (port_file, self.run_dir / "chief.address"):   # a run dir used before: not this chief's
            stale.unlink(missing_ok=True)
        chief = self._spawn("chief", ["chief", "--bind", f"{self._host('chief')[1]}:0", "--port-file", str(port_file),
                                      "--mode", job.mode, "--num-shards", str(job.num_shards),
                                      "--backup-workers", str(job.backup_workers),
                                      "--staleness", str(job.staleness),
                                      "--lease-seconds", str(job.lease_seconds),
                                      "--replicas", str(job.replicas), "--recovery", job.recovery,
                                      "--nonfinite", job.nonfinite, *guard_flags(job),
                                      "--end-drain", "inf",     # this supervisor reads the records, then stops them
                                      "--journal", str(self._new_journal()), *self._checkpoint_args(),
                                      *(["--config", self.cfg.config] if self.cfg.config else []),
                                      *observe.local_role_flags(self.cfg, "chief", 0)])
        self.chief_address = f"{self._host('chief')[1]}:{self._wait_port(port_file, chief)}"
        (self.run_dir / "chief.address").write_text(self.chief_address)
        for k in range(self.cfg.num_ps):
            self._spawn(f"ps{k}", ["ps", "--chief", self.chief_address, "--bind", f"{self._host(f'ps{k}')[1]}:0",
                                   *observe.local_role_flags(self.cfg, "ps", k)])
        for k in range(self.cfg.num_workers):
            self.start_worker(f"worker{k}")
        if self.cfg.autoscale:
            self.scaler = WorkerScaler(self.chief_address, self.workers, self.start_worker, self.cfg.num_workers)

    def _checkpoint_args(self) -> list[str]:
        c = self.cfg
        if not c.checkpoint_dir:
            return []
        return ["--checkpoint-dir", c.checkpoint_dir, "--keep-checkpoints", str(c.keep_checkpoints),
                *(["--checkpoint-interval", c.checkpoint_interval] if c.checkpoint_interval else [])]

    def _new_journal(self) -> Path:
        """``<run-dir>/chief.db``: a restarted chief (same arguments) carries on from it. A journal left
        by an earlier run in the same run dir belongs to another job, so it is removed first."""
        path = self.run_dir / "chief.db"
        for suffix in ("", "-wal", "-shm", ".job"):       # .job: the job's marker (chief/identity.py)
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return path

    def start_worker(self, name: str) -> Child:
        index = name.removeprefix("worker")
        return self._spawn(name, ["worker", "--chief", self.chief_address, "--compression", self.cfg.compression,
                                  "--pull-codec", self.cfg.pull_codec, "--transport", self.cfg.transport,
                                  self.cfg.script, *self.cfg.script_args],
                           {"SHOAL_LOCAL_INDEX": index, **self.threads.env(),
                            **observe.local_worker_env(self.cfg, int(index or 0), self.run_dir)})

    def workers(self) -> list[Child]:
        return [c for n, c in self.children.items() if n.startswith("worker")]

    def wait_workers(self) -> dict[str, int]:
        """Supervises until every worker has finished and no role waits for a restart (a chief or a
        server that died as the workers ended is brought back: the job's records live there)."""
        while True:
            self.supervise()
            if self.scaler is not None:
                self.scaler.poll(time.monotonic())
            if all(w.name in self.exits for w in self.workers()) and not self._restart_at:
                return dict(self.exits)
            time.sleep(0.05)

    def supervise(self) -> None:
        """One round: notes exits, restarts crashed roles when their backoff is over, rolls back."""
        now = time.monotonic()
        for name, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None or name in self.exits:
                continue
            if name == "chief" and (code == EXIT_ROLLBACK or stopped_in_journal(self.run_dir / "chief.db")):
                self._rollback()
                self.exits.clear()
                break
            if name.startswith("worker") and (code == 0 or (self.scaler and name in self.scaler.scaled_in)):
                self.exits[name] = code          # done, or asked to leave by the autoscaler
            elif name not in self._restart_at and name not in self._gone:
                if name.startswith("worker") and code > 0 and self._data_done():
                    child._pump.join(timeout=1)
                    log.warning("%s exited with %s after the job's data was done; the job is not failed for "
                                "it: %s", self.shown(name), code, traceback_tail(child.tail, 1))
                    self.exits[name] = code
                    self.after_data.add(name)
                else:
                    self._on_failure(name, child, code, now, self.exits)
        for name, when in list(self._restart_at.items()):
            if now >= when:
                del self._restart_at[name]
                self._restart(name)

    def _rollback(self) -> None:
        """The chief stopped the job (a shard lost every copy, --recovery consistent): start every role
        again, so the job resumes from the newest checkpoint; without checkpoints, give up."""
        if not self.cfg.checkpoint_dir:
            raise JobStopped("a shard lost every copy and --recovery consistent stops the job; there is no "
                             "--checkpoint-dir to roll back to (see the chief's log line above)", EXIT_ROLLBACK)
        log.warning("the chief stopped the job; rolling back: restarting every role from the newest checkpoint")
        for c in self.children.values():
            c.terminate()
        for c in self.children.values():
            c.stop()
        self._restart_at.clear()
        self.rollbacks += 1
        for name in ["chief"] + sorted(n for n in self._launch if n.startswith("ps")) + \
                sorted(n for n in self._launch if n.startswith("worker")):
            args, env = self._launch[name]
            if name == "chief":
                args = self._same_port(args)
            self._spawn(name, args, env)

    def shown(self, name: str) -> str:
        """A child as the chief names it (``worker-0``, what its log lines and ``shoal status`` show), with
        the launcher's own name when they differ (``worker-0 (process worker1)``)."""
        names = getattr(self.out, "names", None)
        member = names.get(name) if names is not None else name
        return member if member == name else f"{member} (process {name})"

    def _data_done(self) -> bool:
        return job_data_done(self.chief_address)

    def _on_failure(self, name: str, child: Child, code: int, now: float, exits: dict[str, int]) -> None:
        """Restart ``name`` later, or give up on it, or (an exit that would repeat) stop the run now."""
        child._pump.join(timeout=1)           # its last lines: how it failed
        signature = failure_signature(code, child.tail) if name.startswith("worker") else ""
        d = self.policy.on_exit(name, code, child.started, now, signature)
        if d.restart:
            log.warning("%s exited with %s; restarting it in %.1fs (restart %d of at most %d)", self.shown(name), code,
                        d.delay_s, self.restarts.get(name, 0) + 1, self.cfg.max_restarts)
            self._restart_at[name] = now + d.delay_s
            return
        last = f": {child.last_line}" if child.last_line else ""
        if signature and not signature.startswith("exit "):
            last = ":\n" + traceback_tail(child.tail)      # the script's own error: where and what
        if d.fatal or name == "chief":
            raise JobStopped(f"{self.shown(name)} exited with {code} and is not restarted ({d.why}){last}",
                             stopped_code(code))
        if name.startswith("worker"):
            exits[name] = code
        else:
            log.warning("%s exited with %s and is not restarted (%s); the job goes on without it", self.shown(name),
                        code, d.why)
            self._gone.add(name)

    def _same_port(self, chief_args: list[str]) -> list[str]:
        """The chief's arguments with the port it was given first, so a restart serves the same address."""
        host, port = self.chief_address.rsplit(":", 1)
        return [a if a != f"{host}:0" else f"{host}:{port}" for a in chief_args]

    def _restart(self, name: str) -> None:
        args, env = self._launch[name]
        if name == "chief":            # same port: every member still knows the old address
            args = self._same_port(args)
        self.policy.restarted(name)
        self._spawn(name, args, env)

    def drain(self) -> int:
        """Waits (at most ``drain_s``) until no worker holds a lease; returns how many still do.

        Workers that joined from outside (``shoal worker`` against this cluster)
        finish their last batches, evaluate and report after the job's data is
        done; stopping the servers under them would leave them retrying.
        """
        deadline = time.monotonic() + self.cfg.drain_s
        channel = open_channel(self.chief_address)
        try:
            stub = pb_grpc.ChiefStub(channel)
            while True:
                try:
                    view = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=5)
                    live = [m.member_id for m in view.members
                            if m.role == pb.WORKER and m.state in ("alive", "idle")]
                except grpc.RpcError as exc:
                    if exc.code() in RETRYABLE and time.monotonic() < deadline:
                        self.supervise()           # the chief may be on its way back
                        time.sleep(0.1)
                        continue
                    log.warning("could not read the view to drain workers: %s", exc.code().name)
                    return -1
                if not live or time.monotonic() >= deadline:
                    if live:
                        log.warning("stopping with %d worker(s) still joined: %s", len(live), ", ".join(live))
                    return len(live)
                time.sleep(0.1)
        finally:
            channel.close()

    def job_stats(self) -> pb.JobStats | None:
        def read() -> pb.JobStats:
            channel = open_channel(self.chief_address)
            try:
                return pb_grpc.ChiefStub(channel).GetJobStats(pb.Empty(), timeout=10)
            finally:
                channel.close()

        return read_settled(read, lambda _: True, 0.0, "job stats from the chief", self.supervise)

    def shard_report(self, settle_s: float = 5.0, unreadable_s: float = 60.0) -> dict | None:
        """Shard versions and ledgers, read before the servers stop.

        Every shard must answer from a primary that holds it: a chief restarted from its journal
        routes a shard to a primary that died with it until that primary's lease runs out and its
        backup is promoted, so an unreachable or uninitialised primary is read again (for up to
        ``unreadable_s``), never taken as the shard's record (it has no version and no ledger).
        A sync round a departed worker pushed into closes once its shard sees the
        worker gone; wait (briefly) for every shard to have no open round.
        """
        return read_settled(lambda: collect(self.chief_address),
                             lambda r: all(not sh.get("round_pending") for sh in r["shards"]), settle_s,
                             "shard status", self.supervise, unavailable_s=unreadable_s, ready=shards_readable)

    def final_checkpoint(self, target: int, wait_s: float = 60.0) -> int:
        """Waits (at most ``wait_s``) for the chief to commit the checkpoint of the final state, at
        shard version ``target``; returns the step of the newest checkpoint it knows (-1: unreadable)."""
        t0 = time.monotonic()
        deadline = t0 + wait_s
        step = -1
        while True:
            stats = self.job_stats()
            failing = False
            if stats is not None:
                step = max(stats.checkpoint_step, stats.restored_step)
                if step >= target:
                    return step
                # the final attempt itself fails (a full disk): a few retries (2 s apart), not the whole wait
                failing = stats.checkpoint_failed_step >= target > 0 and time.monotonic() - t0 >= min(wait_s, 10.0)
            if time.monotonic() >= deadline or failing:
                log.warning("the final checkpoint (step %d) was not written within %.0fs; the newest is step %d "
                            "(see the chief's log for why)", target, time.monotonic() - t0, step)
                return step
            time.sleep(0.2)

    def replica_report(self, settle_s: float = 10.0) -> dict | None:
        """Digests of every shard's copies; waits (briefly) for a backup still being filled."""
        return read_settled(lambda: replica_digests(self.chief_address),
                             lambda d: replicas_identical(d) is not False, settle_s, "replica digests",
                             self.supervise)

    def stop(self) -> None:
        if self.scaler is not None:
            self.scaler.close()
        order = self.workers() + [c for n, c in self.children.items() if n.startswith("ps")]
        chief = [c for n, c in self.children.items() if n == "chief"]
        for group in (order, chief):  # the chief last, so members can leave cleanly
            for c in group:
                c.terminate()
            for c in group:     # a server's orderly leave (Leave, drain, gRPC grace) can take a few seconds
                c.stop(grace_s=5.0 if c in self.workers() else 10.0)


def run_local(cfg: LocalConfig, out: IO[str] = sys.stdout) -> int:
    console = Console(out)
    cluster = LocalCluster(cfg, console)
    console.open_log(cluster.run_dir / "shoal.log")
    started = time.monotonic()
    interrupted = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        interrupted.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
        console.follow(cluster.chief_address)
        end = finish(cluster, started)
        codes, seconds, stats, shards, replicas, final_step = (end.codes, end.seconds, end.stats, end.shards,
                                                               end.replicas, end.final_step)
    except KeyboardInterrupt:
        console.close()
        log.info("interrupted: stopping the cluster")
        cluster.stop()
        return EXIT_INTERRUPTED
    except JobStopped as exc:
        console.close()
        log.error("job stopped: %s (exit %d: %s)", exc, exc.exit_code, outcome(exc.exit_code))
        cluster.stop()
        if cfg.summary:
            write_json(Path(cfg.summary), mark({**build_summary(cfg, {}, time.monotonic() - started, None),
                                                 "error": str(exc), "restarts": dict(cluster.restarts),
                                                 "rollbacks": cluster.rollbacks}, exc.exit_code))
        return exc.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)
    console.close()
    cluster.stop()
    console.close_log()
    ok = any(c == 0 for c in codes.values()) and all(c == 0 or c < 0 or n in cluster.after_data
                                                     for n, c in codes.items())
    summary = build_summary(cluster.cfg, codes, seconds, stats)
    add_records(summary, shards, replicas, final_step, cfg.checkpoint_dir)
    summary["restarts"] = dict(cluster.restarts)
    summary["rollbacks"] = cluster.rollbacks
    broken = violation(summary)
    code = run_code(summary, ok, broken, cfg.allow_checkpoint_failures)
    mark(summary, code)
    if cfg.summary:
        write_json(Path(cfg.summary), summary)
    if summary.get("checkpoints_failed"):
        log.error("%d checkpoint attempt(s) FAILED, the newest at step %d (%s); the newest checkpoint is step %s; "
                  "missing steps: %s", summary["checkpoints_failed"], summary["checkpoint_failed_step"],
                  summary["checkpoint_error"], summary.get("checkpoint_step", "none"),
                  ", ".join(map(str, summary.get("checkpoint_missing_steps", []))) or "none")
    if summary.get("lost_shards") and summary.get("exactly_once") is True:   # after the final checkpoint
        log.warning("shard(s) %s lost every live copy once the final checkpoint held all their updates: their "
                    "records were read from it", summary["lost_shards"])
    elif summary.get("lost_shards"):
        log.error("shard(s) %s lost acknowledged updates during the run (--recovery %s): exactly_once is %s",
                  summary["lost_shards"], summary.get("recovery", "?"),
                  "unknown" if summary.get("exactly_once", False) is None else "false")
    if broken:
        log.error("%s", broken)
    out.write("\n".join(result_lines(summary, ok and not broken, cfg.summary, console.log_path)) + "\n")
    if code:
        out.write(f"exit {code}: {outcome(code)} (docs/exit-codes.md)\n")
    out.flush()
    return code
