"""The nemesis's install_kill (bench/_install_kill.py, bench/nemesis_install.py) without a cluster: the kill
sequence against stand-in processes and a log file, and the draw (earlier seeds replay unchanged)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _install_kill  # noqa: E402
import nemesis  # noqa: E402


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def test_the_primary_dies_only_once_every_copy_after_the_first_kill_is_reported_whole(tmp_path, procs):
    log = tmp_path / "local.log"
    log.write_text("shard 0: backup ps-1 holds a whole copy\nshard 1: backup ps-0 holds a whole copy\n")  # before
    first, second, restart = sleeper(), sleeper(), sleeper()
    procs += [first, second, restart]
    roles = {"ps0": first.pid, "ps1": second.pid}
    seen: list[tuple[str, bool]] = []            # (what happened, was the primary still alive then)

    def job() -> None:                           # the supervisor restarts ps0; its primary copies to it
        first.wait()
        roles["ps0"] = restart.pid
        for line in ("shard 0: new backup ps-2; sending it a copy", "shard 0: backup ps-2 holds a whole copy",
                     "shard 0: backup ps-2 no longer holds a whole copy (its primary ps-1 says so)",
                     "shard 1: backup ps-2 holds a whole copy", "shard 0: backup ps-2 holds a whole copy"):
            time.sleep(0.2)
            seen.append((line, second.poll() is None))
            with open(log, "a") as f:
                f.write(line + "\n")

    t = threading.Thread(target=job)
    t.start()
    notes: list[str] = []
    _install_kill.kill_around_install("after", lambda: dict(roles), log, lambda: True, timeout_s=10,
                                      note=notes.append)
    t.join()
    assert second.wait(5) == -9 and first.returncode == -9 and restart.poll() is None
    assert [alive for _, alive in seen] == [True] * 5   # not on the old lines, one copy, nor one that went bad
    assert "2 of 2 copies reported whole by then" in notes[-1]


def test_a_copy_no_longer_whole_is_not_counted_until_it_is_whole_again():
    whole = _install_kill.whole_shards
    assert whole("shard 0: backup ps-1 holds a whole copy (its primary ps-0 says so)") == 1
    assert whole("shard 0: backup ps-1 holds a whole copy\nshard 0: backup ps-1 no longer holds a whole copy\n"
                 "shard 1: backup ps-0 holds a whole copy") == 1
    assert whole("shard 3: backup ps-1 holds a whole copy\nshard 3: backup ps-2 holds a whole copy") == 1
    assert whole("shard 12: backup ps-1 no longer holds a whole copy") == 0


def test_before_kills_the_primary_as_soon_as_the_restart_exists_and_a_job_that_ends_spares_it(tmp_path, procs):
    log = tmp_path / "local.log"
    log.write_text("")
    first, second, restart = sleeper(), sleeper(), sleeper()
    procs += [first, second, restart]
    roles = {"ps0": first.pid, "ps1": second.pid}
    threading.Thread(target=lambda: (first.wait(), roles.update(ps0=restart.pid))).start()
    _install_kill.kill_around_install("before", lambda: dict(roles), log, lambda: True, timeout_s=10)
    assert second.wait(5) == -9 and restart.poll() is None

    other, primary = sleeper(), sleeper()
    procs += [other, primary]
    with pytest.raises(_install_kill.NotReached, match="ended while waiting for ps1's restart"):
        _install_kill.kill_around_install("during", lambda: {"ps0": primary.pid, "ps1": other.pid}, log,
                                          lambda: False, first="ps1", timeout_s=10)
    assert other.wait(5) == -9 and primary.poll() is None        # ps1 died, its peer was spared


def test_earlier_seeds_draw_the_same_schedules_and_the_flag_adds_install_kills():
    # as drawn before --install-kills existed (seeds 15 and 119 are in bench/RESULTS.md)
    assert nemesis.draw(15).to_json()["faults"] == [
        {"at": 0.1, "action": "pause", "target": "ps0", "seconds": 3.75, "point": ""},
        {"at": 4.42, "action": "join_leave", "target": "", "seconds": 2.63, "point": ""}]
    # every schedule of seeds 1-200, and of 1-50 with --disk-faults, as main drew them before the flag existed
    earlier = [nemesis.draw(s).to_json() for s in range(1, 201)] + [nemesis.draw(s, disk=True).to_json()
                                                                   for s in range(1, 51)]
    for s in earlier:                    # fields added since (the network faults' branch) hold their defaults
        assert (s.pop("model"), s.pop("netns")) == ("digits", False)
        for f in s["faults"]:
            assert f.pop("point") == ""
    assert hashlib.sha256(json.dumps(earlier).encode()).hexdigest() == \
        "309db582501b24628f4fa02166264ba795a255c0d3974637e7310a9ca32ed842"
    drawn = [nemesis.draw(seed, install=True) for seed in range(800, 830)]
    kills = [(s, f) for s in drawn for f in s.faults if f.action == "install_kill"]
    assert {f.point for _, f in kills} == set(_install_kill.POINTS)
    assert all(f.target in ("ps0", "ps1") and s.epochs >= 10 for s, f in kills)
    assert not any(f.action == "install_kill" for seed in range(800, 830) for f in nemesis.draw(seed).faults)
    replayed = nemesis.Schedule.from_json(drawn[2].to_json())
    assert replayed == drawn[2]
