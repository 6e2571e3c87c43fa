"""The pure parts of bench/tta.py: its cases, the time to target read off an accuracy curve, the data
order of DDP's ranks, and the summary over rounds. No torch, no processes: tests/unit/test_tta.py."""
from __future__ import annotations

import dataclasses
import random
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

DDP = "ddp-gloo"


@dataclass(frozen=True)
class Case:
    """A shoal case, ``CODEC[/PULL][@SHARDS:WINDOW][+server-momentum]`` as in bench/mlp.py
    (``bf16/bf16@32:2``): the gradient codec, the pull codec, the shards (None: one per server), the
    push window (0: off), and whether the momentum stays on the servers for a sparse codec
    (``Trainer(momentum_correction=False)``; by default the workers keep it)."""
    codec: str
    pull_codec: str = "none"
    shards: int | None = None
    window: int = 0
    server_momentum: bool = False

    def name(self, mode: str, ps: int) -> str:
        return (f"shoal-{mode}-{self.codec}" + (f"-pull-{self.pull_codec}" if self.pull_codec != "none" else "")
                + (f"-shards{self.shards}" if self.shards not in (None, ps) else "")
                + (f"-window{self.window}" if self.window else "")
                + ("-server-momentum" if self.server_momentum else ""))


SERVER_MOMENTUM = "+server-momentum"


def parse_case(spec: str) -> Case:
    """``CODEC[/PULL][@SHARDS:WINDOW][+server-momentum]``; a ValueError names what is wrong (argparse shows it)."""
    server_momentum = spec.endswith(SERVER_MOMENTUM)
    case = _parse_case(spec[:-len(SERVER_MOMENTUM)] if server_momentum else spec, spec)
    return dataclasses.replace(case, server_momentum=True) if server_momentum else case


def _parse_case(text: str, spec: str) -> Case:
    codecs, at, pipe = text.partition("@")
    codec, _, pull = codecs.partition("/")
    if not codec or (codecs.count("/") and not pull) or codecs.count("/") > 1:
        raise ValueError(f"case {spec!r}: expected CODEC[/PULL][@SHARDS:WINDOW]")
    if not at:
        return Case(codec, pull or "none")
    shards, colon, window = pipe.partition(":")
    try:
        n, w = int(shards), int(window)
    except ValueError:
        raise ValueError(f"case {spec!r}: expected @SHARDS:WINDOW with two integers, got {pipe!r}") from None
    if not colon or n < 1 or w < 0:
        raise ValueError(f"case {spec!r}: SHARDS must be >= 1 and WINDOW >= 0, got {pipe!r}")
    return Case(codec, pull or "none", n, w)


@dataclass(frozen=True)
class Point:
    """One evaluation: training seconds so far, test accuracy, the evaluating process's steps, everyone's."""
    seconds: float
    accuracy: float
    steps: int
    steps_all: int


def time_to_target(curve: Sequence[Point], target: float) -> Point | None:
    """The first evaluation whose accuracy reached ``target`` (not the best one); None if none did."""
    return next((p for p in curve if p.accuracy >= target), None)


def outcome(curve: Sequence[Point], target: float) -> dict:
    """What a case's round reports about its curve."""
    hit = time_to_target(curve, target)
    return {"reached": hit is not None,
            "seconds": None if hit is None else round(hit.seconds, 2),
            "steps": None if hit is None else hit.steps,
            "steps_all": None if hit is None else hit.steps_all,
            "best_accuracy": round(max(p.accuracy for p in curve), 4) if curve else None,
            "evals": len(curve),
            "curve": [[round(p.seconds, 2), round(p.accuracy, 4), p.steps_all] for p in curve]}


def ratio(ddp_seconds: float | None, seconds: float | None) -> float | None:
    """DDP's time over the case's (> 1: shoal reached the target sooner); None unless both reached it."""
    if not ddp_seconds or not seconds:
        return None
    return round(ddp_seconds / seconds, 3)


def rank_batches(size: int, batch: int, world: int, rank: int, epoch: int, seed: int = 0) -> list[int]:
    """The batches (index b: samples [b*batch, (b+1)*batch)) DDP rank ``rank`` trains on in ``epoch``: the
    full batches in a seeded order, dealt in turn, every rank the same number (all-reduce needs it)."""
    full = size // batch
    order = list(range(full))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[:full // world * world][rank::world]


class Clock:
    """Training seconds: wall time since it started, less the time it was stopped for evaluation."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self.start = now()
        self.stopped_s = 0.0

    def seconds(self) -> float:
        return self._now() - self.start - self.stopped_s

    @contextmanager
    def stopped(self) -> Iterator[None]:
        t = self._now()
        try:
            yield
        finally:
            self.stopped_s += self._now() - t


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def median_cores(per_round: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    """Each process's median cores over the rounds (rounds where it could not be read are left out)."""
    names = dict.fromkeys(k for r in per_round for k in r)
    return {k: _median([r[k] for r in per_round if r.get(k) is not None]) for k in names}


def summarize(case: str, rounds: Sequence[dict]) -> dict:
    """The summary of one case over its rounds: each round a dict with ``seconds``, ``steps``,
    ``steps_all``, ``cores`` and (not for DDP) ``ratio_vs_ddp``, as :func:`outcome` and tta.py make them."""
    reached = [r for r in rounds if r.get("seconds") is not None]
    out = {"summary": case, "rounds": len(rounds), "reached": len(reached),
           "median_seconds": _median([r["seconds"] for r in reached]),
           "seconds_per_round": [r.get("seconds") for r in rounds],
           "median_steps": _median([r["steps"] for r in reached]),
           "median_steps_all": _median([r["steps_all"] for r in reached]),
           "cores_used": median_cores([r.get("cores") or {} for r in rounds])}
    if case != DDP:
        ratios = [r.get("ratio_vs_ddp") for r in rounds]
        out["median_ratio_vs_ddp"] = _median([x for x in ratios if x is not None])
        out["ratio_per_round"] = ratios
    return out
