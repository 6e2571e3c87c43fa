"""The job's records read at the end (``shoal local``'s shard report and final-checkpoint wait) when the
chief and a primary die at once as training ends: found by bench/nemesis.py, whose fixed schedule killed
them just after the final checkpoint was committed. The chief came back from its journal still routing
the dead primary's shard to it (its lease had not run out), the shard report took that unreachable shard
as read (no version, an empty ledger: "exactly once" false), and the recovered chief reported no
checkpoint (step 0) though the final one was on disk, so the run waited 60 s for it in vain."""
import io

import torch.nn.functional as F

from harness import InProcessCluster, wait_until
from shoal.checkpoint import load_latest
from shoal.chief.checkpointer import CheckpointConfig, Interval
from shoal.cli.local import LocalCluster, LocalConfig
from shoal.cli.status import exactly_once, shards_readable
from shoal.config import JobConfig
from shoal.worker import Trainer

from test_cluster import data, mlp

SIZE, BATCH, EPOCHS = 256, 16, 2


def test_the_records_are_the_promoted_backups_and_the_final_checkpoint_is_known(tmp_path):
    root = tmp_path / "ckpts"
    # only the final checkpoint (every task done) is taken: the interval is never reached
    cfg = CheckpointConfig(str(root), Interval(steps=100_000), keep=3, poll_s=0.05)
    c = InProcessCluster(2, JobConfig(mode="sync", num_shards=2, lease_seconds=2.0),
                         journal=str(tmp_path / "chief.db"), checkpoint=cfg)
    trainer = None
    try:
        model = mlp(0)
        trainer = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.02)   # initialises the shards
        wait_until(lambda: set(c.chief.state.complete) == {0, 1}, timeout_s=20,
                   what="every shard to have a whole backup")
        x, y = data(SIZE)
        for xb, yb in trainer.batches((x, y), batch_size=BATCH, epochs=EPOCHS):
            trainer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            trainer.step(samples=len(xb))
        trainer.close()
        trainer = None
        versions = {k: ps.host.shards[k].version for ps in c.servers for k in ps.host.shards
                    if ps.host.roles.get(k) == "primary"}
        final = max(versions.values())
        wait_until(lambda: (ck := load_latest(root)) is not None and ck.step == final, timeout_s=20,
                   what=f"the final checkpoint (step {final})")

        # the chief and shard 1's primary die at the same moment; the chief comes back from its journal
        victim = c.chief.state.routing[1]
        c.stop_chief()
        c.kill_ps(next(i for i, s in enumerate(c.servers) if s.chief.member_id == victim))
        c.start_chief()
        assert c.chief.recovered and c.chief.state.routing[1] == victim   # still routed to the dead primary

        script = tmp_path / "train.py"
        script.write_text("")
        local = LocalCluster(LocalConfig(script=str(script), run_dir=str(tmp_path / "run"),
                                         checkpoint_dir=str(root)), out=io.StringIO())
        local.chief_address = c.chief_address
        report = local.shard_report()
        assert report is not None and shards_readable(report), report["shards"]
        assert {sh["shard"]: sh["version"] for sh in report["shards"]} == versions
        assert exactly_once(report), [sh["ledger"] for sh in report["shards"]]   # the promoted copy's ledger
        assert local.final_checkpoint(final, wait_s=3.0) == final
    finally:
        if trainer is not None:
            trainer.close()
        c.stop()
