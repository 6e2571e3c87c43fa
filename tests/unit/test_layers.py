"""The import contracts (pyproject.toml, [tool.importlinter]) hold, and they bite."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
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


_CIRCLES = """
import json, grimp
graph = grimp.build_graph("shoal", cache_dir=None)
circles = []
for module in sorted(graph.modules):
    # a module is in a circle when one of the modules it imports leads back to it
    back = {m for m in graph.find_modules_directly_imported_by(module)
            if graph.find_shortest_chain(importer=m, imported=module)}
    if back:
        circles.append(sorted({module, *back}))
print(json.dumps(circles))
"""


def _import_circles(root: Path) -> list[list[str]]:
    """Groups of modules that import one another, in the package as installed (TYPE_CHECKING imports count)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from lint_imports import stage
    finally:
        sys.path.pop(0)
    with tempfile.TemporaryDirectory(prefix="shoal-circles-") as tmp:
        stage(root, Path(tmp))
        r = subprocess.run([sys.executable, "-c", _CIRCLES], cwd=tmp, env={**os.environ, "PYTHONPATH": tmp},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


def test_no_module_imports_itself_through_others():
    assert _import_circles(ROOT) == []


def test_a_circle_is_found(tmp_path):
    root = _copy_project(tmp_path)
    tables = root / "shoal" / "state" / "layout.py"
    tables.write_text(tables.read_text() + "\nfrom shoal.state import checkpoint  # a circle\n")
    assert any("shoal.state.layout" in c for c in _import_circles(root))


def test_the_core_top_level_stays_small():
    """Concerns live in sub-packages (net, security, state, settings, observe); a handful of modules sit beside them."""
    top = [p.stem for p in (ROOT / "shoal").glob("*.py") if p.stem != "__init__"]
    assert len(top) <= 8, sorted(top)
