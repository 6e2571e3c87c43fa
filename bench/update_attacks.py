"""The issue's attacks on a real job: ``shoal local`` trains the digits example clean, then with one
worker pushing a 3e38 gradient and a learning rate of 1e30 (bench/_attack_digits.py), same seed, in the
same run. One JSON object per run: exit status, test accuracy, exactly-once, what the update guard did;
then the attacked run's accuracy against the clean one's.

    .venv/bin/python bench/update_attacks.py [--epochs 3] [--security plain secure] [--mode sync]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOAL = str(Path(sys.executable).parent / "shoal")
SCRIPT = str(ROOT / "bench" / "_attack_digits.py")


def run(attacker: int, args: argparse.Namespace, secure: bool, tag: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"shoal-attack-{tag}-") as d:
        summary = Path(d) / "summary.json"
        cmd = [SHOAL, "local", "--ps", "2", "--workers", "2", "--mode", args.mode, "--run-dir", d,
               "--summary", str(summary), *(["--secure"] if secure else []),
               SCRIPT, "--epochs", str(args.epochs), "--attacker", str(attacker)]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        s = json.loads(summary.read_text()) if summary.exists() else {}
    return {"case": tag, "secure": secure, "rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
            "test_accuracy": s.get("test_accuracy"), "exactly_once": s.get("exactly_once"),
            "replicas_identical": s.get("replicas_identical"), "update_guard": s.get("update_guard"),
            "guard_line": next((ln.strip() for ln in proc.stdout.splitlines()
                                if ln.strip().startswith("update guard")), "")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--mode", default="sync", choices=["sync", "async"])
    p.add_argument("--security", nargs="+", default=["plain"], choices=["plain", "secure"])
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    for sec in args.security:
        secure = sec == "secure"
        clean = run(-1, args, secure, f"clean-{sec}")          # no worker has index -1: all honest
        attacked = run(1, args, secure, f"attacked-{sec}")
        for r in (clean, attacked):
            print(json.dumps(r), flush=True)
        if clean["test_accuracy"] is not None and attacked["test_accuracy"] is not None:
            print(json.dumps({"case": f"accuracy-{sec}", "clean": clean["test_accuracy"],
                              "attacked": attacked["test_accuracy"],
                              "points_lost": round(100 * (clean["test_accuracy"] - attacked["test_accuracy"]), 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
