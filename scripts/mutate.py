#!/usr/bin/env python3
"""Mutation testing of the modules that carry shoal's promises (``make mutate``), with cosmic-ray.

cosmic-ray changes one thing in one module at a time (``<`` for ``<=``, ``and`` for ``or``, a
constant, a deleted statement, ...), runs that module's fast tests, and counts the mutant killed
when a test fails (or the tests outlive the per-mutant timeout) and survived when they all pass.
A survivor is a bug the tests would let through, or an equivalent mutant that no behaviour can
tell apart (bench/RESULTS.md lists both).

Mutations are made in place, so they run in a scratch copy of the tree, never in the worktree:
the roles live in top-level ``ps/``, ``chief/``, ``worker/`` and ``proto/`` mapped into the
``shoal`` package by ``[tool.setuptools] package-dir``; the copy links them under ``shoal/`` and
goes first on ``PYTHONPATH``, so ``import shoal.ps.ledger`` loads the mutated copy (checked before
the first mutant runs).

    python scripts/mutate.py                        # every module below, smallest first
    python scripts/mutate.py ps/ledger.py chief/tasks.py
    python scripts/mutate.py --list                 # modules, their tests, mutant counts
    python scripts/mutate.py --timeout-factor 4 --report /tmp/mutate.md

Each test run is a fork of one interpreter that imported torch, grpc and numpy once
(``scripts/pytest_forkserver.py``; it never imports ``shoal``, so every fork loads the mutated
module from disk): 3-4x faster per mutant on 2 cores. ``--no-fork-server`` starts a new one each time.

Each module's session (``<workdir>/<module>.sqlite``) is kept; ``--resume`` runs only the
mutants it has not run yet. The summary (killed / survived / timeout per module, then every
survivor with its place and operator) goes to the terminal and to ``--report``.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

U, I = "tests/unit/", "tests/integration/"

# module -> the fast tests that exercise it (unit first, then integration), most targeted first:
# pytest stops at the first failure, so a mutant the first file kills costs only that file.
MODULES: dict[str, list[str]] = {
    "shoal/security/tokens.py": [U + "test_task_tokens.py", U + "test_membership.py", U + "test_chief_persistence.py",
                        I + "test_cluster.py::test_a_push_for_a_task_the_worker_does_not_hold_is_refused"],
    "ps/ledger.py": [U + "test_ledger_counts.py", U + "test_shard_rounds.py", U + "test_checkpoint_cut.py",
                     U + "test_replication_order.py"],
    "shoal/codecs/feedback.py": [U + "test_error_feedback.py", U + "test_codecs.py"],
    "ps/consistency.py": [U + "test_consistency_rules.py", U + "test_shard_rounds.py", U + "test_shard_optimizer.py", U + "test_changes.py",
                          U + "test_replication_order.py", U + "test_checkpoint_cut.py"],
    "chief/journal.py": [U + "test_journal_mutants.py", U + "test_journal_edges.py", U + "test_journal_changes.py", U + "test_chief_persistence.py", I + "test_task_journal.py",
                         I + "test_chief_recovery.py"],
    "chief/idset.py": [U + "test_idset.py", U + "test_task_snapshot.py"],
    "chief/tasks.py": [U + "test_task_queue_mutants.py", U + "test_tasks.py", U + "test_task_snapshot.py", U + "test_task_queue_edges.py", U + "test_chief_persistence.py",
                       U + "test_task_feed.py",
                       U + "test_membership.py", I + "test_task_journal.py"],
    "chief/membership.py": [U + "test_membership_edges.py", U + "test_membership.py", U + "test_chief_isolation.py",
                            U + "test_chief_persistence.py", U + "test_lease_deadlines.py"],
    "chief/placement.py": [U + "test_placement_edges.py", U + "test_placement.py"],
    "shoal/state/checkpoint_store.py": [U + "test_checkpoint_store_edges.py", U + "test_checkpoint.py", U + "test_checksum_chunks.py",
                                  U + "test_checkpoint_cut.py"],
    "ps/shard.py": [U + "test_shard_mutants.py", U + "test_shard_rounds.py", U + "test_replication_order.py", U + "test_ledger_counts.py",
                    U + "test_shard_optimizer.py", U + "test_changes.py", U + "test_checkpoint_cut.py",
                    U + "test_nonfinite.py", U + "test_sparse_apply.py", U + "test_accumulate.py",
                    U + "test_open_round_failover.py",      # added after the 2026-12-06 run (RESULTS)
                    U + "test_replication_edges.py",        # the overlapped replication path: added late 2026-12-06, not run yet
                    I + "test_ps_servicer.py", I + "test_tcp_channel.py"],
    "ps/shard_copies.py": [U + "test_replication_edges.py", U + "test_backup_recopy.py", U + "test_checkpoint_cut.py",
                           U + "test_shard_mutants.py", I + "test_replication.py"],   # split from shard.py; not run yet
    "ps/replication.py": [U + "test_replication_edges.py", U + "test_replication_order.py", U + "test_backup_recopy.py",
                          U + "test_no_backup_warning.py", I + "test_fencing.py", I + "test_tcp_channel.py",
                          I + "test_replication.py"],
    "ps/update_wire.py": [U + "test_update_wire.py", U + "test_replication_edges.py", I + "test_tcp_channel.py",
                          I + "test_replication.py"],           # added 2026-12-07
    "worker/trainer.py": [I + "test_trainer_mutants.py", I + "test_partial_refusal.py", I + "test_cluster.py"],
}


@dataclass
class Tally:
    module: str
    total: int = 0
    killed: int = 0
    survived: int = 0
    timeout: int = 0
    incompetent: int = 0
    excluded: int = 0
    pending: int = 0
    baseline_s: float = 0.0
    timeout_s: float = 0.0
    error: str = ""

    @property
    def score(self) -> str:
        done = self.killed + self.survived + self.timeout
        return f"{100.0 * (self.killed + self.timeout) / done:.0f}%" if done else "-"


def package_dirs() -> dict[str, str]:
    """``shoal.ps -> ps`` and the like, from pyproject.toml (only the ones outside ``shoal/``)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = cfg["tool"]["setuptools"]["package-dir"]
    return {pkg: d for pkg, d in dirs.items() if pkg.startswith("shoal.") and not d.startswith("shoal")}


def make_scratch(workdir: Path) -> Path:
    """A copy of the tracked (and new, not ignored) files, with the role packages linked into ``shoal/``."""
    tree = workdir / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            dst = tree / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    for pkg, d in package_dirs().items():
        link = tree / pkg.replace(".", "/")
        if not link.exists():
            link.symlink_to(Path("..") / d, target_is_directory=True)
    return tree


def env_for(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "tests")] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def dotted(module: str) -> str:
    for pkg, d in package_dirs().items():
        if module.startswith(d + "/"):
            return pkg + "." + module[len(d) + 1:-3].replace("/", ".")
    return module[:-3].replace("/", ".")


def check_imports_from(tree: Path, module: str) -> None:
    """The tests must load the copy that cosmic-ray mutates, not the editable install's."""
    code = f"import {dotted(module)} as m, os; print(os.path.realpath(m.__file__))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env_for(tree), capture_output=True, text=True)
    want = os.path.realpath(tree / module)
    if out.returncode != 0 or out.stdout.strip() != want:
        raise SystemExit(f"mutate: {dotted(module)} loads from {out.stdout.strip() or out.stderr.strip()!r}, "
                         f"not the scratch copy {want}; mutants would not be tested")


def test_command(tests: list[str], per_test_timeout: float, fork_socket: Path | None = None) -> str:
    """``python -m pytest ...``, or the same run as a fork of the fork server (``fork_socket``)."""
    runner = [sys.executable, "-m", "pytest"] if fork_socket is None else \
        [sys.executable, str(ROOT / "scripts" / "pytest_forkserver.py"), "--client", str(fork_socket), "--"]
    return " ".join(map(shlex.quote, [*runner, "-x", "-q", "-p", "no:cacheprovider",
                                      f"--timeout={int(per_test_timeout)}", *tests]))


class ForkServer:
    """scripts/pytest_forkserver.py for one run: torch and the rest imported once, each test run a fork."""

    def __init__(self, tree: Path, workdir: Path):
        self.socket = workdir / "forkserver.sock"
        self.log = open(workdir / "forkserver.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "pytest_forkserver.py"), "--serve",
                                      str(self.socket)], cwd=tree, env=env_for(tree), stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        ready = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if ready != "ready":
            self.close()
            raise SystemExit(f"mutate: the fork server did not start (see {self.log.name}); "
                             f"--no-fork-server runs each test command in a new interpreter")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        self.log.close()


# The operators kept: for arithmetic, the inverse (+ for -, * for /); for comparisons, the boundary
# and the negation (< for <=, >= for <, == for !=, is for is not, in for not in). cosmic-ray also
# swaps every operator for every other one (+ for **, <<, |, %, ...; < for is, ==, >): ten times the
# mutants, nearly all killed by any test that runs the line or equivalent (``|`` in annotations,
# which ``from __future__ import annotations`` never evaluates), at five seconds each.
KEEP_BINARY = ("Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Div", "Mod_FloorDiv")
KEEP_COMPARISON = ("Lt_LtE", "Lt_GtE", "LtE_Lt", "LtE_Gt", "Gt_GtE", "Gt_LtE", "GtE_Gt", "GtE_Lt",
                   "Eq_NotEq", "NotEq_Eq", "Is_IsNot", "IsNot_Is", "In_NotIn", "NotIn_In")
EXCLUDE_OPERATORS = [f"core/ReplaceBinaryOperator_(?!({'|'.join(KEEP_BINARY)})$)",
                     f"core/ReplaceComparisonOperator_(?!({'|'.join(KEEP_COMPARISON)})$)"]


def write_config(path: Path, module: str, command: str, timeout_s: float) -> None:
    path.write_text(f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {timeout_s:.1f}\nexcluded-modules = []\n'
                    f'test-command = {json.dumps(command)}\n\n[cosmic-ray.distributor]\nname = "local"\n\n'
                    f'[cosmic-ray.filters.operators-filter]\nexclude-operators = {json.dumps(EXCLUDE_OPERATORS)}\n')


def init_session(cfg: Path, db: Path, tree: Path) -> str:
    """Creates the session and marks the excluded operators' mutants skipped; an error message or ''."""
    db.unlink(missing_ok=True)
    for tool, args in (("cosmic-ray", ["init", str(cfg), str(db)]), ("cr-filter-operators", [str(db), str(cfg)])):
        out = subprocess.run([str(Path(sys.executable).parent / tool), *args], cwd=tree, env=env_for(tree),
                             capture_output=True, text=True)
        if out.returncode != 0:
            return f"{tool} failed: {out.stderr.strip()[-500:]}"
    return ""


def cosmic_ray(*args: str, tree: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "cosmic-ray"
    return subprocess.run([str(exe), "--verbosity", "ERROR", *args], cwd=tree, env=env_for(tree),
                          capture_output=True, text=True)


def tally(module: str, db: Path, tree: Path) -> tuple[Tally, list[dict]]:
    out = cosmic_ray("dump", str(db), tree=tree)
    if out.returncode != 0:
        raise SystemExit(f"mutate: cannot read the session {db}: {out.stderr.strip()[-300:]}")
    t, survivors = Tally(module), []
    for line in out.stdout.splitlines():
        item, result = json.loads(line)
        if result is not None and result.get("worker_outcome") == "skipped":
            t.excluded += 1
            continue
        t.total += 1
        if result is None:
            t.pending += 1
        elif result.get("test_outcome") == "killed":
            if (result.get("output") or "").strip() == "timeout":
                t.timeout += 1
            else:
                t.killed += 1
        elif result.get("test_outcome") == "survived":
            t.survived += 1
            for m in item["mutations"]:
                survivors.append({"module": module, "line": m["start_pos"][0], "col": m["start_pos"][1],
                                  "operator": m["operator_name"].split("/")[-1], "occurrence": m["occurrence"],
                                  "job": item["job_id"], "diff": result.get("diff") or ""})
        else:
            t.incompetent += 1
    return t, survivors


def run_module(module: str, tree: Path, workdir: Path, args: argparse.Namespace) -> tuple[Tally, list[dict]]:
    tests = MODULES[module]
    db, cfg = session_files(workdir, module)
    check_imports_from(tree, module)
    t0 = time.monotonic()
    sock = args.fork_server.socket if args.fork_server else None
    base = subprocess.run(shlex.split(test_command(tests, 300, sock)), cwd=tree, env=env_for(tree),
                          capture_output=True, text=True)
    baseline = time.monotonic() - t0
    if base.returncode != 0:
        t = Tally(module, error=f"tests fail without any mutant:\n{base.stdout[-1500:]}")
        return t, []
    timeout_s = max(args.min_timeout, args.timeout_factor * baseline)
    write_config(cfg, module, test_command(tests, timeout_s, sock), timeout_s)
    if not (args.resume and db.exists()):
        error = init_session(cfg, db, tree)
        if error:
            return Tally(module, error=error), []
    elif args.retry_survivors:
        with sqlite3.connect(db) as con:
            con.execute("DELETE FROM work_results WHERE lower(test_outcome) = 'survived'")
    todo = tally(module, db, tree)[0].pending
    print(f"{module}: {todo} mutant(s) to run, tests {baseline:.1f}s unmutated, {timeout_s:.0f}s allowed each",
          flush=True)
    proc = subprocess.Popen([str(Path(sys.executable).parent / "cosmic-ray"), "--verbosity", "ERROR", "exec",
                             str(cfg), str(db)], cwd=tree, env=env_for(tree),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None:
            time.sleep(min(10.0, max(1.0, timeout_s / 4)))
            if sys.stdout.isatty():
                t, _ = tally(module, db, tree)
                print(f"\r  {t.total - t.pending}/{t.total} run, {t.survived} survived", end="", flush=True)
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        print("\ninterrupted: the session is kept, --resume goes on from here", file=sys.stderr)
        raise
    if sys.stdout.isatty():
        print()
    t, survivors = tally(module, db, tree)
    t.baseline_s, t.timeout_s = baseline, timeout_s
    if proc.returncode not in (0, None) and t.pending:
        t.error = (proc.stderr.read() if proc.stderr else "")[-500:]
    return t, survivors


def render(tallies: list[Tally], survivors: list[dict], tree: Path) -> str:
    lines = ["| module | mutants | killed | timeout | survived | incompetent | not run | score | tests (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in tallies:
        lines.append(f"| `{t.module}` | {t.total} | {t.killed} | {t.timeout} | {t.survived} | {t.incompetent} | "
                     f"{t.pending} | {t.score} | {f'{t.baseline_s:.1f}' if t.baseline_s else '-'} |")
    for t in tallies:
        if t.error:
            lines.append(f"\n{t.module}: {t.error}")
    if survivors:
        lines += ["", "Survivors:", ""]
        for s in survivors:
            old = [ln[1:].strip() for ln in s["diff"].splitlines() if ln.startswith("-") and not ln.startswith("---")]
            new = [ln[1:].strip() for ln in s["diff"].splitlines() if ln.startswith("+") and not ln.startswith("+++")]
            change = f"`{' '.join(old)[:110]}` -> `{' '.join(new)[:110]}`" if old or new else "(no diff kept)"
            lines.append(f"- `{s['module']}:{s['line']}` {s['operator']} #{s['occurrence']}: {change}")
    return "\n".join(lines)


def count_mutants(module: str, tree: Path, workdir: Path) -> int:
    cfg, db = workdir / "count.toml", workdir / "count.sqlite"
    write_config(cfg, module, "true", 1)
    init_session(cfg, db, tree)
    t, _ = tally(module, db, tree)
    db.unlink(missing_ok=True)
    return t.total


def _interrupt(signum, frame):
    """SIGTERM ends a run as Ctrl-C does: the test run in flight is stopped, the sessions kept."""
    raise KeyboardInterrupt


def session_files(workdir: Path, module: str) -> tuple[Path, Path]:
    name = module.replace("/", "_")[:-3]
    return workdir / f"{name}.sqlite", workdir / f"{name}.toml"


def summarise(modules: list[str], args: argparse.Namespace) -> int:
    tree = args.workdir / "tree"
    tallies, survivors = [], []
    for m in modules:
        db, cfg = session_files(args.workdir, m)
        if not db.exists():
            continue
        t, s = tally(m, db, tree)
        if cfg.exists():
            t.timeout_s = float(next(line.split("=")[1] for line in cfg.read_text().splitlines()
                                     if line.startswith("timeout")))
        tallies.append(t)
        survivors += s
    if not tallies:
        print(f"mutate: no sessions under {args.workdir} for {', '.join(modules)}", file=sys.stderr)
        return 1
    text = render(tallies, survivors, tree)
    print(text)
    if args.report:
        args.report.write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("modules", nargs="*", help=f"modules to mutate (default: all). Known: {', '.join(MODULES)}")
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / f"shoal-mutate-{ROOT.name}",
                   help="scratch copy and sessions (default: %(default)s)")
    p.add_argument("--timeout-factor", type=float, default=3.0,
                   help="a mutant's tests may run this many times the unmutated run (default: %(default)s)")
    p.add_argument("--min-timeout", type=float, default=30.0, help="but at least this many seconds (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="run only the mutants a kept session has not run")
    p.add_argument("--retry-survivors", action="store_true",
                   help="with --resume, also run the survivors again (after adding tests that should kill them)")
    p.add_argument("--no-fork-server", dest="use_fork_server", action="store_false",
                   help="start a new interpreter per test run instead of forking one that has torch imported "
                        "(scripts/pytest_forkserver.py; 3-4x faster here)")
    p.add_argument("--report", type=Path, help="also write the summary (markdown) here")
    p.add_argument("--list", action="store_true", help="show the modules, their tests and mutant counts; run nothing")
    p.add_argument("--summary", action="store_true",
                   help="tally the kept sessions (a run still going, or one stopped part way); run nothing")
    args = p.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        p.error(f"unknown module(s) {', '.join(unknown)}; known: {', '.join(MODULES)}")
    if args.retry_survivors and not args.resume:
        p.error("--retry-survivors goes with --resume (a new session runs every mutant anyway)")
    if args.timeout_factor < 1 or args.min_timeout <= 0:
        p.error(f"--timeout-factor must be >= 1 and --min-timeout > 0, got {args.timeout_factor}, {args.min_timeout}")
    if shutil.which("cosmic-ray", path=str(Path(sys.executable).parent)) is None:
        p.error("cosmic-ray is not installed next to this python; run make setup (it is in the dev extra)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    modules = args.modules or list(MODULES)
    if args.summary:
        return summarise(modules, args)
    lock = open(args.workdir / "lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        p.error(f"another mutation run is using {args.workdir}; wait for it, or pass another --workdir")
    tree = make_scratch(args.workdir)
    if args.list:
        for m in modules:
            print(f"{m}: {count_mutants(m, tree, args.workdir)} mutants; tests: {' '.join(MODULES[m])}")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    tallies, survivors = [], []
    args.fork_server = ForkServer(tree, args.workdir) if args.use_fork_server else None
    try:
        for m in modules:
            t, s = run_module(m, tree, args.workdir, args)
            tallies.append(t)
            survivors += s
            print(f"{m}: {t.killed} killed, {t.timeout} timed out, {t.survived} survived, {t.pending} not run "
                  f"({t.score})", flush=True)
    except KeyboardInterrupt:
        return 130
    finally:
        if args.fork_server:
            args.fork_server.close()
    text = render(tallies, survivors, tree)
    print("\n" + text)
    if args.report:
        args.report.write_text(text + "\n")
    return 1 if any(t.error for t in tallies) else 0


if __name__ == "__main__":
    sys.exit(main())
