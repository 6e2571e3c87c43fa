"""The autoscaler over a whole job: workers wanted (the chief's desired count) and workers live, sampled
from the chief's job stats twice a second while ``shoal local --autoscale`` runs the digits example.

Prints one JSON object a sample-change and a summary (decisions, the largest count, whether it ever went
back up after coming down, the count at the end), and with ``--png`` draws the trace.

    .venv/bin/python bench/autoscale_trace.py [--epochs 4] [--png bench/autoscale_trace.png]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml

from _local import DIGITS

from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import open_channel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max-workers", type=int, default=4)
    p.add_argument("--tasks-per-worker", type=float, default=6)
    p.add_argument("--cooldown", default="5s")
    p.add_argument("--scale-out-after", default="2s")
    p.add_argument("--png", default="")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-autoscale-") as tmp:
        job = Path(tmp) / "job.yaml"
        job.write_text(yaml.safe_dump({
            "train": {"batch_size": 16}, "cluster": {"lease_seconds": 2},
            "autoscaling": {"min_workers": 1, "max_workers": args.max_workers, "target": "queue",
                            "tasks_per_worker": args.tasks_per_worker, "cooldown": args.cooldown,
                            "scale_out_after": args.scale_out_after}}))
        run = Path(tmp) / "run"
        log = open(Path(tmp) / "local.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "local", "--ps", "1", "--workers", "1",
                                 "--autoscale", "--config", str(job), "--run-dir", str(run), "--mode", "async",
                                 DIGITS, "--epochs", str(args.epochs), "--hidden", "64", "--step-delay", "0.02"],
                                stdout=log, stderr=subprocess.STDOUT)
        t0, trace, stub, channel = time.monotonic(), [], None, None
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                if stub is None:
                    address = run / "chief.address"
                    if not address.exists():
                        continue
                    channel = open_channel(address.read_text().strip())
                    stub = pb_grpc.ChiefStub(channel)
                try:
                    s = stub.GetJobStats(pb.Empty(), timeout=2)
                except grpc.RpcError:
                    continue
                desired = s.metrics.get("autoscale_desired_workers")
                row = (round(time.monotonic() - t0, 1), None if desired is None else int(desired), s.workers_live,
                       s.tasks_done, s.tasks_total)
                if not trace or row[1:] != trace[-1][1:]:
                    print(json.dumps(dict(zip(("t", "wanted", "live", "tasks_done", "tasks_total"), row))), flush=True)
                trace.append(row)
                decisions = list(s.autoscale_decisions)
        finally:
            if channel is not None:
                channel.close()
            rc = proc.wait()
        wanted = [w for _, w, *_ in trace if w is not None]
        came_down = False
        went_up_again = False
        for a, b in zip(wanted, wanted[1:]):
            came_down = came_down or b < a
            went_up_again = went_up_again or (came_down and b > a)
        print(json.dumps({"case": "summary", "rc": rc, "samples": len(trace), "max_wanted": max(wanted, default=0),
                          "wanted_at_end": wanted[-1] if wanted else None, "went_up_after_coming_down": went_up_again,
                          "decisions": decisions}))
        if args.png:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(8, 3.5))
            ts = [t for t, *_ in trace]
            ax.step(ts, [w if w is not None else 0 for _, w, *_ in trace], where="post", label="workers wanted")
            ax.step(ts, [live for _, _, live, *_ in trace], where="post", label="workers live")
            ax2 = ax.twinx()
            ax2.plot(ts, [d / t if t else 0 for *_, d, t in trace], color="gray", alpha=0.5, label="tasks done")
            ax2.set_ylabel("share of tasks done")
            ax.set_xlabel("seconds since start")
            ax.set_ylabel("workers")
            ax.legend(loc="upper left")
            ax.set_title("shoal local --autoscale (queue target), digits")
            fig.tight_layout()
            fig.savefig(args.png, dpi=100)


if __name__ == "__main__":
    main()
