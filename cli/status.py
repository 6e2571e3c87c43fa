"""``shoal status``: the job at a glance, from the chief's view and each shard's status."""
from __future__ import annotations

import json
from typing import Any

import grpc

from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.net.rpc import open_channel

ROLE_NAMES = {pb.WORKER: "worker", pb.PS: "ps"}


def collect(chief: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Reads the view and job stats from the chief, then each primary's shard status."""
    ch = open_channel(chief)
    try:
        stub = pb_grpc.ChiefStub(ch)
        view = stub.GetView(pb.ViewRequest(after_epoch=-1), timeout=timeout_s)
        stats = stub.GetJobStats(pb.Empty(), timeout=timeout_s)
    finally:
        ch.close()
    shards = []
    for route in view.shards:
        entry: dict[str, Any] = {"shard": route.shard, "primary": route.primary_id, "address": route.primary_address,
                                 "backup": route.backup_id, "backup_complete": route.backup_complete}
        sch = open_channel(route.primary_address)
        try:
            st = pb_grpc.ParameterServerStub(sch).Status(pb.StatusRequest(shard=route.shard, by_shard=True),
                                                         timeout=timeout_s)
            entry.update(initialized=st.initialized, version=st.version, numel=st.numel, applied=st.pushes_applied, dropped=st.pushes_dropped,
                         backup_state=st.backup_state,
                         round_pending=st.round_pending, clocks=dict(st.worker_clocks),
                         nonfinite=dict(st.nonfinite_refused), guard_refused=dict(st.guard_refused),
                         rolled_back=st.rolled_back, expelled=list(st.expelled),
                         tables=[{"name": t.name, "rows": t.rows, "bytes": t.bytes, "bytes_per_row": t.bytes_per_row,
                                  "dim": t.dim, "num_embeddings": t.num_embeddings or None,
                                  "optimizer": t.optimizer} for t in st.tables],
                         ledger=[{"epoch": e.epoch, "batches": e.applied, "max_count": e.max_count}
                                 for e in st.ledger])
        except grpc.RpcError as exc:
            entry["error"] = exc.code().name
        finally:
            sch.close()
        shards.append(entry)
    clocks: dict[str, int] = shards[0].get("clocks", {}) if shards else {}
    lead = max(clocks.values(), default=0)
    members = []
    for m in view.members:
        row = {"id": m.member_id, "role": ROLE_NAMES.get(m.role, "?"), "state": m.state, "host": m.host,
               "address": m.address, "steps": m.counters.steps}
        if m.role == pb.WORKER:
            row.update(steps_per_s=round(1.0 / m.step_seconds, 2) if m.step_seconds else 0.0,
                       lag=lead - clocks[m.member_id] if m.member_id in clocks else None,
                       straggler=m.straggler)
        members.append(row)
    return {"view_epoch": view.epoch, "ready": view.ready, "mode": view.job.mode, "members": members,
            "num_shards": view.job.num_shards,     # a shard routed to no one is missing from ``shards``
            "shards": shards, "tasks": {"done": stats.tasks_done, "total": stats.tasks_total,
                                        "queue_depth": stats.queue_depth},
            "epochs": {"completed": stats.completed_epochs, "total": stats.epochs,
                       "batches_per_epoch": stats.batches_per_epoch},
            "totals": {"steps": stats.totals.steps, "samples": stats.totals.samples},
            "checkpoints": {"written": stats.checkpoints_written, "step": stats.checkpoint_step,
                            "failed": stats.checkpoints_failed, "failed_step": stats.checkpoint_failed_step,
                            "error": stats.checkpoint_error},
            "lost_shards": list(stats.lost_shards),
            "alerts": alerts_of(dict(stats.metrics)),
            "job": _ending(stats),
            **_autoscale(stats)}


def _ending(stats: pb.JobStats) -> dict[str, Any]:
    """The job's phase (running, finished, closing; chief/lifecycle.py) and, once it ended, how."""
    out: dict[str, Any] = {"phase": stats.job_phase or "running"}
    if stats.job_result:
        out.update(result=stats.job_result, exit_code=stats.job_exit_code,
                   ended_seconds_ago=round(stats.job_ended_seconds_ago, 1),
                   drain_left_seconds=round(stats.job_drain_left_seconds, 1))
    return out


def alerts_of(job_metrics: dict[str, float]) -> list[dict[str, Any]]:
    """The alerts workers and the chief raised (``alert/<kind>/<member>`` = step of the latest occurrence)."""
    out = []
    for key, step in sorted(job_metrics.items()):
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "alert":
            out.append({"kind": parts[1], "member": parts[2], "step": int(step)})
    return out


def _autoscale(stats: pb.JobStats) -> dict[str, Any]:
    """The chief's desired worker count (with an autoscaling policy) next to the live one."""
    desired = stats.metrics.get("autoscale_desired_workers")
    if desired is None:
        return {}
    return {"autoscale": {"desired_workers": int(desired), "live_workers": stats.workers_live,
                          "decisions": list(stats.autoscale_decisions)}}


def replica_digests(chief: str, timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """Per shard: version and sha256 of the primary's copy and of the backup's (if it has one)."""
    ch = open_channel(chief)
    try:
        view = pb_grpc.ChiefStub(ch).GetView(pb.ViewRequest(after_epoch=-1), timeout=timeout_s)
    finally:
        ch.close()
    out: dict[str, dict[str, Any]] = {}
    for route in view.shards:
        entry: dict[str, Any] = {}
        for role, address in (("primary", route.primary_address), ("backup", route.backup_address)):
            if not address:
                continue
            sch = open_channel(address)
            try:
                d = pb_grpc.ShardControlStub(sch).Digest(pb.DigestRequest(shard=route.shard), timeout=timeout_s)
                entry[role] = {"member": route.primary_id if role == "primary" else route.backup_id,
                               "version": d.version, "sha256": d.sha256}
            except grpc.RpcError as exc:
                entry[role] = {"error": exc.code().name}
            finally:
                sch.close()
        out[str(route.shard)] = entry
    return out


def replicas_identical(digests: dict[str, dict[str, Any]]) -> bool | None:
    """True when every shard's backup equals its primary; None when no shard has a backup."""
    pairs = [(e.get("primary"), e.get("backup")) for e in digests.values()]
    if not any(b for _, b in pairs):
        return None
    return all(p and b and "sha256" in p and (p["version"], p["sha256"]) == (b.get("version"), b.get("sha256"))
               for p, b in pairs)


def shards_readable(s: dict[str, Any]) -> bool:
    """Every shard of a :func:`collect` report answered from a primary that holds it (an unreachable
    primary, or one the view names before it holds the shard, reports no version and no ledger)."""
    return all("error" not in sh and sh.get("initialized", False) for sh in s["shards"])


def exactly_once(s: dict[str, Any]) -> bool:
    """Every shard's ledger holds every batch of every epoch, each applied once (every shard of the job:
    one the view routes to no one has no ledger to show)."""
    want, epochs = s["epochs"]["batches_per_epoch"], s["epochs"]["total"]
    if not s["shards"] or not want:
        return False
    if s.get("num_shards") and {sh.get("shard") for sh in s["shards"]} != set(range(s["num_shards"])):
        return False
    for sh in s["shards"]:
        ledger = {e["epoch"]: e for e in sh.get("ledger", [])}
        if sorted(ledger) != list(range(epochs)):
            return False
        if any(e["batches"] != want or e["max_count"] != 1 for e in ledger.values()):
            return False
    return True


def _state_word(s: dict[str, Any]) -> str:
    job = s.get("job", {})
    if job.get("result"):
        word = "finished" if not job.get("exit_code") else f"FAILED (exit {job['exit_code']})"
        return f"{word}: {job['result']}" + (" (closing)" if job.get("phase") == "closing" else "")
    return "ready" if s["ready"] else "NOT READY"


def render(s: dict[str, Any]) -> str:
    out = [f"job: mode {s['mode']}, view epoch {s['view_epoch']}, {_state_word(s)}; "
           f"epochs {s['epochs']['completed']}/{s['epochs']['total']}; tasks {s['tasks']['done']}/"
           f"{s['tasks']['total']} done, {s['tasks']['queue_depth']} queued; {s['totals']['steps']} steps",
           *([f"autoscaling: {s['autoscale']['desired_workers']} worker(s) wanted, "
              f"{s['autoscale']['live_workers']} live"] if "autoscale" in s else []),
           *(f"  {line}" for line in s.get("autoscale", {}).get("decisions", [])[-3:]),
           "", f"{'member':<12} {'role':<7} {'state':<8} {'steps':>7} {'steps/s':>8} {'lag':>5}  flags"]
    ck = s.get("checkpoints", {})
    if ck.get("failed"):
        out[1:1] = [f"CHECKPOINTS FAILING: {ck['failed']} attempt(s) failed, the newest at step {ck['failed_step']} "
                    f"({ck['error']}); the newest checkpoint is step {ck['step'] or 'none'}"]
    if s.get("lost_shards"):
        out[1:1] = [f"LOST: shard(s) {s['lost_shards']} lost acknowledged updates (exactly-once no longer holds)"]
    for m in s["members"]:
        flags = "STRAGGLER" if m.get("straggler") else ""
        lag = "" if m.get("lag") is None else str(m["lag"])
        rate = f"{m['steps_per_s']:.1f}" if m["role"] == "worker" else ""
        out.append(f"{m['id']:<12} {m['role']:<7} {m['state']:<8} {m['steps']:>7} {rate:>8} {lag:>5}  {flags}")
    out += ["", f"{'shard':<6} {'primary':<10} {'backup':<10} {'version':>8} {'applied':>8} {'dropped':>8}  "
                f"ledger (epoch:batches, max count)"]
    for sh in s["shards"]:
        if "error" in sh:
            out.append(f"{sh['shard']:<6} {sh['primary']:<10} {sh.get('backup') or '-':<10} unreachable ({sh['error']})")
            continue
        ledger = " ".join(f"{e['epoch']}:{e['batches']}x{e['max_count']}" for e in sh["ledger"][-4:])
        # '*': the chief has not heard from the primary that this backup's copy is whole (it would not
        # promote it)
        backup = f"{sh['backup'] or '-'}{'*' if sh['backup'] and not sh.get('backup_complete') else ''}"
        out.append(f"{sh['shard']:<6} {sh['primary']:<10} {backup:<10} {sh['version']:>8} {sh['applied']:>8} "
                   f"{sh['dropped']:>8}  {ledger}")
    out += tables_lines(s["shards"])
    if s.get("alerts"):
        out += ["", "alerts (latest occurrence of each):"]
        out += [f"  {a['kind']:<15} {a['member']:<12} step {a['step']}" for a in s["alerts"]]
    refused = [f"{w} {n} (shard {sh['shard']})" for sh in s["shards"] for w, n in sorted(sh.get("nonfinite", {}).items())]
    if refused:
        out += ["", "pushes refused for NaN/Inf: " + ", ".join(refused)]
    guarded = [f"{w} {n}{' EXPELLED' if w in sh.get('expelled', ()) else ''} (shard {sh['shard']})"
               for sh in s["shards"] for w, n in sorted(sh.get("guard_refused", {}).items())]
    if guarded:
        rolled = sum(sh.get("rolled_back", 0) for sh in s["shards"])
        out += ["", "updates refused by the update guard (docs/update-safety.md): " + ", ".join(guarded) +
                (f"; {rolled} step(s) rolled back" if rolled else "")]
    return "\n".join(out)


def tables_lines(shards: list[dict[str, Any]]) -> list[str]:
    """The embedding tables on the servers: rows held and memory, per table and shard (nothing without tables)."""
    rows = [(t, sh["shard"]) for sh in shards for t in sh.get("tables", ())]
    if not rows:
        return []
    out = ["", f"{'table':<16} {'shard':<6} {'rows':>12} {'memory':>10} {'bytes/row':>9}  size, row optimizer"]
    for t, k in sorted(rows, key=lambda r: (r[0]["name"], r[1])):
        size = f"{t['num_embeddings']:,} x {t['dim']}" if t["num_embeddings"] else f"dynamic x {t['dim']}"
        out.append(f"{t['name']:<16} {k:<6} {t['rows']:>12,} {_mib(t['bytes']):>10} {t['bytes_per_row']:>9}  "
                   f"{size}, {t['optimizer']}")
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def to_json(s: dict[str, Any]) -> str:
    return json.dumps(s, indent=2, sort_keys=True)
