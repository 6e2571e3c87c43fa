"""The run summary's exactly-once verdict and the exit it leads to (cli/records.py ``judge``,
``violation``): a violation a ledger shows fails the run; records that could not be read leave it
unknown, never a claimed violation; a job stopped before its data was done is not exactly-once but
violated nothing."""
from shoal.cli.progress import result_lines
from shoal.cli.records import add_records, judge, violation

PER_EPOCH, EPOCHS, TASKS = 4, 2, 6


def shard(k, rows=None, error=None):
    if error:
        return {"shard": k, "error": error}
    rows = rows if rows is not None else [[e, PER_EPOCH, 1] for e in range(EPOCHS)]
    return {"shard": k, "initialized": True, "version": 8,
            "ledger": [{"epoch": e, "batches": b, "max_count": m} for e, b, m in rows]}


def report(*shards, done=TASKS):
    return {"shards": list(shards), "num_shards": 2, "epochs": {"total": EPOCHS, "batches_per_epoch": PER_EPOCH},
            "tasks": {"done": done, "total": TASKS}}


def summary_of(rep, **extra):
    s = {"recovery": "consistent", "lost_shards": [], **extra}
    add_records(s, rep, None, None)
    return s


def test_complete_ledgers_hold():
    assert judge(report(shard(0), shard(1))) == (True, "", [])
    s = summary_of(report(shard(0), shard(1)))
    assert s["exactly_once"] is True and s["ledger_sources"] == {"0": "primary", "1": "primary"}
    assert violation(s) is None


def test_a_batch_applied_twice_is_a_violation_and_fails_the_run():
    s = summary_of(report(shard(0), shard(1, [[0, PER_EPOCH, 1], [1, PER_EPOCH, 2]])))
    assert s["exactly_once"] is False and s["exactly_once_violated"] == [1]
    assert "shard 1 applied a batch twice" in s["exactly_once_detail"]
    assert "VIOLATED on shard(s) [1]" in violation(s)
    assert "NO (shard 1 applied a batch twice" in "\n".join(result_lines(s, True))


def test_a_missing_batch_once_every_task_is_done_is_a_violation():
    s = summary_of(report(shard(0), shard(1, [[0, PER_EPOCH, 1], [1, PER_EPOCH - 1, 1]])))
    assert s["exactly_once_violated"] == [1] and "misses 1 batch(es)" in s["exactly_once_detail"]
    assert violation(s)


def test_a_job_stopped_before_its_data_was_done_is_not_exactly_once_but_violated_nothing():
    short = [[0, PER_EPOCH, 1]]                             # epoch 1 never trained (a time budget ran out)
    s = summary_of(report(shard(0, short), shard(1, short), done=3))
    assert s["exactly_once"] is False and s["exactly_once_violated"] == []
    assert "stopped before its data was done (tasks 3/6)" in s["exactly_once_detail"]
    assert violation(s) is None


def test_an_unreadable_or_unrouted_shard_leaves_it_unknown_unless_another_shows_a_violation():
    s = summary_of(report(shard(0), shard(1, error="UNAVAILABLE")))
    assert s["exactly_once"] is None and s["ledger_sources"] == {"0": "primary", "1": "none"}
    assert s["shard_errors"] == {"1": "UNAVAILABLE"} and violation(s) is None
    assert summary_of(report(shard(0)))["exactly_once"] is None          # shard 1 routed to no one
    twice = summary_of(report(shard(0, [[0, PER_EPOCH, 2], [1, PER_EPOCH, 1]])))
    assert twice["exactly_once"] is False and twice["exactly_once_violated"] == [0]


def test_fast_recovery_losing_a_shard_is_reported_but_does_not_fail_the_run():
    lost = [[0, PER_EPOCH, 1], [1, 1, 1]]                   # what the restarted shard kept
    s = summary_of(report(shard(0), shard(1, lost)), recovery="fast", lost_shards=[1])
    assert s["exactly_once"] is False and s["exactly_once_violated"] == [1]
    assert violation(s) is None                             # the user asked for fast; it was said during the run
    s = summary_of(report(shard(0, lost), shard(1, lost)), recovery="fast", lost_shards=[1])
    assert "[0]" in violation(s)                            # shard 0 was not one it let go


def test_a_chief_that_could_not_be_read_leaves_it_unknown():
    s = {"ps": 2, "epochs": EPOCHS, "batches_per_epoch": PER_EPOCH, "tasks_done": TASKS, "tasks_total": TASKS}
    add_records(s, None, None, None)
    assert s["exactly_once"] is None and violation(s) is None
    assert "UNKNOWN" in "\n".join(result_lines(s, True))


def test_a_shard_that_lost_every_copy_with_no_final_checkpoint_fails_a_consistent_run():
    """The chief saw every copy die (lost_shards) after the newest checkpoint: the records cannot show
    it (unknown), but the job's end state is gone; only --recovery fast accepts that."""
    rep = report(shard(0, error="UNAVAILABLE"), shard(1, error="UNAVAILABLE"))
    s = summary_of(rep, lost_shards=[0, 1])
    assert s["exactly_once"] is None and "lost every copy" in violation(s)
    assert violation(summary_of(rep, recovery="fast", lost_shards=[0, 1])) is None
    assert violation(summary_of(report(shard(0), shard(1)), lost_shards=[1])) is None   # records prove it held
