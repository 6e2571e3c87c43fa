"""Starts a shard's push as soon as backward() has produced every gradient in it.

Like DDP's buckets and BytePS's partitions: a post-accumulate-grad hook on
each parameter counts down the parameters each shard still waits for; when a
shard's count reaches zero its push is submitted to the shard pool while
autograd keeps computing the earlier layers. The last layers sit at the end
of the flat vector, so the last shard usually leaves first.

Assumes one backward() per step; pass ``overlap=False`` to the Trainer when
accumulating over micro-batches or editing gradients (clipping) between
backward() and step().
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Sequence

import torch

from shoal.state.layout import ModelLayout, ShardPlan


class GradReadiness:
    def __init__(self, params: Sequence[torch.nn.Parameter], grad_views: Sequence[torch.Tensor],
                 layout: ModelLayout, plan: ShardPlan, launch: Callable[[int], Future]):
        self._params = list(params)
        self._views = list(grad_views)
        self._launch = launch
        self._lock = threading.Lock()
        self._shards_of: list[list[int]] = [
            sorted({seg.shard for seg in plan.segments(off, spec.numel)})
            for spec, off in zip(layout.specs, layout.offsets)]
        self._needed = [sum(1 for shards in self._shards_of if k in shards) for k in range(plan.num_shards)]
        self._left: list[int] = []
        self.launched: dict[int, Future] = {}
        self.armed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self._params)]

    def arm(self) -> None:
        """A new step begins (called from zero_grad)."""
        with self._lock:
            self._left = list(self._needed)
            self.launched = {}
            self.armed = True

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def on_ready(p: torch.Tensor) -> None:
            if p.grad is not None and p.grad.data_ptr() != self._views[i].data_ptr():
                self._views[i].copy_(p.grad)   # a new gradient (after zero_grad): into the flat buffer
                p.grad = self._views[i]
            with self._lock:
                if not self.armed:
                    return
                ready = []
                for k in self._shards_of[i]:
                    self._left[k] -= 1
                    if self._left[k] == 0:
                        ready.append(k)
            for k in ready:
                self.launched[k] = self._launch(k)
        return on_ready

    def take(self) -> dict[int, Future]:
        """The pushes started during backward; disarms until the next step."""
        with self._lock:
            self.armed = False
            out, self.launched = self.launched, {}
            return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
