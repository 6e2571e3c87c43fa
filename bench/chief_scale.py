"""The chief's cost curves (issue 17, part 1): its pure state driven by a simulated clock, no gRPC.

Per size (members = workers; 4 parameter servers on top), one process per case, a simulated job:

- every worker joins, then heartbeats once per ``lease / 3`` (counters, task progress, step time:
  what a training worker sends), asks for a task every ``--task-period`` simulated seconds
  (``take_tasks`` with its finished task and the ids it holds, like ``GetTasks`` with
  ``reports_held``), and a few die each simulated second (they stop heartbeating; the lease check
  expires them and a replacement joins, which is also the view change of that second);
- the lease check (``ChiefState.tick``) runs every 0.2 simulated seconds, as the chief's ticker;
- the view is built once per view change; then, after the run, one view change is answered to all N
  watchers as the servicer's ``GetView`` does (built and serialized once per epoch), against the old
  per-watcher build and serialization (``fanout_old_over_new``).

It reports, as one JSON object per line: CPU-seconds per simulated second (measured over what ran),
per-operation CPU cost (heartbeat, task request, view build, expiry check, join), the RSS the state
added (bytes per member), and the journal (chief/journal.py): CPU time and bytes handed to
``write(2)`` per heartbeat-visible change (a heartbeat whose counters changed, journaled the way the
servicer's ``_save`` does), plus the journal CPU per simulated second that the chief would spend
(the journal write rate of the workload times the measured cost: an extrapolation, said so).
Each ratio is against the smallest case of the same run (these machines are noisy).

A case stops at ``--cap`` wall seconds of simulation (and the journal part at ``--journal-cap``);
a case that hit its cap says so (``capped``) and reports over the simulated seconds it reached.

    .venv/bin/python bench/chief_scale.py                               # 100, 1k, 10k: ~2-3 min
    .venv/bin/python bench/chief_scale.py --sizes 100,1000,10000,100000 --out bench/chief_scale.jsonl
    .venv/bin/python bench/chief_scale.py --plot bench/chief_scale.png before.jsonl after.jsonl
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LEASE_S = 3.0
TICK_S = 0.2
NUM_PS = 4
OPS = ("heartbeat", "task_request", "view_build", "expiry_check", "join")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def written_bytes() -> int:
    """Bytes this process handed to write(2) so far (``wchar`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_case(n: int, sim_s: float, cap_s: float, journal_cap_s: float, task_period_s: float,
             deaths_per_s: int, fanout_old: int = 1000) -> dict:
    from shoal.chief.journal import Journal
    from shoal.chief.servicer import ChiefServicer
    from shoal.chief.state import ChiefState
    from shoal.chief.tasks import DatasetSpec
    from shoal.settings.config import JobConfig
    from shoal.state.layout import ModelLayout, TensorSpec
    from shoal.members import Counters

    logging.disable(logging.CRITICAL)
    gc.collect()
    rss0 = rss_bytes()
    clock = Clock()
    state = ChiefState(JobConfig(num_shards=NUM_PS, lease_seconds=LEASE_S), clock)
    layout = ModelLayout([TensorSpec("w", (1000,), "float32")])
    cpu = {op: 0.0 for op in OPS}
    count = {op: 0 for op in OPS}

    def timed(op: str, fn, *args, **kw):
        t0 = time.process_time()
        out = fn(*args, **kw)
        cpu[op] += time.process_time() - t0
        count[op] += 1
        return out

    for i in range(NUM_PS):
        state.join_ps(f"127.0.0.1:{7000 + i}")
    workers: list[str] = []
    for _ in range(n):
        workers.append(timed("join", state.join_worker, layout).member_id)
    # two tasks per worker per epoch, many epochs: the queue never runs dry
    spec = DatasetSpec(size=2 * n, batch_size=1, epochs=1000, batches_per_task=1)
    held: dict[str, int] = {}
    steps: dict[str, int] = {w: 0 for w in workers}

    def ask(w: str) -> None:
        done = (held[w],) if w in held else ()
        got, _ = state.take_tasks(w, spec, 1, done=done, known=frozenset(done))
        if got:
            held[w] = got[0].task_id
        else:
            held.pop(w, None)

    for w in workers:               # everyone starts with a task (not counted: the warm-up)
        ask(w)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    ps_ids = [m.member_id for m in state.members.alive() if m.role.value == "ps"]
    slots = int(round(sim_s / TICK_S))
    per_s = int(round(1 / TICK_S))
    hb_every = int(round(LEASE_S / 3 / TICK_S))
    task_every = int(round(task_period_s / TICK_S))
    dying: set[str] = set()
    capped = False
    slot = 0
    deaths = 0
    while slot < slots:
        if time.perf_counter() - t_start > cap_s:
            capped = True
            break
        clock.now += TICK_S
        for i, w in enumerate(workers):
            if w in dying:
                continue
            if (i + slot) % hb_every == 0:
                steps[w] += 1
                t = held.get(w)
                timed("heartbeat", state.heartbeat, w, Counters(steps=steps[w], samples=steps[w]),
                      {t: 0} if t is not None else None, 0.1 + (i % 7) * 0.01)
            if (i + slot) % task_every == 0:
                timed("task_request", ask, w)
        for p in ps_ids:
            if slot % hb_every == 0:
                timed("heartbeat", state.heartbeat, p, None)
        gone = timed("expiry_check", state.tick)
        for m in gone:
            if m.member_id in dying:
                dying.discard(m.member_id)
                deaths += 1
                idx = workers.index(m.member_id)
                workers[idx] = timed("join", state.join_worker, layout).member_id
                steps[workers[idx]] = 0
        if slot % per_s == 0:
            # a few deaths per simulated second: they stop heartbeating and expire a lease later
            for k in range(deaths_per_s):
                dying.add(workers[(slot * 7919 + k * 104729) % len(workers)])
            timed("view_build", state.view)          # the view change of this second, built once
        slot += 1
    sim_done = slot * TICK_S
    cpu_total = time.process_time() - cpu_start
    wall_total = time.perf_counter() - t_start
    gc.collect()
    rss_state = rss_bytes() - rss0

    # ---- view fan-out: one view change answered to every one of the n workers' watches, as the
    # servicer's GetView does (lock held, bytes handed to gRPC): once per epoch now; the old code built
    # and serialized it per watcher (measured over up to --fanout-old watchers, scaled to n if fewer)
    from shoal.state import convert
    from shoal.proto import shoal_pb2 as pb
    fan = ChiefServicer(state)
    t0 = time.process_time()
    for w in workers:                 # each worker watches the routing view (chief/views.py)
        fan.views.answer(pb.ROUTING, w, fresh=False)
    fan_new = time.process_time() - t0
    k = min(n, fanout_old)
    t0 = time.process_time()
    for _ in range(k):
        convert.view_to_pb(state.view()).SerializeToString()
    fan_old = (time.process_time() - t0) * n / k
    fr = {"fanout_ms_per_change": 1e3 * fan_new, "fanout_old_ms_per_change": 1e3 * fan_old,
          "fanout_old_watchers_measured": k, "fanout_old_over_new": fan_old / max(fan_new, 1e-9)}

    # ---- journal: one heartbeat-visible change (counters moved), journaled as the servicer does
    jr: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal(Path(tmp) / "chief.db")
        servicer = ChiefServicer(state, journal)
        servicer._save("start")
        w = next(x for x in workers if x not in dying)
        writes, jcpu, jbytes = 0, 0.0, 0
        t_j = time.perf_counter()
        while writes < 200 and (writes < 3 or time.perf_counter() - t_j < journal_cap_s):
            steps[w] += 1
            state.heartbeat(w, Counters(steps=steps[w], samples=steps[w]))
            b0, c0 = written_bytes(), time.process_time()
            servicer._save("heartbeats")
            jcpu += time.process_time() - c0
            jbytes += written_bytes() - b0
            writes += 1
        journal.close()
        jr = {"journal_writes_measured": writes, "journal_cpu_us_per_change": 1e6 * jcpu / writes,
              "journal_bytes_per_change": jbytes / writes,
              "journal_db_bytes": sum(p.stat().st_size for p in Path(tmp).iterdir())}
    # the servicer journals every GetTasks that hands out or finishes a task, every join and expiry,
    # and batched heartbeat changes at most every 0.2 s: writes per simulated second of this workload
    writes_per_s = (count["task_request"] + count["join"] - n) / max(sim_done, 1e-9) + 1 / TICK_S
    jr["journal_writes_per_sim_s"] = writes_per_s
    jr["journal_cpu_s_per_sim_s_extrapolated"] = writes_per_s * jr["journal_cpu_us_per_change"] / 1e6

    per_op = {op: (1e6 * cpu[op] / count[op] if count[op] else None) for op in OPS}
    return {"members": n, "sim_s_requested": sim_s, "sim_s_run": round(sim_done, 2), "capped": capped,
            "wall_s": round(wall_total, 2), "cpu_s_per_sim_s": cpu_total / max(sim_done, 1e-9),
            "deaths": deaths, "counts": count, "cpu_us_per_op": per_op,
            "rss_bytes": rss_state, "rss_bytes_per_member": rss_state / n, **fr, **jr}


def add_ratios(rows: list[dict]) -> None:
    base = min(rows, key=lambda r: r["members"])
    for r in rows:
        r["ratio_vs_smallest"] = {
            **{op: (r["cpu_us_per_op"][op] / base["cpu_us_per_op"][op]
                    if r["cpu_us_per_op"][op] and base["cpu_us_per_op"][op] else None) for op in OPS},
            "journal_per_change": r["journal_cpu_us_per_change"] / base["journal_cpu_us_per_change"],
            "journal_bytes_per_change": r["journal_bytes_per_change"] / base["journal_bytes_per_change"],
            "cpu_s_per_sim_s_per_member": (r["cpu_s_per_sim_s"] / r["members"])
            / (base["cpu_s_per_sim_s"] / base["members"]),
        }


def plot(out: Path, files: list[Path]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axj) = plt.subplots(1, 2, figsize=(12, 5))
    styles = ["-", "--", ":", "-."]
    for fi, f in enumerate(files):
        rows = sorted((json.loads(line) for line in f.read_text().splitlines() if line.strip()),
                      key=lambda r: r["members"])
        label = rows[0].get("label") or f.stem
        xs = [r["members"] for r in rows]
        for i, op in enumerate(OPS):
            ys = [r["cpu_us_per_op"][op] for r in rows]
            ax.plot(xs, ys, styles[fi % 4], color=f"C{i}", marker="o", label=f"{op} ({label})")
        axj.plot(xs, [r["journal_cpu_us_per_change"] for r in rows], styles[fi % 4], color="C0", marker="o",
                 label=f"journal CPU us/change ({label})")
        axj.plot(xs, [r["journal_bytes_per_change"] for r in rows], styles[fi % 4], color="C1", marker="s",
                 label=f"journal bytes to write(2)/change ({label})")
    for a, title in ((ax, "chief pure state: CPU per operation"), (axj, "chief journal per heartbeat change")):
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("workers")
        a.set_title(title)
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    ax.set_ylabel("CPU microseconds per operation")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100,1000,10000", help="worker counts (add 100000: minutes more)")
    ap.add_argument("--sim-s", type=float, default=10.0, help="simulated seconds per case")
    ap.add_argument("--cap", type=float, default=40.0, help="wall seconds of simulation per case at most")
    ap.add_argument("--journal-cap", type=float, default=8.0, help="wall seconds of journal writes per case")
    ap.add_argument("--task-period", type=float, default=5.0, help="simulated seconds between a worker's tasks")
    ap.add_argument("--deaths-per-s", type=int, default=2)
    ap.add_argument("--fanout-old", type=int, default=1000,
                    help="watchers the old per-watcher view build is measured over (scaled to the size above it)")
    ap.add_argument("--label", default="", help="tag every line (e.g. before/after)")
    ap.add_argument("--out", type=Path, help="also write the JSON lines here")
    ap.add_argument("--plot", type=Path, help="plot the JSON-lines files given as arguments to this PNG and exit")
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, args.files)
        return
    if args.case:
        print(json.dumps(run_case(args.case, args.sim_s, args.cap, args.journal_cap, args.task_period,
                                  args.deaths_per_s, args.fanout_old)))
        return
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        cmd = [sys.executable, __file__, "--case", str(n), "--sim-s", str(args.sim_s), "--cap", str(args.cap),
               "--journal-cap", str(args.journal_cap), "--task-period", str(args.task_period),
               "--deaths-per-s", str(args.deaths_per_s), "--fanout-old", str(args.fanout_old)]
        try:
            # joins and setup are outside the cap: allow them generously, then give up on the case
            done = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                  timeout=args.cap + args.journal_cap + 180 + n / 500)
        except subprocess.TimeoutExpired:
            print(json.dumps({"members": n, "error": "timed out (setup or journal past the case's limit)"}))
            continue
        except subprocess.CalledProcessError as exc:
            print(exc.stderr, file=sys.stderr)
            raise
        row = json.loads(done.stdout.strip().splitlines()[-1])
        if args.label:
            row["label"] = args.label
        rows.append(row)
        print(f"{n} members: {row['cpu_s_per_sim_s']:.3f} cpu-s/sim-s, sim {row['sim_s_run']}s"
              f"{' (capped)' if row['capped'] else ''}", file=sys.stderr)
    add_ratios(rows)
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    print(lines, end="")
    if args.out:
        args.out.write_text(lines)


if __name__ == "__main__":
    main()
