"""Behaviours of worker/trainer.py that the mutation run (issue 19) found untested.

Each test names the behaviour it checks; the cosmic-ray mutant it was written against is in
its docstring. No sleeps: the step clock is a fake, everything else is synchronous.
"""
import logging
import time

import grpc
import pytest
import torch
import torch.nn.functional as F

import shoal.worker.trainer as trainer_mod
from shoal.errors import InvalidArgument
from shoal.proto import shoal_pb2 as pb
from shoal.worker import Trainer

from test_cluster import assert_exactly_once, data, mlp

SIZE, BATCH = 64, 8


def one_step(t, model, x, y, **kw):
    t.zero_grad()
    F.cross_entropy(model(x), y).backward()
    t.step(**kw)


# ------------------------------------------------------------ construction, no cluster needed

def test_a_connect_timeout_of_zero_is_refused_before_connecting():
    """Mutant: ``connect_timeout_s > -1`` (0 would be accepted and the join attempted)."""
    with pytest.raises(InvalidArgument, match="connect timeout must be > 0"):
        Trainer(mlp(0), chief="127.0.0.1:1", connect_timeout_s=0)


def test_the_options_after_the_model_are_keyword_only():
    """Mutant: ``def __init__(self, model, /, chief=...)`` (the chief could be passed by position)."""
    with pytest.raises(TypeError):
        Trainer(mlp(0), "127.0.0.1:1", connect_timeout_s=0.01)


# ------------------------------------------------------------ against an in-process cluster

def test_a_model_with_a_single_parameter_trains_on_one_shard(cluster_factory):
    """Mutants: ``params[1].device`` (IndexError with one parameter); a shard pool of
    ``2 * shards - 1`` threads (one thread for one shard's push and pull)."""
    c = cluster_factory(1, mode="async")
    model = torch.nn.Linear(8, 3, bias=False)
    x, y = data(16)
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        before = model.weight.detach().clone()
        one_step(t, model, x, y, samples=16)
        assert t.step_count == 1
        assert not torch.equal(model.weight.detach(), before)     # the pulled weights moved


def test_delta_pulls_are_on_by_default_and_a_model_without_buffers_sends_none(cluster_factory):
    """Mutants: ``delta_pulls: bool = False``; ``if not self.buffers.ranges`` (for a model without buffers)."""
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        assert t.delta_pulls is True
        assert not t.buffers.ranges
        assert t.optimizer.buffers == ()


def test_a_model_with_buffers_sends_their_ranges_with_the_optimizer(cluster_factory):
    """Mutant: ``if not self.buffers.ranges`` (BatchNorm statistics would be stepped by the optimizer)."""
    c = cluster_factory(1, mode="async")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        assert t.buffers.ranges
        assert tuple(t.optimizer.buffers) == tuple(t.buffers.ranges)


def test_a_step_without_samples_counts_the_sizes_of_its_batches(cluster_factory):
    """Mutant: ``sum(b.stop + b.start for b in group)``."""
    c = cluster_factory(2, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        for xb, yb in t.batches((x, y), batch_size=BATCH, epochs=1):
            one_step(t, model, xb, yb)
        assert t.counters.samples == SIZE
        assert t.counters.steps == SIZE // BATCH


def test_the_step_records_bytes_add_up_to_the_byte_counters(cluster_factory):
    """Mutant: ``self._bytes_at_step = [0, 1]`` (the first step's pulled bytes one short)."""
    c = cluster_factory(2, mode="async")
    model = mlp(0)
    x, y = data(16)
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        records, record = [], t.telemetry.record
        t.telemetry.record = lambda rec: (records.append(rec), record(rec))
        for _ in range(2):
            one_step(t, model, x, y, samples=16)
        assert len(records) == 2
        assert sum(r.bytes_pulled for r in records) == t.counters.bytes_pulled > 0
        assert sum(r.bytes_pushed for r in records) == t.counters.bytes_pushed > 0


class FakeClock:
    """Stands in for the trainer module's ``time``: ``perf_counter`` reads the given ticks in order."""

    def __init__(self, ticks):
        self.ticks = list(ticks)

    def perf_counter(self):
        return self.ticks.pop(0)

    def __getattr__(self, name):
        return getattr(time, name)


def test_step_seconds_start_at_zero_then_follow_a_moving_average_of_the_step_periods(cluster_factory, monkeypatch,
                                                                                         caplog):
    """Mutants: ``self._step_seconds = 1.0`` at the start; ``0.8 / self._step_seconds + 0.2 * period``;
    the debug line's ``(now + t0)``, ``/ 1e3`` and ``* 999.0``."""
    c = cluster_factory(1, mode="async")
    model = mlp(0)
    x, y = data(16)
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        def heartbeat_step_seconds():
            req = pb.HeartbeatRequest()
            t._fill_heartbeat(req)
            return req.step_seconds

        assert heartbeat_step_seconds() == 0.0                 # no step yet: the chief sees no step time
        # each step reads the clock twice: when it starts, when it ends
        monkeypatch.setattr(trainer_mod, "time", FakeClock([10.0, 10.5, 11.0, 12.0, 12.5, 13.0]))
        caplog.set_level(logging.DEBUG, logger=trainer_mod.__name__)
        one_step(t, model, x, y, samples=16)
        assert heartbeat_step_seconds() == 0.0                 # one step: no period yet
        one_step(t, model, x, y, samples=16)
        assert heartbeat_step_seconds() == pytest.approx(1.5)  # the first period as it is (10.5 -> 12.0)
        one_step(t, model, x, y, samples=16)
        assert heartbeat_step_seconds() == pytest.approx(0.8 * 1.5 + 0.2 * 1.0)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
        assert lines == ["step 1 in 500.0 ms", "step 2 in 1000.0 ms", "step 3 in 500.0 ms"]


def test_a_skipped_batch_goes_back_to_the_chief_and_is_trained_again(cluster_factory):
    """Mutant: ``for b in []:`` in skip_batch (the skipped batch would never be trained)."""
    c = cluster_factory(2, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    seen, skipped = [], None
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        for xb, yb in t.batches((x, y), batch_size=BATCH, epochs=1):
            start = t._batch.start
            seen.append(start)
            if skipped is None:
                skipped = start
                t.skip_batch()
                continue
            one_step(t, model, xb, yb, samples=len(xb))
        assert sorted(seen) == sorted([*range(0, SIZE, BATCH), skipped])
        assert_exactly_once(c, SIZE, BATCH, 1)


def test_request_stop_is_false_when_no_trainer_takes_batches_and_otherwise_ends_the_loop_with_exit_code_0(
        cluster_factory):
    """Mutants: ``if not feed is not None`` and ``for trainer in []`` in request_stop; ``SystemExit(-1)``."""
    c = cluster_factory(2, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    t = Trainer(model, chief=c.chief_address, lr=0.1)
    steps = 0
    try:
        assert trainer_mod.request_stop() is False      # a live trainer, but outside batches()
        trainer_mod._STOP_REQUESTED.clear()
        with pytest.raises(SystemExit) as stop:
            for xb, yb in t.batches((x, y), batch_size=BATCH, epochs=1):
                one_step(t, model, xb, yb, samples=len(xb))
                steps += 1
                if steps == 2:
                    assert trainer_mod.request_stop() is True
        assert stop.value.code == 0
        assert steps == 2                               # stopped at the next batch boundary
        assert t._closed
    finally:
        trainer_mod._STOP_REQUESTED.clear()
        t.close()


class ChiefGone(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the chief is gone (test)"


class FailingFeed:
    """A sampler's feed whose last report of finished tasks fails."""

    def __init__(self):
        self.closed = False

    def flush(self):
        raise ChiefGone()

    def close(self):
        self.closed = True

    def progress_holds(self):
        return {}

    def interrupt(self):
        pass


def test_close_goes_on_leaving_when_reporting_finished_tasks_fails(cluster_factory, caplog):
    """Mutant: ``except grpcCosmicRayTestingExceptionRpcError`` in close (the error would escape close)."""
    c = cluster_factory(1, mode="async")
    t = Trainer(mlp(0), chief=c.chief_address, lr=0.1)
    feed = FailingFeed()
    t._feed = feed
    t.close()
    assert feed.closed and t._closed and t._feed is None
    assert any("could not report finished tasks" in r.getMessage() for r in caplog.records)
