"""The sparse server path: a top-k push applied to its elements only, bit for bit what the dense step gives."""
import math

import numpy as np
import pytest
import torch

from shoal import codecs
from shoal.net import frames
from shoal.settings.config import OptimizerSpec
from shoal.state.optim import ShardOptimizer
from shoal.proto import shoal_pb2 as pb
from shoal.ps import changes
from shoal.ps.consistency import AsyncRule, SyncRule
from shoal.ps.servicer import PushAssembly
from shoal.ps.shard import Shard
from shoal.ps.sparse import SparseGrad

N = 50_000
SGD = OptimizerSpec("sgd", {"lr": 0.37})


def sparse_grads(seed: int, count: int, n: int = N, k: int = 500) -> list[SparseGrad]:
    """Random top-k-like gradients: magnitudes over many decades, some exact zeros and -0.0."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        idx = np.sort(rng.choice(n, size=k, replace=False))
        values = (rng.standard_normal(k) * 10.0 ** rng.uniform(-9, 3, k)).astype(np.float32)
        values[:5] = 0.0
        values[5:10] = -0.0
        out.append(SparseGrad(torch.from_numpy(idx), torch.from_numpy(values), n))
    return out


def shard(spec=SGD, rule=None, n=N, seed=0) -> Shard:
    weights = torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))
    weights[:50] = -0.0
    return Shard(0, weights, spec, rule or AsyncRule(), "fp")


def no_dense_step(monkeypatch):
    def refuse(self, grad=None):
        raise AssertionError("the dense optimizer step ran for a sparse push into plain SGD")
    monkeypatch.setattr(ShardOptimizer, "step", refuse)


def test_async_sparse_pushes_give_the_dense_paths_weights_bit_for_bit_without_a_dense_step(monkeypatch):
    grads = sparse_grads(1, 20)
    dense, sparse = shard(), shard()
    for v, g in enumerate(grads):
        assert dense.push("w", v, g.dense().clone(), sparse=True).accepted
    no_dense_step(monkeypatch)
    for v, g in enumerate(grads):
        assert sparse.push("w", v, g).accepted
    assert sparse.digest() == dense.digest()
    assert sparse.stats.sparse_updates == 20


@pytest.mark.parametrize("workers", [2, 3])
def test_a_sync_round_of_sparse_pushes_sums_and_averages_as_the_dense_round_does(monkeypatch, workers):
    names = [f"w{i}" for i in range(workers)]
    rounds = [sparse_grads(10 * r, workers, k=4000) for r in range(6)]     # overlapping indices
    dense, sparse = shard(rule=SyncRule()), shard(rule=SyncRule())
    for s in (dense, sparse):
        s.set_live_workers(names)
    for r, grads in enumerate(rounds):
        for w, g in zip(names, grads):
            assert dense.push(w, r, g.dense().clone(), sparse=True).accepted
    no_dense_step(monkeypatch)
    for r, grads in enumerate(rounds):
        for w, g in zip(names, grads):
            assert sparse.push(w, r, g).accepted
    assert sparse.version == dense.version == 6
    assert sparse.digest() == dense.digest()
    assert sparse.stats.sparse_updates == 6


def test_a_sync_sum_turns_a_negative_zero_a_later_push_does_not_name_into_a_positive_one(monkeypatch):
    # weights 0..49 are -0.0: -0.0 - lr * (+0.0) stays -0.0, -0.0 - lr * (-0.0) becomes +0.0
    a = SparseGrad(torch.tensor([1, 2]), torch.tensor([-0.0, 1.0]), N)
    b = SparseGrad(torch.tensor([2, 3]), torch.tensor([1.0, -0.0]), N)
    dense, sparse = shard(rule=SyncRule()), shard(rule=SyncRule())
    for s in (dense, sparse):
        s.set_live_workers(["a", "b"])
    dense.push("a", 0, a.dense().clone())
    dense.push("b", 0, b.dense().clone())
    no_dense_step(monkeypatch)
    sparse.push("a", 0, a)
    sparse.push("b", 0, b)
    assert sparse.values()[:4].numpy().tobytes() == dense.values()[:4].numpy().tobytes()
    assert sparse.digest() == dense.digest()


def test_a_round_mixing_sparse_and_dense_pushes_turns_dense_in_push_order():
    names = ["a", "b", "c"]
    g = sparse_grads(3, 2)
    plain = torch.from_numpy(np.random.default_rng(4).standard_normal(N).astype(np.float32))
    dense, mixed = shard(rule=SyncRule()), shard(rule=SyncRule())
    for s in (dense, mixed):
        s.set_live_workers(names)
    for s, (x, y) in ((dense, (g[0].dense().clone(), g[1].dense().clone())), (mixed, (g[0], g[1]))):
        s.push("a", 0, x)
        s.push("b", 0, plain.clone())
        s.push("c", 0, y)
    assert mixed.digest() == dense.digest() and mixed.version == 1
    assert mixed.stats.sparse_updates == 0


@pytest.mark.parametrize("spec", [
    OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9}),
    OptimizerSpec("sgd", {"lr": 0.1, "weight_decay": 0.01}),
    OptimizerSpec("adam", {"lr": 0.01}),
    OptimizerSpec("adamw", {"lr": 0.01}),
], ids=["momentum", "weight_decay", "adam", "adamw"])
def test_optimizers_that_move_every_element_take_the_dense_step(spec):
    grads = sparse_grads(5, 4)
    dense, sparse = shard(spec), shard(spec)
    for v, g in enumerate(grads):
        dense.push("w", v, g.dense().clone(), sparse=True)
        sparse.push("w", v, g)
    assert sparse.digest() == dense.digest()
    assert sparse.stats.sparse_updates == 0
    assert sparse.changes.changed_since(1, 4) is None          # every element moved: a full pull


def test_a_scheduler_that_turns_weight_decay_on_sends_sparse_pushes_the_dense_way():
    dense, sparse = shard(), shard()
    g = sparse_grads(6, 2)
    for s, (x, y) in ((dense, (g[0].dense().clone(), g[1].dense().clone())), (sparse, tuple(g))):
        s.push("w", 0, x)
        s.push("w", 1, y, hparams={"0.weight_decay": 0.5})
    assert sparse.digest() == dense.digest()
    assert sparse.stats.sparse_updates == 1


def test_buffers_in_a_shard_take_the_gradient_as_it_is_on_the_sparse_path_too(monkeypatch):
    spec = OptimizerSpec("sgd", {"lr": 0.25}, buffers=((100, 2000), (30_000, 30_010)))
    grads = sparse_grads(7, 5, k=3000)
    dense, sparse = shard(spec), shard(spec)
    for v, g in enumerate(grads):
        dense.push("w", v, g.dense().clone())
    no_dense_step(monkeypatch)
    for v, g in enumerate(grads):
        sparse.push("w", v, g)
    assert sparse.digest() == dense.digest()


def test_the_change_log_records_a_sparse_update_without_scanning_and_deltas_match(monkeypatch):
    grads = sparse_grads(8, 6)
    dense, sparse = shard(), shard()
    at = [sparse.values()]                    # the weights at each version
    for v, g in enumerate(grads[:2]):
        dense.push("w", v, g.dense().clone(), sparse=True)
        sparse.push("w", v, g)
        at.append(sparse.values())

    def no_scan(*a, **kw):
        raise AssertionError("the change log scanned the shard for a sparse update")
    with monkeypatch.context() as m:
        m.setattr(changes.np, "flatnonzero", no_scan)
        for v, g in enumerate(grads[2:], start=2):
            sparse.push("w", v, g)
            at.append(sparse.values())
    for v, g in enumerate(grads[2:], start=2):
        dense.push("w", v, g.dense().clone(), sparse=True)
    assert sparse.digest() == dense.digest()
    for since in range(1, 7):
        a, b = sparse.delta("none", since), dense.delta("none", since)
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a[0] == b[0] == 6
        # the sparse log names every index it was handed; the dense scan skips the pushed zeros
        zeros = {int(i) for g in grads[since:] for i in g.indices[g.values == 0]}
        assert set(b[1].tolist()) <= set(a[1].tolist()) <= set(b[1].tolist()) | zeros
        for idx, raw in (a[1:], b[1:]):       # either delta rebuilds the current weights bit for bit
            rebuilt = at[since].clone()
            rebuilt[torch.from_numpy(idx).long()] = frames.fp32_from(raw, len(idx))
            assert rebuilt.numpy().tobytes() == at[6].numpy().tobytes()


def test_a_sparse_push_holding_nan_or_inf_is_refused_and_changes_nothing():
    s = shard()
    before = s.digest()
    g = sparse_grads(9, 1)[0]
    for bad in (math.nan, math.inf):
        values = g.values.clone()
        values[3] = bad
        r = s.push("w", 0, SparseGrad(g.indices, values, N))
        assert not r.accepted and "non-finite" in r.reason
    assert s.digest() == before and s.stats.nonfinite == {"w": 2}


class _Host:
    completed_epochs = 0

    def __init__(self, s):
        self.shards = {0: s}

    def get(self, shard):
        return self.shards[shard]

    def count(self, **kw):
        pass


class _Servicer:
    def __init__(self, s):
        self.host = _Host(s)

    def batches_of(self, head):
        return ()


def _encode(tag, t):
    return codecs.compressor_from_tag(tag, error_feedback=False, ratio=0.01).compress(0, t) if tag != "none" \
        else frames.tensor_bytes(t)


def _push(s, chunks):
    """Sends ``[(codec, offset, tensor)]`` through a PushAssembly; returns what the shard was offered."""
    offered = []
    real = s.push
    s.push = lambda *a, **kw: offered.append(a[2]) or real(*a, **kw)
    asm = PushAssembly(_Servicer(s))
    for codec, off, t in chunks:
        head = pb.PushHeader(shard=0, worker_id="w", key="k", version=0, offset=off, numel=t.numel(),
                             codec=codec, layout_fingerprint="fp")
        asm.check(head)
        asm.place_encoded(head, memoryview(_encode(codec, t)))
    assert asm.finish(0).accepted
    return offered[0]


@pytest.mark.parametrize("tags", [("topk",), ("topk", "topk+lz4", "topk"), ("topk", "none"), ("none", "topk"),
                                  ("topk", "none", "topk")])
def test_a_push_reaches_the_shard_sparse_only_when_every_chunk_is(tags):
    x = torch.from_numpy(np.random.default_rng(11).standard_normal(N).astype(np.float32))
    bounds = np.linspace(0, N, len(tags) + 1).astype(int)
    chunks = [(tag, int(a), x[a:b].clone()) for tag, a, b in zip(tags, bounds[:-1], bounds[1:])]
    want = torch.cat([t if tag == "none" else codecs.decode_tagged(tag, _encode(tag, t), t.numel())
                      for tag, _, t in chunks])
    s = shard()
    got = _push(s, chunks)
    if all(tag.startswith("topk") for tag in tags):
        assert isinstance(got, SparseGrad) and torch.equal(got.dense(), want)
        assert s.stats.sparse_updates == 1
    else:
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)


def test_a_sparse_push_with_nan_through_the_servicer_is_refused():
    x = torch.zeros(N)
    x[[5, 900, 40_000]] = torch.tensor([1.0, math.nan, 2.0])
    s = shard()
    asm = PushAssembly(_Servicer(s))
    head = pb.PushHeader(shard=0, worker_id="w", key="k", version=0, offset=0, numel=N, codec="topk",
                         layout_fingerprint="fp")
    asm.check(head)
    asm.place_encoded(head, memoryview(_encode("topk", x)))
    r = asm.finish(0)
    assert not r.accepted and "non-finite" in r.reason and s.version == 0
