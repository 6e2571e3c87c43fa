"""A running ``shoal chief`` with everything ``shoal local`` turns on (a journal, checkpoints,
TensorBoard, /metrics) has not loaded torch once it serves and writes its TensorBoard events:
neither its imports nor its watcher thread pull it in."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch  # noqa: F401 - loaded here, so the check is seen to find it
from harness import wait_until


def _mapped(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_a_serving_chief_writing_tensorboard_events_has_not_loaded_torch(tmp_path):
    port_file, tb = tmp_path / "chief.port", tmp_path / "tb"
    log = open(tmp_path / "chief.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "chief", "--bind", "127.0.0.1:0",
                             "--port-file", str(port_file), "--journal", str(tmp_path / "chief.db"),
                             "--checkpoint-dir", str(tmp_path / "ckpts"), "--tensorboard", str(tb),
                             "--metrics-port", "0"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_until(lambda: port_file.exists() or proc.poll() is not None, timeout_s=60, what="the chief's port")
        assert proc.poll() is None, (tmp_path / "chief.log").read_text()
        # the watcher's first poll (a second in) opens the event file and writes to it
        wait_until(lambda: any(f.stat().st_size > 0 for f in (tb / "chief").glob("events.out.tfevents.*"))
                   if (tb / "chief").is_dir() else False, timeout_s=30, what="the chief's TensorBoard events")
        maps = _mapped(proc.pid)
        assert "libtorch" not in maps and "/torch/" not in maps, \
            sorted({line.split()[-1] for line in maps.splitlines() if "torch" in line})[:5]
        assert "/torch/" in _mapped(os.getpid())     # the same check finds torch where it is loaded (here)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "chief.log").read_text()
