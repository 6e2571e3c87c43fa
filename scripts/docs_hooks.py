"""MkDocs hooks (mkdocs.yml ``hooks:``): the reference pages generated from the code, and the checks that keep them whole.

Generated at build time, never written by hand:

- ``reference/cli.md``: ``shoal --help`` and every sub-command's help, from the argparse parser
  (``shoal.cli.main.build_parser``);
- ``reference/job-file.md``: every job-file key, from the schema (``shoal.settings.jobfile.KEYS``) and the
  ``alerts`` thresholds (``shoal.observe.alerts.AlertConfig``);
- ``reference/metrics.md``: every Prometheus metric, from the registry in ``shoal/observe/metrics.py`` and the
  state gauges the chief and the parameter servers yield at scrape time;
- ``benchmarks/RESULTS.md`` and ``benchmarks/NOTEBOOK.md``: ``bench/RESULTS.md`` and ``bench/NOTEBOOK.md``
  as they are in the repository (those files stay where the figures are recorded).

In strict mode (``mkdocs build --strict``, ``make docs``, ``tests/unit/test_docs.py``) every warning logged
here fails the build: a public name of the API reference without a docstring, a command-line option
without help text, a job-file key without what it allows, a metric without a description.

``shoal.worker``, ``shoal.chief`` and ``shoal.ps`` live in their own folders (``pyproject.toml``'s
``package-dir``), which griffe's static loader cannot follow; the hook lays a tree of symbolic links
shaped like the installed package under ``build/docs-src`` for mkdocstrings to read (no import, no torch).
It holds what the API reference shows and no more (``shoal/__init__.py`` and ``shoal.worker``): griffe
reads every module of a package it is given, and the whole of shoal with its generated protocol costs
seconds a build. A name from elsewhere in shoal added to the reference needs its folder added here.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.shoal")
ROOT = Path(__file__).resolve().parent.parent
SOURCE_TREE = ROOT / "build" / "docs-src"          # mkdocs.yml: mkdocstrings' python handler reads it
_SUBPACKAGES = {"worker": "worker"}            # pyproject's package-dir: shoal.worker is the folder worker/
_TOP_FILES = ("__init__.py",)                  # of shoal/ itself

# the public surface the API reference shows: module -> the names whose docstrings must exist
API_SURFACE = {
    "shoal.worker": ("distribute", "DistributedOptimizer", "DistributedSampler", "Trainer", "ShardedEmbedding",
                     "ShardedEmbeddingBag",
                     "table_options"),
    "shoal.worker.optimizer": ("_Distributed",),      # what DistributedOptimizer returns
}


def lay_source_tree(root: Path = ROOT, dest: Path = SOURCE_TREE) -> Path:
    """``dest/shoal`` as the installed package looks, as far as the API reference reads it (links)."""
    pkg = dest / "shoal"
    if dest.exists():
        shutil.rmtree(dest)
    pkg.mkdir(parents=True)
    for name in _TOP_FILES:
        (pkg / name).symlink_to(root / "shoal" / name)
    for name, folder in _SUBPACKAGES.items():
        (pkg / name).symlink_to(root / folder)
    return dest


lay_source_tree()       # before mkdocstrings' handler looks for it


@contextmanager
def _plain_environment():
    """Help text as a user sees it with no ``SHOAL_*`` variables set, 100 columns wide, no colour."""
    saved = dict(os.environ)
    try:
        for key in list(os.environ):
            if key.startswith("SHOAL_") or key == "TF_CONFIG":
                del os.environ[key]
        os.environ.update(COLUMNS="100", NO_COLOR="1")
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    from shoal.cli.main import build_parser

    with _plain_environment():
        parser = build_parser()
        commands = _subcommands(parser)
        lines = ["# Command-line reference", "",
                 "Generated from the argparse parser (`shoal.cli.main.build_parser`) each time the site is built,",
                 "so it is the help the installed `shoal` prints. Every flag also reads a `SHOAL_*` variable",
                 "and the job file ([job-file reference](job-file.md)); the command line wins.", "",
                 "## shoal", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in sorted(commands.items()):
            for action in sub._actions:
                if action.help is None and action.option_strings and not isinstance(action, argparse._HelpAction):
                    log.warning("shoal %s %s has no help text (cli)", name, "/".join(action.option_strings))
            lines += [f"## shoal {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def _flags(dests: tuple[str, ...]) -> str:
    return ", ".join(f"`--{d.replace('_', '-')}`" for d in dests if d not in ("script", "script_args")) or ""


def job_file_reference() -> str:
    from shoal.observe.alerts import AlertConfig
    from shoal.settings.jobfile import _LEGACY_FLAT, _OPEN_SECTIONS, KEYS

    lines = ["# Job-file reference", "",
             "Generated from the schema in `shoal/settings/jobfile.py` (`KEYS`) and `shoal/observe/alerts.py` (`AlertConfig`) each",
             "time the site is built. How the file is used: [The job file](../operations/job-file.md).", "",
             "Precedence, lowest first: the file, the `SHOAL_*` variable, the flag. A key a command does not",
             "take is ignored by it; an unknown key, a wrong type or a bad value is one line naming the key path.", "",
             "| key | type | allowed | flag | variable | commands |", "|---|---|---|---|---|---|"]
    for path, key in KEYS.items():
        if not key.allowed:
            log.warning("job-file key %s says nothing of what is allowed (shoal/settings/jobfile.py KEYS)", path)
        commands = ", ".join(key.commands) if key.commands else ("each with the flag" if key.dests else "file only")
        lines.append(f"| `{path}` | {key.kind} | {key.allowed.replace('|', '/')} | {_flags(key.dests)} | "
                     f"{'`' + key.env_name() + '`' if key.env_name() else ''} | {commands} |")
    for field in dataclasses.fields(AlertConfig):
        lines.append(f"| `alerts.{field.name}` | {field.type} | default {field.default:g} (0 turns a spike check off) | "
                     f"`--alert-{field.name.replace('_', '-')}` | `SHOAL_ALERT_{field.name.upper()}` | worker, local |")
    lines.append("| `logging.tensorboard` | str | a directory for TensorBoard runs | `--tensorboard` | "
                 "`SHOAL_TENSORBOARD` | chief, worker, local |")
    lines += ["", "Free-form sections: " + ", ".join(f"`{s}`" for s in _OPEN_SECTIONS)
              + " (`optimizer`: the optimizer's own hyper-parameters, checked against its `torch.optim` class; "
                "`resources`: Kubernetes `requests` and `limits` quantities).", "",
              "The older flat form still loads: " + ", ".join(f"`{old}` = `{new}`" for old, new in _LEGACY_FLAT.items())
              + ".", ""]
    return "\n".join(lines)


def _state_gauges() -> list[tuple[str, str, list[str], str]]:
    """``metrics.gauge("shoal_...", "doc", [labels])`` calls in the roles' telemetry (read at scrape time)."""
    found = []
    for role in ("chief", "ps", "worker"):
        tree = ast.parse((ROOT / role / "telemetry.py").read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "gauge" and node.args
                    and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("shoal_")):
                doc = node.args[1]
                text = doc.value if isinstance(doc, ast.Constant) else ast.unparse(doc)
                labels = []
                label_node = node.args[2] if len(node.args) > 2 else next(
                    (k.value for k in node.keywords if k.arg == "labels"), None)
                if isinstance(label_node, ast.List):
                    labels = [e.value for e in label_node.elts if isinstance(e, ast.Constant)]
                found.append((node.args[0].value, text, labels, role))
    return found


def _metric_sections(path: Path) -> dict[str, str]:
    """metric name -> who updates it, from the ``# ---- <who>: ...`` comment above it in shoal/observe/metrics.py."""
    owner, found = "", {}
    for line in path.read_text().splitlines():
        if line.startswith("# ---- "):
            owner = line[len("# ---- "):].split(":")[0].strip()
        elif owner and (m := re.search(r'^[A-Z_]+ = (?:Counter|Gauge|Histogram)\("(shoal_[a-z_]+)"', line)):
            found[m.group(1).removesuffix("_total")] = owner
    return found


def metric_reference() -> str:
    from prometheus_client import Counter, Gauge, Histogram

    import shoal.observe.metrics as metrics

    lines = ["# Metric reference", "",
             "Generated from the registry in `shoal/observe/metrics.py` and the state gauges in `chief/telemetry.py` and",
             "`ps/telemetry.py` each time the site is built. Every role serves them on `/metrics` with",
             "`--metrics-port` ([Monitoring](../monitoring.md#prometheus)).", "",
             "| metric | type | labels | what | from |", "|---|---|---|---|---|"]
    kinds = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}
    sections = _metric_sections(Path(metrics.__file__))
    for obj in vars(metrics).values():
        kind = next((k for cls, k in kinds.items() if isinstance(obj, cls)), None)
        if kind is None:
            continue
        name = obj._name + ("_total" if kind == "counter" and not obj._name.endswith("_total") else "")
        if not obj._documentation:
            log.warning("metric %s has no description (shoal/observe/metrics.py)", name)
        labels = ", ".join(f"`{label}`" for label in obj._labelnames)
        source = sections.get(obj._name, "")
        if obj is metrics.ALERTS:
            source = "worker (loss, gradient), chief (worker behind)"
        lines.append(f"| `{name}` | {kind} | {labels} | {obj._documentation} | {source} |")
    for name, doc, labels, role in _state_gauges():
        if not doc:
            log.warning("metric %s has no description (%s/telemetry.py)", name, role)
        lines.append(f"| `{name}` | gauge | {', '.join(f'`{x}`' for x in labels)} | {doc} | {role} (at scrape) |")
    return "\n".join(lines) + "\n"


def check_api_docstrings() -> None:
    """A warning (a failed strict build) for each public name of the API reference without a docstring."""
    import griffe

    loader = griffe.GriffeLoader(search_paths=[str(SOURCE_TREE)])
    for module_name, names in API_SURFACE.items():
        module = loader.load(module_name)
        for name in sorted({str(n) for n in module.exports or ()} - set(names)):
            log.warning("public name %s.%s (in __all__) is missing from the API reference "
                        "(scripts/docs_hooks.py API_SURFACE, docs/reference/api.md)", module_name, name)
        for name in names:
            obj = module[name]
            obj = obj.final_target if obj.is_alias else obj         # shoal.worker re-exports its classes
            if not obj.docstring:
                log.warning("public name %s.%s has no docstring", module_name, name)
            if obj.is_class:
                for member_name, member in obj.members.items():
                    if (member_name.startswith("_") or member.is_alias
                            or member.is_attribute and "property" not in member.labels):
                        continue
                    if not member.docstring:
                        log.warning("public name %s.%s.%s has no docstring", module_name, name, member_name)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """The API page renders every name of :data:`API_SURFACE` (``::: module.name``)."""
    if page.file.src_uri == "reference/api.md":
        for module_name, names in API_SURFACE.items():
            for name in names:
                if not re.search(rf"^::: {re.escape(module_name)}\.{re.escape(name)}\s*$", markdown, re.M):
                    log.warning("docs/reference/api.md does not render %s.%s", module_name, name)
    return markdown


def _repo_file(config, dest: str, source: Path) -> File:
    return File.generated(config, dest, content=source.read_text(encoding="utf-8"))


def on_files(files: Files, config) -> Files:
    check_api_docstrings()
    for dest, content in (("reference/cli.md", cli_reference()), ("reference/job-file.md", job_file_reference()),
                          ("reference/metrics.md", metric_reference())):
        files.append(File.generated(config, dest, content=content))
    files.append(_repo_file(config, "benchmarks/RESULTS.md", ROOT / "bench" / "RESULTS.md"))
    files.append(_repo_file(config, "benchmarks/NOTEBOOK.md", ROOT / "bench" / "NOTEBOOK.md"))
    return files
