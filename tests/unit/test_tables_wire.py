"""shoal/state/tables.py: the row placement and the row blobs worker and server agree on, and an update's rows
on their way to the backup (ps/update_wire.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.net import frames
from shoal.errors import InvalidArgument
from shoal.proto import shoal_pb2 as pb
from shoal.ps.update import Update
from shoal.ps.update_wire import Incoming, update_frames, update_from_frames, update_message
from shoal.state.tables import (decode_rows, encode_rows, mix64, pack_rows, partition_of, split_by_shard, sum_rows,
                          unpack_rows)


def _splitmix_finaliser(x: int) -> int:
    """splitmix64's finaliser written out on Python ints (the reference the vectorised one must match)."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_partition_is_splitmix64_mod_shards_for_any_int64():
    ids = np.array([0, 1, 2, 7, 2**40, -1, -(2**63), 2**63 - 1], dtype=np.int64)
    want = [_splitmix_finaliser(int(i) & ((1 << 64) - 1)) for i in ids]
    assert [int(v) for v in mix64(ids)] == want
    assert partition_of(ids, 3).tolist() == [w % 3 for w in want]
    assert partition_of(ids, 1).tolist() == [0] * len(ids)


def test_partition_spreads_consecutive_ids_evenly():
    counts = np.bincount(partition_of(np.arange(100_000), 4), minlength=4)
    assert counts.min() > 24_000 and counts.max() < 26_000


def test_partition_refuses_no_shards():
    with pytest.raises(InvalidArgument, match="at least 1 shard"):
        partition_of(np.arange(3), 0)


def test_split_by_shard_names_each_position_once():
    ids = np.arange(1000, dtype=np.int64) * 7919
    parts = split_by_shard(ids, 3)
    assert sorted(np.concatenate(list(parts.values())).tolist()) == list(range(1000))
    for k, pos in parts.items():
        assert set(partition_of(ids[pos], 3).tolist()) == {k}


def test_sum_rows_sums_duplicates_in_order():
    a = (np.array([5, 1], np.int64), np.array([[1, 1], [2, 2]], np.float32))
    b = (np.array([1, 9], np.int64), np.array([[10, 10], [3, 3]], np.float32))
    ids, grads = sum_rows([a, b], 2)
    assert ids.tolist() == [1, 5, 9]
    assert grads.tolist() == [[12, 12], [1, 1], [3, 3]]
    ids, grads = sum_rows([(np.array([3, 3], np.int64), np.ones((2, 2), np.float32))], 2)
    assert ids.tolist() == [3] and grads.tolist() == [[2, 2]]


def test_rows_blob_round_trips_and_refuses_what_does_not_add_up():
    t1 = ("emb", np.array([3, -4], np.int64), np.arange(6, dtype=np.float32).reshape(2, 3))
    t2 = ("bag.0", np.array([], np.int64), np.zeros((0, 5), np.float32))
    out = unpack_rows(pack_rows([t1, t2]))
    assert [(n, i.tolist(), g.tolist()) for n, i, g in out] == [(n, i.tolist(), g.tolist()) for n, i, g in (t1, t2)]
    blob = pack_rows([t1])
    with pytest.raises(InvalidArgument, match="needs"):
        unpack_rows(blob[:-4])
    with pytest.raises(InvalidArgument, match="after its 1 table"):
        unpack_rows(blob + b"x")
    with pytest.raises(InvalidArgument, match="twice"):
        unpack_rows(pack_rows([t1, t1]))
    with pytest.raises(InvalidArgument, match="3 ids for 2 rows"):
        pack_rows([("e", np.arange(3), np.zeros((2, 2), np.float32))])


@pytest.mark.parametrize("dtype,tol", [("float32", 0), ("float16", 1e-3), ("bfloat16", 8e-3)])
def test_rows_on_the_wire_in_each_dtype(dtype, tol):
    rows = np.random.default_rng(0).standard_normal((7, 16)).astype(np.float32)
    back = decode_rows(encode_rows(rows, dtype), dtype, 7, 16)
    assert np.allclose(back, rows, rtol=tol, atol=tol)
    if dtype == "bfloat16":      # rounded to nearest: the same as torch's conversion
        assert np.array_equal(back, torch.from_numpy(rows).bfloat16().float().numpy())


def _update_with_rows() -> Update:
    rows = (("emb", np.array([2, 11], np.int64), np.array([[0.5, -1.0], [2.0, 3.0]], np.float32)),)
    return Update(4, torch.arange(6, dtype=torch.float32), keys=("k",), workers=("w",), rows=rows)


def _same_rows(a: Update, b: Update) -> None:
    assert [(n, i.tolist(), g.tolist()) for n, i, g in a.rows] == [(n, i.tolist(), g.tolist()) for n, i, g in b.rows]


def test_an_updates_rows_reach_the_backup_in_grpc_frames():
    u = _update_with_rows()
    fr = update_frames(1, "ps-a", u, chunk_bytes=16)       # several gradient frames, then row frames
    heads = [frames.unpack(f, pb.ReplicateHeader)[0] for f in fr]
    assert any(h.rows_part for h in heads) and not heads[0].rows_part
    _, got = update_from_frames(iter(fr))
    assert torch.equal(got.grad, u.grad) and got.keys == ("k",)
    _same_rows(got, u)
    with pytest.raises(InvalidArgument, match="bytes of rows"):
        update_from_frames(iter(fr[:-1]))            # the last piece of the rows missing


def test_an_updates_rows_reach_the_backup_whole_on_the_tcp_channel():
    u = _update_with_rows()
    head, body = update_message(1, "ps-a", u)
    incoming = Incoming(pb.ReplicateHeader.FromString(head))
    incoming.check_whole(len(body))
    incoming.open().whole()[:] = bytes(body)
    got = incoming.update()
    assert torch.equal(got.grad, u.grad)
    _same_rows(got, u)
    with pytest.raises(InvalidArgument):
        Incoming(pb.ReplicateHeader.FromString(head)).check_whole(len(body) - 1)


def test_an_update_without_rows_travels_as_before():
    u = Update(2, torch.ones(3))
    head, body = update_message(0, "p", u)
    assert pb.ReplicateHeader.FromString(head).rows_bytes == 0 and len(body) == 12
    _, got = update_from_frames(iter(update_frames(0, "p", u, 1 << 20)))
    assert got.rows == ()
