"""A push that names several batches (gradient accumulation): every token checked, applied whole or not at all."""
from types import SimpleNamespace

import pytest
import torch

from shoal.security import tokens
from shoal.settings.config import OptimizerSpec
from shoal.dataset import Task
from shoal.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from shoal.proto import shoal_pb2 as pb
from shoal.ps.consistency import AsyncRule
from shoal.ps.ledger import BatchKey
from shoal.ps.servicer import DataServicer
from shoal.ps.shard import Shard
from shoal.worker.accumulate import Accumulation, header_fields, to_hand_back
from shoal.worker.exchange import BatchContext

SECRET = b"s" * 32


def batch(task_id, start, stop, task_start, task_stop, epoch=0, member="w1", secret=SECRET):
    token = tokens.sign(secret, member, task_id, 1, epoch, task_start, task_stop)
    return BatchContext(Task(task_id, epoch, task_start, task_stop, 1), token, start, stop)


def check(group, completed_epochs=0, worker="w1"):
    head = pb.PushHeader(worker_id=worker, **header_fields(tuple(group)))
    host = SimpleNamespace(verify_key=tokens.public_key(SECRET), completed_epochs=completed_epochs)
    return DataServicer.batches_of(SimpleNamespace(host=host), head)


def test_a_push_spanning_two_tasks_names_both_and_each_token_is_checked():
    a, b = batch(3, 16, 24, 0, 24), batch(7, 24, 32, 24, 48)
    assert check([a, b]) == (BatchKey(0, 16), BatchKey(0, 24))
    forged = BatchContext(b.task, b"x" * 16, b.start, b.stop)
    with pytest.raises(PermissionDenied, match="does not hold task 7"):
        check([a, forged])
    with pytest.raises(PermissionDenied, match="worker w2 does not hold task 3"):
        check([a, b], worker="w2")                              # the tokens are another worker's
    with pytest.raises(InvalidArgument, match="lies outside task 7"):
        check([a, batch(7, 48, 56, 24, 48)])
    with pytest.raises(InvalidArgument, match="names a batch twice"):
        check([a, b, a])
    with pytest.raises(FailedPrecondition, match="epoch 0 is over"):
        check([a, b], completed_epochs=1)


def test_a_group_with_one_batch_applied_before_is_refused_whole_and_says_which():
    s = Shard(0, torch.zeros(4), OptimizerSpec("sgd", {"lr": 1.0}), AsyncRule(), "fp")
    assert s.push("a", 0, torch.ones(4), key="k1", batches=(BatchKey(0, 8),)).accepted
    r = s.push("b", 1, torch.ones(4), key="k2", batches=(BatchKey(0, 0), BatchKey(0, 8), BatchKey(1, 0)))
    assert not r.accepted and r.duplicate and r.applied == (BatchKey(0, 8),)
    assert s.version == 1 and torch.equal(s._param.detach(), -torch.ones(4))    # nothing of it applied
    r = s.push("b", 1, torch.ones(4), key="k3", batches=(BatchKey(0, 0), BatchKey(1, 0)))
    assert r.accepted and s.version == 2
    assert s.ledger.starts(0) == {0: 1, 8: 1} and s.ledger.starts(1) == {0: 1}
    assert s.stats.pushes_applied == 2


def test_the_worker_hands_back_what_some_shard_did_not_take_and_only_that():
    a, b, c = batch(1, 0, 8, 0, 24), batch(1, 8, 16, 0, 24), batch(2, 24, 32, 24, 48)
    group = (a, b, c)
    ok = pb.PushReply(accepted=True)
    assert to_hand_back(group, [ok, ok]) == []
    assert to_hand_back(group, [ok, pb.PushReply(accepted=False)]) == [a, b, c]          # a stale sync push
    dup_b = pb.PushReply(accepted=False, duplicate=True, applied_before=[pb.BatchRange(epoch=0, start=8)])
    assert to_hand_back(group, [ok, dup_b]) == [a, c]
    assert to_hand_back(group, [pb.PushReply(accepted=False, duplicate=True)]) == []   # key seen, non-finite


def test_backward_passes_per_step_must_be_a_whole_number_of_at_least_one():
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(InvalidArgument, match="backward_passes_per_step must be a whole number >= 1"):
            Accumulation((), bad, overlap=False)
    with pytest.raises(InvalidArgument, match="backward_passes_per_step=4 needs overlap=False"):
        Accumulation((), 4, overlap=True)
    p = torch.nn.Parameter(torch.ones(2))
    acc = Accumulation([p], 2, overlap=False)
    for n in range(3):
        (p * 2).sum().backward()
        if n == 0:
            assert not acc.due() and acc.accumulating()
        elif n == 1:
            assert acc.due()
    with pytest.raises(FailedPrecondition, match="step\\(\\) after 3 backward passes with backward_passes_per_step=2"):
        acc.due()
