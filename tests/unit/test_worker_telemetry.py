"""The worker's telemetry: step phases, gradient-norm sampling, and what reaches the chief."""
from __future__ import annotations

import torch

from harness import wait_until
from shoal.observe.alerts import AlertConfig
from shoal.worker.telemetry import NormSampler, StepClock, StepRecord, WorkerTelemetry


def test_step_clock_splits_the_time_between_steps_into_wait_and_compute():
    c = StepClock(budget_s=0)
    c.pushed_at = 1.3
    assert c.phases(1.0, 1.5) == {"push": 0.30000000000000004, "pull": 0.19999999999999996}
    c.waited = 0.2                          # the loop waited this long for its next batch
    c.pushed_at = 2.1
    p = c.phases(2.0, 2.4)
    assert round(p["wait"], 6) == 0.2 and round(p["compute"], 6) == 0.3 and round(p["push"], 6) == 0.1
    assert c.waited == 0.0


def test_the_budget_ends_the_task_stream(monkeypatch):
    import shoal.worker.telemetry as t

    now = [100.0]
    monkeypatch.setattr(t.time, "monotonic", lambda: now[0])
    c = StepClock(budget_s=5)

    def feed():
        for i in range(10):
            now[0] += 2
            yield i

    assert list(c.timed(feed())) == [0, 1, 2]


def test_norm_sampling_keeps_the_norm_near_one_percent_of_a_step():
    s = NormSampler(budget=0.01)
    due = []
    for _ in range(20):
        due.append(s.due())
        if due[-1]:
            s.measured(0.004, 0.1)              # 4 ms for the norm of a 100 ms step: every 4th step
    assert due[:9] == [True, False, False, False, True, False, False, False, True]
    s.measured(1e-6, 0.1)
    assert s.every == 1


def test_alerts_and_the_mean_loss_reach_the_chief_once():
    sent = []
    tel = WorkerTelemetry(lambda: "worker-3", report=sent.append, alerts=AlertConfig(warmup=3),
                          clock=lambda: 0.0)          # no periodic report: only the one at close
    for step in range(12):
        loss = 50.0 if step in (8, 9) else 1.0
        tel.record(StepRecord(step=step, wall=0.0, samples=4, loss=torch.tensor(loss), grad_norm=torch.tensor(2.0),
                              phases={"push": 0.01, "pull": 0.01}, bytes_pushed=100, raw_bytes=400))
    wait_until(lambda: len(tel.raised) == 1, timeout_s=10, what="the loss spike alert")
    tel.close()
    assert [(a.kind, a.member, a.step) for a in tel.raised] == [("loss_spike", "worker-3", 8)]
    assert {"alert/loss_spike/worker-3": 8.0, "alert_count/loss_spike/worker-3": 1.0} in sent
    assert [v["train_loss"] for v in sent if "train_loss" in v] == [(10 * 1.0 + 2 * 50.0) / 12]


def test_an_unwritable_tensorboard_dir_is_one_warning_and_training_goes_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tel = WorkerTelemetry(lambda: "worker-0", tensorboard=str(blocker / "tb"))
    for step in range(5):
        tel.record(StepRecord(step=step, wall=0.0, samples=4, loss=1.0, phases={"push": 0.01}))
    tel.close()
    warnings = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert len(warnings) == 1 and "cannot write TensorBoard events" in warnings[0].getMessage()


def test_tensorboard_steps_are_the_jobs_applied_updates_so_workers_overlay(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tel = WorkerTelemetry(lambda: "worker-1", tensorboard=str(tmp_path))
    for step, job_step in ((1, 40), (2, 43), (3, 47)):       # the others applied updates in between
        tel.record(StepRecord(step=step, wall=1.0 + step, samples=4, loss=1.0, phases={"push": 0.01},
                              job_step=job_step))
    tel.close()
    ea = EventAccumulator(str(tmp_path / "worker-1"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/loss")] == [40, 43, 47]
