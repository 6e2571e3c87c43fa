import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoal.net import frames
from shoal.settings.config import JobConfig, from_sources
from shoal.errors import InvalidArgument
from shoal.proto import shoal_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def test_frame_round_trip_is_zero_copy_on_the_payload():
    t = torch.arange(10, dtype=torch.float32)
    frame = frames.pack(pb.PushHeader(shard=3, numel=10, key="k"), frames.tensor_bytes(t))
    head, payload = frames.unpack(frame, pb.PushHeader)
    assert (head.shard, head.numel, head.key) == (3, 10, "k")
    assert isinstance(payload, memoryview) and payload.obj is frame
    assert torch.equal(frames.fp32_from(payload, 10), t)


@pytest.mark.parametrize("frame", [b"", b"\x01", b"\xff\x00\x00\x00abc", b"\x03\x00\x00\x00\xff\xff\xff"])
def test_corrupt_frames_are_invalid_argument(frame):
    with pytest.raises(InvalidArgument):
        frames.unpack(frame, pb.PushHeader)


def test_payload_size_is_checked():
    with pytest.raises(InvalidArgument, match="does not hold 3 fp32"):
        frames.fp32_from(b"\x00" * 8, 3)


def test_job_config_errors_quote_the_bad_value(monkeypatch, tmp_path):
    with pytest.raises(InvalidArgument, match="--mode 'fast' is not one of sync, async, ssp"):
        JobConfig(mode="fast")
    with pytest.raises(InvalidArgument, match="--staleness must be >= 0, got -1"):
        JobConfig(mode="ssp", staleness=-1)
    monkeypatch.setenv("SHOAL_LEASE_SECONDS", "abc")
    with pytest.raises(InvalidArgument, match="SHOAL_LEASE_SECONDS='abc'"):
        from_sources(JobConfig)
    monkeypatch.setenv("SHOAL_LEASE_SECONDS", "7.5")
    assert from_sources(JobConfig, yaml_values={"mode": "async"}, cli={"num_shards": 3}) == \
        JobConfig(mode="async", num_shards=3, lease_seconds=7.5)
    with pytest.raises(InvalidArgument, match="unknown setting 'modes'"):
        from_sources(JobConfig, yaml_values={"modes": "async"})


def test_generated_proto_code_is_fresh():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_stale_generated_code_is_detected(tmp_path):
    # The check itself must be able to fail: a .proto with an extra field differs from the committed code.
    import shutil
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "proto", copy / "proto")
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    proto = copy / "proto" / "shoal.proto"
    proto.write_text(proto.read_text().replace("message Empty {}", "message Empty { int32 x = 1; }"))
    r = subprocess.run([sys.executable, str(copy / "scripts" / "gen_proto.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "stale generated code" in r.stderr
