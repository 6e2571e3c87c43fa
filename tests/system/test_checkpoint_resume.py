"""Checkpoints through ``shoal local``: interrupt a job, resume it on a different number of
parameter servers from the same --checkpoint-dir, then ``shoal export`` the model."""
from __future__ import annotations

import importlib.util
import re
import signal
import subprocess

import pytest
import torch
from localrun import DIGITS, SHOAL, finish, start_local

from shoal.state.layout import ShardPlan
from shoal.state.checkpoint import list_checkpoints, load_latest
from harness import wait_until

pytestmark = pytest.mark.system

FULL_STEPS = 645            # 15 epochs x 43 batches of the digits example


def newest_step(root) -> int:
    found = list_checkpoints(root)
    return int(found[0].name.split("-")[1]) if found else -1


def digits_module():
    spec = importlib.util.spec_from_file_location("digits_example", DIGITS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_interrupted_job_resumes_on_three_ps_and_exports(tmp_path):
    ckpts = tmp_path / "ckpts"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()

    proc = start_local(first, "--ps", "2", "--workers", "2", "--mode", "sync",
                       "--checkpoint-dir", str(ckpts), "--checkpoint-interval", "40")
    wait_until(lambda: newest_step(ckpts) >= 100 or proc.poll() is not None, timeout_s=120,
               what="a checkpoint at step 100 or later")
    proc.send_signal(signal.SIGINT)                        # the job is preempted
    assert proc.wait(30) == 130, (first / "local.log").read_text()[-3000:]
    log1 = (first / "local.log").read_text()
    held = [float(ms) for ms in re.findall(r"updates held ([\d.]+) ms \(freeze to thaw\)", log1)]
    print(f"freeze-to-thaw pauses (ms) of the digits model: {held}")
    assert held and max(held) < 1000

    ckpt = load_latest(ckpts)
    assert ckpt.step >= 100 and ckpt.num_shards == 2 and len(list_checkpoints(ckpts)) <= 3
    ledger = ckpt.shard_state(ShardPlan(ckpt.layout.numel, 2), 0).extra["ledger_summary"]
    applied = sum(n for _, n, _ in ledger)
    assert applied >= 2 * 100 - 2                          # two workers per sync round

    summary = finish(start_local(second, "--ps", "3", "--workers", "2", "--mode", "sync",
                                 "--checkpoint-dir", str(ckpts), "--checkpoint-interval", "3s"), second)
    log2 = (second / "local.log").read_text()
    assert f"resuming from checkpoint {ckpt.path}: step {ckpt.step}" in log2
    assert summary["ps"] == 3 and summary["restored_step"] == ckpt.step
    assert summary["restored_from"] == str(ckpt.path)
    assert summary["tasks_done"] == summary["tasks_total"] and summary["exactly_once"], summary
    assert 0 < summary["steps"] <= FULL_STEPS - applied + 40, summary          # done work is not redone
    assert summary["test_accuracy"] >= 0.95, summary

    out = tmp_path / "model.pt"
    r = subprocess.run([*SHOAL, "export", str(ckpts), str(out)], capture_output=True, text=True, timeout=60)
    exported = load_latest(ckpts)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {out}: step {exported.step} from {exported.path}", r.stdout
    digits = digits_module()
    model = digits.build_model(256)
    model.load_state_dict(torch.load(out), strict=True)
    if exported.step == max(summary["shard_versions"].values()):   # the final checkpoint made it before the stop
        (_, _), (xte, yte) = digits.load(0)
        assert digits.accuracy(model, xte, yte) >= 0.95
