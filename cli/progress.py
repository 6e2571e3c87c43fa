"""What ``shoal local`` shows while a job runs, and the few lines it ends with.

On a terminal: one overall tqdm bar (epoch, percent of the job's batches, samples/s,
training loss, ETA) read from the chief every half second, with the children's
warnings and errors printed above it; their full logs go to ``<run-dir>/shoal.log``.
Elsewhere (a pipe, a CI log): every child line, prefixed with its role, as before.

In both, a child's prefix follows its member name: the process ``shoal local`` started
as its second worker becomes ``[worker-0]`` once the chief calls it ``worker-0``.
"""
from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import grpc

from shoal.observe.alerts import count_lines

LOG_LINE = re.compile(r"^\[(?P<name>[^\]]+)\] (?P<rest>.*)$", re.S)
JOINED = re.compile(r"joined chief \S+ as (?P<member>\S+)")
LEVEL = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?P<level>[A-Z]+) ")
SHOWN_LEVELS = {"WARNING", "ERROR", "CRITICAL"}


class MemberNames:
    """Maps the supervisor's name for a child (``worker1``) to its member id (``worker-0``) once it joins."""

    def __init__(self) -> None:
        self._names: dict[str, str] = {}
        self._lock = threading.Lock()

    def rewrite(self, line: str) -> str:
        m = LOG_LINE.match(line)
        if not m:
            return line
        name, rest = m["name"], m["rest"]
        joined = JOINED.search(rest)
        with self._lock:
            if joined:
                self._names[name] = joined["member"]
            shown = self._names.get(name, name)
        return f"[{shown}] {rest}"

    def get(self, name: str) -> str:
        with self._lock:
            return self._names.get(name, name)


class Console:
    """The file-like ``out`` of ``shoal local``: child lines in, what a person should see out."""

    def __init__(self, out: IO[str] = sys.stdout, interactive: bool | None = None):
        self.out = out
        self.interactive = _is_tty(out) if interactive is None else interactive
        self.names = MemberNames()
        self.log_path = ""            # on a terminal: where every child line goes
        self._log: IO[str] | None = None
        self._lock = threading.Lock()
        self._bar: Any = None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self._hidden = 0
        self._closed = False
        self._redirect = None

    def open_log(self, path: Path) -> None:
        """On a terminal, keeps every child line (the bar hides their info lines) in ``path``."""
        if self.interactive:
            self._log = open(path, "a", buffering=1)
            self.log_path = str(path)

    # -------------------------------------------------------------- the stream of child lines

    def write(self, text: str) -> int:
        for line in text.splitlines(keepends=True):
            self._line(self.names.rewrite(line))
        return len(text)

    def _line(self, line: str) -> None:
        if not self.interactive:
            with self._lock:
                self.out.write(line)
            return
        if self._log is not None:
            self._log.write(line)
        if self._closed or not shown_on_terminal(line):
            self._hidden += 1            # after close: the cluster's teardown, kept in the log only
            return
        self.message(line.rstrip("\n"))

    def message(self, text: str) -> None:
        """A line for the person at the terminal, printed above the bar when there is one."""
        with self._lock:
            if self._bar is not None:
                self._bar.write(text, file=self.out)
            else:
                self.out.write(text + "\n")
                self.out.flush()

    def flush(self) -> None:
        with self._lock:
            self.out.flush()

    # -------------------------------------------------------------- the bar

    def follow(self, chief_address: str, interval_s: float = 0.5) -> None:
        """On a terminal, starts the bar and a thread that refreshes it from the chief's job stats."""
        if not self.interactive or self._poller is not None:
            return
        from tqdm import tqdm

        from tqdm.contrib.logging import logging_redirect_tqdm

        with self._lock:
            self._bar = tqdm(total=1, file=self.out, desc="starting", dynamic_ncols=True, leave=True,
                             bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")
            self._redirect = logging_redirect_tqdm()      # the supervisor's own log lines go above the bar
            self._redirect.__enter__()
        self._poller = threading.Thread(target=self._poll, args=(chief_address, interval_s),
                                        name="progress", daemon=True)
        self._poller.start()

    def _poll(self, chief_address: str, interval_s: float) -> None:
        from shoal.proto import shoal_pb2 as pb
        from shoal.proto import shoal_pb2_grpc as pb_grpc
        from shoal.net.rpc import open_channel

        channel = open_channel(chief_address)
        stub = pb_grpc.ChiefStub(channel)
        rate = Rate()
        try:
            while not self._stop.wait(interval_s):
                try:
                    stats = stub.GetJobStats(pb.Empty(), timeout=2)
                except grpc.RpcError:
                    continue                   # a chief restarting: the bar waits
                self._update(stats, rate.update(stats.totals.samples, time.monotonic()))
        finally:
            channel.close()

    def _update(self, stats, samples_per_s: float | None) -> None:
        fields = bar_fields(stats, samples_per_s)
        with self._lock:
            bar = self._bar
            if bar is None:
                return
            bar.total = max(1, fields["total"])
            bar.n = min(fields["done"], bar.total)
            bar.set_description_str(fields["desc"], refresh=False)
            bar.set_postfix_str(fields["postfix"], refresh=False)
            bar.refresh()

    def close(self) -> None:
        """Ends the bar; from now on child lines on a terminal go to the log only (see :meth:`close_log`)."""
        self._closed = True
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=3)
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if self._redirect is not None:
                self._redirect.__exit__(None, None, None)
                self._redirect = None

    def close_log(self) -> None:
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None


class Rate:
    """Samples per second over the last few polls (a job's first seconds are start-up, not training)."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self._points: list[tuple[float, int]] = []

    def update(self, samples: int, now: float) -> float | None:
        self._points.append((now, samples))
        while len(self._points) > 2 and now - self._points[0][0] > self.window_s:
            self._points.pop(0)
        (t0, s0), (t1, s1) = self._points[0], self._points[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 >= s0 else None


def bar_fields(stats, samples_per_s: float | None) -> dict[str, Any]:
    """What the bar shows for one ``JobStats``: progress in batches, the epoch, samples/s and loss."""
    per_epoch, epochs = stats.batches_per_epoch, stats.epochs
    total = per_epoch * epochs if per_epoch and epochs else stats.tasks_total
    done_tasks = stats.tasks_done
    done = round(total * done_tasks / stats.tasks_total) if stats.tasks_total else 0
    epoch = min(stats.completed_epochs + 1, epochs) if epochs else 0
    desc = f"epoch {epoch}/{epochs}" if epochs else "waiting for workers"
    post = [f"{stats.workers_live} worker{'s' if stats.workers_live != 1 else ''}"]
    if samples_per_s is not None:
        post.append(f"{samples_per_s:,.0f} samples/s")
    loss = stats.metrics.get("train_loss")
    if loss is not None:
        post.append(f"loss {loss:.4g}")
    return {"total": total, "done": done, "desc": desc, "postfix": ", ".join(post)}


def shown_on_terminal(line: str) -> bool:
    """A child's warnings, errors, tracebacks and plain prints; not its info and debug log lines."""
    m = LOG_LINE.match(line)
    rest = m["rest"] if m else line
    level = LEVEL.match(rest)
    return level is None or level["level"] in SHOWN_LEVELS


def result_lines(summary: dict[str, Any], ok: bool, summary_path: str = "", log_path: str = "") -> list[str]:
    """The few lines a run ends with: outcome, accuracy, time, rates, exactly-once, where the details are."""
    seconds = summary.get("seconds") or 0.0
    steps, samples = summary.get("steps"), summary.get("samples")
    head = (f"training {'finished' if ok else 'FAILED'} in {seconds:.1f}s: {summary.get('mode', '?')} mode, "
            f"{summary.get('ps', '?')} ps, {summary.get('workers', '?')} workers")
    lines = [head]
    if "test_accuracy" in summary:
        source = f" ({summary['test_accuracy_from']})" if summary.get("test_accuracy_from") else ""
        lines.append(f"  test accuracy   {summary['test_accuracy']:.4f}{source}")
    if "train_loss" in summary:
        lines.append(f"  train loss      {summary['train_loss']:.4f}")
    if steps is not None and seconds:
        lines.append(f"  steps           {steps} ({steps / seconds:.1f}/s), {samples} samples "
                     f"({samples / seconds:,.0f}/s)")
    if "exactly_once" in summary:
        lines.append(f"  exactly once    {_exactly_once(summary)}"
                     + ("" if summary.get("replicas_identical") is None else
                        f"; replicas identical: {'yes' if summary['replicas_identical'] else 'NO'}"))
    guard = summary.get("update_guard")
    if guard:       # the model was protected: said, and the run still ends 0
        who = ", ".join(f"{w} {n}" for w, n in sorted(guard["refused"].items()))
        lines.append(f"  update guard    protected the model: {sum(guard['refused'].values())} update(s) refused, "
                     f"clipped or rolled back ({who})" + (f"; expelled {', '.join(guard['expelled'])}"
                                                          if guard["expelled"] else ""))
    failed = {k: v for k, v in summary.get("worker_exit_codes", {}).items() if v != 0}
    if failed:
        lines.append("  worker exits    " + ", ".join(f"{k}={v}" for k, v in sorted(failed.items())))
    alerts = count_lines(summary)          # the lines the roles printed ("alert: ..."), not the kinds
    if alerts:
        lines.append(f"  alerts          {alerts} (see the summary's alert/* entries)")
    if summary.get("tensorboard"):
        lines.append(f"  tensorboard     tensorboard --logdir {summary['tensorboard']}")
    if summary_path:
        lines.append(f"  summary         {summary_path}")
    if log_path:
        lines.append(f"  logs            {log_path}")
    return lines


def _exactly_once(summary: dict[str, Any]) -> str:
    """yes / NO / UNKNOWN, with why, and where the records of a shard whose server was gone came from."""
    holds, why = summary["exactly_once"], summary.get("exactly_once_detail", "")
    text = "yes" if holds else "UNKNOWN" if holds is None else "NO"
    if holds and summary.get("batches_skipped"):
        text += f", with {summary['batches_skipped']} skipped (NaN/Inf gradients, --nonfinite skip)"
    if why and not holds:
        text += f" ({why.removeprefix('unknown: ')})"
    from_ckpt = sorted(k for k, v in summary.get("ledger_sources", {}).items() if v == "checkpoint")
    if from_ckpt:
        step = summary.get("ledger_checkpoint", {}).get("step", "?")
        text += f"; shard(s) {', '.join(from_ckpt)} read from the final checkpoint (step {step}), no live copy answered"
    return text


def _is_tty(out: IO[str]) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False
