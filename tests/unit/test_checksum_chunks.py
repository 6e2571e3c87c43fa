"""Checkpoint checksums cover the whole file, not the first read chunk.

Every other corruption test damages files smaller than one read chunk (1 MiB), so hashing only
the first block (``if`` for ``while``) would pass them. These files span several chunks and are
damaged past the first.
"""
import hashlib

import pytest
import torch

from shoal.state.checkpoint import CheckpointWriter, ShardState, load_latest, open_checkpoint
from shoal.state.checkpoint_store import sha256_file
from shoal.errors import FailedPrecondition
from shoal.state.layout import ModelLayout, TensorSpec

MIB = 1 << 20


def test_sha256_file_hashes_every_chunk_of_a_large_file(tmp_path):
    data = bytes(range(256)) * (3 * MIB // 256 + 7)           # 3 MiB and a bit: four default chunks
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(data)
    damaged = bytearray(data)
    damaged[2 * MIB + 5] ^= 0x01                               # one bit in the third chunk
    b.write_bytes(bytes(damaged))
    assert sha256_file(a) == hashlib.sha256(data).hexdigest()
    assert sha256_file(b) != sha256_file(a)
    assert sha256_file(a, chunk=4096) == sha256_file(a)           # the chunk size does not change the digest


def test_sha256_file_with_a_small_chunk_sees_the_last_byte(tmp_path):
    data = b"x" * 10_000
    p = tmp_path / "f"
    p.write_bytes(data)
    assert sha256_file(p, chunk=1000) == hashlib.sha256(data).hexdigest()
    p.write_bytes(data[:-1] + b"y")
    assert sha256_file(p, chunk=1000) == hashlib.sha256(data[:-1] + b"y").hexdigest()


def test_a_checkpoint_corrupted_past_the_first_mib_is_refused(tmp_path):
    n = 600_000                                               # 2.4 MB of fp32 values: three read chunks
    layout = ModelLayout([TensorSpec("w", (n,))])
    values = torch.arange(n, dtype=torch.float32)
    pending = CheckpointWriter(tmp_path).begin(1)
    pending.write_shard(ShardState(0, 0, n, values, "sgd", {"lr": 0.1}, {"state": {}, "param_groups": []},
                                   version=3, extra={}))
    path = pending.commit(layout, 1, {"step": 1})
    shard_file = path / "shard-00000.pt"
    size = shard_file.stat().st_size
    assert size > 2 * MIB
    assert torch.equal(open_checkpoint(path).flat_values(), values)
    with open(shard_file, "r+b") as f:                        # same size, one byte changed at 2 MiB
        f.seek(2 * MIB)
        byte = f.read(1)
        f.seek(2 * MIB)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert shard_file.stat().st_size == size
    with pytest.raises(FailedPrecondition, match="sha256"):
        open_checkpoint(path)
    assert load_latest(tmp_path) is None
