"""Runs ``shoal local`` on the digits example and returns its summary (shared by the benches)."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.py")


def run_local(local_args: list[str], script_args: list[str], timeout_s: float = 600) -> dict:
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        summary = Path(tmp) / "summary.json"
        log = Path(tmp) / "local.log"
        with open(log, "w") as out:
            rc = subprocess.run([sys.executable, "-m", "shoal.cli", "local", "--summary", str(summary),
                                 "--run-dir", str(Path(tmp) / "run"), *local_args, DIGITS, *script_args],
                                stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        if rc != 0:
            raise RuntimeError(f"shoal local failed ({rc}):\n" + log.read_text()[-3000:])
        return json.loads(summary.read_text())
