"""The object a training script holds: it replaces ``optimizer.step()`` with push + pull.

The model's parameters and gradients are re-pointed into two flat fp32 buffers
laid out as :class:`shoal.state.layout.ShardPlan` says, so a shard's slice is pushed
and pulled without gathering tensors one by one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import grpc
import torch

from shoal.state import convert
from shoal.observe import metrics
from shoal.chief_client import ChiefClient
from shoal.settings.config import OptimizerSpec
from shoal.dataset import DatasetSpec, Task
from shoal.errors import FailedPrecondition, InvalidArgument, Refused, Unreachable
from shoal.settings.jobfile import job_from_env
from shoal.state.layout import ModelLayout, ShardPlan
from shoal.observe.loglines import log_burst
from shoal.members import Counters
from shoal.memory import tune_malloc
from shoal.net.rpc import with_retries
from shoal.proto import shoal_pb2 as pb
from shoal.worker.overlap import GradReadiness
from shoal.worker.data import TaskFeed, batches_of, dataset_size
from shoal.worker.exchange import BatchContext, SentPush, ShardExchange

from shoal.worker.buffers import ModelBuffers
from shoal.worker.momentum import LocalMomentum, server_optimizer
from shoal.worker.ps_client import TRANSPORTS, ShardClient, is_uninitialised
from shoal.worker.routes import ShardRoutes, is_failover
from shoal.worker.push import GradientEncoder
from shoal.worker.staging import Staging
from shoal.worker.telemetry import StepClock, WorkerTelemetry, after_step
from shoal.worker.tables import TableRouter

log = logging.getLogger(__name__)

RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_STOP_REQUESTED = threading.Event()
_LIVE: "weakref.WeakSet[Trainer]" = weakref.WeakSet()


def request_stop() -> bool:
    """Preemption (``shoal worker`` calls this on SIGTERM): every Trainer of this process hands back its
    data task at the next batch boundary, leaves the job and ends the process with exit code 0.
    Safe to call from a signal handler: it only sets flags. False when no Trainer is taking batches
    (nothing would see the request: the caller should end the process itself)."""
    _STOP_REQUESTED.set()
    taking = False
    for trainer in list(_LIVE):
        feed = trainer._feed
        if feed is not None:
            feed.interrupt()
            taking = True
        elif trainer._batch_source is not None or trainer.accumulation is not None:
            taking = True           # a DistributedOptimizer's: its next step() or iteration hands back
    return taking


def _leave_asked(why: str) -> None:
    """The chief asks this worker to leave: it hands back its task and exits 0, as on SIGTERM."""
    log.warning("the chief asks this worker to leave (%s): handing back its task at the next batch", why)
    request_stop()


def stop_requested() -> bool:
    """Whether SIGTERM asked this process to leave (:func:`request_stop`): checked at batch boundaries."""
    return _STOP_REQUESTED.is_set()


DEFAULT_CONNECT_TIMEOUT_S = 30.0


class Trainer(ShardExchange):
    """Joins the job, keeps the model's weights in step with the parameter servers.

    ``chief`` defaults to ``$SHOAL_CHIEF``. ``optimizer`` and its hyper-parameters
    (``lr``, ``momentum``, ...) configure the server-side optimizer; the first
    worker to initialise a shard decides them. ``compression`` names a gradient
    codec (``shoal.codecs``); ``pull_codec`` is ``none``, ``fp16`` or ``bf16``. ``transport``
    (default ``$SHOAL_TRANSPORT`` or ``tcp``) carries pushes and pulls over the parameter
    servers' raw TCP data channel; ``grpc`` keeps them on gRPC. ``delta_pulls``: a pull over TCP
    says which version the worker holds, and the ps sends only the elements changed since when
    that is much less (sparse updates: top-k pushes into server SGD without momentum or weight decay,
    as with momentum correction). ``momentum_correction``: with top-k and SGD with momentum, Adam
    or AdamW, a shard this worker creates leaves the momentum (or Adam's moments) to the workers
    (:mod:`shoal.worker.momentum`). ``push_window`` (default ``$SHOAL_PUSH_WINDOW`` or 0: no limit): at
    most this many shard pushes unanswered at once, each shard's pull starting when its push is
    answered (:mod:`shoal.worker.pipeline`; for slow links, with more shards than servers).
    ``table_defaults``: the row optimizer ``(name, hyper)`` of the model's embedding tables on the servers
    (:mod:`shoal.worker.embedding`) that name none (default: ``sgd`` with the optimizer's ``lr``).
    ``row_cache`` (async/ssp): keep up to this many hot rows of each table on the worker, each served for
    ``row_cache_steps`` steps after its pull before it is pulled again (:class:`shoal.worker.tables.RowCache`).
    """

    def __init__(self, model: torch.nn.Module, *, chief: str | None = None,
                 optimizer: str | OptimizerSpec | None = None,
                 compression: str | None = None, pull_codec: str | None = None, overlap: bool = True,
                 transport: str | None = None, delta_pulls: bool = True, momentum_correction: bool = True,
                 ready_timeout_s: float = 120.0, connect_timeout_s: float | None = None, hparams_source: Callable[[], dict[str, float]] | None = None, push_window: int | None = None,
                 table_defaults: tuple[str, dict[str, float]] | None = None, row_cache: int = 0,
                 row_cache_steps: int = 1, **hparams: float):
        tune_malloc()
        if row_cache < 0 or row_cache_steps < 1:
            raise InvalidArgument(f"row_cache must be >= 0 rows and row_cache_steps >= 1, got {row_cache} and "
                                  f"{row_cache_steps}")
        self.model = model
        self.chief_address = chief or os.environ.get("SHOAL_CHIEF", "")
        if not self.chief_address:
            raise InvalidArgument("no chief address: pass chief=HOST:PORT or set SHOAL_CHIEF")
        self.encoder = GradientEncoder(compression or os.environ.get("SHOAL_COMPRESSION", "none"))
        spec = optimizer if isinstance(optimizer, OptimizerSpec) else self._optimizer_spec(optimizer, hparams)
        # the optimizer's current hyper-parameters ("0.lr", ...), sent with every push (LR schedulers)
        self._hparams_source = hparams_source
        # where a step's batch comes from when the loop is the user's (a DistributedSampler)
        self._batch_source: Callable[[], "BatchContext | tuple[BatchContext, ...] | None"] | None = None
        self._batch_done: Callable[[BatchContext], None] | None = None
        # what a shard this worker creates gets; the shard's own optimizer decides (see _follow_shards)
        self.optimizer = server_optimizer(spec, self.encoder.sparse) if momentum_correction else spec
        self.momentum = LocalMomentum()
        self.pull_codec = pull_codec or os.environ.get("SHOAL_PULL_CODEC", "none")
        self.transport = transport or os.environ.get("SHOAL_TRANSPORT", "tcp")
        if self.transport not in TRANSPORTS:
            raise InvalidArgument(f"unknown transport {self.transport!r}; known: {', '.join(TRANSPORTS)}")
        # the flat vector: the parameters, then the buffers (worker/buffers.py)
        self.param_layout = ModelLayout.from_module(model)
        self.buffers = ModelBuffers(model, self.param_layout.numel)
        self.layout = ModelLayout(self.param_layout.specs + tuple(self.buffers.specs))
        if self.buffers.ranges:
            self.optimizer = dataclasses.replace(self.optimizer, buffers=self.buffers.ranges)
        self.counters = Counters()
        self._counter_lock = threading.Lock()
        self._batch: BatchContext | None = None         # the batch batches() yielded last
        self._group: tuple[BatchContext, ...] = ()      # the batches the next push names
        self.accumulation: Any = None    # a DistributedOptimizer's: backward passes not pushed yet (accumulate.py)
        self._progress: dict[int, int] = {}
        self._step_seconds = 0.0
        self._own_seconds = 0.0        # outside step(): what a sync round waits on (chief/stragglers.py)
        self._last_step_end = 0.0
        self._feed: TaskFeed | None = None      # before the heartbeats start: they read it
        self._closed = False
        self._data_done = 0                     # batches() went through this many epochs: the job's data is done
        if connect_timeout_s is None:
            connect_timeout_s = float(os.environ.get("SHOAL_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_S))
        if not connect_timeout_s > 0:
            raise InvalidArgument(f"connect timeout must be > 0 seconds, got {connect_timeout_s}")
        self.chief = ChiefClient(self.chief_address, pb.WORKER, host=socket.gethostname(),
                                 layout=convert.layout_to_pb(self.layout), counters=self._snapshot_counters,
                                 heartbeat_extra=self._fill_heartbeat, join_deadline_s=connect_timeout_s,
                                 view_scope=pb.ROUTING)     # woken by routing changes only (chief/views.py)
        self.chief.on_leave_asked = _leave_asked                 # an evicted straggler (chief/stragglers.py)
        # before joining: a metrics port in use is an error that leaves nothing behind
        self.telemetry = WorkerTelemetry.from_env(lambda: self.chief.member_id, report=self._send_metrics)
        self.clock, self._bytes_at_step = StepClock(), [0, 0]
        self._join(connect_timeout_s)
        self.chief.start_background()
        view = self.chief.wait_view(lambda v: v.ready, ready_timeout_s)
        self.mode = view.job.mode
        self.plan = ShardPlan(self.layout.numel, view.job.num_shards)
        lr = spec.hparams.get("lr") if not spec.groups else spec.groups[0].hparams.get("lr")
        if row_cache and view.job.mode == "sync":
            self.chief.leave()
            self.chief.close()
            raise InvalidArgument(f"row_cache={row_cache} in a sync job: a row cache serves rows older than the "
                                  f"round; it takes async or ssp")
        self.tables = TableRouter(model, view.job.num_shards, self, table_defaults or
                                  ("sgd", {"lr": float(lr)} if isinstance(lr, (int, float)) else {}),
                                  cache=(row_cache, row_cache_steps))
        self._row_push: dict[int, bytes] = {}     # this step's row gradients, a blob per shard
        if self.tables:
            overlap = False     # a shard's push carries the rows' gradients, known only once backward is done
        self._bind_flat_buffers()
        self.staging = Staging(self.flat_weights, self.flat_grads, self.plan.ranges)
        self.routes = ShardRoutes(self.chief, view, self._client, lambda: self.chief.member_id)
        self._clients = self.routes.clients
        self.delta_pulls = delta_pulls
        self._held: dict[int, int] = {}     # shard -> the version whose weights its pull buffer holds
        self._pool = ThreadPoolExecutor(max_workers=2 * len(self._clients) + 1, thread_name_prefix="shard")  # pushes+pulls
        self.versions = {k: 0 for k in self._clients}
        self.step_count = 0
        self._step_versions = dict(self.versions)
        self._sent: dict[int, SentPush] = {}
        self._sent_to: dict[int, object] = {}     # shard -> the client that answered its latest push
        self._open_pushes: dict[int, list] = {}     # shard -> OpenPush (worker/exchange.py)
        self._init_pipeline(push_window)            # worker/pipeline.py
        self._readiness = GradReadiness(self._params, self._grad_views, self.param_layout, self.plan,
                                        self._launch_push) if overlap else None
        self._started = False
        self._initialise_or_pull()
        self._follow_shards()
        self.staging.before_compute()
        self.buffers.load(self.flat_weights)       # the job's buffers, not this process's fresh ones
        self._started = True
        _LIVE.add(self)
        metrics.set_info(mode=self.mode)          # shoal_job_info's mode label
        log.info("worker %s ready: %d parameters in %d shard(s), mode %s, compression %s",
                 self.member_id, self.layout.numel, len(self._clients), self.mode, self.encoder.tag)

    # ------------------------------------------------------------ setup

    @staticmethod
    def job_section(name: str) -> dict[str, Any]:
        """A section of the job file the launcher was given (``shoal worker --config job.yaml``), as a
        dict: ``Trainer.job_section("train")`` holds ``batch_size``, ``epochs``, ... ({} without a file).
        A script can take its defaults from it before it builds the Trainer."""
        job = job_from_env()
        if job is None:
            return {}
        if name == "optimizer":
            return {"name": job.optimizer.name, **dict(job.optimizer.hparams)} if job.optimizer else {}
        return job.section(name)

    @staticmethod
    def _optimizer_spec(name: str | None, hparams: dict[str, float]) -> OptimizerSpec:
        """The script's optimizer; without a name, the job file's ``optimizer`` section, else sgd."""
        if name is None:
            job = job_from_env()
            if job is not None and job.optimizer is not None:
                return OptimizerSpec(job.optimizer.name, {**job.optimizer.hparams, **hparams})
        return OptimizerSpec(name or "sgd", hparams)

    def _join(self, timeout_s: float) -> None:
        """Joins the chief, retrying for ``timeout_s``; a refusal or an unreachable chief is one clear error."""
        log.info("joining the chief at %s (giving up after %.0f s)", self.chief_address, timeout_s)
        t0 = time.monotonic()
        try:
            self.chief.join()
        except Unreachable:
            self.chief.close()
            raise Unreachable(f"cannot reach the chief at {self.chief_address}: gave up after "
                              f"{time.monotonic() - t0:.0f} s; is it running, and is the address right? "
                              f"(--connect-timeout / $SHOAL_CONNECT_TIMEOUT)") from None
        except grpc.RpcError as exc:
            self.chief.close()
            code, details = exc.code(), exc.details() or ""
            if code in RETRY_CODES:
                raise Unreachable(f"cannot reach the chief at {self.chief_address}: gave up after "
                                  f"{time.monotonic() - t0:.0f} s ({code.name}); is it running, and is the "
                                  f"address right? (--connect-timeout / $SHOAL_CONNECT_TIMEOUT)") from None
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise Refused(f"the job refused this worker: {details}") from None
            raise

    @property
    def member_id(self) -> str:
        """The name the chief gave this worker when it joined (``worker-1``: what ``shoal status`` shows)."""
        return self.chief.member_id

    @property
    def failovers(self) -> int:
        """How many times a shard moved to another server (a failover) during this worker's life."""
        return self.routes.failovers

    def _client(self, shard: int, address: str) -> ShardClient:
        return ShardClient(shard, address, self.plan.shard_numel(shard), self.layout.fingerprint,
                           transport=self.transport, member_id=lambda: self.chief.member_id,
                           credential=lambda: self.chief.credential)

    def _bind_flat_buffers(self) -> None:
        params = list(self.model.parameters())
        device = params[0].device if params else torch.device("cpu")
        self.flat_weights = torch.zeros(self.layout.numel, dtype=torch.float32, device=device)
        pn = self.param_layout.numel
        self.param_layout.flatten([p.detach() for p in params], out=self.flat_weights[:pn])
        self.buffers.write(self.flat_weights)
        self.flat_grads = torch.zeros_like(self.flat_weights)
        weights, grads = self.param_layout.unflatten(self.flat_weights[:pn]), self.param_layout.unflatten(self.flat_grads[:pn])
        for p, w, g in zip(params, weights, grads):
            p.data = w
            p.grad = g
        self._params = params
        self._grad_views = grads
        self.device = device

    def _initialise_or_pull(self) -> None:
        created: list[int] = []

        def one(shard: int) -> None:
            a, b = self.plan.ranges[shard]
            try:
                self._pull_shard(shard)
                return
            except grpc.RpcError as exc:
                if not is_uninitialised(exc):
                    raise
            while True:                 # a server that dies meanwhile: follow the view, as the pulls do
                client = self._clients[shard]
                try:
                    reply = client.init(self.flat_weights[a:b].cpu(), self.optimizer, flat_start=a,
                                        tables_json=self.tables.specs_json())
                    break
                except grpc.RpcError as exc:
                    if not is_failover(exc):
                        raise
                    self.routes.reroute(shard, client, exc)
            if reply.created:
                created.append(shard)
            self._pull_shard(shard)

        list(self._pool.map(one, self._clients))
        log_burst(log, [f"initialised shard {k} from this worker's weights" for k in sorted(created)])

    def _follow_shards(self) -> None:
        """Applies what each shard's optimizer leaves to the workers (``worker_momentum``, ``worker_beta2``)."""
        for shard in list(self._clients):
            while True:
                client = self._clients[shard]
                try:
                    status = client.status(timeout_s=max(1.0, 2 * self.chief.lease_seconds))
                    break
                except grpc.RpcError as exc:
                    if not is_failover(exc) and exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    self.routes.reroute(shard, client, exc)   # follows the view (or tries it again)
            self.momentum.follow(shard, dict(status.optimizer.hparams))
            if self.momentum.active(shard):
                log.info("shard %d: %s applied here, before compression (momentum correction)",
                         shard, self.momentum.describe(shard))

    # ------------------------------------------------------------ training

    def zero_grad(self) -> None:
        """Clears the gradients (to None, as torch's optimizers do); with overlap, arms the push hooks.

        Autograd then hands each parameter a new gradient, which the hooks (or :meth:`step`) copy
        into the flat buffer: one copy, where zeroing the buffer and letting autograd add into it
        cost a fill and an add (8% of a worker's CPU in bench/mlp.py, measured with perf).
        """
        if self._readiness is not None:
            self._step_versions = dict(self.versions)
            self._readiness.arm()
        for p in self._params:
            p.grad = None
        self.tables.zero_grad()

    def step(self, samples: int = 0, loss: Any = None, batches: int = 1) -> None:
        """Pushes this step's gradients to every shard and pulls the new weights.

        ``loss`` (a float or the loss tensor, optional) goes to TensorBoard, the metrics,
        the loss-spike alerts and the progress bar; it is read off the training thread.

        Inside :meth:`batches` the push names its batch, so every shard applies
        that batch at most once; a batch some shard dropped (a late gradient in
        a sync round) is handed back to the chief to be trained again. With a
        sampler, the push names its next ``batches`` batches (gradient accumulation).
        """
        t0 = time.perf_counter()
        early = self._readiness.take() if self._readiness is not None else {}
        self._gather_grads()
        self._row_push = self.tables.collect() if self.tables else {}
        group = self._current_group(batches)
        samples = samples or sum(b.stop - b.start for b in group)
        versions = self._step_versions if early else dict(self.versions)
        futures = {k: early.get(k) or self._launch_push(k, versions) for k in self._push_order()}
        by_shard = self._push_then_pull(futures, versions)
        self.staging.before_compute()
        self.buffers.load(self.flat_weights)
        self._settle_group(group, list(by_shard.values()))
        self.step_count += 1
        now = time.perf_counter()
        with self._counter_lock:
            self.counters.steps += 1
            self.counters.samples += samples
            if self._last_step_end:
                period, own = now - self._last_step_end, max(0.0, t0 - self._last_step_end)
                self._step_seconds = period if not self._step_seconds else 0.8 * self._step_seconds + 0.2 * period
                self._own_seconds = own if not self._own_seconds else 0.8 * self._own_seconds + 0.2 * own
            self._last_step_end = now
        after_step(self, t0, samples, loss, versions, by_shard, self._bytes_at_step)
        log.debug("step %d in %.1f ms", self.step_count, (now - t0) * 1e3)

    def pull(self) -> None:
        """Refreshes the local weights from every shard (e.g. before evaluating)."""
        list(self._pool.map(self._pull_shard, self._clients))
        self.staging.before_compute()
        self.buffers.load(self.flat_weights)

    # ------------------------------------------------------------ data

    def batches(self, data: Any, batch_size: int | None = None, epochs: int | None = None,
                batches_per_task: int = 4, seed: int = 0, prefetch: int = 2) -> Iterator[Any]:
        """Yields the batches of the tasks the chief hands this worker, until the job's data is done.

        Call :meth:`step` once per batch. ``data`` is a tuple of tensors or a map-style dataset.
        ``batch_size`` and ``epochs`` default to the job file's ``train`` section (epochs: 1 without).
        One call goes through all ``epochs``: a second call after the job's data is done is an error
        (inside your own epoch loop, use :class:`shoal.worker.DistributedSampler` instead).
        """
        if self._data_done:
            raise FailedPrecondition(
                f"batches() already went through the job's data ({self._data_done} epoch(s)); it is one "
                f"iterator over all epochs: pass epochs=N to a single call, or keep your own epoch loop "
                f"with shoal.worker.DistributedSampler")
        train = self.job_section("train")
        batch_size = batch_size if batch_size is not None else train.get("batch_size")
        if batch_size is None:
            raise InvalidArgument("no batch size: pass batch_size= or set train.batch_size in the job file")
        epochs = epochs if epochs is not None else train.get("epochs", 1)
        spec = DatasetSpec(dataset_size(data), batch_size, epochs, batches_per_task, seed)
        feed = TaskFeed(self.chief.stub, lambda: self.member_id, spec, prefetch, rejoin=self.chief.join,
                        chief=f"the chief at {self.chief_address}", call_timeout_s=self.chief.call_timeout_s)
        self._feed = feed
        try:
            for task, token in self.clock.timed(feed):
                for start, stop, batch in batches_of(data, task, batch_size):
                    if _STOP_REQUESTED.is_set():
                        self._hand_back(feed)
                    self._batch = BatchContext(task, token, start, stop)
                    steps = self.step_count
                    yield batch
                    if self.step_count == steps and self._batch is not None:
                        self._unstepped(self._batch)
                self._batch = None
                self._task_finished(task)
                feed.mark_done(task)
            if _STOP_REQUESTED.is_set():
                self._hand_back(feed)
            feed.flush()
            self._data_done = epochs
        finally:
            self._batch = None
            feed.close()
            self._feed = None

    def _unstepped(self, batch: BatchContext) -> None:
        """The loop went on to the next batch without step() or skip_batch(): its gradient would be
        pushed under the next batch's name (accumulation over micro-batches) or not at all, and the
        ledger would misname the job's data either way."""
        raise FailedPrecondition(
            f"batches() yielded batch {batch.task.epoch}/{batch.start} and the loop asked for the next one "
            f"without step() or skip_batch(): call step() once per batch, or skip_batch() to hand a batch back "
            f"(for gradient accumulation over micro-batches, use DistributedOptimizer with DistributedSampler)")

    def skip_batch(self, batches: int = 1) -> None:
        """The loop skipped this batch's step (an inf/nan gradient under a GradScaler): nothing is pushed,
        and the batch (with a sampler: the next ``batches``, accumulated) goes back to the chief, so the
        ledger still gets every batch once."""
        group, self._group = self._current_group(batches), ()
        if self.tables:
            self.tables.collect()           # the skipped step's row gradients go nowhere
        if not group or self._feed is None:
            return
        log.info("step skipped: batch(es) %s go back to the chief", [f"{b.task.epoch}/{b.start}" for b in group])
        for b in group:
            self._feed.drop(b.task.epoch, b.start, b.stop, b.task.task_id)
            if self._batch_done is not None:
                self._batch_done(b)
        self._batch = None

    def _task_finished(self, task: Task) -> None:
        with self._counter_lock:
            self._progress.pop(task.task_id, None)

    # ------------------------------------------------------------ reporting

    def _count(self, pushed: int = 0, pulled: int = 0) -> None:
        with self._counter_lock:
            self.counters.bytes_pushed += pushed
            self.counters.bytes_pulled += pulled

    def _fill_heartbeat(self, req: pb.HeartbeatRequest) -> None:
        feed = self._feed
        with self._counter_lock:
            holds = feed.progress_holds() if feed is not None else {}
            for task_id, next_start in self._progress.items():
                req.progress.add(task_id=task_id, next_start=min(next_start, holds.get(task_id, next_start)))
            req.step_seconds = self._step_seconds
            req.own_step_seconds = self._own_seconds

    def _send_metrics(self, values: dict[str, float]) -> None:
        self.chief.stub.ReportMetrics(pb.MetricsReport(member_id=self.member_id, values=values), timeout=2)

    def _snapshot_counters(self) -> Counters:
        with self._counter_lock:
            c = self.counters
            return Counters(c.steps, c.samples, c.bytes_pushed, c.bytes_pulled)

    def report(self, **values: float) -> None:
        """Publishes job-level metrics (e.g. ``test_accuracy``) to the chief."""
        self.telemetry.reported(values, self.step_count)
        req = pb.MetricsReport(member_id=self.member_id, values={k: float(v) for k, v in values.items()})
        with_retries(lambda: self.chief.stub.ReportMetrics(req, timeout=self.chief.call_timeout_s()),
                     "report metrics to the chief", deadline_s=120)

    def hand_back(self) -> None:
        """SIGTERM on the user's own loop (``DistributedOptimizer``/``DistributedSampler``): between two
        batches, as :meth:`batches` does. Batches the DataLoader holds but no step pushed resume on
        another worker from this one's reported progress."""
        feed = self._feed
        if feed is None:
            log.info("worker %s stopping on request (SIGTERM) after %d step(s): leaving the job",
                     self.member_id, self.step_count)
            self.close()
            raise SystemExit(0)
        self._hand_back(feed)

    def _hand_back(self, feed: TaskFeed) -> None:
        """Preempted between two batches: reports finished tasks and how far the current one got, leaves
        (the chief hands the rest of this worker's tasks to the others) and ends the process with 0."""
        held = sorted(self._progress)
        log.info("worker %s stopping on request (SIGTERM) after %d step(s): handing back task(s) %s and "
                 "leaving the job", self.member_id, self.step_count, held or "none")
        self._batch = None
        try:
            feed.flush()
            self.chief.heartbeat_sync()         # the chief resumes each task from this worker's progress
        except grpc.RpcError as exc:
            log.warning("could not report progress before leaving (%s); the chief resumes from the last "
                        "heartbeat", exc.code().name)
        self.close()
        raise SystemExit(0)

    def close(self) -> None:
        """Leaves the job gracefully (returns held tasks) and closes connections."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        self.telemetry.close()
        feed, self._feed = self._feed, None
        if feed is not None:            # a sampler's: report the tasks it finished before leaving
            try:
                feed.flush()
            except grpc.RpcError as exc:
                log.warning("could not report finished tasks to the chief: %s", exc.details())
            feed.close()
        self.chief.leave()
        self._pool.shutdown(wait=False)
        self.tables.close()
        self.routes.close()
        self.chief.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
