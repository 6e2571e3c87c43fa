"""Pushing a step's gradients to the shards and pulling their weights back: the worker's half of the
exchange with the parameter servers, and what it does when a shard moves (a failover, a server that
came back empty) in the middle of it.

:class:`ShardExchange` is a mixin of :class:`shoal.worker.trainer.Trainer`: it works on the Trainer's
flat buffers (``flat_weights``, ``flat_grads``, ``staging``, ``buffers``), its shard plan and routes
(``plan``, ``_clients``, ``routes``), its codecs (``encoder``, ``momentum``, ``pull_codec``) and its
per-shard bookkeeping (``versions``, ``_step_versions``, ``_held``, ``_sent``), all set up by
``Trainer.__init__``. The Trainer decides when a step pushes; this decides how.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import grpc
import torch

from shoal.dataset import Task
from shoal.errors import Refused
from shoal.proto import shoal_pb2 as pb
from shoal.state.tables import ROWS_CODEC
from shoal.worker import accumulate
from shoal.worker.batch import BatchContext  # noqa: F401  (re-exported: where the loop's batch is named)
from shoal.worker.pipeline import Pipeline, push_order, window_from, worker_rank
from shoal.worker.ps_client import is_uninitialised
from shoal.worker.routes import is_failover, went_back

log = logging.getLogger("shoal.worker.trainer")      # one logger for the worker's lines, as before
EARLY_WAIT_S = 1.0     # sync, pulls started before the step's last push is answered: the ps's wait per turn


@dataclass(frozen=True)
class SentPush:
    """One shard's encoded push of the current step, kept to re-send it after a failover."""

    chunks: list
    version: int
    key: str
    samples: int
    extra: dict
    group: tuple = ()          # the batches it names (to hand back if a new primary drops it)


@dataclass
class OpenPush:
    """A sync push a round took that this worker did not wait for (another shard had its batch already):
    until that round closes it lives only in the primary that took it (nemesis --netns seed 519)."""

    sent: SentPush
    client: object             # the primary's client that took it
    at: int                    # that primary's version then: its round closes at ``at + 1``


class ShardExchange:
    """Push, pull and their failover paths (see the module docstring)."""

    tables = None          # the Trainer's TableRouter (worker/tables.py): the model's embedding tables, if any
    _row_push: dict[int, bytes] = {}    # set per step by the Trainer: each shard's row gradients (read only here)

    def _init_pipeline(self, push_window: int | None) -> None:
        """Sets up the step pipeline (worker/pipeline.py); called by ``Trainer.__init__``."""
        self.push_window = window_from(push_window)
        self._pipe = Pipeline(self._pool, self.push_window, self._on_push_answered)
        self._early_pulls: dict[int, Future] = {}      # shard -> its pull, started when its push was answered
        self._step_late = threading.Event()           # sync: a push of this step was dropped or a duplicate
        self._open_lock = threading.Lock()            # guards _open_pushes (early pulls confirm them)
        self.push_orders: list[list[int]] = []        # the order of the last steps' pushes (tests, debugging)

    def _push_order(self) -> list[int]:
        view = self.chief.view
        if view is not None and view.routing_only:
            rank = view.worker_rank         # as of the last routing change: only spreads the first pushes
        else:
            rank = worker_rank(self.member_id, [m.member_id for m in view.members if m.role == pb.WORKER]
                               if view is not None else [])
        return push_order(list(self._clients), {k: c.address for k, c in self._clients.items()}, rank)

    def _on_push_answered(self, shard: int, reply: pb.PushReply) -> None:
        """On the thread that sent shard's push, as soon as it is answered: starts the shard's pull.

        Async and ssp: at the version the push reached. Sync (with a push window only): when the
        shard's round took this push, a pull of the round's result, which the ps sends the moment
        that round closes, while this worker's later pushes still go up. Until every push of the step
        is answered such a pull waits on the ps in short turns: if another shard turns out to have
        dropped this step's push, it takes the version its push reached instead (see
        :meth:`_push_then_pull` for why a late worker must not wait for rounds).
        """
        if self.mode != "sync":
            self._early_pulls[shard] = self._pool.submit(self._pull_shard, shard, reply.version, True)
        elif self.push_window and reply.accepted and not reply.duplicate and not self._step_late.is_set():
            sent = self._sent.get(shard)
            if sent is None:
                return

            def relax() -> int | None:
                return reply.version if self._step_late.is_set() else None
            self._early_pulls[shard] = self._pool.submit(self._pull_shard, shard, sent.version + 1, True, relax)
        elif self.mode == "sync" and not (reply.accepted and not reply.duplicate):
            self._step_late.set()

    def _push_then_pull(self, futures: dict[int, Future], versions: dict[int, int]) -> dict[int, pb.PushReply]:
        """Waits for the pushes and pulls every shard's new weights; returns the push replies.

        Async and ssp: a shard's pull starts as soon as its own push is answered, so it comes down
        while the other shards' pushes still go up. Sync waits for the rounds only when every shard
        took this step's gradient: a worker that was late somewhere (a backup-worker round closed
        without it) moves on at once instead, as waiting on the shards that did take it could
        deadlock against workers late elsewhere (a pull started early gives up its round then).
        """
        try:
            try:
                replies = {k: f.result() for k, f in futures.items()}
            finally:
                order = self._pipe.end()
                if order:
                    self.push_orders = (self.push_orders + [order])[-8:]
            self.clock.pushed_at = time.perf_counter()
            pulls, self._early_pulls = self._early_pulls, {}
            if self.mode != "sync":
                for k, r in replies.items():
                    if k not in pulls:
                        pulls[k] = self._pool.submit(self._pull_shard, k, r.version, True)
                for f in pulls.values():
                    f.result()
                return replies
            in_round = all(r.accepted and not r.duplicate for r in replies.values())
            if not in_round:
                self._step_late.set()          # early pulls stop waiting for their rounds
                for k, r in replies.items():
                    if r.accepted and not r.duplicate and k in self._sent:
                        with self._open_lock:
                            self._open_pushes.setdefault(k, []).append(
                                OpenPush(self._sent[k], self._clients[k], r.version))
            for k in self._clients:
                if k not in pulls:
                    pulls[k] = self._pool.submit(self._pull_shard, k, versions[k] + 1 if in_round else
                                                 replies[k].version, True)
            for f in pulls.values():
                f.result()
            return replies
        finally:
            self._step_late.clear()

    def _gather_grads(self) -> None:
        """Copies any gradient autograd did not accumulate in place into the flat buffer."""
        for p, g in zip(self._params, self._grad_views):
            if p.grad is None:
                g.zero_()
            elif p.grad.data_ptr() != g.data_ptr():
                g.copy_(p.grad)
                p.grad = g

    def _current_group(self, n: int = 1) -> tuple[BatchContext, ...]:
        """The batches this step's push names: the one :meth:`batches` yielded, or the next ``n`` a
        sampler recorded (``n`` > 1: the gradient was accumulated over micro-batches)."""
        if not self._group:
            if self._batch_source is not None:     # a record may hold short batches the DataLoader joined
                records = (self._batch_source() for _ in range(n))
                self._group = tuple(b for r in records if r is not None for b in (r if isinstance(r, tuple) else (r,)))
            elif self._batch is not None:
                self._group = (self._batch,)
        return self._group

    def _settle_group(self, group: tuple[BatchContext, ...], replies: list[pb.PushReply]) -> None:
        """After a push: hands back the batches some shard did not apply, records the tasks' progress
        and tells a sampler which batches were stepped (a task whose batches all were is done)."""
        if group and self._feed is not None:
            for b in accumulate.to_hand_back(group, replies):
                self._feed.drop(b.task.epoch, b.start, b.stop, b.task.task_id)
            with self._counter_lock:
                for b in group:
                    self._progress[b.task.task_id] = b.stop
        self._group = ()
        if self._batch_source is not None:
            self._batch = None
            for b in group if self._batch_done is not None else ():
                self._batch_done(b)

    def _key_base(self) -> str:
        batch = self._group[0] if self._group else None
        if batch is not None:
            return f"{self.member_id}/{batch.task.task_id}.{batch.task.attempt}/{batch.start}"
        return f"{self.member_id}/step{self.step_count}"

    def _launch_push(self, shard: int, versions: dict[int, int] | None = None):
        """Submits shard's push for the current step to the pool (from step() or a backward hook)."""
        group = self._current_group()
        version = (versions or self._step_versions)[shard]
        samples = sum(b.stop - b.start for b in group)
        self.buffers.fill_deltas(self.flat_grads)    # the forward passes since the last pull moved them
        ready = self.staging.grads_ready()         # CUDA: where this thread's stream has the gradients
        hparams = self._hparams_source() if self._hparams_source is not None else None   # read here: main thread
        args = (shard, version, self._key_base(), samples, group, ready, hparams)
        return self._pipe.launch(shard, lambda: self._push(*args), self._push_order)

    def _push(self, shard: int, version: int, key_base: str, samples: int,
              group: tuple[BatchContext, ...], ready=None, hparams: dict[str, float] | None = None) -> pb.PushReply:
        a, b = self.plan.ranges[shard]
        if self.encoder.tag == "none" and not self.momentum.active(shard):
            grad = self.staging.host_grads(shard, ready)      # raw fp32 leaves from host memory
        else:
            grad = self.flat_grads[a:b]                       # compressed where it lives (GPU or CPU)
            if ready is not None:
                torch.cuda.current_stream(grad.device).wait_event(ready)
            if self.momentum.active(shard):
                grad = self.momentum.apply(shard, grad)
                self.buffers.patch(grad, a, self.flat_grads)    # buffers' changes go as they are
            if self.encoder.tag == "none":
                grad = grad.cpu()
        chunks = self.encoder.encode(shard, grad, self._clients[shard].chunk_bytes)
        rows = self._row_push.get(shard)
        if rows:        # the embedding rows' gradients: the push's last frame (shoal/state/tables.py)
            chunks = [*chunks, (b - a, 0, ROWS_CODEC, rows)]
        extra = accumulate.header_fields(group)
        if hparams:
            extra["hparams"] = hparams
        sent = SentPush(chunks, version, f"{key_base}/{shard}", samples, extra, group)
        self._sent[shard] = sent
        self._resend_open(shard)
        return self._send(shard, sent)

    def _resend_open(self, shard: int) -> None:
        """Sends again the pushes of :class:`OpenPush` whose primary the shard has left since: the open round
        that held them went with it. The key keeps one that was applied from applying twice; one the new
        primary drops (its round closed without it) is handed back to the chief to be trained again."""
        with self._open_lock:
            pending = self._open_pushes.pop(shard, [])
        keep = []
        for p in pending:
            if p.client is self._clients[shard]:
                keep.append(p)
                continue
            reply = self._send(shard, p.sent)
            if reply.accepted and not reply.duplicate:
                keep.append(OpenPush(p.sent, self._clients[shard], reply.version))
                continue
            back = accumulate.to_hand_back(p.sent.group, [reply])
            if back and self._feed is not None:
                log.info("shard %d: a push its old primary took in a round that never closed was dropped by "
                         "the new one; handing back %d batch(es)", shard, len(back))
                for b in back:
                    self._feed.drop(b.task.epoch, b.start, b.stop, b.task.task_id)
        if keep:
            with self._open_lock:
                self._open_pushes[shard] = keep + self._open_pushes.get(shard, [])

    def _confirm_open(self, shard: int, version: int) -> None:
        """The shard's primary is at ``version``: the rounds that closed there applied the pushes they held."""
        with self._open_lock:
            pending = self._open_pushes.get(shard)
            if pending:
                client = self._clients[shard]
                left = [p for p in pending if not (p.client is client and version > p.at)]
                if left:
                    self._open_pushes[shard] = left
                else:
                    self._open_pushes.pop(shard, None)

    def _send(self, shard: int, p: "SentPush") -> pb.PushReply:
        """Sends (or, after a failover, re-sends) one encoded push; the key keeps it from applying twice."""
        while True:
            client = self._clients[shard]
            try:
                reply, sent = client.push(p.chunks, worker=self.member_id, version=p.version, key=p.key,
                                          view_epoch=self.chief.view.epoch if self.chief.view else 0,
                                          samples=p.samples, **p.extra)
                break
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "is over" in (exc.details() or ""):
                    # this worker trained a task the chief re-queued (its lease lapsed) and another
                    # worker already finished the epoch: nothing to apply, skip the batch
                    log.info("shard %d: %s; skipping the batch", shard, exc.details())
                    return pb.PushReply(accepted=False, duplicate=True, reason=exc.details())
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:   # ssp back-pressure: same key again
                    log.info("shard %d: %s; retrying", shard, exc.details())
                    continue
                if went_back(exc) and self._started:
                    version = self._restart_shard(shard, exc)
                    return pb.PushReply(accepted=False, version=version, reason=exc.details())
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "non-finite" in (exc.details() or ""):
                    # --nonfinite stop (or refuse, after a streak): the job stops, not a crash to restart
                    raise Refused(f"worker {self.member_id} at step {self.step_count + 1}: "
                                  f"{exc.details()}") from None
                if not is_failover(exc):
                    raise
                self.routes.reroute(shard, client, exc)
        if p is self._sent.get(shard):   # this step's push (not an older open one sent again): who holds it
            self._sent_to[shard] = client
        self._count(pushed=sent)
        return reply

    def _restart_shard(self, shard: int, exc: grpc.RpcError) -> int:
        """The shard lost every copy and came back empty or from a checkpoint (``--recovery fast``).

        An empty one is initialised from this worker's weights (the first worker
        to get there wins); the shard's version starts over. Returns it. The
        batch being pushed is handed back to the chief to be trained again.
        """
        a, b = self.plan.ranges[shard]
        client = self._clients[shard]
        log.warning("shard %d lost its state (%s); --recovery fast: going on from %s", shard,
                    (exc.details() or "")[:100], "this worker's weights" if is_uninitialised(exc) else "its restore")
        self._held.pop(shard, None)
        self.momentum.reset(shard)
        if is_uninitialised(exc):
            client.init(self.flat_weights[a:b].cpu(), self.optimizer, flat_start=a,
                        tables_json=self.tables.specs_json() if self.tables else "")
        version, _ = client.pull(torch.empty(b - a, dtype=torch.float32), 0, "none")
        self.versions[shard] = self._step_versions[shard] = version
        return version

    def _pull_shard(self, shard: int, min_version: int = 0, resend: bool = False,
                    relax: Callable[[], int | None] | None = None) -> None:
        """Pulls shard's weights at ``min_version`` or later. ``resend``: after a failover, push this
        step's gradient again first (the new primary may not have it; if it has, the key says so).
        ``relax``: the ps waits for ``min_version`` in turns of :data:`EARLY_WAIT_S`; after each,
        ``relax()`` may lower it (None: keep waiting)."""
        buf = self.staging.weights_target(shard)
        since = self._held.pop(shard, None) if self.delta_pulls else None
        while True:
            self._resend_open(shard)
            client = self._clients[shard]
            sent = self._sent.get(shard)
            if resend and sent is not None and self._sent_to.get(shard) not in (None, client):
                # the view moved the shard after its push was answered (a planned move, followed without a
                # failed call): the new primary may not have it, and a sync round there would wait for it.
                # Once per move, whatever it answers: a shard that came back empty (--recovery fast) refuses
                # it for good, and sending it again would loop here for ever (tests/system/test_recovery.py)
                self._sent_to[shard] = client
                reply = self._send(shard, sent)
                if not reply.accepted and not reply.duplicate:
                    min_version = min(min_version, reply.version)
                continue                          # pull from the client that took it
            try:
                turn = {} if relax is None else {"wait_s": EARLY_WAIT_S}
                version, got = client.pull(buf, min_version, self.pull_codec, since=since, **turn)
                if client is not self._clients[shard] and self._open_pushes.get(shard):
                    since = None                  # moved while pulling: the open pushes go there first
                    continue
                self._confirm_open(shard, version)
                break
            except grpc.RpcError as exc:
                held, since = since, None         # buf may be partly written: the next try pulls it whole
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    if relax is not None and "waiting for" in (exc.details() or ""):
                        since = held              # the ps's wait ran out before it sent a byte
                    lower = relax() if relax is not None else None
                    if lower is not None:
                        min_version = min(min_version, lower)
                    elif relax is None:
                        log.info("shard %d: still waiting for version %d", shard, min_version)
                    continue
                if is_uninitialised(exc) and self._started:   # at start-up the caller initialises it
                    min_version = min(min_version, self._restart_shard(shard, exc))
                    continue
                if not is_failover(exc):
                    raise
                self.routes.reroute(shard, client, exc)
                sent = self._sent.get(shard)
                if resend and sent is not None:
                    reply = self._send(shard, sent)
                    if not reply.accepted and not reply.duplicate:   # the new primary closed that round
                        min_version = min(min_version, reply.version)
        self.staging.land(shard)
        self.versions[shard] = version
        self._held[shard] = version
        self._count(pulled=got)
