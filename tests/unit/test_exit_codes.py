"""One exit status per outcome (shoal/errors.py), and how a ``shoal local`` run picks its own."""
from shoal import errors
from shoal.cli.outcome import mark, run_code, stopped_code


def test_every_exit_status_is_distinct_and_has_its_word():
    codes = [v for k, v in vars(errors).items() if k.startswith("EXIT_")]
    assert len(codes) == len(set(codes)) == len(errors.OUTCOMES)
    assert set(codes) == set(errors.OUTCOMES)
    assert (errors.EXIT_USAGE, errors.EXIT_UNREACHABLE, errors.EXIT_ROLLBACK, errors.EXIT_REFUSED) == (2, 69, 75, 78)
    assert errors.outcome(-9) == "killed by signal 9" and errors.outcome(42) == "exit 42"


def test_a_run_that_lost_batches_under_fast_recovery_or_failed_checkpoints_does_not_exit_0():
    clean = {"exactly_once": True}
    assert run_code(clean, ok=True) == 0
    assert run_code(clean, ok=False) == errors.EXIT_FAILED
    assert run_code(clean, ok=True, broken="exactly once broken") == errors.EXIT_FAILED
    lost = {"lost_shards": [0, 1], "exactly_once": False, "recovery": "fast"}
    assert run_code(lost, ok=True) == errors.EXIT_DATA_LOST == 65
    # the copies died after the final checkpoint held every update: nothing was lost
    assert run_code({"lost_shards": [0], "exactly_once": True}, ok=True) == 0
    failed = {"exactly_once": True, "checkpoints_failed": 2, "checkpoint_failed_step": 40,
              "checkpoint_missing_steps": [30, 40]}
    assert run_code(failed, ok=True) == errors.EXIT_CHECKPOINT_FAILED == 73
    healed = {**failed, "checkpoint_missing_steps": []}      # a later checkpoint holds the job's state
    assert run_code(healed, ok=True) == 0
    assert run_code(failed, ok=True, allow_checkpoint_failures=True) == 0
    assert run_code({**lost, **failed, "exactly_once": False}, ok=True) == 65     # the worse of the two
    assert mark({}, 65) == {"exit_code": 65, "outcome": "finished with data lost"}


def test_a_stopped_run_passes_on_the_exit_that_says_why():
    assert stopped_code(errors.EXIT_REFUSED) == 78
    assert stopped_code(errors.EXIT_USAGE) == 2
    assert stopped_code(errors.EXIT_UNREACHABLE) == 69
    assert stopped_code(1) == stopped_code(-9) == errors.EXIT_STOPPED == 3
