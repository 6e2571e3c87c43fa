"""A job resumed past a corrupt checkpoint ends with a valid checkpoint of its final state,
and ``shoal export`` returns the trained model, not an older one."""
from __future__ import annotations

import subprocess

import pytest
import torch
from localrun import SHOAL, finish, start_local

from shoal.state.checkpoint import Checkpoint, list_checkpoints, load_latest, open_checkpoint
from shoal.settings.config import JobConfig
from shoal.state.layout import ShardPlan
from shoal.ps.consistency import rule_for
from shoal.ps.shard import Shard

pytestmark = pytest.mark.system

ARGS = ("--ps", "1", "--workers", "1", "--mode", "sync", "--checkpoint-interval", "10")
SCRIPT = ("--epochs", "1", "--step-delay", "0.03")


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def digests_of(ckpt: Checkpoint, num_shards: int) -> dict[str, str]:
    """The sha256 each shard's server reports (Digest) for a copy restored from ``ckpt``."""
    plan = ShardPlan(ckpt.layout.numel, num_shards)
    rule = rule_for(JobConfig(num_shards=num_shards))
    return {str(k): Shard.from_state(ckpt.shard_state(plan, k), rule, ckpt.layout.fingerprint).digest()[1]
            for k in range(num_shards)}


def test_a_job_resumed_past_a_corrupt_checkpoint_writes_its_final_state(tmp_path):
    ckpts = tmp_path / "ckpts"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    s1 = finish(start_local(first, *ARGS, "--checkpoint-dir", str(ckpts), script_args=SCRIPT), first)
    final = max(s1["shard_versions"].values())
    assert s1["final_checkpoint_step"] == final and load_latest(ckpts).step == final, s1

    newest = list_checkpoints(ckpts)[0]
    _flip(newest / "shard-00000.pt")                      # the final checkpoint is damaged
    older = load_latest(ckpts)                            # an earlier checkpoint, or none: start over
    before = older.step if older is not None else 0
    assert before < final

    s2 = finish(start_local(second, *ARGS, "--checkpoint-dir", str(ckpts), script_args=SCRIPT), second)
    assert s2.get("restored_step", 0) == before and s2["exactly_once"], s2
    end = max(s2["shard_versions"].values())
    assert end == final and s2["final_checkpoint_step"] == end, s2
    log = (second / "local.log").read_text()
    assert "skipping this step" not in log and "moved" in log
    ckpt = load_latest(ckpts)
    assert ckpt.path == newest and ckpt.step == end       # the final state, valid, where the corrupt one was
    live = {k: e["primary"]["sha256"] for k, e in s2["replicas"].items()}
    assert digests_of(ckpt, 1) == live                    # byte for byte the servers' final weights and state
    assert list(ckpts.glob(f"{newest.name}.set-aside-*"))   # the damaged one kept aside, not deleted
    out = tmp_path / "model.pt"
    r = subprocess.run([*SHOAL, "export", str(ckpts), str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    exported = torch.load(out)
    flat = torch.cat([t.reshape(-1) for t in exported.values()])
    assert torch.equal(flat, open_checkpoint(newest).flat_values())
