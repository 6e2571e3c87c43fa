"""examples/ctr.py on a real cluster (shoal local): its table lives on the servers, the job ends with the ledger
whole and the replicas identical, and ``shoal export`` of its checkpoint loads into the single-process model with
``load_state_dict(strict=True)``."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from localrun import ROOT, SHOAL, _default_sigint, finish

pytestmark = pytest.mark.system

CTR = str(ROOT / "examples" / "ctr.py")
ROWS = 4096


def test_ctr_trains_on_a_cluster_and_its_export_loads_into_the_plain_model(tmp_path):
    log = open(tmp_path / "local.log", "w")
    proc = subprocess.Popen([*SHOAL, "local", "--run-dir", str(tmp_path / "run"), "--summary",
                             str(tmp_path / "summary.json"), "--ps", "2", "--workers", "2", "--mode", "sync",
                             "--checkpoint-dir", str(tmp_path / "ckpt"), CTR, "--rows", str(ROWS), "--steps", "0",
                             "--train-samples", "8192", "--test-samples", "4096"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, preexec_fn=_default_sigint)
    summary = finish(proc, tmp_path, timeout=180)
    assert summary["exactly_once"] and summary["replicas_identical"], summary
    assert summary["tasks_done"] == summary["tasks_total"] > 0
    assert 0.6 < summary["test_auc"] <= summary["bayes_auc"], summary
    out = tmp_path / "model.pt"
    done = subprocess.run([*SHOAL, "export", str(tmp_path / "ckpt"), str(out)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"table table: {ROWS:,} x 16 as table.weight" in done.stdout
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import ctr
    finally:
        sys.path.pop(0)
    model = ctr.DLRM(ROWS)                                  # the single-process model, its table on the CPU
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert model.table.weight.shape == (ROWS, 16)
