"""The chief's desired worker count (chief/autoscale.py): pure state on a fake clock."""
from __future__ import annotations

import pytest

from shoal.chief.autoscale import AutoscalePolicy, Autoscaler
from shoal.errors import InvalidArgument


def test_a_queue_that_grows_scales_out_at_once_and_in_after_the_cooldown():
    a = Autoscaler(AutoscalePolicy(min_workers=1, max_workers=4, target="queue", tasks_per_worker=5,
                                   cooldown_s=10))
    assert a.observe(0.0, pending_tasks=0, workers=1, steps=0) == 1
    assert a.observe(1.0, pending_tasks=12, workers=1, steps=0) == 3        # ceil(12 / 5), at once
    assert a.observe(2.0, pending_tasks=100, workers=3, steps=0) == 4       # bounded by max_workers
    assert a.observe(3.0, pending_tasks=6, workers=4, steps=0) == 4         # lower: wait for the cooldown
    assert a.observe(12.0, pending_tasks=6, workers=4, steps=0) == 4
    assert a.observe(13.0, pending_tasks=6, workers=4, steps=0) == 2        # 10 s lower without a break
    assert a.observe(14.0, pending_tasks=0, workers=2, steps=0) == 2
    assert a.observe(20.0, pending_tasks=11, workers=2, steps=0) == 3       # a blip up resets the wait
    assert a.observe(21.0, pending_tasks=0, workers=3, steps=0) == 3
    assert a.observe(30.0, pending_tasks=0, workers=3, steps=0) == 3
    assert a.observe(31.0, pending_tasks=0, workers=3, steps=0) == 1        # bounded by min_workers


def test_a_step_rate_target_scales_to_the_rate_one_worker_reaches():
    a = Autoscaler(AutoscalePolicy(min_workers=1, max_workers=8, target="step_rate", step_rate=50,
                                   cooldown_s=5))
    assert a.observe(0.0, 0, workers=2, steps=0) == 1          # nothing measured yet
    assert a.observe(0.5, 0, workers=2, steps=10) == 1
    assert a.observe(2.0, 0, workers=2, steps=40) == 5         # 40 steps in 4 worker-seconds: 10/s each
    assert a.observe(4.0, 0, workers=5, steps=140) == 5        # 5 workers at 10 steps/s each
    assert a.observe(6.0, 0, workers=5, steps=240) == 5
    assert a.observe(8.0, 0, workers=5, steps=440) == 5        # 20 steps/s each now: wants 4, waits
    assert a.observe(14.0, 0, workers=5, steps=1040) == 3      # over the last 10 s: 18/s each, cooldown over


def test_bad_policies_are_one_line_errors():
    with pytest.raises(InvalidArgument, match="max_workers 1 is below min_workers 2"):
        AutoscalePolicy(min_workers=2, max_workers=1)
    with pytest.raises(InvalidArgument, match="target 'cpu' is not one of queue, step_rate"):
        AutoscalePolicy(target="cpu")
    with pytest.raises(InvalidArgument, match="step_rate must be > 0"):
        AutoscalePolicy(target="step_rate")
    assert AutoscalePolicy.from_section({"min_workers": 1, "max_workers": 3, "cooldown": 5.0}).cooldown_s == 5.0
