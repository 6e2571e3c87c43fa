"""The synthetic click-through data of examples/ctr_data.py: deterministic, Zipf-shaped, with a known Bayes AUC."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import ctr_data  # noqa: E402
from ctr_data import NUM_DENSE, NUM_SPARSE, CTRConfig, CTRDataset, PlantedModel, collate  # noqa: E402

ROWS = 2 ** 18


@pytest.fixture(scope="module")
def cfg() -> CTRConfig:
    return CTRConfig(rows=ROWS, seed=3)


def test_vocabularies_fill_the_table_in_criteo_proportions(cfg):
    assert len(cfg.vocab) == NUM_SPARSE and sum(cfg.vocab) == ROWS
    assert cfg.offsets[0] == 0 and cfg.offsets[-1] == ROWS
    big = int(np.argmax(ctr_data.CRITEO_CARDINALITIES))
    assert cfg.vocab[big] == max(cfg.vocab)
    assert all(v >= min(c, 4) for v, c in zip(cfg.vocab, ctr_data.CRITEO_CARDINALITIES))
    with pytest.raises(ValueError, match="rows=10"):
        CTRConfig(rows=10)
    with pytest.raises(ValueError, match="zipf=-1"):
        CTRConfig(zipf=-1)


def test_a_sample_is_a_function_of_seed_split_and_index_only(cfg):
    ds = CTRDataset(cfg, "train", 10_000)
    dense, ids, clicks = ds.batch([7, 9000, 3])
    assert dense.shape == (3, NUM_DENSE) and dense.dtype == torch.float32
    assert ids.shape == (3, NUM_SPARSE) and ids.dtype == torch.int64
    assert clicks.shape == (3,) and set(clicks.tolist()) <= {0.0, 1.0}
    again = CTRDataset(CTRConfig(rows=ROWS, seed=3), "train", 10_000)       # a fresh object, same config
    d1, i1, c1 = again[9000]
    assert torch.equal(d1, dense[1]) and torch.equal(i1, ids[1]) and c1 == clicks[1]
    assert torch.equal(again.batch([3])[1][0], ids[2])                     # batch company does not matter
    lo, hi = torch.tensor(cfg.offsets[:-1]), torch.tensor(cfg.offsets[1:])
    assert bool(((ids >= lo) & (ids < hi)).all())                          # each feature in its own range
    other_seed = CTRDataset(CTRConfig(rows=ROWS, seed=4), "train", 10_000).batch([7, 9000, 3])
    test_split = CTRDataset(cfg, "test", 10_000).batch([7, 9000, 3])
    assert not torch.equal(other_seed[1], ids) and not torch.equal(test_split[1], ids)
    with pytest.raises(IndexError, match="sample 10000 is outside"):
        ds.batch([1, 10_000])


def test_the_dataloader_gives_the_same_batches_in_worker_processes(cfg):
    ds = CTRDataset(cfg, "train", 2_000)
    expected = list(ds.batches(256))
    for workers in (0, 2):
        got = list(DataLoader(ds, batch_size=256, collate_fn=collate, num_workers=workers))
        assert len(got) == len(expected) == 8
        for g, e in zip(got, expected):
            assert all(torch.equal(a, b) for a, b in zip(g, e))
    single = collate([ds[0], ds[1]])                                       # per-sample items stack too
    assert all(torch.equal(a, b) for a, b in zip(single, ds.batch([0, 1])))


@pytest.mark.parametrize("zipf", [1.0, 1.2])
def test_ids_follow_a_zipf_law(zipf):
    model = PlantedModel(CTRConfig(rows=ROWS, seed=1, zipf=zipf))
    f = int(np.argmax(model.vocab))                                        # the largest feature
    local, _ = model.features(0, np.arange(200_000))
    counts = np.sort(np.bincount(local[:, f], minlength=int(model.vocab[f])))[::-1]
    ranks = np.arange(5, 300)                                              # frequent enough to count
    slope = np.polyfit(np.log(ranks + 1), np.log(counts[ranks]), 1)[0]
    assert slope == pytest.approx(-zipf, abs=0.12)
    top = counts[0] / counts.sum()
    assert top == pytest.approx(1 / np.sum(np.arange(1, model.vocab[f] + 1, dtype=np.float64) ** -zipf), rel=0.15)


def test_the_click_rate_is_the_one_asked_for(cfg):
    p = CTRDataset(cfg, "test", 20_000).probabilities()
    assert p.mean() == pytest.approx(cfg.ctr, abs=0.02)
    p = CTRDataset(CTRConfig(rows=ROWS, seed=3, ctr=0.1), "test", 20_000).probabilities()
    assert p.mean() == pytest.approx(0.1, abs=0.02)


def test_bayes_auc_is_stable_high_and_beats_a_partial_model(cfg):
    from sklearn.metrics import roc_auc_score

    a = CTRDataset(cfg, "test", 20_000)
    b = CTRDataset(CTRConfig(rows=ROWS, seed=3), "train", 20_000)          # other samples, same planted model
    auc_a, auc_b = a.bayes_auc(), b.bayes_auc()
    assert auc_a == a.bayes_auc()                                          # deterministic
    assert abs(auc_a - auc_b) < 0.015 and auc_a > 0.75
    # the planted probability beats the same model without its pairwise part (DLRM's dot interaction)
    _, _, clicks = a.batch(np.arange(len(a)))
    local, dense = a.model.features(ctr_data.SPLITS["test"], np.arange(len(a)))
    s1, _, d = a.model.parts(local, dense)
    partial = a.model.a1 * s1 + a.model.a3 * d
    assert roc_auc_score(clicks.numpy(), partial) < auc_a - 0.01
    # and a weaker signal gives a lower ceiling
    weak = CTRConfig(rows=ROWS, seed=3, first_order_std=0.3, pairwise_std=0.1, dense_std=0.2)
    flat = CTRDataset(weak, "test", 20_000)
    assert 0.5 < flat.bayes_auc() < auc_a - 0.1


def test_the_example_dlrm_learns_toward_the_bayes_auc():
    import torch.nn.functional as F

    import ctr

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        cfg = CTRConfig(rows=2 ** 14, seed=5)
        train, test = CTRDataset(cfg, "train", 300 * 256), CTRDataset(cfg, "test", 5_000)
        model = ctr.DLRM(cfg.rows)
        (opt,) = ctr.optimizers(model, "adagrad", 0.01, 0.05)
        untrained = ctr.evaluate(model, test)
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            for dense, ids, clicks in train.batches(256):
                opt.zero_grad()
                F.binary_cross_entropy_with_logits(model(dense, ids), clicks).backward()
                opt.step()
        auc, bayes = ctr.evaluate(model, test), test.bayes_auc()
    finally:
        torch.set_num_threads(threads)
    assert untrained < 0.7 and 0.75 < auc < bayes
