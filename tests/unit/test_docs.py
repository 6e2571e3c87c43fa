"""The documentation site builds in strict mode (a broken link, a missing page, an undocumented public name
fails it), its reference pages are generated from the code, and README.md stays one screen and a half.

The build runs in-process, into a temporary folder, with no network (mkdocs.yml asks for no web fonts and
no plugin that fetches anything); the failure cases build a copy of the site's inputs with one thing broken.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import pytest

import mkdocs.config as mkdocs_config
from mkdocs.commands.build import build
from mkdocs.exceptions import Abort

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _build(tmp_path: Path, config_file: Path) -> Path:
    """``mkdocs build --strict`` into ``tmp_path/site`` (as ``make docs``, without Material's notice)."""
    site = tmp_path / "site"
    saved = os.environ.get("NO_MKDOCS_2_WARNING")
    os.environ["NO_MKDOCS_2_WARNING"] = "1"
    try:
        cfg = mkdocs_config.load_config(config_file=str(config_file), site_dir=str(site), strict=True)
        cfg.plugins.on_startup(command="build", dirty=False)
        try:
            build(cfg)
        finally:
            cfg.plugins.on_shutdown()
    finally:
        if saved is None:
            os.environ.pop("NO_MKDOCS_2_WARNING", None)
        else:
            os.environ["NO_MKDOCS_2_WARNING"] = saved
    return site


def _text(html: Path) -> str:
    return re.sub(r"<[^>]+>", " ", html.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("docs"), ROOT / "mkdocs.yml")


def test_the_site_builds_strict_with_every_page(site):
    for page in ("index", "getting-started", "guide/training-loop", "guide/modes", "guide/network",
                 "operations/roles", "operations/job-file", "operations/docker", "operations/kubernetes",
                 "operations/autoscaling", "operations/checkpoints", "monitoring", "security", "architecture",
                 "internals/testing", "benchmarks/RESULTS", "benchmarks/NOTEBOOK", "reference/api",
                 "reference/cli", "reference/job-file", "reference/metrics"):
        assert (site / f"{page}.html").is_file(), page


def test_the_references_are_generated_from_the_code(site):
    from shoal.cli.main import build_parser
    from shoal.settings.jobfile import KEYS
    from shoal.observe.metrics import metric_names

    cli = _text(site / "reference/cli.html")
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in commands:
        assert f"shoal {name}" in cli, name
    assert "--push-window" in cli and "--checkpoint-interval" in cli
    jobfile = _text(site / "reference/job-file.html")
    for path in KEYS:
        assert path in jobfile, path
    assert "alerts.loss_spike" in jobfile
    metrics = _text(site / "reference/metrics.html")
    for name in metric_names() + ["shoal_live_workers", "shoal_shard_bytes", "shoal_autoscale_desired_workers"]:
        assert name in metrics, name
    api = _text(site / "reference/api.html")
    for name in ("DistributedOptimizer", "DistributedSampler", "Trainer", "set_epoch", "synchronize", "skip_batch"):
        assert name in api, name


def test_bench_results_are_the_site_benchmarks_page(site):
    page = _text(site / "benchmarks/RESULTS.html")
    assert "bench/mlp.py --link 1gbit" in page          # each table's command is on the page
    assert "bench/modes.py (issue 4)" in _text(site / "benchmarks/NOTEBOOK.html")   # the notebook, as it is


def _broken_tree(tmp_path: Path, change) -> Path:
    """A copy of the site's inputs with one thing broken; returns its mkdocs.yml."""
    tree = tmp_path / "tree"
    for name in ("docs", "scripts", "bench", "shoal", "cli", "worker", "chief", "ps", "proto"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "chief_scale"),
                        symlinks=True)
    for name in ("mkdocs.yml", "SECURITY.md"):
        shutil.copy(ROOT / name, tree / name)
    change(tree)
    return tree / "mkdocs.yml"


def test_a_broken_link_a_missing_page_and_an_undocumented_public_name_each_fail_the_build(tmp_path, caplog):
    def change(tree):
        with open(tree / "docs" / "index.md", "a") as f:
            f.write("\n[gone](no-such-page.md)\n")
        (tree / "docs" / "security.md").unlink()
        sampler = tree / "worker" / "sampler.py"
        text = sampler.read_text()
        doc_start = text.index('"""', text.index("def set_epoch"))
        doc_end = text.index('"""', doc_start + 3) + 3
        sampler.write_text(text[:doc_start] + "pass" + text[doc_end:])
        with open(tree / "worker" / "__init__.py", "a") as f:
            f.write("\nExtra = Trainer\n__all__ += ['Extra']\n")

    config = _broken_tree(tmp_path, change)
    with caplog.at_level(logging.WARNING), pytest.raises(Abort):
        _build(tmp_path, config)
    assert "'no-such-page.md'" in caplog.text
    assert "'security.md' is included in the 'nav'" in caplog.text
    assert "DistributedSampler.set_epoch has no docstring" in caplog.text
    assert "public name shoal.worker.Extra (in __all__) is missing from the API reference" in caplog.text


def test_the_readme_is_short_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 150
    first_block = next(i for i, line in enumerate(readme) if line.startswith("```"))
    assert readme[first_block + 1].startswith("make run") and readme[first_block + 2].startswith("make test")
