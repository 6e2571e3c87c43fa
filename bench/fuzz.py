"""Longer fuzzing than CI: hypothesis-made requests at every RPC of the chief and the ps and at the TCP
data channel of a live token job (tests/integration/fuzzing.py), reporting cases and failures.

A failure is a call answered INTERNAL/UNKNOWN, or one that changed the job (members, routing, tasks,
metrics, the shard's weights, optimizer state, version or push counts). At the end: whether every role
still answers, and how much this process's memory grew. One JSON object per target, then a total.

    .venv/bin/python bench/fuzz.py [--cases 300] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import grpc
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests"),
                str(Path(__file__).resolve().parent.parent / "tests" / "integration")]

from fuzzing import (BAD_CODES, CHIEF_METHODS, DATA_METHODS, PS_METHODS, STREAMING, Target,  # noqa: E402
                     data_frames, messages, rss_mb, tcp_messages)
from shoal.net import tcp_channel as tc  # noqa: E402


def run(name: str, strategy, probe, cases: int, seed_value: int) -> dict:
    counts = {"cases": 0, "failures": 0, "codes": {}}
    examples: list[str] = []

    @seed(seed_value)
    @settings(max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def check(value):
        counts["cases"] += 1
        ok, code = probe(value)
        counts["codes"][code] = counts["codes"].get(code, 0) + 1
        if not ok:
            counts["failures"] += 1
            if len(examples) < 3:
                examples.append(repr(value)[:200])

    t0 = time.monotonic()
    check()
    return {"target": name, **counts, "seconds": round(time.monotonic() - t0, 1), "examples": examples}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=300, help="cases per target (22 RPCs and the data channel)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    t = Target.start()
    rss0 = rss_mb()
    results = []

    def grpc_probe(where, method, cred, wrap):
        def probe(value):
            before = t.state()
            code = t.call(where, method, wrap(value), cred)
            changed = method != "Join" and t.state() != before
            return code not in BAD_CODES and not changed, code.name
        return probe

    for m, kind in sorted(CHIEF_METHODS.items()):
        results.append(run(f"chief.{m}", messages(kind), grpc_probe("chief", m, t.worker, lambda v: [v]),
                           args.cases, args.seed))
    for m, (_, kind) in sorted(PS_METHODS.items()):
        results.append(run(f"ps.{m}", messages(kind), grpc_probe("ps", m, t.worker, lambda v: [v]),
                           args.cases, args.seed))
    for m, kind in sorted(DATA_METHODS.items()):
        size = 3 if m in STREAMING else 1
        results.append(run(f"ps.data.{m}", st.lists(data_frames(kind), min_size=1, max_size=size),
                           grpc_probe("ps", m, t.ps, lambda v: v), args.cases, args.seed))

    def tcp_probe(value):
        chunks, hello = value
        before = t.state()
        kinds, _ = t.tcp(chunks, hello)
        bad = any(tc.status_code(k) in BAD_CODES for k in kinds) or (not hello and tc.OK in kinds)
        return not bad and t.state() == before, "closed" if not kinds else tc.status_code(kinds[-1]).name

    results.append(run("ps.tcp", st.tuples(st.lists(tcp_messages(), min_size=1, max_size=3), st.booleans()),
                       tcp_probe, args.cases, args.seed))
    for r in results:
        print(json.dumps(r), flush=True)
    alive = t.alive()
    grew = round(rss_mb() - rss0, 1)
    t.stop()
    print(json.dumps({"total_cases": sum(r["cases"] for r in results),
                      "failures": sum(r["failures"] for r in results), "alive": alive, "rss_growth_mb": grew,
                      "internal": sum(r["codes"].get(grpc.StatusCode.INTERNAL.name, 0) for r in results)}))


if __name__ == "__main__":
    main()
