"""bench/table_apply.py on tiny sizes: its cases run and their figures hang together (the bench does not rot)."""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import table_apply  # noqa: E402


def args(**kw):
    base = dict(batch=256, dim=4, optimizer="adagrad", steps=3, warmup=1, snapshot_rows=1 << 16, stored=2000,
                snapshot_steps=20, zipf=1.05)
    base.update(kw)
    return argparse.Namespace(**base)


def test_apply_case_lazy_stores_only_what_the_steps_touched():
    r = table_apply.apply_case(14, "lazy", args(), np.random.default_rng(0))
    assert r["stored_before"] == 0 and 256 <= r["stored_after"] <= 4 * 256
    assert r["lookup_ms"] > 0 and r["apply_ms"] > 0
    s = table_apply.apply_case(12, "stored", args(), np.random.default_rng(0))
    assert s["stored_before"] == s["stored_after"] == 1 << 12


def test_snapshot_case_counts_and_ratio():
    r = table_apply.snapshot_case(args(), np.random.default_rng(0))
    assert r["snapshot_bytes_per_row"] == 8 + 4 * 4 + 4 * 4 + 8 + 8        # id, row, adagrad sum, count, last step
    assert 0 < r["rows_changed"] <= r["ids_applied"] <= 20 * 256
    assert r["incremental_bytes"] >= r["rows_changed"] * r["snapshot_bytes_per_row"]
    assert r["ratio_incremental_over_full_all_rows"] == round(r["incremental_bytes"] /
                                                              r["full_bytes_all_rows_computed"], 4)


def test_zipf_ranks_are_bounded_and_head_heavy():
    k = table_apply.zipf_ranks(np.random.default_rng(0), 100_000, 1000, 1.05)
    assert k.min() >= 1 and k.max() <= 1000
    assert (k == 1).mean() > 5 * (k == 10).mean() > 0
