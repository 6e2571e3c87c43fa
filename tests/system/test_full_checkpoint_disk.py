"""The checkpoint disk fills up mid-run (a small tmpfs, filled to the last byte): the run exits 73 naming the
missing steps, and ``shoal export`` refuses the stale checkpoint unless ``--allow-stale``.

Before: the failure note could not be written to that same disk, so the export wrote step 61-76 of a
258/516-version job with exit 0 and no warning, and the run itself exited 0."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from localrun import SHOAL, start_local

from harness import wait_until
from shoal.state.checkpoint import load_latest

pytestmark = pytest.mark.system


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only), unmounted after the test."""
    disk = tmp_path / "ckpts"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def fill(disk) -> None:
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass


def test_a_full_checkpoint_disk_ends_the_run_with_73_and_export_refuses_the_stale_checkpoint(tmp_path, small_disk):
    proc = start_local(tmp_path, "--ps", "1", "--workers", "1", "--mode", "sync", "--checkpoint-dir", str(small_disk),
                       "--checkpoint-interval", "10", script_args=("--epochs", "2"))
    try:
        wait_until(lambda: load_latest(small_disk) is not None, timeout_s=120, what="a first checkpoint")
        fill(small_disk)
        good = load_latest(small_disk).step
        rc = proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "local.log").read_text()
    assert rc == 73, log[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "checkpoints failed" and summary["exit_code"] == 73
    missing = summary["checkpoint_missing_steps"]
    assert missing and min(missing) > good, summary
    assert "exit 73: checkpoints failed" in log and "missing steps: " in log
    out = tmp_path / "model.pt"
    export = subprocess.run([*SHOAL, "export", str(small_disk), str(out)], capture_output=True, text=True)
    assert export.returncode == 73 and not out.exists(), export.stderr
    assert f"is step {load_latest(small_disk).step}, older than the job's last applied update at step" in export.stderr
    assert str(max(missing)) in export.stderr and export.stderr.count("\n") == 1
    os.remove(small_disk / "filler")
    allowed = subprocess.run([*SHOAL, "export", "--allow-stale", str(small_disk), str(out)], capture_output=True, text=True)
    assert allowed.returncode == 0 and out.exists(), allowed.stderr
