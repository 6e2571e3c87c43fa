"""The job's records read at the end (``shoal local``'s shard report and final-checkpoint wait) when the
chief and a primary die at once as training ends: found by bench/nemesis.py, whose fixed schedule killed
them just after the final checkpoint was committed. The chief came back from its journal still routing
the dead primary's shard to it (its lease had not run out), the shard report took that unreachable shard
as read (no version, an empty ledger: "exactly once" false), and the recovered chief reported no
checkpoint (step 0) though the final one was on disk, so the run waited 60 s for it in vain."""
import io

import torch.nn.functional as F

from harness import InProcessCluster, wait_until
from shoal.state.checkpoint import load_latest
from shoal.chief.checkpointer import CheckpointConfig, Interval
from shoal.cli.local import LocalCluster, LocalConfig
from shoal.cli.progress import result_lines
from shoal.cli.records import add_records, violation
from shoal.cli.status import exactly_once, shards_readable
from shoal.settings.config import JobConfig
from shoal.worker import Trainer

from test_cluster import data, mlp

SIZE, BATCH, EPOCHS = 256, 16, 2


def train_to_the_final_checkpoint(c: InProcessCluster, root) -> tuple[dict[int, int], int]:
    """Trains the whole job with one Trainer; returns the primaries' versions and the final checkpoint's step."""
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
    finally:
        if trainer is not None:
            trainer.close()
    versions = {k: ps.host.shards[k].version for ps in c.servers for k in ps.host.shards
                if ps.host.roles.get(k) == "primary"}
    final = max(versions.values())
    wait_until(lambda: (ck := load_latest(root)) is not None and ck.step == final, timeout_s=20,
               what=f"the final checkpoint (step {final})")
    return versions, final


def final_only(root) -> CheckpointConfig:
    """Only the final checkpoint (every task done) is taken: the interval is never reached."""
    return CheckpointConfig(str(root), Interval(steps=100_000), keep=3, poll_s=0.05)


def local_records(c: InProcessCluster, tmp_path) -> LocalCluster:
    """``shoal local``'s record reading, pointed at the in-process cluster."""
    script = tmp_path / "train.py"
    script.write_text("")
    local = LocalCluster(LocalConfig(script=str(script), run_dir=str(tmp_path / "run")), out=io.StringIO())
    local.chief_address = c.chief_address
    return local


def test_the_records_are_the_promoted_backups_and_the_final_checkpoint_is_known(tmp_path):
    root = tmp_path / "ckpts"
    c = InProcessCluster(2, JobConfig(mode="sync", num_shards=2, lease_seconds=2.0),
                         journal=str(tmp_path / "chief.db"), checkpoint=final_only(root))
    try:
        versions, final = train_to_the_final_checkpoint(c, root)

        # the chief and shard 1's primary die at the same moment; the chief comes back from its journal
        victim = c.chief.state.routing[1]
        c.stop_chief()
        c.kill_ps(next(i for i, s in enumerate(c.servers) if s.chief.member_id == victim))
        c.start_chief()
        assert c.chief.recovered and c.chief.state.routing[1] == victim   # still routed to the dead primary

        local = local_records(c, tmp_path)
        report = local.shard_report()
        assert report is not None and shards_readable(report), report["shards"]
        assert {sh["shard"]: sh["version"] for sh in report["shards"]} == versions
        assert exactly_once(report), [sh["ledger"] for sh in report["shards"]]   # the promoted copy's ledger
        assert local.final_checkpoint(final, wait_s=3.0) == final
    finally:
        c.stop()


def test_a_shard_lost_after_the_end_is_read_from_the_final_checkpoint(tmp_path):
    """Both copies of every shard die after the final checkpoint was committed (bench/pauses.py
    install-kill-after, when the kill lands after the workers ended): the chief stops the job and
    routes the shards to no one, so no live ledger is left. The records come from the final
    checkpoint and the summary says so; without one, exactly-once is unknown, not violated."""
    root = tmp_path / "ckpts"
    c = InProcessCluster(2, JobConfig(mode="sync", num_shards=2, lease_seconds=1.0), checkpoint=final_only(root))
    try:
        versions, final = train_to_the_final_checkpoint(c, root)
        c.kill_ps(0)
        c.kill_ps(1)
        wait_until(lambda: c.chief.state.stopped and not c.chief.state.view().routes, timeout_s=20,
                   what="the chief to stop the job and route the lost shards to no one")
        report = local_records(c, tmp_path).shard_report(settle_s=0.5, unreadable_s=5.0)
        assert report is not None and report["shards"] == [] and not exactly_once(report)

        summary = {"epochs": EPOCHS, "recovery": "consistent", "lost_shards": [0, 1]}
        add_records(summary, report, None, final, str(root))
        assert summary["exactly_once"] is True, summary
        assert summary["ledger_sources"] == {"0": "checkpoint", "1": "checkpoint"}
        assert summary["ledger_checkpoint"]["step"] == final
        assert summary["shard_versions"] == {str(k): v for k, v in versions.items()}
        assert all(len(rows) == EPOCHS for rows in summary["ledger"].values())
        assert violation(summary) is None
        line = next(x for x in result_lines(summary, True) if "exactly once" in x)
        assert "yes" in line and "final checkpoint (step" in line, line

        unknown = {"epochs": EPOCHS}
        add_records(unknown, report, None, None, "")          # no checkpoint to read them from
        assert unknown["exactly_once"] is None and unknown["ledger_sources"] == {"0": "none", "1": "none"}
        assert violation(unknown) is None                        # none was seen: the run does not fail for it
        line = next(x for x in result_lines(unknown, True) if "exactly once" in x)
        assert "UNKNOWN" in line and "could not be read" in line, line
    finally:
        c.stop()
