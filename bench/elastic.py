"""Elasticity: a worker joining a running job, and a worker SIGKILLed in one.

Reports the time from a new worker's join (its Trainer starting) to its first
accepted gradient (first finished step), the process start-up before that
(interpreter, torch imports, data), and the longest gap between the other
workers' steps during the join and during the kill, against their median
step time before the event, plus how long the chief took to drop the killed
worker (polled through its status API) and how long after the kill the
others' next step finished (the longest gap includes the part of a sync
round spent waiting for the victim while it was still alive). The killed worker is not restarted
unless ``--restart`` (a restarted process importing torch on this 2-core host
would slow the others down in the very window measured). Prints one JSON object per mode.

    .venv/bin/python bench/elastic.py [--modes async sync] [--hidden 1024 --depth 3] [--restart]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.py")


def read_steps(pattern: str) -> dict[str, list[float]]:
    out = {}
    for path in glob.glob(pattern):
        with open(path) as f:
            out[path] = [float(x) for x in f.read().splitlines() if x and not x.startswith("#")]
    return out


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {what}")


def workers_live(chief: str) -> int:
    from shoal.proto import shoal_pb2 as pb
    from shoal.proto import shoal_pb2_grpc as pb_grpc
    from shoal.net.rpc import open_channel

    channel = open_channel(chief)
    try:
        return pb_grpc.ChiefStub(channel).GetJobStats(pb.Empty(), timeout=5).workers_live
    finally:
        channel.close()


def gap_stats(times: list[float], start: float, end: float, before: float) -> tuple[float, float]:
    """(longest gap between steps overlapping [start, end], median step time before ``before``)."""
    pre = [b - a for a, b in zip(times, times[1:]) if b <= before][-50:]
    window = [t for t in times if start <= t <= end]
    prev = [t for t in times if t < start][-1:]
    seq = prev + window
    gaps = [b - a for a, b in zip(seq, seq[1:])]
    return (max(gaps) if gaps else float("inf")), (statistics.median(pre) if pre else float("nan"))


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="shoal-elastic-"))
    script = ["--epochs", "10000", "--hidden", str(args.hidden), "--depth", str(args.depth),
              "--step-delay", str(args.step_delay)]
    log = open(tmp / "local.log", "w")
    local = subprocess.Popen([sys.executable, "-m", "shoal.cli", "local", "--ps", "2", "--workers", "2",
                              "--mode", mode, "--lease-seconds", str(args.lease), "--run-dir", str(tmp / "run"),
                              *([] if args.restart else ["--no-restart"]),
                              DIGITS, *script, "--step-log", str(tmp / "orig-{pid}.log")],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(read_steps(str(tmp / "orig-*.log"))) == 2 and
                 all(len(v) > 30 for v in read_steps(str(tmp / "orig-*.log")).values()), 120, "warm-up")
        chief = (tmp / "run" / "chief.address").read_text()
        t_join = time.time()
        joiner = subprocess.Popen([sys.executable, "-m", "shoal.cli", "worker", "--chief", chief, DIGITS, *script,
                                   "--step-log", str(tmp / "join.log")], stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: (tmp / "join.log").exists() and (tmp / "join.log").read_text().strip(), 60, "first step")
        wait_for(lambda: len(read_steps(str(tmp / "join.log")).get(str(tmp / "join.log"), [])) > 0, 60, "first step")
        lines = (tmp / "join.log").read_text().splitlines()
        t_trainer = float(next(x for x in lines if x.startswith("# trainer")).split()[2])
        t_first = float(next(x for x in lines if not x.startswith("#")))
        time.sleep(2.0)
        pids = json.loads((tmp / "run" / "pids.json").read_text())
        live_before = workers_live(chief)
        t_kill = time.time()
        os.kill(pids["worker1"], signal.SIGKILL)
        wait_for(lambda: workers_live(chief) < live_before, args.lease * 3, "the chief to drop the killed worker")
        t_dropped = time.time()
        time.sleep(max(0.0, t_kill + args.lease + 3.0 - time.time()))
        steps = read_steps(str(tmp / "orig-*.log"))
        victim_log = str(tmp / f"orig-{pids['worker1']}.log")
        survivor = next(v for k, v in steps.items() if k != victim_log)
        join_gap, median = gap_stats(survivor, t_trainer, t_first + 1.0, t_join)
        # the same statistic over a window of the same length before anything happened: what this
        # host's scheduling noise alone gives (on 2 shared cores it is far from one median step)
        span = t_first + 1.0 - t_trainer
        quiet_gap, _ = gap_stats(survivor, t_join - span, t_join, t_join)
        startup_gap, _ = gap_stats(survivor, t_join, t_trainer, t_join)
        kill_gap, median_k = gap_stats(survivor, t_kill, t_kill + args.lease + 2.0, t_kill)
        # the interval straddling the kill includes time the round waited for the victim while it
        # was still alive; how long the kill itself held the others is kill -> their next step
        next_step = min(t for t in survivor if t > t_kill) - t_kill
        model_mb = (64 * args.hidden + (args.depth - 1) * args.hidden ** 2 + 10 * args.hidden) * 4 / 1e6
        return {"case": f"elastic-{mode}", "mode": mode, "model_mb": round(model_mb, 1), "lease_s": args.lease,
                "process_start_to_first_gradient_s": round(t_first - t_join, 3),
                "imports_and_data_s": round(t_trainer - t_join, 3),
                "join_to_first_gradient_s": round(t_first - t_trainer, 3),
                "median_step_s": round(median, 4), "step_delay_s": args.step_delay,
                "quiet_longest_gap_s": round(quiet_gap, 4), "quiet_gap_vs_median": round(quiet_gap / median, 2),
                "join_longest_gap_s": round(join_gap, 4), "join_gap_vs_median": round(join_gap / median, 2),
                "startup_gap_vs_median": round(startup_gap / median, 2),
                "kill_to_dropped_s": round(t_dropped - t_kill, 3),
                "kill_to_next_step_s": round(next_step, 4), "kill_next_step_vs_median": round(next_step / median_k, 2),
                "kill_longest_gap_s": round(kill_gap, 4), "kill_gap_vs_median": round(kill_gap / median_k, 2)}
    finally:
        local.send_signal(signal.SIGINT)
        try:
            local.wait(30)
        except subprocess.TimeoutExpired:
            local.kill()
        if "joiner" in locals():
            joiner.kill()
            joiner.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["async", "sync"])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--lease", type=float, default=1.5)
    p.add_argument("--restart", action="store_true", help="let shoal local restart the killed worker")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds each worker sleeps per step, leaving the host CPU to spare")
    args = p.parse_args()
    for mode in args.modes:
        print(json.dumps(run_mode(mode, args)), flush=True)


if __name__ == "__main__":
    main()
