"""Fixed nemesis schedules (bench/nemesis.py): faults not tried elsewhere, each checked against every
invariant the nemesis knows (exactly once, replicas identical, final checkpoint equal to the final
weights, the export scores, the run ends, no stray process)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from nemesis import LEASE_S, Fault, Schedule, run_schedule  # noqa: E402

pytestmark = pytest.mark.system

# One schedule, two faults not tried elsewhere (one run: each run of the digits job costs ~20 s of start-up
# and shutdown on two shared cores):
# - a worker frozen past its lease loses its tasks; resumed, its late pushes count nowhere and it joins again;
# - later, the chief and a primary die at the same moment: the chief comes back from its journal while the
#   primary's shard is promoted on its backup.
SCHEDULES = {
    "worker paused past its lease, then chief and a primary killed at once": Schedule(
        seed=-1, epochs=2, mode="sync",
        faults=[Fault(0.3, "pause", "worker1", 2.5 * LEASE_S), Fault(4.5, "kill_chief_and_primary", "ps0")]),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_fixed_schedule_keeps_every_invariant(name, tmp_path):
    result = run_schedule(SCHEDULES[name], tmp_path, bound_s=180)
    detail = json.dumps({k: result[k] for k in ("violations", "why", "nemesis", "schedule")})
    assert result["ok"], detail + "\n" + (tmp_path / "local.log").read_text()[-3000:]
    applied = " ".join(result["nemesis"])
    assert "SIGSTOP worker1" in applied and "SIGKILL chief and ps0" in applied, "a fault was not applied: " + detail
