"""The nemesis's own checks (bench/nemesis.py), without a cluster."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import nemesis  # noqa: E402


def test_a_stray_is_a_process_the_run_started_not_a_later_one_that_took_its_pid():
    """Found by the --install-kills series (seed 804): a restarted chief's pid, reaped by ``shoal local``,
    was taken by another process within a minute (pid_max 32768 on a busy host); the check called it a
    stray process of the run, and SIGKILLed it."""
    mine = subprocess.Popen(["sleep", "60"])
    try:
        seen = nemesis.SeenProcesses()
        seen.update([mine.pid])
        assert seen.alive() == [mine.pid]
        seen.started[mine.pid] = str(int(seen.started[mine.pid]) - 1)   # as if an earlier process had this pid
        assert seen.alive() == []
    finally:
        mine.kill()
        mine.wait()
    seen = nemesis.SeenProcesses()
    seen.add(mine.pid)                   # gone already: never counted
    assert seen.alive() == [] and seen.started == {}
