"""Lightweight fake workers for bench/chief_grpc.py: many members per process on one asyncio loop.

Each fake worker does what a training worker does towards the chief and nothing else (no torch,
no parameter servers): one gRPC channel of its own (so one connection, as a real member has),
``Join`` as a worker, a heartbeat every lease/4 with counters, task progress and a step time (as
``ChiefClient._heartbeat_loop`` sends; on a ``KeepAlive`` stream, or as single calls when the sixth
argument says ``unary``), ``GetTasks`` every ``task_period`` seconds reporting the
finished task and the ids it holds (as ``TaskFeed`` does with ``reports_held``), and a view watch:
a ``Watch`` stream, or (``unary``) one that long-polls
``GetView(after_epoch, timeout WATCH_S, member_id, scope)`` and re-opens at once (as
``ChiefClient._watch_loop``; the scope is ROUTING, as a worker's, unless the fifth argument says
``full``). Every received view is parsed (as a real member parses its own).

Driven over stdin/stdout by the coordinator, one line each way:
    -> ``ready N``            all N joined and running
    <- ``measure``            start recording latencies and the views seen
    <- ``stop``               print one JSON line with what was recorded, close the channels, exit
                              (no Leave: the coordinator stops the chief next)
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time

import grpc

from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc

WATCH_S = 25.0      # as shoal.chief_client.WATCH_S (not imported: that module brings torch)

LAYOUT = pb.ModelLayout(tensors=[pb.TensorSpec(name="w", shape=[1000], dtype="float32")])
JOIN_CONCURRENCY = 16


class Recorder:
    def __init__(self) -> None:
        self.measuring = False
        self.heartbeat_ms: list[float] = []
        self.tasks_ms: list[float] = []
        self.errors: dict[str, int] = {}
        self.views = 0
        self.rejoins = 0

    def error(self, what: str, exc: grpc.RpcError) -> None:
        if self.measuring:
            key = f"{what}:{exc.code().name}"
            self.errors[key] = self.errors.get(key, 0) + 1


class FakeWorker:
    def __init__(self, address: str, rec: Recorder, dataset: pb.DatasetSpec, task_period_s: float, scope: int,
                 stream: bool = True):
        self.scope = scope
        self.stream = stream            # heartbeats and the view on streams (as ChiefClient), else calls and polls
        self._beats = None
        # A subchannel pool of its own: otherwise gRPC shares one connection among every channel of a
        # process with the same target and arguments, and a fleet process's members all talk to the chief
        # over one connection, where real members (one a host) have one each.
        self.channel = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb_grpc.ChiefStub(self.channel)
        self.rec = rec
        self.dataset = dataset
        self.task_period_s = task_period_s
        self.member_id = ""
        self.lease_s = 3.0
        self.epoch = -1
        self.seen: list[tuple[int, float]] = []     # (epoch, monotonic time first seen), while measuring
        self.held: list[int] = []
        self.steps = 0

    async def join(self) -> None:
        reply = await self.stub.Join(pb.JoinRequest(role=pb.WORKER, host="fleet", layout=LAYOUT, view_scope=self.scope),
                                     timeout=120)
        self.member_id, self.lease_s, self.epoch = reply.member_id, reply.lease_seconds, reply.view.epoch

    async def heartbeats(self) -> None:
        period = max(0.05, self.lease_s / 4)
        await asyncio.sleep(random.uniform(0, period))
        while True:
            self.steps += 1
            req = pb.HeartbeatRequest(member_id=self.member_id,
                                      counters=pb.Counters(steps=self.steps, samples=32 * self.steps),
                                      progress=[pb.TaskProgress(task_id=t, next_start=0) for t in self.held],
                                      step_seconds=0.1 + random.random() * 0.01)
            t0 = time.perf_counter()
            try:
                reply = await self.beat(req, max(1.0, self.lease_s / 2))
                if self.rec.measuring:
                    self.rec.heartbeat_ms.append(1e3 * (time.perf_counter() - t0))
                if not reply.known:         # the lease lapsed: join again, as ChiefClient does
                    if self.rec.measuring:
                        self.rec.rejoins += 1
                    self.held = []
                    await self.join()
            except grpc.RpcError as exc:
                self.rec.error("heartbeat", exc)
            await asyncio.sleep(max(0.0, period - (time.perf_counter() - t0)))

    async def beat(self, req: pb.HeartbeatRequest, timeout_s: float) -> pb.HeartbeatReply:
        """One heartbeat: on the member's KeepAlive stream (opened afresh after a failure, as
        shoal.net.keepalive does), or a single call."""
        if not self.stream:
            return await self.stub.Heartbeat(req, timeout=timeout_s)
        if self._beats is None:
            self._beats = self.stub.KeepAlive()
        try:
            await self._beats.write(req)
            reply = await asyncio.wait_for(self._beats.read(), timeout_s)
        except (grpc.RpcError, TimeoutError, asyncio.InvalidStateError) as exc:
            self._beats.cancel()
            self._beats = None
            if isinstance(exc, grpc.RpcError):
                raise
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, None, "no answer on the stream") \
                from exc
        if reply is grpc.aio.EOF:
            self._beats = None
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the chief ended the stream")
        return reply

    async def tasks(self) -> None:
        await asyncio.sleep(random.uniform(0, self.task_period_s))
        while True:
            done = list(self.held)
            req = pb.TaskRequest(member_id=self.member_id, dataset=self.dataset, max_tasks=1,
                                 done_task_ids=done, held_task_ids=done, reports_held=True)
            t0 = time.perf_counter()
            try:
                reply = await self.stub.GetTasks(req, timeout=max(1.0, self.lease_s))
                if self.rec.measuring:
                    self.rec.tasks_ms.append(1e3 * (time.perf_counter() - t0))
                self.held = [t.task_id for t in reply.tasks]
            except grpc.RpcError as exc:
                self.rec.error("tasks", exc)
            await asyncio.sleep(max(0.0, self.task_period_s - (time.perf_counter() - t0)))

    async def watch(self) -> None:
        if self.stream:
            await self.watch_stream()
        while True:
            try:
                view = await self.stub.GetView(pb.ViewRequest(after_epoch=self.epoch, timeout_seconds=WATCH_S,
                                                              member_id=self.member_id, scope=self.scope),
                                               timeout=WATCH_S + max(1.0, self.lease_s))
            except grpc.RpcError as exc:
                self.rec.error("view", exc)
                await asyncio.sleep(0.1)
                continue
            if not view.unchanged:
                self.saw(view)


    async def watch_stream(self) -> None:
        """The view on one Watch stream, as ChiefClient follows it; a new stream after one ends."""
        while True:
            try:
                async for view in self.stub.Watch(pb.ViewRequest(after_epoch=self.epoch, member_id=self.member_id,
                                                                 scope=self.scope)):
                    self.saw(view)
            except grpc.RpcError as exc:
                self.rec.error("view", exc)
            await asyncio.sleep(0.1)

    def saw(self, view: pb.ClusterView) -> None:
        if view.epoch > self.epoch:
            self.epoch = view.epoch
            if self.rec.measuring:
                self.seen.append((view.epoch, time.monotonic()))
                self.rec.views += 1


async def run(address: str, n: int, task_period_s: float, dataset_size: int, scope: int, stream: bool) -> None:
    rec = Recorder()
    dataset = pb.DatasetSpec(size=dataset_size, batch_size=1, epochs=1000, batches_per_task=1)
    workers = [FakeWorker(address, rec, dataset, task_period_s, scope, stream) for _ in range(n)]
    gate = asyncio.Semaphore(JOIN_CONCURRENCY)

    async def join(w: FakeWorker) -> None:
        async with gate:
            await w.join()

    await asyncio.gather(*(join(w) for w in workers))
    loops = [asyncio.create_task(coro) for w in workers for coro in (w.heartbeats(), w.tasks(), w.watch())]
    loop = asyncio.get_running_loop()
    print(f"ready {n}", flush=True)
    cpu0 = wall0 = 0.0
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line == "measure":
            cpu0, wall0 = time.process_time(), time.monotonic()
            rec.measuring = True
        elif line in ("stop", ""):
            break
    rec.measuring = False
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    pending = set(loops)
    while pending:      # again until all end: asyncio.wait_for (3.11) can swallow a cancel that meets its answer
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)
    print(json.dumps({"pid": os.getpid(), "workers": n, "heartbeat_ms": rec.heartbeat_ms, "tasks_ms": rec.tasks_ms,
                      "errors": rec.errors, "views": rec.views, "rejoins": rec.rejoins, "cpu_s": cpu, "wall_s": wall,
                      "seen": [w.seen for w in workers]}), flush=True)
    await asyncio.gather(*(w.channel.close() for w in workers))


def main() -> None:
    address, n, task_period_s, dataset_size = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    scope = pb.ViewScope.Value(sys.argv[5].upper()) if len(sys.argv) > 5 else pb.ROUTING
    stream = (sys.argv[6] if len(sys.argv) > 6 else "stream") == "stream"
    asyncio.run(run(address, n, task_period_s, dataset_size, scope, stream))


if __name__ == "__main__":
    main()
