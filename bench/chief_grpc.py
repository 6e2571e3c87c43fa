"""The real chief over gRPC on loopback with many fake workers (issue 17, part 2).

Per size N, one fresh chief started as ``shoal chief`` starts it (its own process, a journal, port 0,
4 shards, ``--recovery fast``: the fake parameter servers hold no data, so a lapsed ps lease must not
stop the job and end the case), 4 parameter-server members joined through the real ``ChiefClient`` (heartbeats and a
view watch in threads; no data plane), and N fake workers (bench/_fleet.py: no torch) spread over
``--procs`` processes on asyncio, each with its own channel: join, heartbeat every lease/4,
``GetTasks`` every ``--task-period`` s (a dataset of 100 tasks per worker, so no data epoch ends
in the window: its end, and workers going idle, are view changes too), and a view watch always open.

After all have joined and settled, a measured window of ``--window`` seconds in which
``--changes`` view changes are triggered by this process, alternately an extra member joining and
leaving: a server (``--trigger ps``, the default: what wakes a worker's ROUTING watch) or a worker
(``--trigger worker``, with ``--scope full``: fake workers that watch every member, as all did
before routing views). It prints one JSON object per case:

- heartbeat and GetTasks latency p50/p99/max (ms, as the fake workers' clients saw it: an asyncio
  loop with hundreds of members adds its own scheduling delay, so the fleet's CPU is reported too);
- view propagation per change: from just before the triggering RPC until the last watcher has a
  view newer than the epoch just before it (``time.monotonic`` is system-wide on Linux); the max
  over changes;
- the chief's CPU (its process's utime+stime per wall second of the window), and the fake workers'
  and this process's CPU over the same window, to see what the 2 shared cores bound; and the time the
  chief's threads spent runnable but waiting for a CPU (``/proc/PID/task/*/schedstat``) per wall
  second, with the host's load average: a chief that waits for a CPU more than it runs is bounded by
  the host, not by its own work;
- the chief's RSS before the workers joined, after, and the growth per worker;
- the RPC errors the fleet saw while measuring (deadline exceeded, unavailable...), and how many fake
  workers had to join again because their lease lapsed (``rejoins``).

    .venv/bin/python bench/chief_grpc.py                          # 100, 500, 1000 workers: ~3 min
    .venv/bin/python bench/chief_grpc.py --sizes 1000 --window 30 --label after --out after.jsonl
    .venv/bin/python bench/chief_grpc.py --plot bench/chief_scale/chief_grpc.png before.jsonl after.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NUM_PS = 4
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK        # utime, stime


def proc_runqueue_wait_s(pid: int) -> float:
    """Seconds the process's live threads spent runnable but waiting for a CPU (schedstat's second
    field; threads that ended are not counted)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def proc_threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))], 2)

    return {"n": len(s), "p50": q(0.50), "p99": q(0.99), "max": round(s[-1], 2)}


def wait_until(pred, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {deadline_s:.0f}s")
        time.sleep(0.05)


def start_chief(tmp: Path, extra: list[str], tree: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``shoal chief`` on port 0; ``tree``: from that checkout instead (its roles linked under shoal/, as
    scripts/mutate.py lays a scratch tree out), for a before/after comparison in one run."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if tree is not None:        # and run from there: `python -m` puts the current directory first
        env["PYTHONPATH"] = str(tree)
    port_file = tmp / "chief.port"
    log = open(tmp / "chief.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "--log-level", "warning", "chief",
                             "--bind", "127.0.0.1:0", "--port-file", str(port_file),
                             "--journal", str(tmp / "chief.db"), "--num-shards", str(NUM_PS),
                             "--recovery", "fast", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree)
    try:
        wait_until(lambda: proc.poll() is not None or (port_file.exists() and port_file.read_text().strip()),
                   60, "chief port file")
    except RuntimeError:
        proc.kill()
        raise
    if proc.poll() is not None:
        raise RuntimeError("chief exited: " + (tmp / "chief.log").read_text())
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Fleet:
    """One fake-worker process (bench/_fleet.py) and a thread reading its lines."""

    def __init__(self, address: str, n: int, task_period_s: float, dataset_size: int, log, scope: str,
                 heartbeats: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_fleet.py"), address, str(n), str(task_period_s),
                                      str(dataset_size), scope, heartbeats], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    @property
    def ready(self) -> bool:
        return any(x.startswith("ready") for x in self.lines)

    def result(self) -> dict | None:
        return next((json.loads(x) for x in self.lines if x.startswith("{")), None)


def run_case(n: int, args) -> dict:
    import grpc

    from shoal.chief_client import ChiefClient
    from shoal.proto import shoal_pb2 as pb
    from shoal.proto import shoal_pb2_grpc as pb_grpc

    tmp = Path(tempfile.mkdtemp(prefix="shoal-chief-grpc-"))
    chief, address = start_chief(tmp, args.chief_arg, args.chief_tree)
    fleets: list[Fleet] = []
    extra_ps = None         # the extra server of --trigger ps (a ChiefClient)
    ps: list[ChiefClient] = []
    try:
        for i in range(NUM_PS):
            c = ChiefClient(address, pb.PS, host="bench", address_advertised=f"127.0.0.1:{40000 + i}")
            c.join()
            c.start_background()
            ps.append(c)
        time.sleep(1.0)
        rss_before, threads_before = proc_rss(chief.pid), proc_threads(chief.pid)
        log = open(tmp / "fleet.log", "w")
        per = [n // args.procs + (1 if i < n % args.procs else 0) for i in range(args.procs)]
        t_join = time.monotonic()
        fleets = [Fleet(address, k, args.task_period, 100 * n, log, args.scope, args.heartbeats) for k in per if k]
        wait_until(lambda: all(f.ready for f in fleets) or any(f.proc.poll() is not None for f in fleets),
                   120 + n / 5, "fleet joined")
        if not all(f.ready for f in fleets):
            raise RuntimeError("a fleet process exited: " + (tmp / "fleet.log").read_text()[-3000:])
        join_s = time.monotonic() - t_join
        time.sleep(args.settle)
        rss_after, threads_after = proc_rss(chief.pid), proc_threads(chief.pid)

        channel = grpc.insecure_channel(address)
        stub = pb_grpc.ChiefStub(channel)
        layout = pb.ModelLayout(tensors=[pb.TensorSpec(name="w", shape=[1000], dtype="float32")])
        cpu_chief0, cpu_fleet0 = proc_cpu_s(chief.pid), sum(proc_cpu_s(f.proc.pid) for f in fleets)
        wait_chief0 = proc_runqueue_wait_s(chief.pid)
        load0 = open("/proc/loadavg").read().split()[0]
        cpu_self0, t0 = time.process_time(), time.monotonic()
        for f in fleets:
            f.send("measure")
        changes: list[tuple[str, float, int]] = []       # (what, monotonic time of the trigger, epoch it made)
        extra = ""
        trigger_errors: list[str] = []
        gap = args.window / (args.changes + 1)
        for k in range(args.changes):
            time.sleep(max(0.0, t0 + gap * (k + 1) - time.monotonic()))
            try:
                # a watcher has seen the change when it holds a view newer than the epoch before it: a
                # routing watch is answered with the epoch of its answer, which worker churn moves on
                before = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=30).epoch
                t = time.monotonic()
                if not extra and args.trigger == "ps":  # a worker's watch is woken by servers, not workers;
                    # the extra server heartbeats, or its lease would lapse before it leaves (a change too)
                    extra_ps = ChiefClient(address, pb.PS, host="trigger", address_advertised="127.0.0.1:49999")
                    extra_ps.join()
                    extra_ps.start_background()
                    extra, what = extra_ps.member_id, "ps join"
                elif not extra:
                    req = pb.JoinRequest(role=pb.WORKER, host="trigger", layout=layout)
                    extra, what = stub.Join(req, timeout=30).member_id, "worker join"
                elif args.trigger == "ps":
                    extra_ps.leave()
                    extra_ps.close()
                    extra, what = "", "ps leave"
                else:
                    stub.Leave(pb.LeaveRequest(member_id=extra), timeout=30)
                    extra, what = "", "worker leave"
                epoch = before + 1
            except grpc.RpcError as exc:        # e.g. a chief whose job stopped: said in the row
                trigger_errors.append(f"{exc.code().name}: {exc.details()}"[:300])
                continue
            changes.append((what, t, epoch))
        time.sleep(max(0.0, t0 + args.window - time.monotonic()))
        wall = time.monotonic() - t0
        cpu_chief = proc_cpu_s(chief.pid) - cpu_chief0
        cpu_fleet = sum(proc_cpu_s(f.proc.pid) for f in fleets) - cpu_fleet0
        cpu_self = time.process_time() - cpu_self0
        wait_chief = proc_runqueue_wait_s(chief.pid) - wait_chief0
        for f in fleets:
            f.send("stop")
        wait_until(lambda: all(f.result() is not None or f.proc.poll() is not None for f in fleets), 120,
                   "fleet results")
        results = [f.result() for f in fleets]
        if any(r is None for r in results):
            raise RuntimeError("a fleet gave no result: " + (tmp / "fleet.log").read_text()[-3000:])
        channel.close()
    finally:
        for c in ps + ([extra_ps] if extra_ps is not None else []):
            c.close()
        for f in fleets:
            try:
                f.proc.stdin.close()
            except OSError:
                pass
            stop(f.proc)
        stop(chief)
        log_tail = (tmp / "chief.log").read_text()[-500:]
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    seen = [s for r in results for s in r["seen"]]
    props = []
    for what, t, epoch in changes:
        firsts = [next((ts for e, ts in w if e >= epoch), None) for w in seen]
        missing = sum(1 for x in firsts if x is None)
        got = [x - t for x in firsts if x is not None]
        props.append({"change": what, "epoch": epoch, "missing": missing,
                      "last_ms": round(1e3 * max(got), 1) if got else None,
                      "median_ms": round(1e3 * sorted(got)[len(got) // 2], 1) if got else None})
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    lasts = [p["last_ms"] for p in props if p["last_ms"] is not None]
    return {
        "workers": n, "procs": len(fleets), "scope": args.scope, "trigger": args.trigger, "heartbeats": args.heartbeats,
        "chief_tree": str(args.chief_tree or ""), "window_s": round(wall, 1), "join_all_s": round(join_s, 1),
        "heartbeat_ms": percentiles([x for r in results for x in r["heartbeat_ms"]]),
        "get_tasks_ms": percentiles([x for r in results for x in r["tasks_ms"]]),
        "view_change_to_last_watcher_ms": {"max": max(lasts) if lasts else None,
                                          "all_seen": all(p["missing"] == 0 for p in props), "changes": props},
        "chief_cpu_per_wall_s": round(cpu_chief / wall, 3),
        "fleet_cpu_per_wall_s": round(cpu_fleet / wall, 3),
        "coordinator_cpu_per_wall_s": round(cpu_self / wall, 3),
        "chief_runqueue_wait_per_wall_s": round(wait_chief / wall, 3),
        "host_cpus": os.cpu_count(), "loadavg_at_start": load0, "loadavg_at_end": open("/proc/loadavg").read().split()[0],
        "chief_rss_before_mb": round(rss_before / 2**20, 1), "chief_rss_after_mb": round(rss_after / 2**20, 1),
        "chief_rss_kb_per_worker": round((rss_after - rss_before) / n / 1024, 1),
        "chief_threads_before": threads_before, "chief_threads_after": threads_after,
        "rejoins": sum(r["rejoins"] for r in results), "errors": errors, "trigger_errors": trigger_errors,
        "chief_log_tail": log_tail if trigger_errors else "",
    }


def plot(out: Path, files: list[Path]) -> None:
    """Heartbeat latency, view propagation and the chief's CPU against workers, one style per label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axv, axc) = plt.subplots(1, 3, figsize=(15, 4.5))
    series: dict[str, list[dict]] = {}              # one line per label (a file's name when unlabelled)
    for f in files:
        for x in f.read_text().splitlines():
            if x.strip():
                row = json.loads(x)
                series.setdefault(row.get("label") or f.stem, []).append(row)
    for fi, (label, rows) in enumerate(series.items()):
        rows = sorted(rows, key=lambda r: r["workers"])
        color = f"C{fi % 10}"
        xs = [r["workers"] for r in rows]
        for q, style, marker in (("p50", ":", "o"), ("p99", "-", "s")):
            ax.plot(xs, [r["heartbeat_ms"].get(q) for r in rows], style, color=color, marker=marker,
                    label=f"{q} ({label})")
        axv.plot(xs, [r["view_change_to_last_watcher_ms"]["max"] for r in rows], "-", color=color, marker="o",
                 label=label)
        axc.plot(xs, [r["chief_cpu_per_wall_s"] for r in rows], "-", color=color, marker="o", label=label)
    for a, title, ylabel in ((ax, "heartbeat latency (answered calls)", "ms"),
                             (axv, "view change to the last watcher", "ms"),
                             (axc, "the chief's CPU per wall second", "s/s")):
        a.set_xlabel("fake workers")
        a.set_ylabel(ylabel)
        a.set_title(title)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    ax.set_yscale("log")
    axv.set_yscale("log")
    fig.suptitle("chief over gRPC on loopback, 2 cores shared with the fake workers (labels and load: bench/RESULTS.md)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100,500,1000", help="fake worker counts")
    ap.add_argument("--procs", type=int, default=4, help="fake-worker processes")
    ap.add_argument("--window", type=float, default=20.0, help="measured seconds per case")
    ap.add_argument("--changes", type=int, default=4, help="view changes triggered in the window")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after the last join before measuring")
    ap.add_argument("--task-period", type=float, default=5.0, help="seconds between a fake worker's GetTasks")
    ap.add_argument("--heartbeats", choices=("stream", "unary"), default="stream",
                    help="fake workers heartbeat and watch the view on streams (KeepAlive, Watch), as members "
                         "do; or with single calls and long polls, as before them (and for a chief tree "
                         "without them)")
    ap.add_argument("--scope", choices=("routing", "full"), default="routing",
                    help="what the fake workers watch: routing (as a worker since issue 17's routing views) or "
                         "full (every member, as before)")
    ap.add_argument("--trigger", choices=("ps", "worker"), default="",
                    help="the view changes made in the window: an extra server or worker joining and leaving "
                         "(default: ps for --scope routing, worker for full)")
    ap.add_argument("--chief-tree", type=Path,
                    help="run the chief from this checkout (e.g. `git worktree add /tmp/old REV`, then link "
                         "proto ps worker chief under its shoal/) to compare it with this one in one run")
    ap.add_argument("--chief-arg", action="append", default=[], help="extra argument for `shoal chief` (repeat)")
    ap.add_argument("--keep", action="store_true", help="keep each case's chief log, journal and fleet log")
    ap.add_argument("--label", default="", help="tag every line (e.g. before/after)")
    ap.add_argument("--out", type=Path, help="also append the JSON lines here")
    ap.add_argument("--plot", type=Path, help="plot the JSON-lines files given as arguments to this PNG and exit")
    ap.add_argument("files", nargs="*", type=Path)
    args = ap.parse_args()
    args.trigger = args.trigger or ("ps" if args.scope == "routing" else "worker")
    if args.trigger == "worker" and args.scope == "routing":
        ap.error("a worker joining or leaving wakes no routing watch (chief/views.py): "
                 "--trigger worker needs --scope full")
    if args.plot:
        plot(args.plot, args.files)
        return
    for n in (int(s) for s in args.sizes.split(",")):
        row = run_case(n, args)
        if args.label:
            row["label"] = args.label
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
