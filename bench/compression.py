"""Gradient compression on the digits example: bytes sent and accuracy against ``none``.

Each compressor trains the same job (2 ps, 2 workers, sync, same epochs and
seed); reports the gradient bytes pushed relative to ``none`` and the final
test accuracy next to ``none``'s, in the same run. One JSON object per case.

    .venv/bin/python bench/compression.py [--codecs none fp16 bf16 int8 topk sign topk+lz4]
"""
from __future__ import annotations

import argparse
import json

from _local import run_local


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", nargs="+", default=["none", "fp16", "bf16", "int8", "topk", "sign", "topk+lz4"])
    p.add_argument("--mode", default="sync")
    p.add_argument("--epochs", type=int, default=15)
    args = p.parse_args()
    base = None
    for codec in args.codecs:
        s = run_local(["--ps", "2", "--workers", "2", "--mode", args.mode, "--compression", codec],
                      ["--epochs", str(args.epochs), "--seed", "0"])
        per_step = s["bytes_pushed"] / s["steps"]
        if base is None:
            base = (per_step, s["test_accuracy"])
        print(json.dumps({"case": codec, "mode": args.mode, "steps": s["steps"],
                          "push_bytes_per_step": int(per_step),
                          "reduction_vs_none": round(base[0] / per_step, 1),
                          "test_accuracy": round(s["test_accuracy"], 4),
                          "accuracy_points_vs_none": round(100 * (s["test_accuracy"] - base[1]), 2),
                          "exactly_once": s.get("exactly_once")}), flush=True)


if __name__ == "__main__":
    main()
