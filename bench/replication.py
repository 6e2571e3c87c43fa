"""Cost of replicated shards: the digits example with ``--replicas 1`` and ``--replicas 2``, same seed.

Reports worker steps per second of each and the ratio (2 over 1), plus whether
the replicas ended byte-identical. Prints one JSON object per mode.

    .venv/bin/python bench/replication.py [--modes async sync] [--epochs 20] [--hidden 256]
"""
from __future__ import annotations

import argparse
import json

from _local import run_local


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["async", "sync"])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    for mode in args.modes:
        runs = {}
        for replicas in (1, 2):
            s = run_local(["--ps", "2", "--workers", "2", "--mode", mode, "--replicas", str(replicas)],
                          ["--epochs", str(args.epochs), "--hidden", str(args.hidden)])
            runs[replicas] = {"steps_per_s": round(s["steps"] / s["seconds"], 2), "seconds": s["seconds"],
                              "test_accuracy": s.get("test_accuracy"), "replicas_identical": s.get("replicas_identical")}
        print(json.dumps({"case": f"replication-{mode}", "mode": mode, "epochs": args.epochs, "hidden": args.hidden,
                          "replicas_1": runs[1], "replicas_2": runs[2],
                          "ratio_2_vs_1": round(runs[2]["steps_per_s"] / runs[1]["steps_per_s"], 3)}), flush=True)


if __name__ == "__main__":
    main()
