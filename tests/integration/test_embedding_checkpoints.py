"""Embedding tables in checkpoints: a restore holds exactly the rows of the cut, and ``shoal export`` writes a
fixed table into the state_dict (loaded strictly by a model with nn.Embedding) and a dynamic one as a file."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from harness import InProcessCluster, wait_until
from shoal import cli
from shoal.chief.checkpointer import CheckpointConfig, Interval
from shoal.state.checkpoint import load_latest
from shoal.settings.config import JobConfig
from shoal.state.tables import RowsFile
from shoal.worker import Trainer
from shoal.worker.embedding import ShardedEmbedding

N, DIM = 1000, 4


class Model(torch.nn.Module):
    def __init__(self, fixed: torch.nn.Module, dynamic: torch.nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.tags = fixed, dynamic
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.head(self.emb(ids % N) + self.tags(ids)).squeeze(-1)


def data(n=256):
    g = np.random.default_rng(0)
    ids = torch.from_numpy(g.integers(0, 2**50, 60)[g.integers(0, 60, n)])
    return ids, torch.from_numpy(g.uniform(-1, 1, n).astype(np.float32))


def primaries(c):
    return {k: s for ps in c.servers for k, s in ps.host.shards.items() if ps.host.roles.get(k) == "primary"}


def test_a_restore_holds_the_cuts_rows_and_export_writes_both_kinds_of_table(tmp_path, capsys):
    root = tmp_path / "ckpts"
    cfg = CheckpointConfig(str(root), Interval(steps=8), keep=2, poll_s=0.05)
    ids, y = data()
    c = InProcessCluster(2, JobConfig(mode="async", num_shards=2), checkpoint=cfg)
    try:
        model = Model(ShardedEmbedding(N, DIM, hyper={"lr": 0.1}), ShardedEmbedding(None, DIM, optimizer="adagrad",
                                                                                   hyper={"lr": 0.1}))
        t = Trainer(model, chief=c.chief_address, optimizer="sgd", lr=0.05)
        for xb, yb in t.batches((ids, y), batch_size=16, epochs=2):
            t.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            t.step()
        t.close()
        shards = primaries(c)
        top = max(s.version for s in shards.values())
        wait_until(lambda: (ck := load_latest(root)) is not None and ck.step == top, timeout_s=30,
                   what="the final checkpoint")
        digests = {k: s.digest() for k, s in shards.items()}
        # the newest checkpoint holds each table as the full snapshot of an earlier one and the changes since
        ckpt = load_latest(root)
        for k in (0, 1):
            for name in ("emb", "tags"):
                chain = ckpt.shard_extra(k)["tables"][name]["chain"]
                assert [f["kind"] for f in chain] == ["full", "diff"] and chain[0]["version"] < ckpt.step
                assert chain[1]["version"] == ckpt.step and (root / chain[1]["file"]).is_file()
        held = {k: {n: tab.export() for n, tab in s.tables.tables.items()} for k, s in shards.items()}
        assert all(held[k]["tags"][0].size for k in held)
    finally:
        c.stop()

    c = InProcessCluster(2, JobConfig(mode="async", num_shards=2), checkpoint=cfg)     # restored from root
    try:
        wait_until(lambda: len(primaries(c)) == 2, timeout_s=30, what="the shards to be restored")
        assert {k: s.digest() for k, s in primaries(c).items()} == digests      # weights, rows, row state
    finally:
        c.stop()

    out = tmp_path / "model.pt"
    assert cli.main(["export", str(root), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"table emb: 1,000 x {DIM} as emb.weight" in printed and "table tags:" in printed
    plain = torch.nn.ModuleDict({"emb": torch.nn.Embedding(N, DIM), "head": torch.nn.Linear(DIM, 1)})
    state = torch.load(out, weights_only=True)
    plain.load_state_dict({k: v for k, v in state.items() if not k.startswith("tags")}, strict=True)
    assert set(state) == {"emb.weight", "head.weight", "head.bias"}
    for k in held:
        fixed_ids, fixed_rows = held[k]["emb"]
        assert torch.equal(plain["emb"].weight[torch.from_numpy(fixed_ids)], torch.from_numpy(fixed_rows))
    tags = RowsFile(f"{out}.tags.rows.npz")
    want_ids = np.concatenate([held[k]["tags"][0] for k in held])
    want_rows = np.concatenate([held[k]["tags"][1] for k in held])
    assert len(tags) == len(want_ids) and tags.spec["optimizer"] == "adagrad"
    assert np.array_equal(tags.lookup(want_ids), want_rows)
