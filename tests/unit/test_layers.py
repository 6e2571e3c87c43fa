"""The import contracts (pyproject.toml, [tool.importlinter]) hold, and they bite."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lint_imports.py"


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True,
                          timeout=120)


def _copy_project(dest: Path) -> Path:
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for folder in ("shoal", "cli", "proto", "ps", "worker", "chief"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_tree_keeps_every_contract():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_a_role_importing_another_role_is_refused_with_the_line(tmp_path):
    root = _copy_project(tmp_path)
    trainer = root / "worker" / "trainer.py"
    trainer.write_text(trainer.read_text() + "\nfrom shoal.ps.shard import Shard  # crossing\n")
    r = _lint(root)
    assert r.returncode == 1
    assert "BROKEN" in r.stdout and "shoal.worker.trainer -> shoal.ps.shard" in r.stdout


def test_the_core_importing_a_command_is_refused(tmp_path):
    root = _copy_project(tmp_path)
    (root / "shoal" / "net" / "wire.py").write_text((root / "shoal" / "net" / "wire.py").read_text()
                                           + "\nfrom shoal.cli import status  # crossing\n")
    r = _lint(root)
    assert r.returncode == 1 and "shoal.net.wire -> shoal.cli" in r.stdout


def test_a_core_module_missing_from_the_layers_is_refused(tmp_path):
    root = _copy_project(tmp_path)
    (root / "shoal" / "newthing.py").write_text("X = 1\n")
    r = _lint(root)
    assert r.returncode == 1 and "shoal.newthing" in r.stdout
