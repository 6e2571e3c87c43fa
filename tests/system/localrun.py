"""Helpers for tests that drive ``shoal local`` as a real process tree."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc

from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import open_channel

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")
SHOAL = [sys.executable, "-m", "shoal.cli"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_local(tmp_path: Path, *args: str, script_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """Starts ``shoal local`` on the digits example; logs to tmp_path/local.log.

    Ctrl-C works in it however the tests were started: a shell that runs them in the background
    (``make test &``) passes SIGINT down ignored, and ``shoal local`` rightly keeps it ignored.
    """
    log = open(tmp_path / "local.log", "w")
    return subprocess.Popen([*SHOAL, "local", "--run-dir", str(tmp_path / "run"),
                             "--summary", str(tmp_path / "summary.json"), *args, DIGITS, *script_args],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, preexec_fn=_default_sigint)


def finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = 240, expect: int = 0) -> dict:
    """Waits for ``shoal local`` to end with exit status ``expect`` (docs/exit-codes.md); its summary."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("shoal local did not finish:\n" + (tmp_path / "local.log").read_text()[-4000:])
    log = (tmp_path / "local.log").read_text()
    assert rc == expect, log[-4000:]
    return json.loads((tmp_path / "summary.json").read_text())


def pids(tmp_path: Path) -> dict[str, int]:
    return json.loads((tmp_path / "run" / "pids.json").read_text())


def job_steps(tmp_path: Path) -> int:
    address = (tmp_path / "run" / "chief.address").read_text()
    ch = open_channel(address)
    try:
        return pb_grpc.ChiefStub(ch).GetJobStats(pb.Empty(), timeout=2).totals.steps
    except grpc.RpcError:
        return 0
    finally:
        ch.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def prewarmed_worker(tmp_path: Path, name: str, *script_args: str) -> tuple[subprocess.Popen, Path]:
    """A worker that imports now and joins a job from outside its supervisor once :func:`let_in` opens the
    returned gate (tests/system/prewarmed.py); ``<gate>.ready`` appears when its imports are done."""
    gate = tmp_path / f"{name}.go"
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("prewarmed.py")), str(gate), "worker",
                             "--chief", "@gate", DIGITS, *script_args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=tmp_path)
    return proc, gate


def let_in(tmp_path: Path, gate: Path) -> None:
    """Lets a :func:`prewarmed_worker` join the running job (its chief's address, written whole)."""
    part = gate.with_suffix(".part")
    part.write_text((tmp_path / "run" / "chief.address").read_text())
    part.rename(gate)


def kill_and_await_restart(tmp_path: Path, role: str, timeout_s: float = 30.0) -> int:
    """SIGKILLs ``role`` (a name in pids.json) and waits for the supervisor to start it again."""
    import signal
    import time

    victim = pids(tmp_path)[role]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while pids(tmp_path)[role] == victim:
        if time.monotonic() > deadline:
            raise AssertionError(f"{role} was not restarted within {timeout_s:.0f}s")
        time.sleep(0.05)
    return victim
