"""``--nonfinite skip`` (the default): a refused batch counts as skipped in the ledger and the summary, so
exactly-once reads "yes, with k skipped" and one NaN does not fail a good run."""
import math

import grpc
import pytest
import torch

from shoal.cli.progress import result_lines
from shoal.cli.records import batches_skipped, judge
from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.ps.consistency import AsyncRule
from shoal.ps.ledger import BatchKey
from shoal.ps.shard import Shard


def shard(policy):
    s = Shard(0, torch.zeros(4), OptimizerSpec("sgd", {"lr": 1.0}), AsyncRule(), "fp")
    s.nonfinite = policy
    return s


def nan_grad():
    g = torch.ones(4)
    g[2] = math.nan
    return g


def test_skip_is_the_default_and_records_the_refused_batch_in_the_ledger_once():
    assert JobConfig().nonfinite == "skip"
    s = shard("skip")
    r = s.push("w", 0, nan_grad(), key="k1", batch=BatchKey(0, 32))
    assert not r.accepted and r.duplicate and s.version == 0
    assert s.ledger.starts(0) == {32: 1} and "skipped" in s.ledger.owner(BatchKey(0, 32))
    # the same batch again (a retry) is not counted twice, and a good one is applied as usual
    s.push("w", 0, nan_grad(), key="k2", batch=BatchKey(0, 32))
    assert s.ledger.starts(0) == {32: 1}
    assert s.push("w", 0, torch.ones(4), key="k3", batch=BatchKey(0, 0)).accepted
    assert s.ledger.starts(0) == {0: 1, 32: 1}


@pytest.mark.parametrize("policy", ["refuse", "stop"])
def test_other_policies_leave_the_refused_batch_out_of_the_ledger(policy):
    s = shard(policy)
    try:
        s.push("w", 0, nan_grad(), key="k1", batch=BatchKey(0, 32))
    except Exception:           # noqa: BLE001 - stop fails the push: what the ledger holds is the point
        pass
    assert s.ledger.starts(0) == {}


def report(nonfinite):
    return {"epochs": {"batches_per_epoch": 2, "total": 1}, "tasks": {"done": 1, "total": 1},
            "shards": [{"shard": 0, "version": 5, "initialized": True, "ledger": [{"epoch": 0, "batches": 2, "max_count": 1}],
                        "nonfinite": nonfinite}]}


def test_the_summary_says_yes_with_the_skipped_count():
    r = report({"worker-1": 1})
    assert judge(r)[0] is True and batches_skipped(r) == 1
    summary = {"exactly_once": True, "batches_skipped": 1, "mode": "sync", "workers": 2, "ps": 2, "seconds": 1.0}
    line = next(x for x in result_lines(summary, True) if "exactly once" in x)
    assert "yes, with 1 skipped" in line
    assert batches_skipped(report({})) == 0


def test_a_worker_whose_push_the_job_stops_for_exits_refused_naming_its_step():
    from shoal.errors import EXIT_REFUSED, Refused
    from shoal.net.tcp_channel import ChannelError
    from shoal.worker.exchange import ShardExchange

    class Fake(ShardExchange):
        member_id = "worker-1"
        step_count = 99

        def __init__(self):
            self._clients = {0: self}
            self.chief = type("C", (), {"view": None})()
            self._started = True

        def push(self, *a, **k):
            raise ChannelError(grpc.StatusCode.INVALID_ARGUMENT, "the gradient of worker-1 for shard 0 holds 1 "
                               "non-finite value(s) (NaN/Inf); not applied: 1 such push(es) in a row and the job "
                               "runs with --nonfinite stop; check the loss and the learning rate")

    sent = type("P", (), {"chunks": [], "version": 0, "key": "k", "samples": 1, "extra": {}})()
    with pytest.raises(Refused, match=r"worker worker-1 at step 100: .*--nonfinite stop") as refused:
        Fake()._send(0, sent)
    assert refused.value.exit_code == EXIT_REFUSED
