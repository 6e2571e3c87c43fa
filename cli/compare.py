"""``shoal compare``: the same script on the same cluster shape once per mode (or codec), side by side.

    shoal compare --modes sync async ssp --ps 2 --workers 2 --epochs 5 examples/digits.py

Each case is a ``shoal local`` run (its logs in ``<out>/<case>/shoal.log``, its
summary next to them, its TensorBoard runs under ``<out>/tb/<case>``). The
training loss comes from the workers' TensorBoard event files: the table gives
the run's time (start-up included) and its training time (first to last
step), worker steps, model updates (shard versions) and samples per second of
training, the final loss and the metric the script reported, the time each case took to reach a
target loss (by default the worst case's final loss, so every row has one), and
whether every batch was applied at most / exactly once. ``compare.png`` plots
the loss against wall-clock time and against samples, one line per case;
``compare.json`` holds the table and the curves.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, IO

from shoal.errors import InvalidArgument

COLUMNS = ("case", "seconds", "train s", "steps/s", "updates/s", "samples/s", "final loss", "metric", "to target",
           "exactly once")


def parse_budget(text: str | None) -> float:
    """``60``, ``60s``, ``5m``, ``1h`` -> seconds; a clear error otherwise."""
    if not text:
        return 0.0
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m or float(m[1]) <= 0:
        raise InvalidArgument(f"--budget must be a positive time like 60s, 5m or 1h, got {text!r}")
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[m[2]]


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str
    codec: str

    @property
    def name(self) -> str:
        return self.mode if self.codec == "none" else f"{self.mode}+{self.codec}"


def cases(modes: list[str], codecs: list[str]) -> list[Case]:
    out = [Case(m, c) for m, c in itertools.product(modes, codecs)]
    if len({c.name for c in out}) != len(out):
        raise InvalidArgument(f"--modes and --codecs name a case twice: {' '.join(c.name for c in out)}")
    return out


# ---------------------------------------------------------------- curves from TensorBoard


def read_curve(run_dir: Path) -> list[tuple[float, float, int]]:
    """(wall time, loss, samples so far in the whole job) at every worker step of one run, in time order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points: list[tuple[float, str, float, int]] = []
    for worker in sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name != "chief"):
        ea = EventAccumulator(str(worker), size_guidance={"scalars": 0})
        ea.Reload()
        tags = ea.Tags()["scalars"]
        if "train/loss" not in tags:
            continue
        samples = {e.step: int(e.value) for e in ea.Scalars("train/samples")} if "train/samples" in tags else {}
        for e in ea.Scalars("train/loss"):
            points.append((e.wall_time, worker.name, e.value, samples.get(e.step, 0)))
    points.sort()
    latest: dict[str, int] = {}
    out = []
    for wall, worker, loss, seen in points:
        latest[worker] = seen
        out.append((wall, loss, sum(latest.values())))
    return out


def smooth(values: list[float], window: int = 20) -> list[float]:
    """Trailing mean over ``window`` points (the losses of several workers' batches interleave)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """First time the (smoothed) loss is at or below ``target``; None if never."""
    return next((t for t, loss in curve if loss <= target), None)


# ---------------------------------------------------------------- the table


def row(case: Case, summary: dict[str, Any], curve: list[tuple[float, float, int]], metric: str) -> dict[str, Any]:
    seconds = summary.get("seconds") or 0.0
    versions = summary.get("shard_versions") or {}
    updates = max(versions.values(), default=0)
    t0 = curve[0][0] if curve else 0.0
    train_s = curve[-1][0] - t0 if len(curve) > 1 else seconds     # first to last step: rates leave out start-up
    losses = smooth([p[1] for p in curve])
    ledger = summary.get("ledger") or {}
    at_most_once = bool(ledger) and all(e.get("max_count", 0) <= 1 for entries in ledger.values() for e in entries)
    return {"case": case.name, "mode": case.mode, "codec": case.codec, "seconds": seconds,
            "train_seconds": train_s,
            "steps_per_s": summary.get("steps", 0) / train_s if train_s else 0.0,
            "updates_per_s": updates / train_s if train_s else 0.0,
            "samples_per_s": summary.get("samples", 0) / train_s if train_s else 0.0,
            "final_loss": losses[-1] if losses else None, "metric": summary.get(metric),
            "exactly_once": bool(summary.get("exactly_once")), "at_most_once": at_most_once,
            "curve": {"seconds": [p[0] - t0 for p in curve], "samples": [p[2] for p in curve], "loss": losses}}


def add_targets(rows: list[dict[str, Any]], target: float | None) -> float | None:
    """Time to ``target`` loss per row; the default target is the worst row's final loss."""
    finals = [r["final_loss"] for r in rows if r["final_loss"] is not None and math.isfinite(r["final_loss"])]
    if target is None:
        target = max(finals) if finals else None
    for r in rows:
        c = r["curve"]
        r["time_to_target"] = time_to(list(zip(c["seconds"], c["loss"])), target) if target is not None else None
    return target


def table(rows: list[dict[str, Any]], metric: str, target: float | None) -> str:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    header = list(COLUMNS)
    header[7] = metric
    header[8] = f"to loss {target:.3g}" if target is not None else "to target"
    body = []
    for r in rows:
        once = "yes" if r["exactly_once"] else ("at most (partial)" if r["at_most_once"] else "NO")
        body.append([r["case"], fmt(r["seconds"], ".1f"), fmt(r["train_seconds"], ".1f"), fmt(r["steps_per_s"], ".1f"), fmt(r["updates_per_s"], ".1f"),
                     fmt(r["samples_per_s"], ",.0f"), fmt(r["final_loss"], ".4f"), fmt(r["metric"], ".4f"),
                     fmt(r["time_to_target"], ".1f") + ("s" if r["time_to_target"] is not None else ""), once])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for b in body:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        c = r["curve"]
        a.plot(c["seconds"], c["loss"], label=r["case"])
        b.plot(c["samples"], c["loss"], label=r["case"])
    a.set_xlabel("wall-clock time (s)")
    b.set_xlabel("samples trained (all workers)")
    for ax in (a, b):
        ax.set_ylabel("training loss (mean of the last 20 steps)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- the command


def run_compare(args, job_for, out: IO[str] = sys.stdout) -> int:
    """``job_for(mode)`` builds the JobConfig for one mode (the CLI's flags and job file)."""
    from shoal.cli.local import LocalConfig, run_local

    for noisy in ("tensorboard", "matplotlib"):            # their info lines are not for this terminal
        logging.getLogger(noisy).setLevel(logging.WARNING)
    fix_positionals(args)
    budget = parse_budget(args.budget)
    if args.epochs is not None and args.epochs < 1:
        raise InvalidArgument(f"--epochs must be >= 1, got {args.epochs}")
    if budget and args.epochs is not None:
        raise InvalidArgument("give --budget or --epochs, not both")
    todo = cases(args.modes, args.codecs)
    from shoal.worker.push import GradientEncoder

    for codec in args.codecs:
        GradientEncoder(codec)                            # an unknown codec: the error lists the known ones
    jobs = {m: job_for(m) for m in args.modes}           # every bad flag is reported before anything runs
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    script_args = list(args.script_args)
    if args.epochs is not None:
        script_args += ["--epochs", str(args.epochs)]
    rows = []
    for i, case in enumerate(todo, 1):
        out.write(f"[{i}/{len(todo)}] {case.name}: training ...")
        out.flush()
        run_dir = root / case.name
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = LocalConfig(script=args.script, script_args=tuple(script_args), num_ps=args.ps,
                          num_workers=args.workers, job=jobs[case.mode], compression=case.codec,
                          summary=str(run_dir / "summary.json"), run_dir=str(run_dir),
                          tensorboard=str(root / "tb"), run_name=case.name, drain_s=5.0)
        previous = os.environ.get("SHOAL_TIME_BUDGET")
        if budget:
            os.environ["SHOAL_TIME_BUDGET"] = str(budget)
        try:
            with open(run_dir / "shoal.log", "w") as log:
                code = run_local(cfg, out=log)
        finally:
            if previous is None:
                os.environ.pop("SHOAL_TIME_BUDGET", None)
            else:
                os.environ["SHOAL_TIME_BUDGET"] = previous
        if code != 0 or not (run_dir / "summary.json").exists():
            out.write(f" FAILED (exit {code}); see {run_dir / 'shoal.log'}\n")
            return 1
        summary = json.loads((run_dir / "summary.json").read_text())
        r = row(case, summary, read_curve(root / "tb" / case.name), args.metric)
        rows.append(r)
        out.write(f" {r['seconds']:.1f}s\n")
    target = add_targets(rows, args.target_loss)
    text = table(rows, args.metric, target)
    png = root / "compare.png"
    plot(rows, png, f"{Path(args.script).name}: {args.ps} ps, {args.workers} workers")
    (root / "compare.json").write_text(json.dumps({"target_loss": target, "rows": rows}, indent=1) + "\n")
    out.write("\n" + text + "\n\n")
    out.write(f"plot: {png}\ntable and curves: {root / 'compare.json'}\n"
              f"curves in TensorBoard: tensorboard --logdir {root / 'tb'}\n")
    return 0


def fix_positionals(args) -> None:
    """``--codecs none bf16 train.py``: argparse hands the script to the list before it; take it back."""
    if args.script is None:
        for flag in ("codecs", "modes"):
            values = getattr(args, flag)
            if values and (values[-1].endswith(".py") or Path(values[-1]).is_file()):
                args.script = values.pop()
                break
    if args.script is None:
        raise InvalidArgument("which training script? e.g. shoal compare --modes sync async examples/digits.py")
    from shoal.settings.config import MODES

    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes or not args.codecs:
        raise InvalidArgument(f"--modes takes one or more of {', '.join(MODES)}; got {' '.join(args.modes) or 'none'}")
    if not Path(args.script).is_file():
        raise InvalidArgument(f"training script {args.script!r} does not exist")


def add_parser(sub, job_args) -> None:
    """The ``compare`` sub-command's flags; ``job_args`` adds the job settings every mode shares."""
    from shoal.settings.config import MODES

    p = sub.add_parser("compare", help="run a script once per mode (or codec) and compare them in a table and "
                                       "a plot")
    p.add_argument("--modes", nargs="+", default=["sync", "async"], help=f"modes to compare: {', '.join(MODES)}")
    p.add_argument("--codecs", nargs="+", default=["none"], help="gradient codecs to compare (none, bf16, topk, ...)")
    p.add_argument("--ps", type=int, default=2, help="parameter servers (= shards)")
    p.add_argument("--workers", type=int, default=2, help="workers in each run (default 2)")
    p.add_argument("--budget", default=None, help="stop each run after this long (60s, 5m): workers take no "
                                                   "more tasks, then evaluate and report")
    p.add_argument("--epochs", type=int, default=None, help="passed to the script as --epochs N")
    p.add_argument("--target-loss", type=float, default=None,
                   help="report the time to this training loss (default: the worst case's final loss)")
    p.add_argument("--metric", default="test_accuracy", help="the reported figure to show (default test_accuracy)")
    p.add_argument("--out", default="compare", help="folder for the runs, compare.png and compare.json")
    p.add_argument("--config", help="YAML file with job settings")
    job_args(p)
    p.add_argument("script", nargs="?")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script")
