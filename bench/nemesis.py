"""Nemesis: the digits example under a random schedule of faults, then invariants from the run's records.

Each schedule is drawn from a seed: SIGKILL of any role (the chief included),
SIGSTOP/SIGCONT past a lease or within it, the chief and a primary killed at the
same moment, a checkpoint file corrupted under the job, a worker joining from
outside and leaving again, (with ``--disk-faults``) the checkpoint disk full
for a few seconds: the checkpoint directory is a small tmpfs of its own (root
only) that the nemesis fills and frees again, and (with ``--install-kills``) a
ps killed and, once restarted, the other ps, the primary of every shard, killed
before, during or just after the restart's first copy (bench/nemesis_install.py). With ``--netns``
every role runs on a host of its own (a network namespace, root) and the network fails too: a host
cut off and healed, the chief split from one server while the workers reach both, a slowed link
(bench/nemesis_net.py); ``--model wide`` trains a 300k-parameter model. ``shoal local`` supervises the job (restarting what it
kills); the nemesis only hurts it. After the run it checks, from the run's own
records (the summary, the checkpoint directory, the process table):

- ``ended``: the run ended within its time bound (success or a clear failure), no hang;
- ``succeeded``: it ended with exit 0 (a failure must name its reason: ``summary["error"]``);
- ``exactly_once``: every batch of every epoch applied once per shard (the shards' ledgers);
- ``all_tasks_done``;
- ``replicas_identical``: every backup byte-identical to its primary;
- ``final_checkpoint``: the newest valid checkpoint is at the final version and restores
  to exactly the servers' final weights and optimizer state (their own sha256 digests);
- ``export_scores``: ``shoal export`` of it loads strictly into the model and scores the
  job's test accuracy (within 0.02);
- ``no_stray_process``: every process the run started is gone.
- ``no_leftover_namespace`` (``--netns``): every host it made is removed.

Prints one JSON object per schedule (seed, schedule, verdicts, violations); a schedule
with violations can be replayed with ``--replay '<its schedule JSON>'``.

    .venv/bin/python bench/nemesis.py --seeds 1 2 3          # fixed seeds
    .venv/bin/python bench/nemesis.py --count 50 --first 100 # 50 schedules from seeds 100..149
    .venv/bin/python bench/nemesis.py --count 10 --disk-faults  # the checkpoint disk fills, too
    .venv/bin/python bench/nemesis.py --count 30 --first 800 --install-kills  # primaries die around a copy, too
    .venv/bin/python bench/nemesis.py --netns --count 30 --first 500   # network faults too (root)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nemesis_install

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.py")
SHOAL = [sys.executable, "-m", "shoal.cli"]
ROLES = ("chief", "ps0", "ps1", "worker0", "worker1")
ACTIONS = ("kill", "pause", "kill_chief_and_primary", "corrupt_checkpoint", "join_leave")
DISK_ACTIONS = ACTIONS + ("disk_full",)        # --disk-faults (ACTIONS alone: earlier seeds replay unchanged)
INSTALL_ACTIONS = ("install_kill",)            # --install-kills, after DISK_ACTIONS' (the same reason)
NET_ACTIONS = ("partition", "split_chief_ps", "slow_link")   # --netns (bench/nemesis_net.py), likewise
MODELS = {"digits": 256, "wide": 4000}       # the example's --hidden: 19,210 parameters, or 300,010 (wide)
CKPT_FS_BYTES = 64 << 20                       # the checkpoint tmpfs that disk_full fills
LEASE_S = 1.5


@dataclass
class Fault:
    at: float               # seconds after training is under way
    action: str             # one of ACTIONS
    target: str = ""        # a role name, where the action takes one
    seconds: float = 0.0    # how long a pause lasts / an outside worker stays
    point: str = ""         # install_kill: when the primary dies (before/during/after the copy)


@dataclass
class Schedule:
    seed: int
    epochs: int = 2
    mode: str = "sync"
    faults: list[Fault] = field(default_factory=list)
    model: str = "digits"                    # a key of MODELS
    netns: bool = False                      # every role on a host of its own (network namespaces)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Schedule":
        return cls(d["seed"], d.get("epochs", 2), d.get("mode", "sync"), [Fault(**f) for f in d["faults"]],
                   d.get("model", "digits"), d.get("netns", False))


def draw(seed: int, faults: int = 2, disk: bool = False, net: bool = False, model: str = "digits",
         install: bool = False) -> Schedule:
    """A schedule of ``faults`` faults from ``seed``: the same seed (and flags) always gives the same schedule."""
    rng = random.Random(seed)
    s = Schedule(seed, epochs=rng.choice((2, 3)), mode=rng.choice(("sync", "async")), model=model, netns=net)
    for _ in range(faults):
        action = rng.choice((DISK_ACTIONS if disk else ACTIONS) + (NET_ACTIONS if net else ())
                            + (INSTALL_ACTIONS if install else ()))
        at = round(rng.uniform(0.0, 6.0), 2)
        if action in NET_ACTIONS:
            s.faults.append(Fault(at, action, *nemesis_net().draw(rng, action, LEASE_S)))
        elif action == "kill":
            s.faults.append(Fault(at, action, rng.choice(ROLES)))
        elif action == "pause":                      # within the lease, or well past it
            s.faults.append(Fault(at, action, rng.choice(ROLES),
                                  round(rng.choice((0.3 * LEASE_S, 2.5 * LEASE_S)), 2)))
        elif action == "kill_chief_and_primary":
            s.faults.append(Fault(at, action, rng.choice(("ps0", "ps1"))))
        elif action == "corrupt_checkpoint":
            s.faults.append(Fault(at, action))
        elif action == "disk_full":                  # frees it again well before the job ends
            s.faults.append(Fault(at, action, "", round(rng.uniform(1.0, 4.0), 2)))
        elif action == "install_kill":
            s.faults.append(Fault(at, action, **nemesis_install.draw(rng, s)))
        else:
            s.faults.append(Fault(at, action, "", round(rng.uniform(2.0, 6.0), 2)))
    s.faults.sort(key=lambda f: f.at)
    return s


def nemesis_net():
    import nemesis_net as net                     # bench/: needs root and ip netns, so only with --netns

    return net


# ---------------------------------------------------------------- the run

class Run:
    def __init__(self, schedule: Schedule, work: Path, bound_s: float, net=None):
        self.s = schedule
        self.net = net                               # nemesis_net.Net: the hosts, with --netns
        self.work = work
        self.bound_s = bound_s
        self.ckpts = work / "ckpts"
        self.run_dir = work / "run"
        self.seen_pids = SeenProcesses()
        self.outside: list[subprocess.Popen] = []
        self.log: list[str] = []                     # what the nemesis did, with times
        self.corrupted: set[int] = set()             # steps of the checkpoints it damaged
        self.own_fs = False                          # the checkpoint directory is a tmpfs of this run's
        self.t0 = 0.0
        self.proc: subprocess.Popen | None = None    # shoal local

    def pids(self) -> dict[str, int]:
        try:
            found = json.loads((self.run_dir / "pids.json").read_text())
        except (OSError, ValueError):
            return {}
        self.seen_pids.update(found.values())
        return found

    def note(self, what: str) -> None:
        self.log.append(f"{time.monotonic() - self.t0:6.2f}s {what}")

    def signal(self, role: str, sig: signal.Signals) -> None:
        pid = self.pids().get(role)
        if pid:
            try:
                os.kill(pid, sig)
                self.note(f"{sig.name} {role} ({pid})")
            except ProcessLookupError:
                self.note(f"{sig.name} {role}: already gone")

    def steps(self) -> int:
        from shoal.proto import shoal_pb2 as pb
        from shoal.proto import shoal_pb2_grpc as pb_grpc
        from shoal.net.rpc import open_channel

        try:
            address = (self.run_dir / "chief.address").read_text()
        except OSError:
            return 0
        if self.net:
            return self.net.steps(address)
        ch = open_channel(address)
        try:
            return pb_grpc.ChiefStub(ch).GetJobStats(pb.Empty(), timeout=2).totals.steps
        except Exception:  # noqa: BLE001 - the chief may be down: that is the point
            return 0
        finally:
            ch.close()

    def apply(self, f: Fault) -> None:
        if f.action in NET_ACTIONS:
            self.net.apply(f.action, f.target, f.seconds, self.note)
        elif f.action == "kill":
            self.signal(f.target, signal.SIGKILL)
        elif f.action == "pause":
            self.signal(f.target, signal.SIGSTOP)
            time.sleep(f.seconds)
            self.signal(f.target, signal.SIGCONT)
        elif f.action == "kill_chief_and_primary":
            steps = self.steps()                     # where in training it lands (the end, on a slow machine)
            pids = self.pids()
            for role in ("chief", f.target):
                if role in pids:
                    try:
                        os.kill(pids[role], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self.note(f"SIGKILL chief and {f.target} at once (after {steps} worker steps)")
        elif f.action == "corrupt_checkpoint":
            from shoal.state.checkpoint import list_checkpoints

            found = list_checkpoints(self.ckpts)
            files = sorted(found[0].glob("shard-*.pt")) if found else []
            if files:
                data = bytearray(files[0].read_bytes())
                data[len(data) // 2] ^= 0xFF
                files[0].write_bytes(bytes(data))
                self.corrupted.add(int(found[0].name.split("-")[1]))
                self.note(f"corrupted {found[0].name}/{files[0].name}")
            else:
                self.note("corrupt_checkpoint: no checkpoint yet")
        elif f.action == "disk_full":
            self.fill_disk(f.seconds)
        elif f.action == "install_kill":
            nemesis_install.apply(self, f)
        elif f.action == "join_leave":
            address = (self.run_dir / "chief.address").read_text()
            log = open(self.work / f"outside{len(self.outside)}.log", "w")
            p = subprocess.Popen([*self.on("outside"), *SHOAL, "worker", "--chief", address, DIGITS, *self.script_args()],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.outside.append(p)
            self.seen_pids.add(p.pid)
            self.note(f"outside worker joined ({p.pid})")
            time.sleep(f.seconds)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                self.note(f"outside worker left (SIGTERM {p.pid})")

    def fill_disk(self, seconds: float) -> None:
        """Fills the checkpoint filesystem (ENOSPC for every write), then frees it after ``seconds``."""
        if not self.own_fs:
            self.note("disk_full: skipped (the checkpoint directory is not a filesystem of its own: not root?)")
            return
        # one file per fault: two that overlap (seed 1031) must not free each other's
        fd, name = tempfile.mkstemp(prefix=".nemesis-filler-", dir=self.ckpts)
        filler = Path(name)
        with os.fdopen(fd, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        self.note(f"checkpoint disk full ({filler.stat().st_size >> 20} MB filler) for {seconds}s")
        time.sleep(seconds)
        filler.unlink()
        self.note("checkpoint disk freed")

    def mount_checkpoint_fs(self) -> None:
        """A tmpfs of its own under the checkpoint directory, when a schedule fills it (root only)."""
        self.ckpts.mkdir(parents=True, exist_ok=True)
        if not any(f.action == "disk_full" for f in self.s.faults) or os.geteuid() != 0:
            return
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={CKPT_FS_BYTES}", "tmpfs", str(self.ckpts)],
                           capture_output=True, text=True)
        self.own_fs = r.returncode == 0
        if not self.own_fs:
            self.note(f"could not mount a tmpfs for the checkpoints: {r.stderr.strip()}")

    def unmount_checkpoint_fs(self) -> None:
        if self.own_fs:
            subprocess.run(["umount", "-l", str(self.ckpts)], capture_output=True)
            self.own_fs = False

    def script_args(self) -> list[str]:
        # a step of at least 30 ms: with one torch thread per worker (shoal local's default since issue 36)
        # a digits step takes a few ms, and a schedule's faults (seconds into training) came after the end
        return ["--epochs", str(self.s.epochs), "--step-delay", "0.03", "--hidden", str(MODELS[self.s.model])]

    def on(self, host: str) -> list[str]:
        """The argv prefix that runs a command on ``host`` (nothing without --netns)."""
        return self.net.prefix(host) if self.net else []

    def go(self) -> dict:
        self.mount_checkpoint_fs()
        self.t0 = time.monotonic()
        log = open(self.work / "local.log", "w")
        proc = subprocess.Popen([*self.on("ops"), *SHOAL, "local", *(self.net.local_args() if self.net else []),
                                 "--run-dir", str(self.run_dir), "--summary",
                                 str(self.work / "summary.json"), "--ps", "2", "--workers", "2", "--mode", self.s.mode,
                                 "--lease-seconds", str(LEASE_S), "--restart-backoff", "0.2",
                                 "--checkpoint-dir", str(self.ckpts), "--checkpoint-interval", "10",
                                 DIGITS, *self.script_args()],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.seen_pids.add(proc.pid)
        self.proc = proc
        try:
            return self._drive(proc)
        except BaseException:                       # the nemesis itself stopped: leave nothing behind
            for p in (proc, *self.outside):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            raise

    def _drive(self, proc: subprocess.Popen) -> dict:
        deadline = self.t0 + self.bound_s
        while self.steps() < 5 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        start = time.monotonic()
        threads = []
        for f in self.s.faults:
            def one(f: Fault = f) -> None:
                time.sleep(max(0.0, start + f.at - time.monotonic()))
                if proc.poll() is None:
                    self.apply(f)
            t = threading.Thread(target=one, daemon=True)
            t.start()
            threads.append(t)
        while proc.poll() is None and time.monotonic() < deadline:
            self.pids()
            time.sleep(0.1)
        hung = proc.poll() is None
        if hung:
            self.note("HANG: the run did not end within its bound; killing it")
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
        for t in threads:
            t.join(timeout=10)
        for p in self.outside:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        return {"rc": rc, "hung": hung, "seconds": round(time.monotonic() - self.t0, 1)}


# ---------------------------------------------------------------- invariants

def started(pid: int) -> str | None:
    """When ``pid`` started (clock ticks after boot; with the pid, that names one process: pids are reused,
    within minutes on a busy host), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[-1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] == "Z" else fields[19]


class SeenProcesses:
    """The processes a run started, each known by its pid and start time: a pid that a later process of
    someone else's took is not this run's stray (and must not be killed as one)."""

    def __init__(self) -> None:
        self.started: dict[int, str] = {}

    def add(self, pid: int) -> None:
        if pid not in self.started and (when := started(pid)) is not None:
            self.started[pid] = when

    def update(self, pids) -> None:
        for pid in pids:
            self.add(pid)

    def alive(self) -> list[int]:
        return sorted(pid for pid, when in self.started.items() if started(pid) == when)


def checkpoint_digests(ckpt, num_shards: int, mode: str) -> dict[str, str]:
    """The sha256 a server's Digest reports for each shard restored from ``ckpt``."""
    from shoal.settings.config import JobConfig
    from shoal.state.layout import ShardPlan
    from shoal.ps.consistency import rule_for
    from shoal.ps.shard import Shard

    plan = ShardPlan(ckpt.layout.numel, num_shards)
    rule = rule_for(JobConfig(mode=mode, num_shards=num_shards))
    return {str(k): Shard.from_state(ckpt.shard_state(plan, k), rule, ckpt.layout.fingerprint).digest()[1]
            for k in range(num_shards)}


def export_accuracy(ckpts: Path, out: Path, hidden: int = MODELS["digits"]) -> float:
    """``shoal export``'s code path on the newest valid checkpoint, loaded strictly and scored."""
    import importlib.util

    import torch

    from shoal.state.checkpoint import export_to_file

    export_to_file(ckpts, out)
    spec = importlib.util.spec_from_file_location("digits_example", DIGITS)
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    model = digits.build_model(hidden)
    model.load_state_dict(torch.load(out), strict=True)
    (_, _), (xte, yte) = digits.load(0)
    return float(digits.accuracy(model, xte, yte))


def check(run: Run, outcome: dict) -> dict:
    from shoal.state.checkpoint import load_latest

    v: dict[str, bool | None] = {"ended": not outcome["hung"], "succeeded": outcome["rc"] == 0}
    why: list[str] = []
    try:
        summary = json.loads((run.work / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    if outcome["rc"] != 0:
        why.append(f"exit {outcome['rc']}: {summary.get('error', 'no summary error line')}")
    if outcome["rc"] == 0:
        v["exactly_once"] = bool(summary.get("exactly_once"))
        if not v["exactly_once"]:
            why.append(f"ledgers (epoch: batches applied, most times one was applied): {summary.get('ledger')}, "
                       f"batches per epoch {summary.get('batches_per_epoch')}")
        v["all_tasks_done"] = summary.get("tasks_done") == summary.get("tasks_total") and summary.get("tasks_total", 0) > 0
        v["replicas_identical"] = summary.get("replicas_identical") is not False
        final = max((summary.get("shard_versions") or {"-": -1}).values())
        ckpt = load_latest(run.ckpts)
        if summary.get("shard_errors"):
            # a shard the run could not read has no version or ledger in the summary: its final version
            # (and so the final checkpoint's) is unknown, not the other shards' highest
            v["final_checkpoint"] = False
            why.append(f"the run could not read shard(s) {summary['shard_errors']}: no final version to check "
                       f"the newest checkpoint ({ckpt.step if ckpt else None}) against")
        elif (ckpt is None or ckpt.step != final) and final in run.corrupted:
            v["final_checkpoint"] = None              # the nemesis damaged the final one itself, once written
            why.append(f"not checked: the nemesis corrupted the final checkpoint (step {final}) after the commit")
        elif ckpt is None or ckpt.step != final:
            v["final_checkpoint"] = False
            why.append(f"newest valid checkpoint is {ckpt.step if ckpt else None}, final version {final}")
        else:
            live = {k: e.get("primary", {}).get("sha256") for k, e in (summary.get("replicas") or {}).items()}
            v["final_checkpoint"] = checkpoint_digests(ckpt, ckpt.num_shards, run.s.mode) == live
            if not v["final_checkpoint"]:
                why.append("the final checkpoint differs from the servers' final weights")
        try:
            acc = export_accuracy(run.ckpts, run.work / "model.pt", MODELS[run.s.model])
            if v["final_checkpoint"] is None:
                # the nemesis damaged the final checkpoint: export takes an older one, whose score
                # nobody reported; it must still load strictly and score (export_accuracy did both)
                v["export_scores"] = None
                why.append(f"export score not compared: an older checkpoint was exported ({acc:.4f})")
            else:
                v["export_scores"] = abs(acc - float(summary.get("test_accuracy", -1))) <= 0.02
                if not v["export_scores"]:
                    why.append(f"exported model scores {acc:.4f}, the job reported {summary.get('test_accuracy')}")
        except Exception as exc:  # noqa: BLE001 - any failure to export or load is the finding
            v["export_scores"] = False
            why.append(f"export: {exc}")
    deadline = time.monotonic() + 15
    while run.seen_pids.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    stray = run.seen_pids.alive()
    v["no_stray_process"] = not stray
    if stray:
        why.append(f"stray processes {stray}")
        for p in stray:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    failed = [k for k, ok in v.items() if ok is False]
    return {"seed": run.s.seed, "ok": not failed, "violations": failed, "why": why, **outcome,
            "steps": summary.get("steps"), "test_accuracy": summary.get("test_accuracy"),
            "restarts": summary.get("restarts"), "rollbacks": summary.get("rollbacks"),
            "nemesis": run.log, "verdicts": v, "schedule": run.s.to_json()}


def run_schedule(schedule: Schedule, work: Path | None = None, bound_s: float = 240.0) -> dict:
    """Runs one schedule in ``work`` (a fresh temp dir by default) and returns its verdict."""
    work = Path(work or tempfile.mkdtemp(prefix=f"nemesis-{schedule.seed}-"))
    work.mkdir(parents=True, exist_ok=True)
    net = nemesis_net().Net(work) if schedule.netns else None
    run = Run(schedule, work, bound_s, net)
    try:
        result = check(run, run.go())
    finally:
        run.unmount_checkpoint_fs()
        left = net.close() if net else []
    if net:                                        # the hosts are gone once the run is over
        result["verdicts"]["no_leftover_namespace"] = not left
        if left:
            result["ok"] = False
            result["violations"].append("no_leftover_namespace")
            result["why"].append(f"namespaces left behind: {left}")
    result["work"] = str(work)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="run the schedules of these seeds")
    p.add_argument("--first", type=int, default=1, help="with --count: the first seed")
    p.add_argument("--count", type=int, default=1, help="how many schedules (seeds first, first+1, ...)")
    p.add_argument("--faults", type=int, default=2, help="faults per schedule")
    p.add_argument("--disk-faults", action="store_true",
                   help="draw the checkpoint disk filling up, too (root: the checkpoints get a tmpfs of their own)")
    p.add_argument("--install-kills", action="store_true",
                   help="draw a primary killed before, during or just after its new backup's first copy, too")
    p.add_argument("--netns", action="store_true",
                   help="every role on a host of its own (network namespaces, root), and draw network faults too")
    p.add_argument("--model", choices=sorted(MODELS), default="digits", help="wide: a 300k-parameter hidden layer")
    p.add_argument("--bound", type=float, default=240.0, help="seconds a run may take before it counts as a hang")
    p.add_argument("--replay", help="a schedule's JSON (as printed) to run again")
    p.add_argument("--keep", action="store_true",
                   help="keep every run's directory (logs, checkpoints); a failing run's is always kept")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the job under test too (Run.go)
    if args.replay:
        schedules = [Schedule.from_json(json.loads(args.replay))]
    else:
        seeds = args.seeds if args.seeds else list(range(args.first, args.first + args.count))
        schedules = [draw(s, args.faults, args.disk_faults, args.netns, args.model, args.install_kills)
                     for s in seeds]
    if any(s.netns for s in schedules) and nemesis_net().unavailable():
        p.error(f"--netns: {nemesis_net().unavailable()}")
    bad = 0
    for s in schedules:
        work = Path(tempfile.mkdtemp(prefix=f"nemesis-{s.seed}-"))
        result = run_schedule(s, work, args.bound)
        bad += not result["ok"]
        if result["ok"] and not args.keep:         # a failing run's logs and checkpoints stay, to be read
            shutil.rmtree(work, ignore_errors=True)
            result.pop("work")
        print(json.dumps(result), flush=True)
    print(json.dumps({"schedules": len(schedules), "violations": bad}), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
