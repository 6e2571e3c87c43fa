"""The job's end (chief/lifecycle.py) with a fake clock: when it ends, how long it drains, when all exit."""
import math

import pytest

from shoal.chief.lifecycle import FINAL_CHECKPOINT_ATTEMPTS, FinalCheckpoint, JobLifecycle, Observed, Phase
from shoal.chief.state import ChiefState
from shoal.chief.tasks import DatasetSpec
from shoal.settings.config import JobConfig
from shoal.errors import EXIT_CHECKPOINT_FAILED, EXIT_FAILED, EXIT_ROLLBACK, FailedPrecondition, JOB_FINISHED
from shoal.state.layout import ModelLayout, TensorSpec


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def seen(finished=True, workers=0, checkpoint=None, stopped="", servers=2):
    return Observed(10 if finished else 4, 10, finished, stopped, checkpoint, workers, servers)


def test_a_job_runs_until_every_task_is_done_then_drains_and_closes():
    clock = Clock()
    lc = JobLifecycle(clock, drain_s=30, quiet_s=3, close_grace_s=10)
    assert lc.step(seen(finished=False, workers=2)) == [] and lc.phase is Phase.RUNNING
    [line] = lc.step(seen(workers=1))
    assert lc.phase is Phase.FINISHED and lc.ending.ok and "10/10 tasks done" in line
    assert lc.drain_left_s() == 30
    clock.t += 20
    assert lc.step(seen(workers=1)) == [] and lc.phase is Phase.FINISHED    # a worker still evaluates
    assert not lc.chief_may_exit(live_servers=0)
    clock.t += 10
    [line] = lc.step(seen(workers=1))
    assert lc.phase is Phase.CLOSING and "drain is over" in line
    assert not lc.chief_may_exit(live_servers=1)            # its servers get to leave first
    assert lc.chief_may_exit(live_servers=0)
    clock.t += 10
    assert lc.chief_may_exit(live_servers=1)                # or it stops waiting for them


def test_the_drain_ends_early_once_no_worker_is_left_for_quiet_s():
    clock = Clock()
    lc = JobLifecycle(clock, drain_s=30, quiet_s=3)
    lc.step(seen(workers=2))
    lc.step(seen(workers=0))
    clock.t += 2.9
    lc.step(seen(workers=0))
    assert lc.phase is Phase.FINISHED
    clock.t += 0.2
    [line] = lc.step(seen(workers=0))
    assert lc.phase is Phase.CLOSING and "no worker left" in line


def test_a_drain_until_stopped_never_closes():
    clock = Clock()
    lc = JobLifecycle(clock, drain_s=math.inf, quiet_s=1)
    lc.step(seen())
    clock.t += 1e6
    lc.step(seen())
    assert lc.phase is Phase.FINISHED and lc.drain_left_s() == -1


def test_the_end_waits_for_the_final_checkpoint_and_fails_when_it_cannot_be_kept():
    lc = JobLifecycle(Clock())
    assert lc.step(seen(checkpoint=FinalCheckpoint())) == [] and lc.phase is Phase.RUNNING
    lc.step(seen(checkpoint=FinalCheckpoint(committed_step=420)))
    assert lc.ending.ok and "final checkpoint step 420" in lc.ending.result

    lc = JobLifecycle(Clock())
    lc.step(seen(checkpoint=FinalCheckpoint(failures=FINAL_CHECKPOINT_ATTEMPTS - 1, error="disk full")))
    assert lc.phase is Phase.RUNNING
    [line] = lc.step(seen(checkpoint=FinalCheckpoint(failures=FINAL_CHECKPOINT_ATTEMPTS, error="disk full")))
    assert lc.ending.exit_code == EXIT_CHECKPOINT_FAILED and "disk full" in lc.ending.result and "FAILED" in line


def test_a_stopped_job_ends_with_the_rollback_code():
    lc = JobLifecycle(Clock())
    lc.step(seen(finished=False, stopped="shard 1 lost every copy"))
    assert lc.ending.exit_code == EXIT_ROLLBACK and "shard 1 lost" in lc.ending.result


def _finished_state(clock) -> ChiefState:
    s = ChiefState(JobConfig(num_shards=1), clock)
    layout = ModelLayout([TensorSpec("w", (4,), "float32")])
    w = s.join_worker(layout)
    got, _ = s.take_tasks(w.member_id, DatasetSpec(size=8, batch_size=4, epochs=1, batches_per_task=1), 8)
    _, finished = s.take_tasks(w.member_id, None, 0, done=tuple(t.task_id for t in got))
    assert finished
    return s


def test_the_state_turns_away_a_worker_once_the_job_ended_and_journals_the_ending():
    clock = Clock()
    s = _finished_state(clock)
    epoch = s.epoch
    [line] = s.step_lifecycle(None)
    assert s.epoch == epoch + 1 and s.view().job_phase == "finished" and "2/2 tasks done" in line
    with pytest.raises(FailedPrecondition, match=JOB_FINISHED):
        s.join_worker(ModelLayout([TensorSpec("w", (4,), "float32")]))
    back = ChiefState.from_dict(s.to_dict(), clock, recover=True)
    assert back.lifecycle.phase is Phase.FINISHED and back.lifecycle.ending == s.lifecycle.ending
    assert back.view().job_result == s.lifecycle.ending.result
