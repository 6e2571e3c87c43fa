"""A replicated update travels in as few bytes as exact (ps/update_wire.py): a sparse one as its entries,
one from a single bf16/fp16 push in that dtype, anything else as fp32; the backup ends bit for bit where
its primary is, change log included; a body that disagrees with its header is refused whole.

Pure state: encoders, a shard and its backup shard, a PushAssembly; no sockets.
"""
import re

import numpy as np
import pytest
import torch

from shoal import codecs
from shoal.net import frames
from shoal.settings.config import OptimizerSpec
from shoal.errors import InvalidArgument
from shoal.proto import shoal_pb2 as pb
from shoal.ps.consistency import AsyncRule, SyncRule
from shoal.ps.ledger import BatchKey
from shoal.ps.servicer import PushAssembly
from shoal.ps.shard import Shard
from shoal.ps.sparse import SparseGrad
from shoal.ps.update import Update
from shoal.ps.update_wire import Incoming, update_frames, update_from_frames, update_message

from test_sparse_apply import _Servicer     # a servicer stand-in over one shard, for a PushAssembly

N = 1000
SGD = OptimizerSpec("sgd", {"lr": 0.37})
RNG = np.random.default_rng(3)


def randn(n=N):
    return torch.from_numpy(RNG.standard_normal(n).astype(np.float32))


def a_sparse(n=N, k=37):
    idx = torch.from_numpy(np.sort(RNG.choice(n, size=k, replace=False)))
    return SparseGrad(idx, randn(k), n)


def update(grad, exact="", sparse=False):
    return Update(4, grad, ("k1", "k2"), ((BatchKey(1, 32), "k1"),), ("w0", "w1"), sparse=sparse,
                  hparams=(("0.lr", 0.5),), exact=exact)


CASES = {                        # name: (update, the body's bytes)
    "fp32": (update(randn()), 4 * N),
    "bf16": (update(randn().bfloat16().float(), "bfloat16"), 2 * N),
    "fp16": (update(randn().half().float(), "float16"), 2 * N),
    "entries": (update(a_sparse(), sparse=True), 12 * 37),
    "no entries": (update(SparseGrad(torch.empty(0, dtype=torch.int64), torch.empty(0), N), sparse=True), 0),
    "sparse flag, dense": (update(randn(), sparse=True), 4 * N),
    "every element an entry": (update(SparseGrad(torch.arange(N), randn(), N), sparse=True), 12 * N),
    "an empty shard": (update(torch.empty(0)), 0),
}


def whole(u):
    head, body = update_message(0, "ps-a", u)
    h = pb.ReplicateHeader.FromString(head)
    incoming = Incoming(h)
    incoming.check_whole(len(body))
    incoming.open().whole()[:] = body
    return incoming.update(), len(body)


def same(a: Update, b: Update):
    assert (a.version, a.keys, a.batches, a.workers, a.hparams, a.sparse) == \
        (b.version, b.keys, b.batches, b.workers, b.hparams, b.sparse)
    assert isinstance(a.grad, SparseGrad) == isinstance(b.grad, SparseGrad)
    if isinstance(a.grad, SparseGrad):
        assert torch.equal(a.grad.indices, b.grad.indices) and torch.equal(a.grad.values, b.grad.values)
    assert a.dense_grad().dtype == torch.float32
    assert torch.equal(a.dense_grad().view(torch.int32), b.dense_grad().view(torch.int32))   # bit for bit


@pytest.mark.parametrize("name", CASES)
def test_every_encoding_arrives_bit_for_bit_whole_and_in_chunks_in_the_bytes_it_needs(name):
    u, size = CASES[name]
    got, sent = whole(u)
    assert sent == size
    same(got, u)
    for chunk_bytes in (1, 7, 100, 1 << 20):
        fr = update_frames(0, "ps-a", u, chunk_bytes)
        head, got = update_from_frames(iter(fr))
        same(got, u)
        assert head.keys == ["k1", "k2"]
        assert sum(len(frames.unpack(f, pb.ReplicateHeader)[1]) for f in fr) == size


def test_an_update_not_marked_exact_travels_as_fp32_even_when_its_values_would_fit():
    u = update(randn().bfloat16().float())
    assert whole(u)[1] == 4 * N


def a_header(**kw):
    fields = dict(shard=0, version=1, primary_id="ps-a", offset=0, numel=N, shard_numel=N)
    fields.update(kw)
    return pb.ReplicateHeader(**fields)


@pytest.mark.parametrize("head, why", [
    (a_header(dtype="float64"), re.escape("dtype 'float64': not one of ['bfloat16', 'float16', 'fp32']")),
    (a_header(dtype="bfloat16", entries=True, nnz=3, numel=3), "3 bfloat16 entries .* entries are fp32"),
    (a_header(nnz=3), "a dense replicated update that names 3 entries"),
    (a_header(entries=True, nnz=N + 1, numel=N + 1), "at most one an element"),
    (a_header(entries=True, nnz=-1, numel=0), "at most one an element"),
    (a_header(shard_numel=-1, numel=-1), "shard of -1"),
])
def test_a_header_that_cannot_describe_an_update_is_refused_before_anything_is_allocated(head, why):
    checked = []
    with pytest.raises(InvalidArgument, match=why):
        Incoming(head).open(checked.append)
    assert checked == []


@pytest.mark.parametrize("indices, why", [([3, 2, 9], "strictly increasing"), ([1, 1, 9], "strictly increasing"),
                                          ([1, 5, 3], "strictly increasing"), ([1, 2, N], "inside"),
                                          ([-1, 2, 9], "inside")])
def test_entries_out_of_order_or_outside_the_shard_are_refused(indices, why):
    head = a_header(entries=True, nnz=3, numel=3, sparse=True)
    body = b"".join((frames.tensor_bytes(torch.tensor(indices, dtype=torch.int64)),
                     frames.tensor_bytes(torch.ones(3))))
    incoming = Incoming(head)
    incoming.check_whole(len(body))
    incoming.open().whole()[:] = body
    with pytest.raises(InvalidArgument, match=why):
        incoming.update()


@pytest.mark.parametrize("head, body_len", [(a_header(), 4 * N - 4), (a_header(), 4 * N + 4), (a_header(offset=1), 4 * N),
                                            (a_header(numel=N - 1), 4 * N), (a_header(dtype="bfloat16"), 4 * N),
                                            (a_header(entries=True, nnz=3, numel=2), 36)])
def test_an_update_sent_whole_must_cover_what_its_header_counts_in_the_bytes_it_says(head, body_len):
    with pytest.raises(InvalidArgument, match="sent whole, it must hold all"):
        Incoming(head).check_whole(body_len)


def test_a_chunk_that_changes_the_encoding_midway_or_its_size_is_refused():
    u, _ = CASES["bf16"]
    fr = update_frames(0, "ps-a", u, 400)                 # 200 elements a frame
    head, payload = frames.unpack(fr[1], pb.ReplicateHeader)
    head.dtype = ""                                       # the rest claims to be fp32
    with pytest.raises(InvalidArgument, match="does not continue"):
        update_from_frames(iter([fr[0], frames.pack(head, payload), *fr[2:]]))
    head.dtype = "bfloat16"
    with pytest.raises(InvalidArgument, match="399 bytes for 200 elements"):
        update_from_frames(iter([fr[0], frames.pack(head, payload[:399]), *fr[2:]]))
    with pytest.raises(InvalidArgument, match="covers 800 of 1000 elements"):
        update_from_frames(iter(fr[:4]))
    with pytest.raises(InvalidArgument, match="no frames"):
        update_from_frames(iter([]))


# ---------------------------------------------------------------- a primary and its backup, through the wire

def a_pair(spec=SGD, rule=AsyncRule):
    w = randn(N)
    primary, backup = Shard(0, w.clone(), spec, rule(), "fp"), Shard(0, w.clone(), spec, rule(), "fp")
    sent = []

    def replicator(u):
        got, size = whole(u)
        sent.append((u.exact, size))
        backup.apply_replica(got)

    primary.replicator = replicator
    return primary, backup, sent


def topk(x):
    payload = codecs.compressor_from_tag("topk", error_feedback=False, ratio=0.05).compress(0, x)
    idx, values = codecs.decode_tagged_entries("topk", payload, x.numel())
    return SparseGrad(idx, values, x.numel())


@pytest.mark.parametrize("spec", [SGD, OptimizerSpec("sgd", {"lr": 0.1, "momentum": 0.9}),
                                  OptimizerSpec("adamw", {"lr": 0.01})], ids=["sgd", "momentum", "adamw"])
def test_a_backup_fed_compact_updates_stays_bit_identical_to_its_primary_change_log_included(spec):
    primary, backup, sent = a_pair(spec)
    pushes = [(topk(randn()), ""), (randn().bfloat16().float(), "bfloat16"), (randn(), ""),
              (randn().half().float(), "float16"), (topk(randn()), "")]
    for v, (g, exact) in enumerate(pushes):
        assert primary.push("w", v, g, key=f"k{v}", exact=exact).accepted
        assert primary.digest() == backup.digest()
        assert torch.equal(primary.values().view(torch.int32), backup.values().view(torch.int32))
        for since in range(v + 1):
            a, b = primary.delta("none", since), backup.delta("none", since)
            assert (a is None) == (b is None)
            if a is not None:
                assert a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2] == b[2]
    k = pushes[0][0].nnz
    assert sent == [("", 12 * k), ("bfloat16", 2 * N), ("", 4 * N), ("float16", 2 * N), ("", 12 * pushes[4][0].nnz)]


def test_a_sync_round_of_two_bf16_pushes_is_their_average_and_travels_as_fp32():
    primary, backup, sent = a_pair(rule=SyncRule)
    primary.set_live_workers({"a", "b"})
    for w in ("a", "b"):
        primary.push(w, 0, randn().bfloat16().float(), key=w, exact="bfloat16")
    assert sent == [("", 4 * N)] and primary.digest() == backup.digest()
    primary.set_live_workers({"a"})
    primary.push("a", 1, randn().bfloat16().float(), key="a1", exact="bfloat16")     # a round of one
    assert sent[1] == ("bfloat16", 2 * N) and primary.digest() == backup.digest()


@pytest.mark.parametrize("tags, exact", [(("bf16",), "bfloat16"), (("bf16", "bf16+lz4"), "bfloat16"),
                                         (("fp16",), "float16"), (("bf16", "fp16"), ""), (("bf16", "none"), ""),
                                         (("int8",), ""), (("none",), "")])
def test_a_push_is_exact_in_a_narrower_dtype_only_when_every_chunk_came_in_it(tags, exact):
    primary, _, sent = a_pair()
    asm = PushAssembly(_Servicer(primary))
    x = randn()
    bounds = np.linspace(0, N, len(tags) + 1).astype(int)
    for tag, a, b in zip(tags, bounds[:-1], bounds[1:]):
        head = pb.PushHeader(shard=0, worker_id="w", key="k", version=0, offset=int(a), numel=int(b - a),
                             codec=tag, layout_fingerprint="fp")
        asm.check(head)
        payload = frames.tensor_bytes(x[a:b]) if tag == "none" else \
            codecs.compressor_from_tag(tag, error_feedback=False).compress(0, x[a:b].clone())
        asm.place_encoded(head, memoryview(payload))
    assert asm.finish(0).accepted
    assert sent == [(exact, 2 * N if exact else 4 * N)]
