"""``shoal worker`` with its imports done before it is let in, so a test picks the moment it joins.

    python prewarmed.py GATE shoal-cli-args...

Imports what examples/digits.py needs (torch, NumPy, scikit-learn, shoal.worker: ~10 s on a busy
2-core host), writes ``GATE.ready``, waits for the file GATE, then runs ``shoal`` with the arguments,
each ``@gate`` among them replaced by the gate file's text (e.g. the chief's address, which a test
knows only once the job runs). A worker started at the chosen moment instead could still be
importing when the job ended (tests/system/test_elastic.py's late worker was, under load).
"""
import sys
import time
from pathlib import Path

import numpy  # noqa: F401
import sklearn.datasets  # noqa: F401
import sklearn.model_selection  # noqa: F401
import torch  # noqa: F401
import torch.nn.functional  # noqa: F401

import shoal.worker  # noqa: F401
from shoal.cli.main import main

GIVE_UP_S = 600.0

gate = Path(sys.argv[1])
Path(f"{gate}.ready").write_text("imported\n")
deadline = time.monotonic() + GIVE_UP_S
while not gate.exists():
    if time.monotonic() > deadline:
        sys.exit(f"prewarmed: {gate} did not appear within {GIVE_UP_S:.0f} s")
    time.sleep(0.02)
text = gate.read_text().strip()
sys.exit(main([text if a == "@gate" else a for a in sys.argv[2:]]))
