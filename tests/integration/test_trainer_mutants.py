"""Behaviours of worker/trainer.py that the mutation run (issue 19) found untested.

Each test names the behaviour it checks; the cosmic-ray mutant it was written against is in
its docstring. No sleeps: the step clock is a fake, everything else is synchronous.
"""
import logging
import re
import time

import grpc
import pytest
import torch
import torch.nn.functional as F

import shoal.worker.trainer as trainer_mod
from harness import FakeRpcError
from shoal.errors import InvalidArgument, Refused, Unreachable
from shoal.proto import shoal_pb2 as pb
from shoal.worker import Trainer

from harness import wait_until
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
    """Mutants: ``self._step_seconds = 1.0`` at the start; ``0.8 / self._step_seconds + 0.2 * period``,
    ``0.2 / period`` (hence a period other than 1 s);
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
        monkeypatch.setattr(trainer_mod, "time", FakeClock([10.0, 10.5, 11.0, 12.0, 12.5, 14.0]))
        caplog.set_level(logging.DEBUG, logger=trainer_mod.__name__)
        one_step(t, model, x, y, samples=16)
        assert heartbeat_step_seconds() == 0.0                 # one step: no period yet
        one_step(t, model, x, y, samples=16)
        assert heartbeat_step_seconds() == pytest.approx(1.5)  # the first period as it is (10.5 -> 12.0)
        one_step(t, model, x, y, samples=16)
        assert heartbeat_step_seconds() == pytest.approx(0.8 * 1.5 + 0.2 * 2.0)   # 12.0 -> 14.0
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
        assert lines == ["step 1 in 500.0 ms", "step 2 in 1000.0 ms", "step 3 in 1500.0 ms"]


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
        cluster_factory, caplog):
    """Mutants: ``if not feed is not None`` and ``for trainer in []`` in request_stop; ``SystemExit(-1)``;
    ``held and "none"`` in _hand_back's line (it would say "none" for the task it hands back)."""
    c = cluster_factory(2, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    t = Trainer(model, chief=c.chief_address, lr=0.1)
    steps = 0
    try:
        assert trainer_mod.request_stop() is False      # a live trainer, but outside batches()
        trainer_mod._STOP_REQUESTED.clear()
        held = []
        with pytest.raises(SystemExit) as stop, caplog.at_level(logging.INFO, logger=trainer_mod.__name__):
            for xb, yb in t.batches((x, y), batch_size=BATCH, epochs=1):
                one_step(t, model, xb, yb, samples=len(xb))
                steps += 1
                if steps == 2:
                    held = sorted(t._progress)
                    assert trainer_mod.request_stop() is True
        assert stop.value.code == 0
        assert steps == 2                               # stopped at the next batch boundary
        assert t._closed
        assert held                                     # the task it was on, named in the line that says it stops
        [said] = [r.getMessage() for r in caplog.records if "stopping on request" in r.getMessage()]
        assert f"handing back task(s) {held} and leaving the job" in said
    finally:
        trainer_mod._STOP_REQUESTED.clear()
        t.close()


def chief_gone() -> FakeRpcError:
    return FakeRpcError(grpc.StatusCode.UNAVAILABLE, "the chief is gone (test)")


class FailingFeed:
    """A sampler's feed whose last report of finished tasks fails."""

    def __init__(self):
        self.closed = False

    def flush(self):
        raise chief_gone()

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


def test_the_options_default_to_overlapped_pushes(cluster_factory):
    """Mutant: ``overlap: bool = False`` (the pushes would wait for step() instead of the backward pass)."""
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        assert t._readiness is not None
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1, overlap=False) as t:
        assert t._readiness is None


def test_with_top_k_and_momentum_the_momentum_moves_to_the_worker_unless_told_not_to(cluster_factory, caplog):
    """Mutants: ``server_optimizer(...) if not momentum_correction else spec``; ``momentum_correction: bool =
    False``; ``if not self.momentum.active(shard)`` (the log line saying so)."""
    c = cluster_factory(1, mode="async")
    caplog.set_level(logging.INFO, logger=trainer_mod.__name__)
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1, momentum=0.9, compression="topk") as t:
        assert t.optimizer.hparams.get("worker_momentum") == 0.9 and not t.optimizer.hparams.get("momentum")
        assert t.momentum.active(0)         # the shard this worker created left the momentum to it
        assert [r for r in caplog.records if "momentum correction" in r.getMessage()]
    caplog.clear()
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1, momentum=0.9, compression="topk",
                 momentum_correction=False) as t:
        assert t.optimizer.hparams.get("momentum") == 0.9
        assert not t.momentum.active(0)
        assert not [r for r in caplog.records if "momentum correction" in r.getMessage()]


def test_only_the_worker_that_creates_a_shard_says_it_initialised_it(cluster_factory, caplog):
    """Mutant: ``if not reply.created`` (the log line would name the wrong worker)."""
    c = cluster_factory(2, mode="async")
    caplog.set_level(logging.INFO, logger=trainer_mod.__name__)

    def said():
        return sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("initialised shard"))

    with Trainer(mlp(0), chief=c.chief_address, lr=0.1):
        assert said() == ["initialised shard 0 from this worker's weights",
                          "initialised shard 1 from this worker's weights"]
        caplog.clear()
        with Trainer(mlp(1), chief=c.chief_address, lr=0.1):
            assert said() == []


def test_the_heartbeat_reports_how_far_the_current_task_got(cluster_factory):
    """Mutant: ``for task_id, next_start in []`` in _fill_heartbeat (the chief would not learn the progress)."""
    c = cluster_factory(2, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        for xb, yb in t.batches((x, y), batch_size=BATCH, epochs=1):
            task, stop = t._batch.task, t._batch.stop
            one_step(t, model, xb, yb, samples=len(xb))
            req = pb.HeartbeatRequest()
            t._fill_heartbeat(req)
            assert [(p.task_id, p.next_start) for p in req.progress] == [(task.task_id, stop)]
            break


def test_with_a_sampler_each_step_names_one_batch_by_default(cluster_factory):
    """Mutants: ``batches: int = 0`` and ``= 2`` in step() (no batch named; two batches named per step)."""
    from torch.utils.data import DataLoader, TensorDataset
    from shoal.worker import DistributedSampler

    c = cluster_factory(2, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    ds = TensorDataset(x, y)
    with Trainer(model, chief=c.chief_address, lr=0.1, overlap=False) as t:     # the hooks would name the batch first
        sampler = DistributedSampler(ds, batch_size=BATCH, epochs=1, trainer=t)
        loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0)
        shards = [s for ps in c.servers for s in ps.host.shards.values()]
        steps = 0
        for xb, yb in loader:
            one_step(t, model, xb, yb)
            steps += 1
            # the shard's ledger may lag the push's answer: wait for this step's batch, then no more
            wait_until(lambda: all(len(s.ledger.starts(0)) >= steps for s in shards), timeout_s=10,
                       what=f"step {steps}'s batch in every shard's ledger")
            for s in shards:
                starts = s.ledger.starts(0)
                assert len(starts) == steps and set(starts.values()) == {1}
        assert steps == SIZE // BATCH
        assert t.counters.samples == SIZE
    assert_exactly_once(c, SIZE, BATCH, 1)


def test_an_unreachable_chief_is_reported_with_the_time_waited():
    """Mutant: ``time.monotonic() + t0`` in the Unreachable message."""
    with pytest.raises(Unreachable, match=r"cannot reach the chief at 127\.0\.0\.1:1: gave up after \d+ s") as err:
        Trainer(mlp(0), chief="127.0.0.1:1", connect_timeout_s=0.2)
    waited = int(re.search(r"gave up after (\d+) s", str(err.value)).group(1))
    assert waited <= 30                 # about the 0.2 s asked for, not a clock reading




def fail_once(monkeypatch, obj, name, exc):
    """``obj.name`` raises ``exc`` on its first call, then behaves as before."""
    real, calls = getattr(obj, name), []

    def once(*args, **kw):
        calls.append(args)
        if len(calls) == 1:
            raise exc
        return real(*args, **kw)

    monkeypatch.setattr(obj, name, once)
    return calls


def test_a_shard_status_error_that_is_no_failover_is_raised_not_retried(cluster_factory, monkeypatch):
    """Mutant: ``if is_failover(exc) and exc.code() != DEADLINE_EXCEEDED`` in _follow_shards (an INTERNAL
    error would send the worker looking for another primary instead of failing)."""
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        calls = fail_once(monkeypatch, t._clients[0], "status", FakeRpcError(grpc.StatusCode.INTERNAL, "boom (test)"))
        with pytest.raises(grpc.RpcError) as err:
            t._follow_shards()
        assert err.value.code() == grpc.StatusCode.INTERNAL and len(calls) == 1


def test_a_shard_init_error_that_is_no_failover_is_raised_not_retried(cluster_factory, monkeypatch):
    """Mutant: ``if is_failover(exc): raise`` in _initialise_or_pull's init loop."""
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        fail_once(monkeypatch, t, "_pull_shard",
                  FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "shard 0 is not initialised (test)"))
        calls = fail_once(monkeypatch, t._clients[0], "init", FakeRpcError(grpc.StatusCode.INTERNAL, "boom (test)"))
        with pytest.raises(grpc.RpcError) as err:
            t._initialise_or_pull()
        assert err.value.code() == grpc.StatusCode.INTERNAL and len(calls) == 1


def test_a_named_optimizer_wins_over_the_job_files(tmp_path, monkeypatch):
    """Mutant: ``if not name is None`` in _optimizer_spec (the job file's optimizer would replace the script's)."""
    job = tmp_path / "job.yaml"
    job.write_text("optimizer: {name: adamw, lr: 0.01}\n")
    monkeypatch.setenv("SHOAL_JOB_FILE", str(job))
    assert Trainer._optimizer_spec("sgd", {"lr": 0.5}).name == "sgd"
    assert Trainer._optimizer_spec(None, {}).name == "adamw"


def test_a_pull_that_finds_its_shard_empty_after_start_up_initialises_it_again(cluster_factory, monkeypatch, caplog):
    """Mutant: ``self._started = False`` after start-up (an emptied shard would be an error, not re-initialised)."""
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        calls = fail_once(monkeypatch, t._clients[0], "pull",
                          FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "shard 0 is not initialised (test)"))
        t.pull()
        assert len(calls) >= 2
        assert [r for r in caplog.records if "lost its state" in r.getMessage()]


def starts_seen(cluster_factory, **kw):
    c = cluster_factory(1, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        seen = []
        for xb, yb in t.batches((x, y), batch_size=BATCH, epochs=2, batches_per_task=1, **kw):
            seen.append((t._batch.task.epoch, t._batch.start))
            one_step(t, model, xb, yb, samples=len(xb))
        return seen


def test_batches_default_to_seed_0(cluster_factory):
    """Mutant: ``seed: int = 1`` in batches() (another order of the data than the documented default)."""
    default = starts_seen(cluster_factory)
    assert default == starts_seen(cluster_factory, seed=0)
    assert default != starts_seen(cluster_factory, seed=1)      # the seed does decide the order


def test_with_a_sampler_skip_batch_hands_back_one_batch_by_default(cluster_factory):
    """Mutants: ``skip_batch(self, batches: int = 2)`` and ``= 0`` (the step after a skip would name a batch
    it did not train). The shards are looked up once the Trainer created them (before, the list was empty
    and the ledger checks passed vacuously)."""
    from torch.utils.data import DataLoader, TensorDataset
    from shoal.worker import DistributedSampler

    c = cluster_factory(2, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    ds = TensorDataset(torch.arange(SIZE), x, y)
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        shards = [s for ps in c.servers for s in ps.host.shards.values()]
        assert len(shards) == 2
        sampler = DistributedSampler(ds, batch_size=BATCH, epochs=1, shuffle=False, trainer=t)
        batches = iter(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
        idx, _, _ = next(batches)
        skipped = int(idx[0])
        t.skip_batch()
        idx, xb, yb = next(batches)
        second = int(idx[0])
        one_step(t, model, xb, yb)
        wait_until(lambda: all(s.ledger.starts(0) for s in shards), timeout_s=10, what="the step's batch in the ledgers")
        assert second != skipped
        for s in shards:
            assert dict(s.ledger.starts(0)) == {second: 1}      # the step named the batch it trained


def test_job_section_gives_the_train_section_as_written_and_the_optimizer_with_its_name(tmp_path, monkeypatch):
    """Mutant: ``if name != "optimizer"`` in job_section."""
    job = tmp_path / "job.yaml"
    job.write_text("train: {batch_size: 16, epochs: 3}\noptimizer: {name: adamw, lr: 0.01}\n")
    monkeypatch.setenv("SHOAL_JOB_FILE", str(job))
    assert Trainer.job_section("train") == {"batch_size": 16, "epochs": 3}
    assert Trainer.job_section("optimizer")["name"] == "adamw"


def test_batches_without_epochs_or_a_job_file_go_through_the_data_once_in_tasks_of_four_batches(cluster_factory,
                                                                                               monkeypatch):
    """Mutants: ``train.get("epochs", 0)`` and ``train.get("epochs", 2)`` in batches(); ``batches_per_task: int = 3``
    and ``= 5`` (another task size than the signature's default of four batches)."""
    monkeypatch.delenv("SHOAL_JOB_FILE", raising=False)
    c = cluster_factory(1, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        epochs, tasks = set(), set()
        for xb, yb in t.batches((x, y), batch_size=BATCH):
            epochs.add(t._batch.task.epoch)
            tasks.add((t._batch.task.start, t._batch.task.stop))
            one_step(t, model, xb, yb, samples=len(xb))
        assert t.step_count == SIZE // BATCH and epochs == {0}
        assert tasks == {(0, 4 * BATCH), (4 * BATCH, 8 * BATCH)}


def test_close_twice_leaves_the_job_once(cluster_factory):
    """Mutant: ``self._closed = False`` in close (a second close would leave and shut down again)."""
    c = cluster_factory(1, mode="async")
    t = Trainer(mlp(0), chief=c.chief_address, lr=0.1)
    t.close()
    left = []
    t.chief.leave = lambda *a, **kw: left.append(a)
    t.close()
    assert left == []


def test_a_stop_request_still_ends_with_0_when_the_last_heartbeat_fails(cluster_factory, monkeypatch):
    """Mutant: ``except grpcCosmicRayTestingExceptionRpcError`` in _hand_back."""
    c = cluster_factory(1, mode="async")
    model = mlp(0)
    x, y = data(SIZE)
    t = Trainer(model, chief=c.chief_address, lr=0.1)
    try:
        def fail(*a, **kw):
            raise chief_gone()
        monkeypatch.setattr(t.chief, "heartbeat_sync", fail)
        with pytest.raises(SystemExit) as stop:
            for xb, yb in t.batches((x, y), batch_size=BATCH, epochs=1):
                one_step(t, model, xb, yb, samples=len(xb))
                assert trainer_mod.request_stop() is True
        assert stop.value.code == 0 and t._closed
    finally:
        trainer_mod._STOP_REQUESTED.clear()
        t.close()


def test_a_pull_counts_only_pulled_bytes(cluster_factory):
    """Mutant: ``_count(self, pushed: int = 1, ...)`` (each pull would count a byte as pushed)."""
    c = cluster_factory(2, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        pushed, pulled = t.counters.bytes_pushed, t.counters.bytes_pulled
        t.pull()
        assert t.counters.bytes_pulled > pulled and t.counters.bytes_pushed == pushed


def test_failovers_is_a_count_starting_at_zero(cluster_factory):
    """Mutant: the ``@property`` of ``failovers`` removed (a bound method instead of the count)."""
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        assert t.failovers == 0


# ------------------------------------------------------------ added after the 2026-12-06 runs (issue 19)

def test_a_worker_says_it_gives_up_joining_after_30_s_by_default(monkeypatch, caplog):
    """Mutants: ``DEFAULT_CONNECT_TIMEOUT_S = 29.0`` / ``31.0`` (README: "retries joining for --connect-timeout
    seconds (default 30, said when it starts)")."""
    monkeypatch.delenv("SHOAL_CONNECT_TIMEOUT", raising=False)

    def join(self):
        raise Unreachable("no chief here (test)")

    monkeypatch.setattr(trainer_mod.ChiefClient, "join", join)
    with caplog.at_level(logging.INFO, logger=trainer_mod.__name__), pytest.raises(Unreachable):
        Trainer(mlp(0), chief="127.0.0.1:1")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("joining")] == [
        "joining the chief at 127.0.0.1:1 (giving up after 30 s)"]


@pytest.mark.parametrize("code,details,raised,message", [
    (grpc.StatusCode.UNAVAILABLE, "connection refused (test)", Unreachable,
     r"^cannot reach the chief at 127\.0\.0\.1:1: gave up after (\d+) s \(UNAVAILABLE\); is it running"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "", Unreachable,
     r"^cannot reach the chief at 127\.0\.0\.1:1: gave up after (\d+) s \(DEADLINE_EXCEEDED\)"),
    (grpc.StatusCode.FAILED_PRECONDITION, "0.weight: expected [16, 8] float32 (test)", Refused,
     r"^the job refused this worker: 0\.weight: expected \[16, 8\] float32 \(test\)$"),
    (grpc.StatusCode.INTERNAL, "boom (test)", grpc.RpcError, r"boom \(test\)"),
], ids=["unavailable", "deadline", "refused", "other"])
def test_a_join_the_chief_answers_with_an_error_is_one_clear_error(monkeypatch, code, details, raised, message):
    """Mutants in _join's gRPC branch: ``time.monotonic() + t0`` in the retry codes' message (:211),
    ``exc.details() and ""`` (the refusal without its reason), the branches' conditions negated."""
    closed = []

    def join(self):
        raise FakeRpcError(code, details)

    monkeypatch.setattr(trainer_mod.ChiefClient, "join", join)
    real_close = trainer_mod.ChiefClient.close
    monkeypatch.setattr(trainer_mod.ChiefClient, "close", lambda self: (closed.append(True), real_close(self)))
    with pytest.raises(raised) as err:
        Trainer(mlp(0), chief="127.0.0.1:1", connect_timeout_s=5)
    if raised is grpc.RpcError:
        assert type(err.value) is FakeRpcError and err.value.code() == code
    else:
        assert type(err.value) is raised
    found = re.search(message, str(err.value))
    assert found, str(err.value)
    if found.groups():
        assert int(found.group(1)) <= 30         # about no time at all, not a clock reading
    assert closed                                # the chief's channel is not left open


def test_a_shard_status_call_that_fails_over_is_followed_not_raised(cluster_factory, monkeypatch):
    """Mutants: ``not is_failover(exc) or exc.code() != DEADLINE_EXCEEDED`` and ``if is_failover(exc) and ...``
    in _follow_shards (a status call that hit a server going away would end the worker instead of following
    the view). The view's wait is stood in for: ``reroute`` is recorded, and the call then answers."""
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            rerouted = []
            monkeypatch.setattr(t.routes, "reroute", lambda shard, client, exc: rerouted.append((shard, exc.code())))
            calls = fail_once(monkeypatch, t._clients[0], "status", FakeRpcError(code, "going away (test)"))
            t._follow_shards()
            assert rerouted == [(0, code)] and len(calls) == 2
            monkeypatch.undo()


def test_a_shard_status_call_waits_two_leases_and_at_least_a_second(cluster_factory, monkeypatch):
    """Mutants of ``max(1.0, 2 * lease)`` in _follow_shards: ``2.0``, ``0.0``, ``3 *``, ``1 *``, ``2 / lease``.
    docs/architecture.md: a status call to a server that stopped answering outlasts a failover (a lease)
    before the worker follows the view, and never gives up in under a second on a short lease."""
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        client = t._clients[0]
        for lease, deadline in ((0.3, 1.0), (2.5, 5.0)):
            asked = []

            def status(timeout_s=10, _real=client.status):
                asked.append(timeout_s)
                return _real(timeout_s=timeout_s)
            monkeypatch.setattr(client, "status", status)
            monkeypatch.setattr(t.chief, "lease_seconds", lease)
            t._follow_shards()
            assert asked == [pytest.approx(deadline)], (lease, asked)
            monkeypatch.undo()


def test_the_byte_counters_count_what_the_shard_clients_sent_and_received(cluster_factory, monkeypatch):
    """Mutants: ``_count(self, pushed=0, pulled: int = 1)`` and ``= -1`` (each push would count a pulled byte)."""
    c = cluster_factory(2, mode="async")
    model = mlp(0)
    x, y = data(16)
    with Trainer(model, chief=c.chief_address, lr=0.1) as t:
        moved = {"pushed": 0, "pulled": 0}
        for client in t._clients.values():
            def push(*a, _real=client.push, **kw):
                reply, sent = _real(*a, **kw)
                moved["pushed"] += sent
                return reply, sent

            def pull(*a, _real=client.pull, **kw):
                version, got = _real(*a, **kw)
                moved["pulled"] += got
                return version, got
            monkeypatch.setattr(client, "push", push)
            monkeypatch.setattr(client, "pull", pull)
        pushed, pulled = t.counters.bytes_pushed, t.counters.bytes_pulled
        for _ in range(2):
            one_step(t, model, x, y, samples=16)
        assert moved["pushed"] > 0 and moved["pulled"] > 0
        assert t.counters.bytes_pushed - pushed == moved["pushed"]
        assert t.counters.bytes_pulled - pulled == moved["pulled"]


def test_without_overlap_each_sync_step_pushes_against_the_version_it_pulled(cluster_factory):
    """Mutant: ``versions = self._step_versions if not early else dict(self.versions)`` in step() (without
    overlap every push would name the version the worker started from, and a sync round drops it as stale)."""
    c = cluster_factory(1, mode="sync")
    model = mlp(0)
    x, y = data(16)
    with Trainer(model, chief=c.chief_address, lr=0.1, overlap=False) as t:
        for step in range(1, 4):
            one_step(t, model, x, y, samples=16)
            assert t.versions == {0: step}              # each step's gradient applied, in its own round



def test_a_shard_init_call_that_fails_over_is_followed_not_raised(cluster_factory, monkeypatch):
    """Mutant: ``except CosmicRayTestingException`` for ``except grpc.RpcError`` in _initialise_or_pull's init
    loop (an init that hit a server going away would end the worker instead of following the view)."""
    c = cluster_factory(1, mode="async")
    with Trainer(mlp(0), chief=c.chief_address, lr=0.1) as t:
        rerouted = []
        monkeypatch.setattr(t.routes, "reroute", lambda shard, client, exc: rerouted.append((shard, exc.code())))
        fail_once(monkeypatch, t, "_pull_shard",
                  FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "shard 0 is not initialised (test)"))
        calls = fail_once(monkeypatch, t._clients[0], "init",
                          FakeRpcError(grpc.StatusCode.UNAVAILABLE, "going away (test)"))
        t._initialise_or_pull()
        assert rerouted == [(0, grpc.StatusCode.UNAVAILABLE)] and len(calls) == 2


def test_zero_grad_clears_every_gradient_to_none(cluster_factory):
    """Mutant: ``for p in []`` in zero_grad (the last step's gradients would stay, and autograd add the next
    backward pass to them: every push after the first would carry the sum of all steps so far)."""
    c = cluster_factory(1, mode="async")
    model = mlp(0)
    x, y = data(16)
    with Trainer(model, chief=c.chief_address, lr=0.1, overlap=False) as t:
        one_step(t, model, x, y, samples=16)
        assert all(p.grad is not None for p in model.parameters())
        t.zero_grad()
        assert all(p.grad is None for p in model.parameters())


def test_skip_batch_after_close_hands_nothing_back(cluster_factory):
    """Mutant: ``if not group and self._feed is None`` in skip_batch (a loop that skips a step after the
    Trainer closed, its sampler still holding batches, would fail on the closed feed; close() already gave
    the chief back every task this worker held)."""
    from torch.utils.data import DataLoader, TensorDataset
    from shoal.worker import DistributedSampler

    c = cluster_factory(1, mode="async")
    x, y = data(SIZE)
    ds = TensorDataset(x, y)
    t = Trainer(mlp(0), chief=c.chief_address, lr=0.1)
    sampler = DistributedSampler(ds, batch_size=BATCH, epochs=1, trainer=t)
    batches = iter(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    next(batches)
    t.close()
    t.skip_batch()                                   # nothing to hand back to: quietly nothing
    assert t._feed is None and t._group == ()


def test_without_a_push_window_every_shards_push_is_in_flight_at_once(cluster_factory, monkeypatch):
    """Mutant: a shard pool of ``2 / shards + 1`` threads (two threads for four shards: the pushes would go
    two at a time, where window 0 promises every push at once). Each push waits until all four have started."""
    import threading

    c = cluster_factory(4, mode="async")             # one shard a server (two servers for four shards took 3 s to start)
    model = mlp(0)
    x, y = data(16)
    with Trainer(model, chief=c.chief_address, lr=0.1, overlap=False, push_window=0) as t:
        assert len(t._clients) == 4
        together = threading.Barrier(4, timeout=10)
        for client in t._clients.values():
            def push(*a, _real=client.push, **kw):
                together.wait()                 # BrokenBarrierError if the four are not in flight together
                return _real(*a, **kw)
            monkeypatch.setattr(client, "push", push)
        one_step(t, model, x, y, samples=16)
        assert t.step_count == 1 and not together.broken
