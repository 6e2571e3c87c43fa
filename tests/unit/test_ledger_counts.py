"""The exactly-once proof must be able to fail: a batch applied twice reads as a count of 2 everywhere.

Every other ledger test sees counts of 1, so a ledger that could not count past one (recording
``(1, key)`` instead of ``(count + 1, key)``) would pass them all and ``exactly_once`` would read true
after a double application. These tests apply batches more than once on purpose.
"""
import dataclasses
import json

import pytest

from shoal.cli.status import exactly_once
from shoal.ps.ledger import BatchKey, EpochLedger, Ledger, ledger_from_extra, ledger_to_extra


def test_a_batch_recorded_twice_counts_two_and_its_last_owner():
    ledger = Ledger()
    ledger.record(BatchKey(0, 0), "w1/0.1/0/0")
    ledger.record(BatchKey(0, 8), "w1/0.1/8/0")
    ledger.record(BatchKey(0, 0), "w2/7.1/0/0")          # the same batch again, by another push
    ledger.record(BatchKey(0, 0), "w3/9.1/0/0")          # and a third time
    assert ledger.starts(0) == {0: 3, 8: 1}
    assert ledger.owner(BatchKey(0, 0)) == "w3/9.1/0/0"
    assert ledger.owner(BatchKey(0, 16)) is None
    assert ledger.summary() == [EpochLedger(0, 2, 3)]      # two distinct batches, the worst applied 3 times


def test_counts_are_per_epoch_and_an_empty_epoch_is_absent():
    ledger = Ledger()
    ledger.record(BatchKey(1, 0), "a")
    ledger.record(BatchKey(1, 0), "b")
    ledger.record(BatchKey(0, 0), "c")
    assert ledger.summary() == [EpochLedger(0, 1, 1), EpochLedger(1, 1, 2)]
    assert ledger.starts(2) == {}
    summary = ledger.summary()
    assert len(set(summary)) == 2                      # immutable values: hashable, comparable
    with pytest.raises(dataclasses.FrozenInstanceError):
        summary[0].max_count = 1


def test_a_double_count_survives_a_checkpoint_and_a_reslice_keeps_the_lowest_count():
    ledger = Ledger()
    for start, times in ((0, 2), (8, 1), (16, 3)):
        for i in range(times):
            ledger.record(BatchKey(0, start), f"k{start}.{i}")
    extra = json.loads(json.dumps(ledger_to_extra(ledger)))          # as a checkpoint stores it
    assert extra["ledger"] == [[0, 0, 2], [0, 8, 1], [0, 16, 3]]
    assert extra["ledger_summary"] == [[0, 3, 3]]
    back = ledger_from_extra(extra)
    assert back.starts(0) == {0: 2, 8: 1, 16: 3} and back.owner(BatchKey(0, 0)) == "checkpoint"
    other = Ledger()
    other.record(BatchKey(0, 0), "x")
    other.record(BatchKey(0, 16), "y")
    other.record(BatchKey(0, 16), "y2")
    resliced = ledger_from_extra({"resliced_from": [{"extra": extra}, {"extra": ledger_to_extra(other)}]})
    assert resliced.starts(0) == {0: 1, 16: 2}          # 8 was not applied everywhere: trained again


def status(shards, epochs=2, per_epoch=4):
    return {"epochs": {"batches_per_epoch": per_epoch, "total": epochs}, "shards": shards}


def shard_from(ledger: Ledger):
    """What ``shoal status`` collects for one shard (see cli/status.py collect)."""
    return {"ledger": [{"epoch": e.epoch, "batches": e.applied, "max_count": e.max_count}
                       for e in ledger.summary()]}


def full_ledger(epochs=2, per_epoch=4, batch=8):
    ledger = Ledger()
    for e in range(epochs):
        for i in range(per_epoch):
            ledger.record(BatchKey(e, i * batch), f"w/{e}.{i}")
    return ledger


def test_exactly_once_holds_for_a_complete_ledger_with_single_counts():
    assert exactly_once(status([shard_from(full_ledger()), shard_from(full_ledger())])) is True


def test_exactly_once_reads_false_when_one_batch_was_applied_twice_on_one_shard():
    twice = full_ledger()
    twice.record(BatchKey(1, 8), "w2/late")
    assert twice.summary()[1].max_count == 2
    assert exactly_once(status([shard_from(full_ledger()), shard_from(twice)])) is False


def test_exactly_once_reads_false_for_a_missing_batch_epoch_or_shard_data():
    short = Ledger()
    for e in range(2):
        for i in range(3):                                   # one batch of each epoch never arrived
            short.record(BatchKey(e, i * 8), "w")
    assert exactly_once(status([shard_from(short)])) is False
    one_epoch = full_ledger(epochs=1)
    assert exactly_once(status([shard_from(one_epoch)])) is False
    assert exactly_once(status([shard_from(full_ledger()), {"error": "UNAVAILABLE"}])) is False
    assert exactly_once(status([])) is False
    assert exactly_once(status([shard_from(Ledger())], epochs=0, per_epoch=0)) is False


def test_a_reslice_keeps_only_batches_every_source_applied_whichever_source_lacks_one():
    def extra(*starts):
        ledger = Ledger()
        for s in starts:
            ledger.record(BatchKey(0, s), "k")
        return {"extra": ledger_to_extra(ledger)}

    for sources in ([extra(0, 8), extra(0, 8, 16)], [extra(0, 8, 16), extra(0, 8)],
                    [extra(0, 8, 16), extra(0, 8, 16), extra(8, 16)]):
        common = {0: 1, 8: 1} if len(sources) == 2 else {8: 1, 16: 1}
        assert ledger_from_extra({"resliced_from": sources}).starts(0) == common
    assert ledger_from_extra({"resliced_from": []}).summary() == []
    assert ledger_from_extra({}).summary() == []
