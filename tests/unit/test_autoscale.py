"""The chief's desired worker count (chief/autoscale.py): pure state on a fake clock."""
from __future__ import annotations

import pytest

from shoal.chief.autoscale import AutoscalePolicy, Autoscaler
from shoal.errors import InvalidArgument


def test_no_decision_before_the_job_has_data():
    a = Autoscaler(AutoscalePolicy(min_workers=1, max_workers=4, tasks_per_worker=5))
    assert a.observe(0.0, pending_tasks=0, workers=2, steps=0, total_tasks=0) is None
    assert a.observe(60.0, pending_tasks=0, workers=2, steps=0, total_tasks=0) is None and not a.decisions
    assert a.observe(61.0, pending_tasks=12, workers=2, steps=0, total_tasks=12) == 3     # ceil(12 / 5)
    assert a.decisions[-1].before is None and "12 task(s) not done" in a.decisions[-1].line()


def test_scaling_out_and_in_both_need_the_signal_held():
    a = Autoscaler(AutoscalePolicy(min_workers=1, max_workers=4, target="queue", tasks_per_worker=5,
                                   cooldown_s=10, scale_out_after_s=3))
    assert a.observe(0.0, pending_tasks=6, workers=1, steps=0, total_tasks=40) == 2
    assert a.observe(1.0, pending_tasks=40, workers=2, steps=0, total_tasks=40) == 2     # more: held 3 s first
    assert a.observe(3.9, pending_tasks=40, workers=2, steps=0, total_tasks=40) == 2
    assert a.observe(4.0, pending_tasks=40, workers=2, steps=0, total_tasks=40) == 4     # bounded by max_workers
    assert a.observe(5.0, pending_tasks=6, workers=4, steps=0, total_tasks=40) == 4      # fewer: the cooldown
    assert a.observe(14.0, pending_tasks=6, workers=4, steps=0, total_tasks=40) == 4
    assert a.observe(14.5, pending_tasks=20, workers=4, steps=0, total_tasks=40) == 4    # a blip: the wait restarts
    assert a.observe(15.0, pending_tasks=6, workers=4, steps=0, total_tasks=40) == 4
    assert a.observe(24.9, pending_tasks=6, workers=4, steps=0, total_tasks=40) == 4
    assert a.observe(25.0, pending_tasks=6, workers=4, steps=0, total_tasks=40) == 2
    assert "6 task(s) not done, 5 a worker, for 10s" in a.decisions[-1].line()


def test_a_whole_job_on_a_fake_clock_scales_out_then_in_to_the_minimum_without_flapping():
    """Start (no data), steady (a full queue, ±1 task of noise), drain (the queue empties), end (all done)."""
    a = Autoscaler(AutoscalePolicy(min_workers=1, max_workers=4, target="queue", tasks_per_worker=4,
                                   cooldown_s=10, scale_out_after_s=5))
    total, trace = 64, []
    for t in range(0, 30):                          # start: workers come up, no data described yet
        trace.append(a.observe(float(t), 0, workers=2, steps=0, total_tasks=0))
    for t in range(30, 60):                         # steady: far more tasks than 4 workers' worth
        trace.append(a.observe(float(t), total - (t - 30) // 10 + (t % 2), workers=4, steps=0, total_tasks=total))
    pending = total - 3
    for t in range(60, 240):                        # drain: a task done every 3 s
        pending = max(0, total - 3 - (t - 60) // 3)
        trace.append(a.observe(float(t), pending, workers=a.desired, steps=0, total_tasks=total,
                               finished=pending == 0))
    for t in range(240, 260):                       # end: every task done
        trace.append(a.observe(float(t), 0, workers=a.desired, steps=0, total_tasks=total, finished=True))
    assert trace[:30] == [None] * 30
    assert trace[30] == 4 and trace[-1] == 1
    counts = [d for d in trace if d is not None]
    assert all(b <= a_ for a_, b in zip(counts, counts[1:])), "the count went up again after it came down"
    changes = [(d.before, d.after) for d in a.decisions]
    assert changes[0] == (None, 4) and changes[-1][1] == 1
    downs = [d.at for d in a.decisions][1:]
    assert all(t2 - t1 >= 10 for t1, t2 in zip(downs, downs[1:])), "scaled in faster than the cooldown"


def test_every_task_done_takes_the_minimum_at_once():
    a = Autoscaler(AutoscalePolicy(min_workers=1, max_workers=4, tasks_per_worker=2, cooldown_s=60))
    assert a.observe(0.0, 8, workers=4, steps=0, total_tasks=8) == 4
    assert a.observe(1.0, 0, workers=4, steps=0, total_tasks=8, finished=True) == 1
    assert a.decisions[-1].reason == "every task is done"


def test_a_step_rate_target_scales_to_the_rate_one_worker_reaches():
    a = Autoscaler(AutoscalePolicy(min_workers=1, max_workers=8, target="step_rate", step_rate=50,
                                   cooldown_s=5, scale_out_after_s=0))
    assert a.observe(0.0, 0, workers=2, steps=0) == 2          # nothing measured yet: the workers it has
    assert a.observe(0.5, 0, workers=2, steps=10) == 2
    assert a.observe(2.0, 0, workers=2, steps=40) == 5         # 40 steps in 4 worker-seconds: 10/s each
    assert a.observe(4.0, 0, workers=5, steps=140) == 5        # 5 workers at 10 steps/s each
    assert a.observe(6.0, 0, workers=5, steps=240) == 5
    assert a.observe(8.0, 0, workers=5, steps=440) == 5        # 20 steps/s each now: wants 3, waits
    assert a.observe(14.0, 0, workers=5, steps=1040) == 3      # over the last 10 s: 18/s each, cooldown over


def test_bad_policies_are_one_line_errors():
    with pytest.raises(InvalidArgument, match="max_workers 1 is below min_workers 2"):
        AutoscalePolicy(min_workers=2, max_workers=1)
    with pytest.raises(InvalidArgument, match="target 'cpu' is not one of queue, step_rate"):
        AutoscalePolicy(target="cpu")
    with pytest.raises(InvalidArgument, match="step_rate must be > 0"):
        AutoscalePolicy(target="step_rate")
    assert AutoscalePolicy.from_section({"min_workers": 1, "max_workers": 3, "cooldown": 5.0}).cooldown_s == 5.0
    assert AutoscalePolicy.from_section({"scale_out_after": 2.0}).scale_out_after_s == 2.0
    with pytest.raises(InvalidArgument, match="scale_out_after must be >= 0"):
        AutoscalePolicy(scale_out_after_s=-1)
