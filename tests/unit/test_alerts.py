"""Alert detectors: a spike fires once per occurrence, after warm-up, against the running median."""
from __future__ import annotations

import math

import pytest

from shoal.observe.alerts import AlertConfig, BehindDetector, TrainingAlerts, metric_key
from shoal.errors import InvalidArgument


def feed(alerts: TrainingAlerts, losses, norms=None):
    out = []
    norms = norms or [None] * len(losses)
    for step, (loss, norm) in enumerate(zip(losses, norms)):
        out += alerts.observe("worker-0", step, loss, norm)
    return out


def test_a_loss_spike_fires_once_per_occurrence_and_rearms():
    a = TrainingAlerts(AlertConfig(loss_spike=3, warmup=5, window=20))
    losses = [1.0, 0.9, 0.95, 0.9, 0.85, 0.8, 0.8, 5.0, 6.0, 7.0, 0.8, 0.8, 9.0]
    got = feed(a, losses)
    assert [(x.kind, x.step) for x in got] == [("loss_spike", 7), ("loss_spike", 12)]
    assert got[0].value == 5.0 and got[0].threshold == pytest.approx(3 * 0.9)
    assert "worker-0 step 7: loss jumped to 5" in got[0].message()
    assert metric_key(got[0]) == "alert/loss_spike/worker-0"


def test_no_alert_during_warmup_or_on_a_falling_loss():
    a = TrainingAlerts(AlertConfig(loss_spike=3, warmup=5))
    assert feed(a, [10.0, 0.1, 9.0, 0.1, 0.1]) == []            # warm-up: the first steps swing
    assert feed(TrainingAlerts(), [2.3 * 0.97 ** i for i in range(300)]) == []


def test_nonfinite_loss_and_gradient_spike():
    a = TrainingAlerts(AlertConfig(grad_spike=10, warmup=3))
    got = feed(a, [1.0, 1.0, 1.0, 1.0, math.nan, math.nan, 1.0, math.inf],
               [1.0, 1.2, 0.9, 1.1, 1.0, 50.0, 1.0, 1.0])
    assert [(x.kind, x.step) for x in got] == [("nonfinite_loss", 4), ("grad_spike", 5), ("nonfinite_loss", 7)]


def test_zero_turns_a_check_off():
    a = TrainingAlerts(AlertConfig(loss_spike=0, grad_spike=0, warmup=0))
    assert feed(a, [1.0, 1.0, 1.0, 100.0], [1.0, 1.0, 1.0, 1e6]) == []


@pytest.mark.parametrize("kw, text", [({"loss_spike": 0.5}, "loss_spike must be a factor above 1"),
                                      ({"grad_spike": float("nan")}, "grad_spike"),
                                      ({"window": 2}, "window must be >= 3"),
                                      ({"warmup": "ten"}, "warmup must be a whole number")])
def test_bad_thresholds_are_one_line_errors(kw, text):
    with pytest.raises(InvalidArgument, match=text):
        AlertConfig(**kw)


def test_behind_fires_when_a_worker_becomes_a_straggler_and_again_only_after_it_recovered():
    d = BehindDetector()
    assert d.observe({"worker-0": (False, 10, 0.1), "worker-1": (False, 10, 0.1)}) == []
    got = d.observe({"worker-0": (False, 20, 0.1), "worker-1": (True, 12, 0.5)})
    assert [(x.kind, x.member, x.step) for x in got] == [("worker_behind", "worker-1", 12)]
    assert d.observe({"worker-0": (False, 30, 0.1), "worker-1": (True, 13, 0.5)}) == []
    assert d.observe({"worker-0": (False, 40, 0.1), "worker-1": (False, 20, 0.1)}) == []
    assert len(d.observe({"worker-0": (False, 50, 0.1), "worker-1": (True, 21, 0.5)})) == 1


def test_batch_noise_of_a_small_loss_is_not_a_spike():
    """A falling loss with multiplicative batch noise (a worker that joined late saw one such false alarm at
    0.44 against a median of 0.14): the robust-deviation rule keeps quiet where the factor alone fires."""
    import random

    def noisy(seed):
        r = random.Random(seed)
        return [max(0.02, 2.3 * math.exp(-i / 80)) * math.exp(r.gauss(0, 0.35)) for i in range(600)]

    def count(cfg):
        return sum(len(feed(TrainingAlerts(cfg), noisy(seed))) for seed in range(20))

    assert count(AlertConfig(deviations=0)) > 0
    assert count(AlertConfig()) == 0


def test_the_endings_alert_count_is_the_lines_printed():
    from shoal.observe.alerts import count_lines

    job = {"alert/loss_spike/worker-0": 31.0, "alert_count/loss_spike/worker-0": 3.0,
           "alert/worker_lost/worker-1": 1.0, "alert_count/worker_lost/worker-1": 1.0,
           "alert/grad_spike/worker-2": 7.0,           # from a worker that reports no count: one line
           "train_loss": 0.3}
    assert count_lines(job) == 5
