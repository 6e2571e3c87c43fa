"""``shoal compare`` on the digits example: a table with every column, a PNG that decodes, the runs kept."""
from __future__ import annotations

import json
import subprocess

import pytest
from localrun import DIGITS, SHOAL

pytestmark = pytest.mark.system


def test_compare_two_modes_under_a_budget(tmp_path):
    out = tmp_path / "cmp"
    r = subprocess.run([*SHOAL, "compare", "--modes", "sync", "async", "--ps", "1", "--workers", "2",
                        "--budget", "4s", "--out", str(out), DIGITS,
                        "--step-delay", "0.02"], capture_output=True, text=True, timeout=240,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("case "))
    for column in ("seconds", "train s", "steps/s", "updates/s", "samples/s", "final loss", "test_accuracy",
                   "to loss", "exactly once"):
        assert column in header, header
    rows = {line.split()[0]: line for line in lines if line.split()[:1] in (["sync"], ["async"])}
    assert set(rows) == {"sync", "async"}
    # stopped by the budget: not every epoch ran, and no batch was applied twice
    assert all(row.endswith("at most (partial)") for row in rows.values()), rows
    assert "plot: " in r.stdout and r.stderr.count("\n") <= 2, r.stderr     # no log dump on the terminal

    data = json.loads((out / "compare.json").read_text())
    by_case = {row["case"]: row for row in data["rows"]}
    for row in by_case.values():
        assert row["steps_per_s"] > 0 and 0 < row["metric"] <= 1 and row["final_loss"] > 0
        assert row["time_to_target"] is not None and row["train_seconds"] < row["seconds"]
        assert len(row["curve"]["loss"]) == len(row["curve"]["seconds"]) > 10
        assert row["curve"]["samples"][-1] > row["curve"]["samples"][0]
    # sync applies one update per round of both workers, async one per push
    assert by_case["async"]["updates_per_s"] > by_case["sync"]["updates_per_s"]

    import matplotlib.image

    image = matplotlib.image.imread(str(out / "compare.png"))
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert {p.name for p in (out / "tb").iterdir()} == {"sync", "async"}
    assert {p.name for p in (out / "tb" / "async").iterdir()} == {"chief", "worker-0", "worker-1"}

