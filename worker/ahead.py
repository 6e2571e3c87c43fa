"""Overlapped steps: the next step computes while this step's pulls come down.

A plain step ends when every shard's new weights have landed, so a worker's links idle while it
computes and its CPU idles while the last blocks travel. With ``overlap_steps`` (async and ssp
jobs only) a step ends once its pushes are answered: the pulls they started land in a buffer of
their own (:attr:`PullsAhead.landing`) while the next forward and backward pass run on the weights
the step before pulled, and the step after that adopts them (one copy of the model). Each gradient
is then one more step stale, which async training already allows and which every push reports
honestly: it names the version of the weights it was computed on, not the one landing behind it.
That is Pipe-SGD's two-deep pipeline (Li et al., NeurIPS 2018) on a parameter server.

It costs a second copy of the weights on the worker. On CUDA the pulls land in pinned host memory
and move to the device on a side stream while the model computes (worker/staging.py), so this
module would need a device-side landing buffer and an event ordering each copy; not built, and
refused with a clear error rather than run untested.
"""
from __future__ import annotations

import os
from concurrent.futures import Future

import torch

from shoal.errors import InvalidArgument


def overlap_from(value: bool | None, mode: str, device: torch.device) -> bool:
    """Whether steps overlap (None: ``$SHOAL_OVERLAP_STEPS``); a job or device that cannot is an error."""
    if value is None:
        raw = os.environ.get("SHOAL_OVERLAP_STEPS", "").strip().lower()
        if raw not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
            raise InvalidArgument(f"SHOAL_OVERLAP_STEPS must be 1 or 0, got {raw!r}")
        value = raw in ("1", "true", "yes", "on")
    if not value:
        return False
    if mode == "sync":
        raise InvalidArgument("overlap_steps needs an async or ssp job: in a sync job every worker computes "
                              "on its round's result, which cannot arrive while the next step runs")
    if device.type != "cpu":
        raise InvalidArgument(f"overlap_steps runs on CPU models only for now (this model is on {device})")
    return True


class PullsAhead:
    """Where pulls land while the model computes on :attr:`weights`, and the pulls under way.

    ``landing`` holds, for each shard, the version recorded in :attr:`landed` (a delta pull's base).
    :meth:`adopt` makes them the weights; :meth:`wait` collects the pulls started by :meth:`start`.
    """

    def __init__(self, weights: torch.Tensor, ranges: list[tuple[int, int]], versions: dict[int, int]):
        self.weights, self.ranges, self.versions = weights, ranges, versions
        self.landing = weights.clone()
        self.landed: dict[int, int] = dict(versions)   # shard -> the version its landing slice holds
        self.pending: dict[int, Future] = {}           # shard -> its pull, under way

    @staticmethod
    def lanes(order: list[int], window: int) -> dict[int, list[int]]:
        """The shards' pulls split into ``window`` lanes that each pull in turn (0: one lane per shard),
        keyed by their first shard."""
        n = window or len(order)
        lanes = [order[i::n] for i in range(n) if order[i::n]]
        return {lane[0]: lane for lane in lanes}

    def start(self, pulls: dict[int, Future]) -> None:
        if self.pending:
            raise RuntimeError("the previous step's pulls were not collected")
        self.pending = dict(pulls)

    def wait(self) -> None:
        """Waits for every pull under way; the first that failed raises, once all of them ended. A failed
        pull may have written part of its slice: the slice goes back to the weights in use (and their
        version), so nothing half-pulled is ever adopted (the shard's next pull is a whole one)."""
        pending, self.pending = self.pending, {}
        error: BaseException | None = None
        for shard, f in pending.items():
            try:
                f.result()
            except BaseException as exc:      # noqa: BLE001 - raised below, once the others ended
                a, b = self.ranges[shard]
                self.landing[a:b].copy_(self.weights[a:b])
                self.landed[shard] = self.versions[shard]
                error = error or exc
        if error is not None:
            raise error

    def adopt(self) -> None:
        """The landed weights become the ones the model computes on, and ``versions`` (the worker's
        record of its weights' versions, which its pushes name) their versions."""
        self.weights.copy_(self.landing)
        self.versions.update(self.landed)
