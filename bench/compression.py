"""Gradient compression on the digits example: bytes sent and accuracy against ``none``.

Each compressor trains the same job (2 ps, 2 workers, sync, same epochs) once
per seed; reports the gradient bytes pushed relative to ``none`` and the final
test accuracy, averaged over the seeds, next to ``none``'s, in the same run. One
JSON object per case. The test set has 450 samples, so one run resolves 0.22
accuracy points, and which gradients share a sync round varies from run to
run: a mean over seeds (each seed also changes the split and the init) is what
tells a codec's effect from that noise.

    .venv/bin/python bench/compression.py [--codecs none fp16 bf16 int8 topk sign topk+lz4] [--seeds 0 1 2]
        [--server-optimizer]
"""
from __future__ import annotations

import argparse
import json
import statistics

from _local import run_local


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", nargs="+", default=["none", "fp16", "bf16", "int8", "topk", "sign", "topk+lz4"])
    p.add_argument("--mode", default="sync")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--script-args", default="", help="more arguments for examples/digits.py, e.g. "
                                                      "'--optimizer sgd --lr 0.05 --momentum 0.9'")
    p.add_argument("--server-optimizer", action="store_true",
                   help="also run each top-k codec with its optimizer's state kept on the server "
                        "(--no-momentum-correction), as case '<codec> server-optimizer'")
    args = p.parse_args()
    cases = [(codec, []) for codec in args.codecs]
    if args.server_optimizer:
        cases += [(f"{codec} server-optimizer", ["--no-momentum-correction"])
                  for codec in args.codecs if codec.startswith("topk")]
    base = None
    for case, extra in cases:
        codec = case.split()[0]
        runs = [run_local(["--ps", "2", "--workers", "2", "--mode", args.mode, "--compression", codec],
                          ["--epochs", str(args.epochs), "--seed", str(seed), *args.script_args.split(), *extra])
                for seed in args.seeds]
        per_step = sum(s["bytes_pushed"] for s in runs) / sum(s["steps"] for s in runs)
        accuracy = statistics.mean(s["test_accuracy"] for s in runs)
        if base is None:
            base = (per_step, accuracy)
        print(json.dumps({"case": case, "mode": args.mode, "script_args": args.script_args, "seeds": args.seeds,
                          "steps": [s["steps"] for s in runs], "push_bytes_per_step": int(per_step),
                          "reduction_vs_none": round(base[0] / per_step, 1),
                          "test_accuracy": round(accuracy, 4),
                          "test_accuracy_per_seed": [round(s["test_accuracy"], 4) for s in runs],
                          "accuracy_points_vs_none": round(100 * (accuracy - base[1]), 2),
                          "exactly_once": all(s.get("exactly_once") for s in runs)}), flush=True)


if __name__ == "__main__":
    main()
