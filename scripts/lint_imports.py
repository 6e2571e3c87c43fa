"""Checks the import contracts in pyproject.toml ([tool.importlinter]) against the source tree.

The roles live in top-level folders mapped into the ``shoal`` namespace
(``package-dir`` in pyproject.toml), which import-linter cannot see through an
editable install: it walks the ``shoal`` folder only. So this script lays the
package out as it is installed, in a temporary folder, and lints that.

    python scripts/lint_imports.py [--root DIR]

Exit status 0 when every contract is kept, 1 with import-linter's report of the
offending imports otherwise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path


def stage(root: Path, dest: Path) -> None:
    """Copies every package's ``.py`` files to ``dest`` at its installed path."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = tool.get("package-dir", {})
    for package in tool["packages"]:
        src = root / mapping.get(package, package.replace(".", "/"))
        out = dest.joinpath(*package.split("."))
        out.mkdir(parents=True, exist_ok=True)
        for f in src.glob("*.py"):
            shutil.copy2(f, out / f.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                   help="the project's root (holds pyproject.toml)")
    args = p.parse_args(argv)
    root = args.root.resolve()
    with tempfile.TemporaryDirectory(prefix="shoal-layers-") as tmp:
        stage(root, Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        lint = Path(sys.executable).with_name("lint-imports")
        cmd = [str(lint) if lint.exists() else "lint-imports", "--config", str(root / "pyproject.toml"), "--no-cache"]
        return subprocess.run(cmd, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
